"""The proxy's HTTP/1.1 server (actorproxy/http/server.py with the proxy's policy, server/http_server.py), against
a toy ASGI app over real loopback sockets."""

from __future__ import annotations

import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.abc
import trio.testing
from _asgi import request_body

from actorproxy.http import server as floor
from actorproxy.http import server as http_server
from actorproxy.http.cycle import BODY_AT_ONCE, BODY_EXTENSION, SEND_NOW_EXTENSION
from actorproxy.http.server import ConnectionLimits
from actorproxy.server.http_server import HTTPServer


class Echo:
    """Answers every request with its method, path and body; records what it saw."""

    def __init__(self) -> None:
        self.disconnected = trio.Event()
        self.waiting = trio.Event()
        self.again: Any = None
        self.proceed = trio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = await request_body(receive)
        if scope["path"] == "/fail":
            raise RuntimeError("the app fails")
        if scope["path"] == "/later":  # answer once the test says so
            self.waiting.set()
            await self.proceed.wait()
        if scope["path"] == "/hang":  # wait for the client to go away
            self.waiting.set()
            if (await receive())["type"] == "http.disconnect":
                try:  # a receive after the disconnect answers at once, but still lets other tasks run
                    with trio.testing.assert_checkpoints():
                        self.again = await receive()
                except AssertionError:
                    self.again = {"type": "no checkpoint"}
                self.disconnected.set()
            return
        out = f"{scope['method']} {scope['path']} {scope['query_string'].decode()} ".encode() + body
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})


@pytest.fixture
async def served() -> AsyncIterator[tuple[Echo, int]]:
    app = Echo()
    async with serving(app) as port:
        yield app, port


@pytest.fixture
async def stream(served: tuple[Echo, int]) -> AsyncIterator[trio.SocketStream]:
    """A connection to the served :class:`Echo` app."""
    async with await trio.open_tcp_stream("127.0.0.1", served[1]) as stream:
        yield stream


@asynccontextmanager
async def serving(app: Any) -> AsyncIterator[int]:
    """``app`` served by the proxy's server (5 s keep-alive) on a free loopback port: the port, until the block ends."""
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(lambda task_status: HTTPServer(app, keep_alive_timeout=5).serve(
            "127.0.0.1", 0, shutdown_trigger=stop.wait, task_status=task_status))
        yield int(url.rsplit(":", 1)[1])
        stop.set()


@asynccontextmanager
async def connected(app: Any) -> AsyncIterator[trio.SocketStream]:
    """A connection to ``app`` served as by :func:`serving`."""
    async with serving(app) as port, await trio.open_tcp_stream("127.0.0.1", port) as stream:
        yield stream


async def read_until(stream: trio.SocketStream, marker: bytes, count: int = 1) -> bytes:
    data = b""
    while data.count(marker) < count:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        data += chunk
    return data


async def test_pipelined_requests_on_one_connection_are_answered_in_order(stream: trio.SocketStream) -> None:
    await stream.send_all(b"POST /a%20b?x=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc"
                          b"GET /two HTTP/1.1\r\nHost: h\r\n\r\n")
    data = await read_until(stream, b"HTTP/1.1 200", 2)
    while not data.endswith(b"GET /two  "):
        data += await stream.receive_some(65536)
    assert data.count(b"HTTP/1.1 200") == 2
    assert b"POST /a b x=1 abc" in data and data.endswith(b"GET /two  ")
    assert b"date: " in data


async def test_an_absolute_form_target_is_served_as_its_path(stream: trio.SocketStream) -> None:
    """RFC 9112 3.2.2: a server must accept ``http://host/path?query`` and serve ``/path``."""
    await stream.send_all(b"GET http://h:9/a%20b?x=1 HTTP/1.1\r\nHost: h\r\n\r\n"
                          b"GET HTTPS://h HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n")
    with trio.fail_after(10):
        data = await read_until(stream, b"never")  # the second reply closes the connection
    assert b"GET /a b x=1 " in data and data.endswith(b"GET /  ")


