"""The relay hub (``http/sockets.py: RelayHub``) reading parked readers' sockets in its own task.

Socket pairs parked on the run's hub: each arrival's bytes reach the reader's callback in the
hub's task and in order, and a socket that never stops sending does not keep the other tasks
from running. Every way out of the hub wakes the reader
as its own read would end: the callback's ``False``, the end of file (bytes before it first),
the connection closed under it (a cut), its read deadline, a fault of the callback, cancellation.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import trio
import trio.testing

from actorproxy.http.errors import ReadTimeout, TransportError
from actorproxy.http.sockets import HUB_ARRIVALS, ClientConnection, ReadDeadlines, RelayHub, relay_hub


@contextmanager
def _pair(tcp: bool = False) -> Iterator[tuple[ClientConnection, socket.socket]]:
    """A plain connection (ours) and the socket of its peer (over loopback TCP, or a Unix socket pair)."""
    if tcp:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            ours = socket.create_connection(listener.getsockname())
            peer, _ = listener.accept()
    else:
        ours, peer = socket.socketpair()
    ours.setblocking(False)
    raw = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
    conn = ClientConnection(raw, raw)
    assert conn.sock is not None
    try:
        yield conn, peer
    finally:
        conn.close()
        peer.close()


def _hub() -> RelayHub:
    hub = relay_hub()
    assert hub is not None
    return hub


def _taker(conn: ClientConnection, got: list[bytes], until: bytes = b"end") -> Callable[[], bool]:
    """A callback that takes the connection's bytes as they come (those in its buffer, then the arrival left
    where it was received); ``False`` once ``until`` came."""
    def arrived() -> bool:
        got.append(bytes(conn.buf) + bytes(conn.fresh or b""))
        conn.buf.clear()
        conn.fresh = None
        return not got[-1].endswith(until)
    return arrived


async def test_arrivals_reach_each_reader_in_the_hubs_task_in_order_until_it_says_enough() -> None:
    hub, deadlines = _hub(), ReadDeadlines(30)
    with _pair() as (a, peer_a), _pair() as (b, peer_b):
        got_a: list[bytes] = []
        got_b: list[bytes] = []
        tasks: list[trio.lowlevel.Task] = []
        answers: list[bool] = []

        def arrived_b() -> bool:
            tasks.append(trio.lowlevel.current_task())
            return _taker(b, got_b)()

        async def park_a() -> None:
            answers.append(await hub.park(a, deadlines, _taker(a, got_a)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(park_a)
            nursery.start_soon(hub.park, b, deadlines, arrived_b)
            await trio.testing.wait_all_tasks_blocked()
            assert hub.parked == 2
            for i in range(5):
                peer_a.send(b"a%d;" % i)
                peer_b.send(b"b%d;" % i)
                await trio.testing.wait_all_tasks_blocked()
            peer_a.send(b"end")
            peer_b.send(b"end")
        assert b"".join(got_a) == b"a0;a1;a2;a3;a4;end"
        assert b"".join(got_b) == b"b0;b1;b2;b3;b4;end"
        assert len(got_b) == 6  # one call an arrival
        assert answers == [False]
        assert tasks and all(task is not trio.lowlevel.current_task() for task in tasks)
        assert hub.parked == 0


async def test_an_arrival_is_read_where_it_lies_and_what_the_callback_leaves_joins_the_buffer() -> None:
    hub, deadlines = _hub(), ReadDeadlines(30)
    with _pair() as (a, peer_a):
        seen: list[tuple[bytes, bytes | None]] = []

        def arrived() -> bool:  # takes nothing: the bytes wait for the next arrival
            seen.append((bytes(a.buf), None if a.fresh is None else bytes(a.fresh)))
            return len(seen) < 3

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.park, a, deadlines, arrived)
            await trio.testing.wait_all_tasks_blocked()
            for piece in (b"ab", b"cd", b"ef"):
                peer_a.send(piece)
                await trio.testing.wait_all_tasks_blocked()
        # The first arrival found the buffer empty: left where it was received; later ones go after it.
        assert seen == [(b"", b"ab"), (b"abcd", None), (b"abcdef", None)]
        assert bytes(a.buf) == b"abcdef" and a.fresh is None


async def test_a_socket_that_never_stops_sending_lets_the_other_tasks_run() -> None:
    hub, deadlines = _hub(), ReadDeadlines(30)
    with _pair() as (a, peer_a):
        arrivals = 0
        ran_at: list[int] = []

        def arrived() -> bool:
            nonlocal arrivals
            arrivals += 1
            a.buf.clear()
            a.fresh = None
            if arrivals < 2000:
                peer_a.send(b"x")  # always more to read
                return True
            return False

        async def other() -> None:
            while arrivals < 2000:
                ran_at.append(arrivals)
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.park, a, deadlines, arrived)
            await trio.testing.wait_all_tasks_blocked()
            peer_a.send(b"x")
            nursery.start_soon(other)
        assert arrivals == 2000
        assert len([n for n in ran_at if 0 < n < 2000]) >= 10  # it ran many times while the stream went on


async def test_many_streams_arriving_at_once_let_the_other_tasks_run_between_a_few_of_them() -> None:
    # A thousand paced streams bring a decoding step's tokens together; read in one task step, they held back
    # every other task (a pause's request among them) for tens of milliseconds.
    hub, deadlines = _hub(), ReadDeadlines(30)
    streams = 3 * HUB_ARRIVALS
    with ExitStack() as stack:
        pairs = [stack.enter_context(_pair()) for _ in range(streams)]
        read: list[int] = []
        seen_by_other: list[int] = []

        def taker(conn: ClientConnection) -> Callable[[], bool]:
            def arrived() -> bool:
                read.append(1)
                conn.buf.clear()
                conn.fresh = None
                return False
            return arrived

        async def other() -> None:
            while len(read) < streams:
                seen_by_other.append(len(read))
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            for conn, _ in pairs:
                nursery.start_soon(hub.park, conn, deadlines, taker(conn))
            await trio.testing.wait_all_tasks_blocked()
            for _, peer in pairs:
                peer.send(b"x")
            nursery.start_soon(other)
        assert len(read) == streams
        between = sorted({n for n in seen_by_other if 0 < n < streams})
        # It ran while the hub read them, which it does at most HUB_ARRIVALS a task step.
        assert between and all(n % HUB_ARRIVALS == 0 for n in between)


@pytest.mark.parametrize("read_first", [False, True], ids=["in-one-arrival", "after-the-bytes-were-read"])
async def test_the_end_of_file_wakes_the_reader_after_the_bytes_before_it(read_first: bool) -> None:
    hub, deadlines = _hub(), ReadDeadlines(30)
    with _pair() as (a, peer_a):
        got: list[bytes] = []
        result: list[bool] = []

        async def park() -> None:
            with trio.fail_after(5):  # (not the read timeout's 30 s: at once)
                result.append(await hub.park(a, deadlines, _taker(a, got)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(park)
            await trio.testing.wait_all_tasks_blocked()
            peer_a.send(b"last")
            if read_first:  # the bytes taken by the callback before the end arrives
                await trio.testing.wait_all_tasks_blocked()
                assert got == [b"last"]
            peer_a.shutdown(socket.SHUT_WR)  # (else the bytes and the end in one arrival)
        assert b"".join(got) == b"last"
        assert result == [True]  # (the end of file: the reader reads it itself)
        assert hub.parked == 0


async def test_a_connection_reset_under_its_parked_reader_fails_its_read() -> None:
    hub, deadlines = _hub(), ReadDeadlines(30)
    with _pair(tcp=True) as (a, peer_a):
        got: list[bytes] = []

        async def park() -> None:
            with trio.fail_after(5), pytest.raises(TransportError, match="dropped"):
                await hub.park(a, deadlines, _taker(a, got))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(park)
            await trio.testing.wait_all_tasks_blocked()
            peer_a.send(b"last")
            peer_a.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            peer_a.close()  # (a reset)
        assert hub.parked == 0


async def test_a_connection_closed_under_its_parked_reader_fails_its_read() -> None:
    hub, deadlines = _hub(), ReadDeadlines(30)
    with _pair() as (a, _peer):
        async with trio.open_nursery() as nursery:
            async def park() -> None:
                with pytest.raises(TransportError, match="closed"):
                    await hub.park(a, deadlines, lambda: True)

            nursery.start_soon(park)
            await trio.testing.wait_all_tasks_blocked()
            a.close()  # (a cut)
        assert hub.parked == 0


async def test_a_parked_reader_waits_at_most_its_read_timeout(autojump_clock: Any) -> None:
    hub, deadlines = _hub(), ReadDeadlines(8)  # (ticks every second)
    with _pair() as (a, peer_a):
        got: list[bytes] = []

        async def send_after(seconds: float, data: bytes) -> None:
            await trio.sleep(seconds)
            peer_a.send(data)

        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(3):  # arrivals within the timeout of each other: waited on
                nursery.start_soon(send_after, 7.5 * (i + 1), b"%d" % i)
            with pytest.raises(ReadTimeout):
                await hub.park(a, deadlines, _taker(a, got))
        assert b"".join(got) == b"012"
        assert 22.5 + 8 <= trio.current_time() - start <= 22.5 + 10
        assert a.expired and hub.parked == 0


async def test_a_fault_of_the_callback_is_raised_in_its_readers_task_and_the_others_go_on() -> None:
    hub, deadlines = _hub(), ReadDeadlines(30)
    with _pair() as (a, peer_a), _pair() as (b, peer_b):
        got_b: list[bytes] = []

        def broken() -> bool:
            raise ValueError("a bad event")

        async def park_a() -> None:
            with pytest.raises(ValueError, match="a bad event"):
                await hub.park(a, deadlines, broken)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(park_a)
            nursery.start_soon(hub.park, b, deadlines, _taker(b, got_b))
            await trio.testing.wait_all_tasks_blocked()
            peer_a.send(b"x")
            peer_b.send(b"1;")
            await trio.testing.wait_all_tasks_blocked()
            assert hub.parked == 1
            peer_b.send(b"end")
        assert b"".join(got_b) == b"1;end"
        assert hub.parked == 0


async def test_a_cancelled_reader_is_out_of_the_hub_at_once_and_hears_no_more() -> None:
    hub, deadlines = _hub(), ReadDeadlines(30)
    with _pair() as (a, peer_a), _pair() as (b, peer_b):
        got_a: list[bytes] = []
        out_at_once: list[int] = []
        scope = trio.CancelScope()

        def arrived_b() -> bool:  # cancels A from the hub's task, then A's bytes arrive at once
            scope.cancel()
            out_at_once.append(hub.parked)
            peer_a.send(b"x")
            return False

        async def park_a() -> None:
            with scope:
                await hub.park(a, deadlines, _taker(a, got_a))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(park_a)
            nursery.start_soon(hub.park, b, deadlines, arrived_b)
            await trio.testing.wait_all_tasks_blocked()
            peer_b.send(b"x")
        assert out_at_once == [1]
        assert scope.cancelled_caught
        assert got_a == []  # never read for it again
        assert bytes(a.buf) == b""
        assert hub.parked == 0
