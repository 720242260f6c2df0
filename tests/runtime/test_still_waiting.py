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


async def test_a_turn_whose_caller_left_is_dropped(autojump_clock: trio.testing.MockClock) -> None:
    waits = StillWaiting(10)
    send, recv = channel()
    other, other_recv = channel()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waits.run)
        waits.add(send)
        waits.add(other)
        recv.close()  # (its caller was cancelled; it had not removed itself yet)
        await trio.sleep(10.5)
        assert taken(other_recv) == [TURN_WAITING]
        await trio.sleep(10)
        assert taken(other_recv) == [TURN_WAITING]
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("idle_first", [True, False])
async def test_a_turn_that_comes_while_none_waits_wakes_it(
    idle_first: bool, autojump_clock: trio.testing.MockClock,
) -> None:
    waits = StillWaiting(10)
    send, recv = channel()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(waits.run)
        if idle_first:
            await trio.sleep(100)  # asleep with nothing to wait for
        waits.add(send)
        await trio.testing.wait_all_tasks_blocked()
        assert taken(recv) == []
        await trio.sleep(9.5)
        assert taken(recv) == []
        await trio.sleep(1)
        assert taken(recv) == [TURN_WAITING]
        nursery.cancel_scope.cancel()