async def test_expect_100_continue(stream: trio.SocketStream) -> None:
    await stream.send_all(b"POST /c HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
    assert (await read_until(stream, b"\r\n\r\n")).startswith(b"HTTP/1.1 100 ")
    await stream.send_all(b"hi")
    assert (await read_until(stream, b"POST /c  hi")).endswith(b"POST /c  hi")


async def test_a_chunked_request_body(stream: trio.SocketStream) -> None:
    await stream.send_all(b"POST /c HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
    await trio.testing.wait_all_tasks_blocked()
    await stream.send_all(b"2\r\nde\r\n0\r\n\r\n")
    assert (await read_until(stream, b"abcde")).endswith(b"POST /c  abcde")


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"NOT HTTP AT ALL\r\n\r\n", b"400"),  # h11 cannot parse it
    (b"POST /c HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", b"400"),  # h11 says 501: bad input
    (b"GET /fail HTTP/1.1\r\nHost: h\r\n\r\n", b"500"),  # the app fails before answering
])
async def test_a_request_that_cannot_be_served_gets_an_error_and_the_connection_closes(
    stream: trio.SocketStream, request_bytes: bytes, status: bytes
) -> None:
    await stream.send_all(request_bytes)
    data = await read_until(stream, b"never")  # until the server closes the connection
    assert data.startswith(b"HTTP/1.1 " + status + b" ") and b"connection: close" in data


async def test_a_client_that_hangs_up_is_an_http_disconnect(served: tuple[Echo, int]) -> None:
    app, port = served
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    await stream.send_all(b"GET /hang HTTP/1.1\r\nHost: h\r\n\r\n")
    await app.waiting.wait()
    await stream.aclose()
    with trio.fail_after(10):
        await app.disconnected.wait()
    # An app that keeps asking (say, a loop draining the body until the client leaves) must not hold the loop.
    assert app.again == {"type": "http.disconnect"}


async def _after_the_eof(connection: Any, head: Any) -> None:
    """A router that lets a request be served only once the client's EOF has been read (then: here)."""
    while not connection.eof:
        await connection.arrived.park()


@pytest.mark.parametrize(("version", "eof_with_the_request"), [("1.1", False), ("1.1", True), ("1.0", True)])
async def test_a_client_that_half_closes_after_its_request_still_gets_the_answer(
    version: str, eof_with_the_request: bool
) -> None:
    """HTTP/1.1 lets a client shut its sending side once the request is out (RFC 9112 9.6) and read on: its EOF
    is not a hang-up. h11 allows it; hypercorn (and this server until now) cancelled the request. HTTP/1.0 gets
    no interim 100 to tell a half-close from a hang-up: its EOF is a hang-up, as before. ``eof_with_the_request``:
    the EOF is read before the request starts (a router holds it back until then)."""
    app, stop = Echo(), trio.Event()
    router = _after_the_eof if eof_with_the_request else None
    async with trio.open_nursery() as nursery:
        url = await nursery.start(lambda task_status: HTTPServer(app, router=router).serve(
            "127.0.0.1", 0, shutdown_trigger=stop.wait, task_status=task_status))
        data = await _half_close(app, int(url.rsplit(":", 1)[1]), version, eof_with_the_request)
        stop.set()
    if version == "1.0":
        assert data == b""
    else:
        assert data.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")
        assert data.endswith(b"POST /later  abc")


