"""The registry's memory of retired sessions' counters: small per session, bounded, and a returning session's."""

from __future__ import annotations

import os
import sys
import tracemalloc
from typing import Any

import hypothesis.strategies as st
import pytest
import trio
import trio.testing
from hypothesis import given, settings

from actorproxy.runtime import registry as reg
from actorproxy.runtime.actor import ask
from actorproxy.runtime.messages import Lookup, SessionCounters, SessionRetired
from actorproxy.runtime.retired import RetiredCounters


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


async def test_retirements_leave_no_small_objects_behind() -> None:
    """Issue 33: each retired session's id and packed int stayed on Python's small-object heap (two blocks a
    session, up to 200,000 of them at the bound), allocated between a turn's short-lived objects: each kept
    one pins its pool and arena after a drain frees the rest. Now they are kept in fixed tables off that heap."""
    registry = reg.SessionRegistry(lambda session_id, counters: _Stub(session_id), max_sessions=10)
    retired = 20_000
    messages = [SessionRetired(f"session-{i:06d}", object(), SessionCounters(3 + i % 5, 1)) for i in range(retired)]
    async with trio.open_nursery() as nursery:
        mailbox = await nursery.start(registry.run)
        await trio.testing.wait_all_tasks_blocked()
        before = sys.getallocatedblocks()
        for msg in messages:
            await mailbox.send(msg)
        await trio.testing.wait_all_tasks_blocked()
        grown = sys.getallocatedblocks() - before  # the messages (and the ids in them) are the test's: held still
        nursery.cancel_scope.cancel()
    assert grown < retired // 20, f"{grown} small objects more after {retired} retirements"


def _model_remember(young: dict[str, int], old: dict[str, int], half: int, sid: str, packed: int) -> tuple[
        dict[str, int], dict[str, int]]:
    """The two dict generations the table replaces (the registry's own code before it), as the model."""
    if len(young) >= half:
        old, young = young, {}
    old.pop(sid, None)
    young[sid] = packed
    return young, old


@settings(max_examples=300, deadline=None)
@given(bound=st.integers(1, 24), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.integers(0, 2**40)),
                                               max_size=300),
       known=st.lists(st.integers(0, 40), unique=True, max_size=60))
def test_the_table_answers_as_two_dict_generations(bound: int, ops: list[tuple[bool, int, int]],
                                                   known: list[int]) -> None:
    """Remember, take and overflow in any order (few ids and a small bound: turnovers and probe chains that
    wrap around, entries moved back when one before them is taken) give what the two dicts gave."""
    half = bound // 2
    table = RetiredCounters(bound)
    given_at_start = [(f"s{k}", k * 7 + 1) for k in known]
    items = given_at_start[-bound:]
    table.load(items)
    split = max(0, len(items) - half)
    old, young = dict(items[:split]), dict(items[split:])
    for remember, k, packed in ops:
        sid = f"s{k}"
        if remember:
            table.remember(sid, packed)
            young, old = _model_remember(young, old, max(1, half), sid, packed)
        else:
            expected = young.pop(sid, None)
            if expected is None:
                expected = old.pop(sid, 0)
            assert table.take(sid) == expected
        assert len(table) == len(young) + len(old)
    for k in range(41):
        sid = f"s{k}"
        expected = young.pop(sid, None)
        assert table.take(sid) == (old.pop(sid, 0) if expected is None else expected)
    assert len(table) == 0


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_process_writes_its_own_copy() -> None:
    """The tables are the process's own: a child forked after them (a trainer embedding the proxy and forking
    workers) takes and remembers in its copy, not in the parent's (a shared mapping would hand them over)."""
    table = RetiredCounters(8)
    table.remember("kept", 5)
    pid = os.fork()
    if pid == 0:  # the child: take what the parent keeps, remember something new, and leave at once
        table.take("kept")
        table.remember("new", 7)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert (table.take("kept"), table.take("new")) == (5, 0)
