"""The registry's memory of retired sessions' counters: small per session, bounded, and a returning session's."""

from __future__ import annotations

import tracemalloc
from typing import Any

import pytest
import trio
import trio.testing

from actorproxy.runtime import registry as reg
from actorproxy.runtime.actor import ask
from actorproxy.runtime.messages import Lookup, SessionCounters, SessionRetired


class _Stub:
    """A session actor that ends at once: the counters it was spawned with are all the test needs."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.token = object()

    async def run(self, inbox: trio.MemoryReceiveChannel[Any]) -> None:
        inbox.close()


async def test_retired_counters_are_compact_bounded_and_found_again() -> None:
    """Issue 33: each retired session was kept as an ordered map's node and a counters object, ~150 bytes
    beyond its id, up to 100,000 of them: RSS grew by it drain after drain (memory_drains.py finalizes a
    session every 10 turns). Now one int a session in plain dicts."""
    spawned: list[tuple[str, SessionCounters]] = []

    def factory(session_id: str, counters: SessionCounters) -> Any:
        spawned.append((session_id, counters))
        return _Stub(session_id)

    retired = 20_000
    ids = [f"session-{i:06d}" for i in range(retired)]
    registry = reg.SessionRegistry(factory, max_sessions=10)
    async with trio.open_nursery() as nursery:
        mailbox = await nursery.start(registry.run)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for i, session_id in enumerate(ids):
                await mailbox.send(SessionRetired(session_id, object(), SessionCounters(12 + i % 7, 1 + i % 3)))
            await trio.testing.wait_all_tasks_blocked()
            per_session = (tracemalloc.get_traced_memory()[0] - before) / retired
        finally:
            tracemalloc.stop()
        assert per_session <= 90, f"{per_session:.0f} bytes a retired session"
        for i in (0, retired - 1):
            await ask(mailbox, lambda r: Lookup(ids[i], True, r))  # noqa: B023
        assert spawned == [(ids[0], SessionCounters(12, 1)), (ids[-1], SessionCounters(12 + (retired - 1) % 7,
                                                                                       1 + (retired - 1) % 3))]
        nursery.cancel_scope.cancel()


async def test_the_last_half_of_the_bound_is_always_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bounded: at most ``_RETIRED_MEMORY`` sessions' counters, and always the last half of that many."""
    monkeypatch.setattr(reg, "_RETIRED_MEMORY", 1000)
    spawned: dict[str, SessionCounters] = {}

    def factory(session_id: str, counters: SessionCounters) -> Any:
        spawned[session_id] = counters
        return _Stub(session_id)

    registry = reg.SessionRegistry(factory, max_sessions=10_000)
    async with trio.open_nursery() as nursery:
        mailbox = await nursery.start(registry.run)
        for i in range(5000):
            await mailbox.send(SessionRetired(f"s{i}", object(), SessionCounters(i, 1)))
        for i in range(5000):
            await ask(mailbox, lambda r: Lookup(f"s{i}", True, r))  # noqa: B023
        nursery.cancel_scope.cancel()
    remembered = [i for i in range(5000) if spawned[f"s{i}"] == SessionCounters(i, 1)]
    assert 500 <= len(remembered) <= 1000 and remembered == list(range(5000 - len(remembered), 5000))


async def test_the_stores_sessions_given_at_start_are_bounded_too(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The sessions a store holds at start (``known``, oldest first) came in whole, however many: 5,000
    here were all remembered until the first retirement, five times the bound. Now the newest of them,
    as many as the bound, and a warning that says how many are not."""
    monkeypatch.setattr(reg, "_RETIRED_MEMORY", 1000)
    spawned: dict[str, SessionCounters] = {}

    def factory(session_id: str, counters: SessionCounters) -> Any:
        spawned[session_id] = counters
        return _Stub(session_id)

    known = {f"s{i}": SessionCounters(i + 1, 1) for i in range(5000)}
    with caplog.at_level("WARNING", logger=reg.__name__):
        registry = reg.SessionRegistry(factory, max_sessions=10_000, known=known)
    assert "5000 sessions" in caplog.text and "4000" in caplog.text
    async with trio.open_nursery() as nursery:
        mailbox = await nursery.start(registry.run)
        for i in range(5000):
            await ask(mailbox, lambda r: Lookup(f"s{i}", True, r))  # noqa: B023
        nursery.cancel_scope.cancel()
    remembered = [i for i in range(5000) if spawned[f"s{i}"] == SessionCounters(i + 1, 1)]
    assert remembered == list(range(4000, 5000))