async def test_without_epoll_an_eof_after_the_request_is_a_hang_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not Linux (no epoll to tell a reset from a half-close): the EOF is a hang-up, as it always was there."""
    monkeypatch.setattr(http_server, "_EPOLL", None)
    app, stop = Echo(), trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(lambda task_status: HTTPServer(app).serve(
            "127.0.0.1", 0, shutdown_trigger=stop.wait, task_status=task_status))
        assert await _half_close(app, int(url.rsplit(":", 1)[1]), "1.1", False) == b""
        stop.set()


async def test_a_server_that_takes_an_eof_for_a_hang_up_does_not_answer_after_it() -> None:
    """``half_close=False`` (uvicorn's and the engines' reading): an EOF after the request is a hang-up."""
    app, stop = Echo(), trio.Event()
    async with trio.open_nursery() as nursery:
        server = floor.HTTPServer(app, policy=floor.ServerPolicy(ConnectionLimits()), half_close=False)
        url = await nursery.start(lambda task_status: server.serve(
            "127.0.0.1", 0, shutdown_trigger=stop.wait, task_status=task_status))
        assert await _half_close(app, int(url.rsplit(":", 1)[1]), "1.1", False) == b""
        stop.set()


async def _half_close(app: Echo, port: int, version: str, eof_with_the_request: bool) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(b"POST /later HTTP/%s\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc" % version.encode())
        if eof_with_the_request:
            await stream.send_eof()  # shutdown(SHUT_WR) at once: nothing more to send, still reading
        await app.waiting.wait()
        if not eof_with_the_request:
            await stream.send_eof()
        await trio.testing.wait_all_tasks_blocked()  # the server has seen the EOF
        app.proceed.set()
        return await read_until(stream, b"never")  # until the server closes the connection after the answer


async def test_an_idle_connection_is_closed_after_the_keep_alive_timeout(autojump_clock: Any) -> None:
    async with connected(Echo()) as stream:
        await stream.send_all(b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n")
        await read_until(stream, b"GET /x  ")
        start = trio.current_time()
        assert await stream.receive_some(100) == b""  # closed by the server
        assert trio.current_time() - start == pytest.approx(5)


async def _start_plain_reply(receive: Any, send: Any) -> None:
    """What the streaming apps below do first: read the request to its end, start a 200 text/plain reply."""
    await request_body(receive)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})


class Firehose:
    """Streams ``pieces`` chunks of 64 KiB as fast as the server takes them; counts what it handed over."""

    def __init__(self, pieces: int) -> None:
        self.pieces = pieces
        self.sent = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await _start_plain_reply(receive, send)
        for _ in range(self.pieces):
            await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
            self.sent += 1
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def test_a_client_that_does_not_read_holds_the_sender_back_and_gets_every_byte_once_it_reads() -> None:
    """Backpressure: a slow reader blocks the app's send (the kernel's buffers hold the rest, not the proxy)."""
    app = Firehose(pieces=1024)  # 64 MiB
    async with connected(app) as stream:
        await stream.send_all(b"GET /firehose HTTP/1.1\r\nHost: h\r\n\r\n")
        while True:  # until the app stops making progress: its send waits for the reader
            before = app.sent
            await trio.testing.wait_all_tasks_blocked()
            if app.sent == before and app.sent > 0:
                break
        held = app.sent
        assert held < 256  # at most the kernel's socket buffers (a few MiB), far from the 64 MiB sent
        received, tail = 0, b""
        with trio.fail_after(30):
            while not tail.endswith(b"\r\n0\r\n\r\n"):
                data = await stream.receive_some(1 << 20)
                assert data, "the server closed the connection before the end of the body"
                received, tail = received + len(data), (tail + data)[-16:]
        assert app.sent == 1024
        assert received > 1024 * 65536


class Stuck(Firehose):
    """A :class:`Firehose` that says whether it was told its client is gone (``http.disconnect``) or cancelled."""

    def __init__(self, pieces: int) -> None:
        super().__init__(pieces)
        self.gone = trio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        async def told() -> None:
            if (await receive())["type"] == "http.disconnect":
                self.gone.set()
                nursery.cancel_scope.cancel()

        try:
            async with trio.open_nursery() as nursery:
                await _start_plain_reply(receive, send)
                nursery.start_soon(told)
                for _ in range(self.pieces):
                    await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
                    self.sent += 1
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                nursery.cancel_scope.cancel()
        except trio.Cancelled:
            self.gone.set()
            raise


async def test_a_client_that_takes_no_byte_for_the_send_timeout_counts_as_gone(autojump_clock: Any) -> None:
    """A client that stops reading but keeps its connection would hold its request (a turn's generation, what a
    drain read) for good: once its reply waited ``send_stall`` seconds without a byte taken, the request is told
    the client is gone and the connection closes."""
    app = Stuck(pieces=1024)  # 64 MiB: far past the kernel's buffers
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(lambda task_status: HTTPServer(app, limits=ConnectionLimits(send_stall=30.0)).serve(
            "127.0.0.1", 0, shutdown_trigger=stop.wait, task_status=task_status))
        async with await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1])) as stream:
            await stream.send_all(b"GET /stuck HTTP/1.1\r\nHost: h\r\n\r\n")
            start = trio.current_time()
            with trio.fail_after(600):
                await app.gone.wait()
            assert 30 <= trio.current_time() - start < 31
            assert app.sent < 1024
            data = await read_until(stream, b"never")  # what the kernel held, then the server's close
            assert not data.endswith(b"0\r\n\r\n")
        stop.set()


class CutShort:
    """Streams 1 MiB pieces; the first one that has to wait for the reader is cancelled (mid-write), then it goes on."""

    def __init__(self) -> None:
        self.cut = trio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await _start_plain_reply(receive, send)
        while not self.cut.is_set():
            with trio.move_on_after(1) as waited:  # a client that does not read: the write waits, then is cut
                await send({"type": "http.response.body", "body": b"x" * (1 << 20), "more_body": True})
            if waited.cancelled_caught:
                self.cut.set()
        await send({"type": "http.response.body", "body": b"after", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def test_a_write_cut_in_the_middle_ends_the_connection_instead_of_going_on_unframed(
    autojump_clock: Any,
) -> None:
    app = CutShort()
    async with connected(app) as stream:
        await stream.send_all(b"GET /cut HTTP/1.1\r\nHost: h\r\n\r\n")
        await app.cut.wait()
        data = await read_until(stream, b"never")  # everything until the server closes the connection
    assert b"after" not in data and not data.endswith(b"0\r\n\r\n")


class BodyNow:
    """Takes its body through the server's ``body_now`` extension when it can; says how it got it."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        whole = scope["extensions"][BODY_EXTENSION]()
        how = b"now"
        if whole is None:
            how, whole = b"received", b""
            while True:
                message = await receive()
                whole += message.get("body", b"")
                if not message.get("more_body"):
                    break
        out = how + b":" + whole + b";"
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(out)).encode())]})
        await send({"type": "http.response.body", "body": out})


