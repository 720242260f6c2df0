"""The HTTP server's hand-off hook, in one process.

A router may take a connection away after reading a request head (and, if it wants, the
body); the connection is then served by another server from the bytes already read, as if
that server had accepted it (``HTTPServer.adopt``). The real hand-off between processes
(``SCM_RIGHTS``) is in tests/workers/test_workers.py; its two ends (:func:`serve_handoffs`,
``Router._send``) are driven here over a Unix socket of the test's own.
"""

from __future__ import annotations

import array
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from _asgi import request_body

from actorproxy.http import h1
from actorproxy.http.server import Handoff, ServerConnection
from actorproxy.server.http_server import HTTPServer
from actorproxy.workers.handoff import HANDOFF_TIMEOUT, Router, handoff_path, serve_handoffs


def _app(name: bytes) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = await request_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": name + b" " + scope["path"].encode() + b" " + body})

    return app


def _adopted_by(other: HTTPServer, head: bytes) -> Handoff:
    """A hand-off to ``other`` in this process: a copy of the socket, adopted with ``head`` and the bytes not served."""

    async def handoff(sock: trio.socket.SocketType, rest: bytes) -> None:
        copy = trio.socket.from_stdlib_socket(socket.socket(fileno=os.dup(sock.fileno())))
        other.adopt(copy, head + rest)

    return handoff


async def _serve_both(nursery: trio.Nursery, here: HTTPServer, other: HTTPServer, stop: trio.Event) -> int:
    """Start both servers on ports of their own until ``stop``; ``here``'s port."""
    url = await nursery.start(lambda task_status: here.serve("127.0.0.1", 0, shutdown_trigger=stop.wait,
                                                              task_status=task_status))
    await nursery.start(lambda task_status: other.serve("127.0.0.1", 0, shutdown_trigger=stop.wait,
                                                        task_status=task_status))
    return int(url.rsplit(":", 1)[1])


async def _exchange(stream: trio.SocketStream, request: bytes, *markers: bytes) -> bytes:
    """Send ``request``; what comes back until every marker has."""
    await stream.send_all(request)
    received = b""
    while not all(marker in received for marker in markers):
        received += await stream.receive_some(65536)
    return received


async def test_a_router_moves_the_connection_to_another_server_with_the_bytes_read() -> None:
    other = HTTPServer(_app(b"other"))
    routed: list[bytes] = []

    async def router(connection: ServerConnection, request: h1.RequestHead) -> Handoff | None:
        if dict(request.headers).get(b"x-go") != b"other":
            return None
        routed.append(request.target)
        head = request.method + b" " + request.target + b" HTTP/1.1\r\n" + b"".join(
            name + b": " + value + b"\r\n" for name, value in request.headers) + b"\r\n"
        return _adopted_by(other, head)

    here = HTTPServer(_app(b"here"), router=router)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        port = await _serve_both(nursery, here, other, stop)
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        first = await _exchange(stream, b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi", b"0\r\n\r\n")
        assert b"here /a hi" in first
        # This request and the next one, pipelined behind it, were read together: both are served over there.
        second = await _exchange(stream, b"POST /b HTTP/1.1\r\nhost: x\r\nx-go: other\r\ncontent-length: 3\r\n\r\nyou"
                                         b"GET /c HTTP/1.1\r\nhost: x\r\n\r\n", b"/b you", b"other /c")
        assert b"here" not in second
        assert routed == [b"/b"]
        third = await _exchange(stream, b"GET /d HTTP/1.1\r\nhost: x\r\n\r\n", b"/d")
        assert b"other /d" in third  # the connection stays where it went
        await stream.aclose()
        stop.set()


class _Adopting:
    """Stands for the owner's HTTP server: records what it adopts (the bytes, and what its socket receives)."""

    policy = None
    accept_from = HTTPServer.accept_from  # the server's own accept loop (its failure paths unused here)

    def __init__(self, expected: int) -> None:
        self.adopted: list[tuple[bytes, bytes]] = []
        self.expected, self.all_in = expected, trio.Event()

    def adopt(self, sock: trio.socket.SocketType, data: bytes) -> None:
        with socket.socket(fileno=sock.detach()) as client:
            self.adopted.append((data, client.recv(100)))
        if len(self.adopted) == self.expected:
            self.all_in.set()


def _hand_over(path: str, data: bytes) -> socket.socket:
    """What a worker's router sends for one connection (a socket pair's end stands for the client's socket);
    the client's end is returned, with a byte of its own waiting for the owner."""
    ours, client = socket.socketpair()
    client.sendall(b"!")
    with ours, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
        peer.connect(path)
        peer.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [ours.fileno()]))])
    return client


