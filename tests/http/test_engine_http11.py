"""The engine's HTTP/1.1 client (a hand-written reader on Trio) against a scripted server on port 0.

Each test server answers every request on a connection with the next scripted raw
response and records what it saw (connections accepted, requests, when a client hung up).
"""

from __future__ import annotations

import os
import resource
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from actorproxy.engines.base import BackendError
from actorproxy.engines.errors import mapped_errors
from actorproxy.http.client import HTTP11Client
from actorproxy.http.errors import ConnectError, ProtocolError, ReadTimeout
from actorproxy.http.sockets import ClientConnection

CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"


def sized(body: bytes, *extra: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n" % len(body) + b"".join(h + b"\r\n" for h in extra)
    return head + b"\r\n" + body


class Server:
    def __init__(self, answer: Callable[[int, bytes], bytes | None]) -> None:
        # (request number, request bytes) -> raw response (None: stay silent; b"": close without answering)
        self.answer = answer
        self.accepted = 0
        self.requests: list[bytes] = []
        self.hangups = 0
        self.close_after_each = False
        self.url = ""

    async def handle(self, stream: trio.SocketStream) -> None:
        self.accepted += 1
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    data = await stream.receive_some(65536)
                    if not data:
                        self.hangups += 1
                        return
                    buffer += data
                head, _, rest = buffer.partition(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(rest) < length:
                    rest += await stream.receive_some(65536)
                self.requests.append(head + b"\r\n\r\n" + rest[:length])
                buffer = rest[length:]
                response = self.answer(len(self.requests), self.requests[-1])
                if response is None:
                    await trio.sleep_forever()
                if not response:
                    await stream.aclose()
                    return
                await stream.send_all(response)
                if self.close_after_each:
                    await stream.aclose()
                    return
        except trio.BrokenResourceError:
            self.hangups += 1


@asynccontextmanager
async def serving(answer: Callable[[int, bytes], bytes | None], host: str = "127.0.0.1") -> AsyncIterator[Server]:
    server = Server(answer)
    async with trio.open_nursery() as nursery:
        serve = partial(trio.serve_tcp, server.handle, 0, host=host)
        [listener] = await nursery.start(serve)
        name = f"[{host}]" if ":" in host else host
        server.url = f"http://{name}:{listener.socket.getsockname()[1]}"
        yield server
        nursery.cancel_scope.cancel()


async def test_bodies_of_both_framings_stream_and_the_connection_is_kept() -> None:
    bodies = [CHUNKED, sized(b'{"ok": true}'), CHUNKED]
    async with serving(lambda n, _: bodies[n - 1]) as server:
        client = HTTP11Client(server.url)
        got = []
        for _ in bodies:
            response = await client.stream("POST", server.url + "/generate", b'{"x": 1}', {"X-Request-Id": "r1"})
            assert response.status_code == 200
            got.append(await response.aread())
        assert got == [b"hello world", b'{"ok": true}', b"hello world"]
        assert server.accepted == 1 and client.opened == 1
        request = server.requests[0]
        assert request.startswith(b"POST /generate HTTP/1.1\r\n")
        assert b"x-request-id: r1" in request.lower() and request.endswith(b'\r\n\r\n{"x": 1}')
        await client.aclose()


async def test_a_body_larger_than_the_socket_takes_at_once_arrives_whole() -> None:
    body = bytes(range(256)) * (24 << 10)  # 6 MB: sent in several goes, the server reading as it comes
    async with serving(lambda n, _: sized(b"ok")) as server:
        client = HTTP11Client(server.url)
        for _ in range(2):
            response = await client.stream("POST", server.url + "/generate", body)
            assert await response.aread() == b"ok"
        assert [request.partition(b"\r\n\r\n")[2] for request in server.requests] == [body, body]
        assert server.accepted == 1
        await client.aclose()


async def test_a_kept_connection_the_engine_closed_is_replaced_without_an_error() -> None:
    async with serving(lambda n, _: sized(b"ok")) as server:
        server.close_after_each = True  # closes without saying so (no "Connection: close")
        client = HTTP11Client(server.url)
        for _ in range(3):
            response = await client.stream("GET", server.url + "/health")
            assert await response.aread() == b"ok"
        assert server.accepted == 3


async def test_a_kept_connection_closed_on_the_request_is_retried_once_on_a_new_one() -> None:
    answers = [sized(b"ok"), b"", sized(b"again"), b"", b""]
    async with serving(lambda n, _: answers[n - 1]) as server:
        client = HTTP11Client(server.url)
        assert await (await client.stream("GET", server.url + "/a")).aread() == b"ok"
        # Not stale when taken from the pool: the server closes once it has read the request.
        assert await (await client.stream("GET", server.url + "/b")).aread() == b"again"
        assert server.accepted == 2 and len(server.requests) == 3
        # Once only: a new connection closed unanswered too is an error.
        with pytest.raises(ProtocolError, match="closed the connection before its response head"):
            await client.stream("GET", server.url + "/c")
        assert server.accepted == 3 and len(server.requests) == 5
        await client.aclose()


async def test_a_kept_connection_that_times_out_is_not_retried(autojump_clock: Any) -> None:
    answers = [sized(b"ok"), None]
    async with serving(lambda n, _: answers[n - 1]) as server:
        client = HTTP11Client(server.url, read_timeout=30.0)
        assert await (await client.stream("GET", server.url + "/a")).aread() == b"ok"
        with pytest.raises(ReadTimeout):
            await client.stream("POST", server.url + "/generate", b"{}")
        assert server.accepted == 1 and len(server.requests) == 2
        await client.aclose()


async def test_connection_close_and_a_body_left_unread_are_not_reused() -> None:
    answers = [sized(b"bye", b"Connection: close"), CHUNKED.removesuffix(b"0\r\n\r\n"), sized(b"ok")]
    async with serving(lambda n, _: answers[n - 1]) as server:
        client = HTTP11Client(server.url)
        assert await (await client.stream("GET", server.url + "/a")).aread() == b"bye"
        response = await client.stream("GET", server.url + "/b")
        assert await response.receive() == b"hello world"  # the pieces already read come together
        await response.aclose()  # before the end: this connection cannot carry another request
        assert await (await client.stream("GET", server.url + "/c")).aread() == b"ok"
        assert server.accepted == 3 and client.idle == 1


async def test_a_body_whose_end_arrives_with_its_last_piece_frees_the_connection_at_once() -> None:
    async with serving(lambda n, _: CHUNKED) as server:
        client = HTTP11Client(server.url)
        response = await client.stream("GET", server.url + "/b")
        assert await response.receive() == b"hello world"
        assert client.idle == 1  # back in the pool before anyone asks for the (empty) rest
        await response.aclose()
        assert await (await client.stream("GET", server.url + "/c")).aread() == b"hello world"
        assert server.accepted == 1


async def test_cancelling_a_read_closes_the_connection() -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"  # and then nothing
    async with serving(lambda n, _: head) as server:
        client = HTTP11Client(server.url)
        response = await client.stream("POST", server.url + "/generate", b"{}")
        assert await response.receive() == b"hello"
        with trio.CancelScope() as reading:
            async with trio.open_nursery() as nursery:

                async def cancel_once_the_read_waits() -> None:
                    await trio.testing.wait_all_tasks_blocked()  # the read waits for bytes that never come
                    reading.cancel()

                nursery.start_soon(cancel_once_the_read_waits)
                await response.receive()
        assert reading.cancelled_caught
        await trio.testing.wait_all_tasks_blocked()  # the server reads the hang-up
        assert server.hangups == 1 and client.idle == 0


async def test_timeouts_and_refusals_map_to_backend_errors(autojump_clock: Any) -> None:
    async with serving(lambda n, _: None) as server:  # never answers
        client = HTTP11Client(server.url, read_timeout=30.0)
        with pytest.raises(BackendError) as caught, mapped_errors("engine"):
            await client.stream("POST", server.url + "/generate", b"{}")
        assert isinstance(caught.value.__cause__, ReadTimeout)
        assert caught.value.status == 504 and not caught.value.unreachable
    refused = HTTP11Client(server.url)  # the server is gone
    with pytest.raises(BackendError) as caught, mapped_errors("engine"):
        await refused.stream("GET", server.url + "/health")
    assert isinstance(caught.value.__cause__, ConnectError)
    assert caught.value.status == 502 and caught.value.unreachable


async def test_a_malformed_answer_is_a_502() -> None:
    async with serving(lambda n, _: b"NOT HTTP AT ALL\r\n\r\n") as server:
        client = HTTP11Client(server.url)
        with pytest.raises(BackendError) as caught, mapped_errors("engine"):
            await client.stream("GET", server.url + "/health")
        assert caught.value.status == 502 and not caught.value.unreachable


@pytest.mark.parametrize("host", ["127.0.0.1", "::1"])
async def test_a_one_shot_request_goes_where_the_client_goes_with_its_head(host: str) -> None:
    # A pause's aborts go on connections of their own (OneShot), made from the engine
    # client's own origin: the same address, path prefix and Host line as every other
    # request (an IPv6 address in brackets, as RFC 9110 writes it).
    async with serving(lambda n, request: sized(b"{}"), host=host) as server:
        client = HTTP11Client(server.url + "/prefix")
        response = await client.stream("POST", server.url + "/prefix/generate", b"{}")
        await response.aread()
        origin = client.one_shot_origin()
        assert origin is not None
        assert await origin.post("/abort_request", b"{}", 10.0).status() == 200
        await client.aclose()
    pooled, one_shot = server.requests
    assert pooled.split(b"\r\n")[0] == b"POST /prefix/generate HTTP/1.1"
    assert one_shot.split(b"\r\n")[0] == b"POST /prefix/abort_request HTTP/1.1"
    port = server.url.rsplit(":", 1)[1]
    name = b"[::1]" if host == "::1" else host.encode()
    host_line = b"host: " + name + b":" + port.encode()
    assert host_line in pooled.split(b"\r\n") and host_line in one_shot.split(b"\r\n")


def test_no_one_shot_origin_over_tls_or_to_a_host_name() -> None:
    assert HTTP11Client("https://127.0.0.1:8443").one_shot_origin() is None
    assert HTTP11Client("http://localhost:30000").one_shot_origin() is None


async def test_a_one_shot_answer_with_an_endless_head_is_refused_at_the_heads_bound() -> None:
    # The same bound as a pooled request's (MAX_HEAD): the buffer does not grow until the timeout.
    endless = b"HTTP/1.1 200 OK\r\n" + b"X-A: " + b"a" * (70 * 1024)
    async with serving(lambda n, request: None if n > 1 else endless) as server:
        origin = HTTP11Client(server.url).one_shot_origin()
        assert origin is not None
        with trio.fail_after(5):
            assert await origin.post("/abort_request", b"{}", 600.0).status() is None


async def test_a_pipeline_whose_answer_closes_the_connection_ends_the_others_unanswered() -> None:
    """Pipelined calls are answered in order; an answer that says ``connection: close`` is the last on that
    connection (RFC 9112 9.6): the calls behind it are unanswered at once, not after the timeout, even if the
    server leaves the connection open."""
    answers = {1: sized(b"{}"), 2: sized(b"{}", b"Connection: close")}
    async with serving(lambda n, request: answers.get(n)) as server:
        origin = HTTP11Client(server.url).one_shot_origin()
        assert origin is not None
        pipeline = origin.pipeline(600.0)
        for _ in range(4):
            pipeline.add(origin.request("/abort_request", b"{}"))
        pipeline.flush()
        with trio.fail_after(5):
            assert [await pipeline.status(i) for i in range(4)] == [200, 200, None, None]
        pipeline.close()


async def test_a_connection_whose_descriptor_is_past_1024_is_kept() -> None:
    """A proxy serving hundreds of streams holds descriptors past 1024 (it lifts ``ulimit -n``): an idle engine
    connection there is reused like any other, not taken for one the engine closed and opened anew each turn."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip("this machine allows no descriptor past 1100")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200) if hard == resource.RLIM_INFINITY else hard, hard))
    filler = []
    try:
        async with serving(lambda n, _: sized(b"ok")) as server:
            while not filler or filler[-1] < 1100:  # the lowest free descriptors taken: the client's is past them
                filler.append(os.open(os.devnull, os.O_RDONLY))
            client = HTTP11Client(server.url)
            for _ in range(5):
                response = await client.stream("POST", server.url + "/generate", b"{}")
                assert await response.aread() == b"ok"
            assert client.opened == 1 and server.accepted == 1
            await client.aclose()
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_an_idle_tls_connection_is_checked_on_its_raw_socket() -> None:
    """A TLS connection (its stream is not the raw socket's) counts as closed once the server's end of file is
    there, and as open while it is quiet."""
    mine, theirs = trio.socket.socketpair()
    tls = trio.StapledStream(trio.testing.MemorySendStream(), trio.testing.MemoryReceiveStream())
    connection = ClientConnection(tls, trio.SocketStream(mine))
    assert connection.sock is None and not connection.stale()
    theirs.close()
    assert connection.stale()
    connection.close()
    assert connection.stale()  # closed here: no descriptor to ask


async def test_an_idle_plain_connection_is_stale_once_the_server_wrote_or_closed() -> None:
    for ending in ("wrote", "closed"):
        mine, theirs = trio.socket.socketpair()
        raw = trio.SocketStream(mine)
        connection = ClientConnection(raw, raw)
        assert connection.sock is not None and not connection.stale()
        if ending == "wrote":
            await theirs.send(b"HTTP/1.1 408 Request Timeout\r\n\r\n")  # unasked
        else:
            theirs.close()
        assert connection.stale(), ending
        connection.close()
        theirs.close()