async def test_a_body_that_has_all_arrived_is_handed_over_at_once_and_a_pipelined_request_is_kept() -> None:
    async with connected(BodyNow()) as stream:
        await stream.send_all(b"POST /a HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc"
                              b"POST /b HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n"
                              b"POST /c HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\n\r\nde")
        data = await read_until(stream, b"now:;")
        await trio.testing.wait_all_tasks_blocked()
        await stream.send_all(b"fg")  # the third body arrives after its request started: received as usual
        data += await read_until(stream, b"received:defg;")
    assert data.count(b"HTTP/1.1 200") == 3
    assert data.index(b"now:abc;") < data.index(b"now:;") < data.index(b"received:defg;")


class TwoWriters:
    """A reply whose second piece is sent by another task while the first still waits for the reader."""

    def __init__(self) -> None:
        self.first_waits = trio.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await _start_plain_reply(receive, send)

        async def first() -> None:
            await send({"type": "http.response.body", "body": b"a" * (8 << 20), "more_body": True})

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first)
            await trio.testing.wait_all_tasks_blocked()  # the first piece fills the socket and waits
            self.first_waits.set()
            await send({"type": "http.response.body", "body": b"b" * 100, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def test_a_write_while_another_waits_for_the_reader_goes_after_it_whole() -> None:
    app = TwoWriters()
    async with connected(app) as stream:
        await stream.send_all(b"GET /two HTTP/1.1\r\nHost: h\r\n\r\n")
        await app.first_waits.wait()
        with trio.fail_after(30):
            data = await read_until(stream, b"\r\n0\r\n\r\n")
    body = data.split(b"\r\n\r\n", 1)[1]
    pieces = []
    while body:  # the chunked framing, piece by piece
        size, _, rest = body.partition(b"\r\n")
        pieces.append(rest[: int(size, 16)])
        body = rest[int(size, 16) + 2:]
    assert [len(piece) for piece in pieces] == [8 << 20, 100, 0]
    assert pieces[0] == b"a" * (8 << 20) and pieces[1] == b"b" * 100


class Pieces:
    """Answers with how many body messages the request came in and the body's length and checksum."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        pieces: list[bytes] = []
        while True:
            message = await receive()
            pieces.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        body = b"".join(pieces)
        out = b"%d %d %d;" % (len(pieces), len(body), sum(body))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(out))]})
        await send({"type": "http.response.body", "body": out})


async def test_a_body_that_arrives_in_pieces_is_given_whole_up_to_body_at_once() -> None:
    async with connected(Pieces()) as stream:
        for size in (300_000, BODY_AT_ONCE + 300_000):
            body = bytes(range(256)) * (size // 256)
            await stream.send_all(b"POST /p HTTP/1.1\r\nHost: h\r\nContent-Length: %d\r\n\r\n" % len(body))
            for at in range(0, len(body), 100_000):  # the body in pieces, the server waiting in between
                await trio.testing.wait_all_tasks_blocked()
                await stream.send_all(body[at : at + 100_000])
            answer = await read_until(stream, b";")
            count, length, total = answer.rpartition(b"\r\n\r\n")[2].rstrip(b";").split()
            assert (int(length), int(total)) == (len(body), sum(body))
            if size <= BODY_AT_ONCE:
                assert int(count) == 1  # gathered, then given in one message
            else:
                assert int(count) > 1  # past the bound: given as it comes, the buffer stays bounded


class _Rounds(trio.abc.Instrument):
    """Scheduling rounds (one ``epoll_wait`` each)."""

    def __init__(self) -> None:
        self.count = 0

    def before_io_wait(self, timeout: float) -> None:
        self.count += 1


async def test_a_request_sent_with_its_connection_reaches_the_app_in_the_round_it_is_accepted() -> None:
    """Issue 33: a new connection's request is read as it is accepted, not two scheduling rounds later.

    With many streams relaying a backlog a round takes long, and a pause (a new connection, usually)
    waited five of them before its route ran.
    """
    rounds = _Rounds()
    seen: list[int] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(rounds.count)
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async with serving(app) as port:
        plain = socket.create_connection(("127.0.0.1", port))  # no checkpoint: not accepted
        plain.sendall(b"POST /v1/rollout/pause HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n")
        plain.setblocking(False)
        with trio.socket.from_stdlib_socket(plain) as client:
            trio.lowlevel.add_instrument(rounds)
            try:
                answer = await client.recv(4096)
            finally:
                trio.lowlevel.remove_instrument(rounds)
    assert answer.startswith(b"HTTP/1.1 200")
    # The round the listener wakes in (the accept), then the connection task's first step: 5 before.
    assert seen == [2], f"the app ran {seen[0]} rounds after the listener woke"


async def test_send_now_writes_a_piece_of_the_body_from_another_task_and_raises_once_the_client_is_gone() -> None:
    """The ``actorproxy.send_now`` extension: a body piece framed as a chunk and written at once, from a task that is
    not the request's; a closed connection raises instead of dropping the piece unseen. An empty piece is a probe:
    nothing is written (no chunk that would end the body), and it raises once the client is gone."""
    pieces: list[Any] = []
    written, gone, done = trio.Event(), trio.Event(), trio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        send_now = scope["extensions"][SEND_NOW_EXTENSION]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"head;", "more_body": True})

        async def other_task() -> None:
            pieces.append(send_now(b""))
            pieces.append(send_now(b"piece;"))
            written.set()
            await gone.wait()
            for late in (b"", b"late;"):
                try:
                    pieces.append(send_now(late))
                except trio.BrokenResourceError as error:
                    pieces.append(error)
            done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other_task)
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

    async with serving(app) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        await written.wait()
        data = await read_until(stream, b"piece;")
        stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        await stream.aclose()  # a reset: the client is gone
        with trio.fail_after(10):
            await done.wait()
    assert data.endswith(b"5\r\nhead;\r\n6\r\npiece;\r\n")
    assert pieces[:2] == [None, None] and [type(p) for p in pieces[2:]] == [trio.BrokenResourceError] * 2


async def test_a_body_given_up_as_too_slow_is_not_handed_over_when_it_comes_after_all(autojump_clock: Any) -> None:
    """Once a body's 408 is decided (its side of the exchange broke), ``body_now`` gives nothing, even if it arrived."""
    seen: list[Any] = []
    arrived = trio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append((await receive())["type"])  # the body stops: after the grace, a disconnect
        await arrived.wait()
        seen.append(scope["extensions"][BODY_EXTENSION]())

    async with connected(app) as stream:
        await stream.send_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n\r\nab")
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(ConnectionLimits().body_grace + 1)
        await stream.send_all(b"cd")
        await trio.testing.wait_all_tasks_blocked()
        arrived.set()
        answer = await stream.receive_some(4096)
    assert seen == ["http.disconnect", None]
    assert answer.startswith(b"HTTP/1.1 408 ")