async def test_handoffs_waiting_together_are_all_taken_in_one_pass_of_the_owners_loop(tmp_path: Path) -> None:
    """New sessions landing on other workers at once must not queue on their owner one scheduling round each (a
    round is long on a busy worker: first turns waited seconds with 2 workers at 256 sessions)."""
    count = 40
    server = _Adopting(count)
    rounds = 0

    async def busy_loop() -> None:  # counts the owner's scheduling rounds
        nonlocal rounds
        while True:
            rounds += 1
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        await nursery.start(serve_handoffs, str(tmp_path), 1, server)
        await trio.testing.wait_all_tasks_blocked()
        path = handoff_path(str(tmp_path), 1)
        clients = [_hand_over(path, b"GET /%d HTTP/1.1\r\n\r\n" % i) for i in range(count)]
        nursery.start_soon(busy_loop)
        await server.all_in.wait()
        assert rounds <= 3
        assert server.adopted == [(b"GET /%d HTTP/1.1\r\n\r\n" % i, b"!") for i in range(count)]
        for client in clients:
            client.close()
        nursery.cancel_scope.cancel()


async def test_a_handoff_to_a_full_queue_waits_for_room_instead_of_refusing_the_connection(tmp_path: Path) -> None:
    """A Unix socket's full queue is not a worker down: the hand-off is retried, not answered 503."""
    path = handoff_path(str(tmp_path), 1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(0)
        queued = []
        while True:  # fill the owner's queue
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.setblocking(False)
            try:
                probe.connect(path)
            except BlockingIOError:
                probe.close()
                break
            queued.append(probe)
        router = Router(0, 2, str(tmp_path))
        ours, client = socket.socketpair()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(router._send, 1, b"HEAD", "/v1/chat/completions",
                               trio.socket.from_stdlib_socket(ours), b"REST")
            await trio.testing.wait_all_tasks_blocked()
            assert router.refused == 0
            for _ in queued:  # the owner's loop comes round: the queue empties
                listener.accept()[0].close()
        assert (router.handed_off, router.refused) == (1, 0)
        stream, _ = listener.accept()
        with stream:
            data, ancillary, _flags, _address = stream.recvmsg(100, socket.CMSG_SPACE(4))
            assert data == b"HEADREST" and ancillary[0][1] == socket.SCM_RIGHTS
            os.close(array.array("i", ancillary[0][2])[0])
        for probe in queued:
            probe.close()
        client.close()


async def test_a_handoff_whose_bytes_stop_coming_is_closed_and_logged(
        tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    """A sender that stops midway (it was cancelled, it died) does not hold the client's socket: after
    ``HANDOFF_TIMEOUT`` the socket is closed, and the log says so."""
    server = _Adopting(1)
    path = handoff_path(str(tmp_path), 1)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_handoffs, str(tmp_path), 1, server)
        ours, client = socket.socketpair()
        with ours, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
            peer.connect(path)
            peer.sendmsg([b"POST / HTTP/1.1\r\ncontent-length: 9\r\n\r\nhalf"],
                         [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [ours.fileno()]))])
            ours.close()
            await trio.sleep(HANDOFF_TIMEOUT + 1)
        client.setblocking(False)
        await trio.lowlevel.wait_readable(client)
        assert client.recv(10) == b""  # the owner closed its copy: the client sees the end
        client.close()
        assert server.adopted == []
        assert "came without the rest of its bytes within 10 s (42 received)" in caplog.text
        nursery.cancel_scope.cancel()


async def test_a_connection_is_handed_over_in_the_step_its_router_decides_not_after_its_reader_stops() -> None:
    """The hand-off must not wait a scheduling round of a busy sender (its reader's cancellation) before the owner
    has the connection: a new session's first turn waits for it. Bytes the client sends after it are the owner's."""
    other = HTTPServer(_app(b"other"))
    rounds = 0
    decided_at: list[int] = []
    handed_at: list[int] = []

    async def busy_loop() -> None:  # counts the sender's scheduling rounds
        nonlocal rounds
        while True:
            rounds += 1
            await trio.lowlevel.checkpoint()

    async def router(connection: ServerConnection, request: h1.RequestHead) -> Handoff | None:
        decided_at.append(rounds)
        move = _adopted_by(other, request.method + b" " + request.target + b" HTTP/1.1\r\nhost: x\r\n\r\n")

        async def handoff(sock: trio.socket.SocketType, rest: bytes) -> None:
            handed_at.append(rounds)
            await move(sock, rest)

        return handoff

    here = HTTPServer(_app(b"here"), router=router)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        stream = await trio.open_tcp_stream("127.0.0.1", await _serve_both(nursery, here, other, stop))
        nursery.start_soon(busy_loop)
        with trio.fail_after(10):
            first = await _exchange(stream, b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n", b"other /a")
        assert b"here" not in first
        assert handed_at == decided_at
        second = await _exchange(stream, b"GET /b HTTP/1.1\r\nhost: x\r\n\r\n", b"other /b")
        assert b"here" not in second
        await stream.aclose()
        stop.set()
        nursery.cancel_scope.cancel()
