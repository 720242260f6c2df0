"""The engine client's socket reads: one ``recv`` per arrival when events come one at a time."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import trio
import trio.testing

from actorproxy.http.errors import ReadTimeout
from actorproxy.http.sockets import ClientConnection, SocketIO


class CountingSocket:
    """The connection's socket, counting its ``recv_into`` calls (those that find nothing included)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.recvs = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv_into(self, buffer: bytearray) -> int:
        self.recvs += 1
        return self.sock.recv_into(buffer)


async def _fill_into(io: SocketIO, conn: ClientConnection, got: list[int]) -> None:
    got.append(await io.fill(conn))


async def test_a_drained_socket_is_waited_on_before_the_next_recv() -> None:
    ours, peer = socket.socketpair()
    ours.setblocking(False)
    raw = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
    conn = ClientConnection(raw, raw)
    assert conn.sock is not None
    counted = CountingSocket(conn.sock)
    conn.sock = counted  # type: ignore[assignment]
    io = SocketIO(read_timeout=30)
    try:
        for i in range(4):  # a streamed event at a time: the reader waits, then its event arrives
            got: list[int] = []
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_fill_into, io, conn, got)
                await trio.testing.wait_all_tasks_blocked()
                peer.send(b"data: %d\n\n" % i)
            assert got == [len(b"data: 0\n\n")]
            if i == 0:
                counted.recvs = 0  # the first read on a fresh connection may try before it waits
        # After the first, each read that took less than the buffer waits first: one recv per event.
        assert counted.recvs == 3
        assert bytes(conn.buf) == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: 3\n\n"
        # Bytes waiting when the reader comes are still read (after the wait, which finds them ready).
        peer.send(b"data: 4\n\n")
        assert await io.fill(conn) == len(b"data: 4\n\n")
        peer.close()
        assert await io.fill(conn) == 0  # the end
    finally:
        conn.close()
        peer.close()


async def test_a_read_waits_at_most_the_timeout_and_at_most_two_ticks_more(autojump_clock: Any) -> None:
    ours, peer = socket.socketpair()
    ours.setblocking(False)
    raw = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
    conn = ClientConnection(raw, raw)
    io = SocketIO(read_timeout=8)  # its deadlines tick every second
    try:
        conn.drained = True  # (each read waits first, as a streamed event's)

        async def send_after(seconds: float) -> None:
            await trio.sleep(seconds)
            peer.send(b"x")

        for _ in range(3):  # bytes within the timeout, wait after wait: read, however long the waits add up to
            async with trio.open_nursery() as nursery:
                nursery.start_soon(send_after, 7.9)
                assert await io.fill(conn) == 1
        start = trio.current_time()
        with pytest.raises(ReadTimeout):
            await io.fill(conn)
        assert 8 <= trio.current_time() - start <= 10
    finally:
        conn.close()
        peer.close()
