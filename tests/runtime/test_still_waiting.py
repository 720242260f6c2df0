"""``StillWaiting``: one task tells every turn whose caller waits for its first event, each interval.

The turn's caller (``Runtime.start_turn``) stops waiting as it takes its first event, so
nothing it is told may come after that event: what tells it must never queue behind it.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from actorproxy.core.turn_events import TURN_WAITING, TurnEvent, TurnMoved
from actorproxy.runtime.still_waiting import StillWaiting


def channel() -> tuple[trio.MemorySendChannel[TurnEvent], trio.MemoryReceiveChannel[TurnEvent]]:
    send: trio.MemorySendChannel[TurnEvent]
    recv: trio.MemoryReceiveChannel[TurnEvent]
    send, recv = trio.open_memory_channel(16)
    return send, recv


def taken(recv: trio.MemoryReceiveChannel[TurnEvent]) -> list[TurnEvent]:
    out = []
    while True:
        try:
            out.append(recv.receive_nowait())
        except trio.WouldBlock:
            return out


async def test_each_turn_is_told_an_interval_after_it_began_to_wait_and_each_interval_after(
    autojump_clock: trio.testing.MockClock,
) -> None:
    waits = StillWaiting(10)
    told: list[tuple[str, float]] = []

    async def caller(name: str, recv: trio.MemoryReceiveChannel[TurnEvent]) -> None:
        async for event in recv:
            assert event is TURN_WAITING
            told.append((name, trio.current_time()))

    (a, a_recv), (b, b_recv) = channel(), channel()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waits.run)
        nursery.start_soon(caller, "a", a_recv)
        nursery.start_soon(caller, "b", b_recv)
        waits.add(a)
        await trio.sleep(4)
        waits.add(b)
        await trio.sleep(21)  # to 25
        waits.remove(a)
        await trio.sleep(20)  # to 45
        nursery.cancel_scope.cancel()
    assert told == [("a", 10), ("b", 14), ("a", 20), ("b", 24), ("b", 34), ("b", 44)], told


async def test_nothing_is_told_behind_the_first_event(autojump_clock: trio.testing.MockClock) -> None:
    """The first event waits in the channel for its caller, as the turn falls due: the caller is not told."""
    waits = StillWaiting(10)
    send, recv = channel()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waits.run)
        waits.add(send)
        await trio.sleep(5)
        send.send_nowait(TurnMoved())
        await trio.sleep(30)
        assert taken(recv) == [TurnMoved()]
        nursery.cancel_scope.cancel()


async def told(recv: trio.MemoryReceiveChannel[TurnEvent], into: list[float]) -> None:
    """A caller blocked on its channel, noting when it is told."""
    async for event in recv:
        assert event is TURN_WAITING
        into.append(trio.current_time())


async def test_a_turn_whose_caller_left_is_dropped(autojump_clock: trio.testing.MockClock) -> None:
    waits = StillWaiting(10)
    send, recv = channel()
    other, other_recv = channel()
    times: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waits.run)
        nursery.start_soon(told, other_recv, times)
        waits.add(send)
        waits.add(other)
        recv.close()  # (its caller was cancelled; it had not removed itself yet)
        await trio.sleep(25)
        assert times == [10, 20]
        assert list(waits._due) == [other]
        nursery.cancel_scope.cancel()


async def test_a_caller_busy_with_its_last_telling_is_not_told_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Its heartbeat is still being written an interval later: the next telling is skipped, not queued."""
    waits = StillWaiting(10)
    send, recv = channel()
    times: list[float] = []

    async def slow_caller() -> None:
        async for event in recv:
            assert event is TURN_WAITING
            times.append(trio.current_time())
            await trio.sleep(15)  # the heartbeat's write

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waits.run)
        nursery.start_soon(slow_caller)
        waits.add(send)
        await trio.sleep(55)
        assert times == [10, 30, 50]
        assert taken(recv) == []
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("idle_first", [True, False])
async def test_a_turn_that_comes_while_none_waits_wakes_it(
    idle_first: bool, autojump_clock: trio.testing.MockClock,
) -> None:
    waits = StillWaiting(10)
    send, recv = channel()
    times: list[float] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waits.run)
        if idle_first:
            await trio.sleep(100)  # asleep with nothing to wait for
        nursery.start_soon(told, recv, times)
        start = trio.current_time()
        waits.add(send)
        await trio.testing.wait_all_tasks_blocked()
        assert times == []
        await trio.sleep(9.5)
        assert times == []
        await trio.sleep(1)
        assert times == [start + 10]
        nursery.cancel_scope.cancel()


async def test_nothing_is_told_behind_a_first_event_handed_to_its_caller(mock_clock: trio.testing.MockClock) -> None:
    """The first event goes straight to a caller blocked on its channel; the turn falls due before that caller runs.

    The channel's buffer is then empty, yet the caller has its first event: a telling sent now would come
    after it (a streamed reply read it as an event its turn cannot have, and failed with a 502). Which of
    the two runs first in trio's batch is a coin toss, so the race is run forty times.
    """
    waits = StillWaiting(10)

    async def caller(recv: trio.MemoryReceiveChannel[TurnEvent], send: trio.MemorySendChannel[TurnEvent],
                     firsts: list[TurnEvent]) -> None:
        try:  # as ``Runtime._first_event``
            while (first := await recv.receive()) is TURN_WAITING:
                pass
            firsts.append(first)
        finally:
            waits.remove(send)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waits.run)
        for _ in range(40):
            send, recv = channel()
            firsts: list[TurnEvent] = []
            nursery.start_soon(caller, recv, send, firsts)
            await trio.testing.wait_all_tasks_blocked()
            waits.add(send)
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(10)  # the turn falls due ...
            send.send_nowait(TurnMoved())  # ... as its first event is handed to its caller
            await trio.testing.wait_all_tasks_blocked()
            assert firsts == [TurnMoved()]
            assert taken(recv) == []
        nursery.cancel_scope.cancel()
