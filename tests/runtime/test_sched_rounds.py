"""The scheduler work of one turn (issue 12): no task spawned, no actor asked for permission, one store wake a batch.

A Trio instrument counts the tasks spawned and the task steps while turns run
against the simulated engine. A turn is admitted by the controller with a method
call (no message, no reply channel), the abort task of a generation exists only
once a pause asks for it, and the journal of completed steps wakes the store once
per batch, not once per turn. Pausing, aborting and recovering still work
(tests/runtime/test_preemption.py, tests/store/test_store.py).
"""

from __future__ import annotations

import sqlite3
import time
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import trio
import trio.abc
import trio.lowlevel
import trio.testing

from actorproxy.config import ProxyConfig
from actorproxy.runtime import store as st
from actorproxy.sim import SimConfig
from actorproxy.testing import open_simulated_proxy

HI = [{"role": "user", "content": "hi"}]


class Rounds(trio.abc.Instrument):
    """Tasks spawned and task steps, by the task's name."""

    def __init__(self) -> None:
        self.spawned: Counter[str] = Counter()
        self.steps: Counter[str] = Counter()

    def task_spawned(self, task: trio.lowlevel.Task) -> None:
        self.spawned[task.name] += 1

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps[task.name] += 1


def _named(counts: Counter[str], part: str) -> int:
    return sum(n for name, n in counts.items() if part in name)


async def _conversation(sim: Any, session: str, turns: int) -> None:
    messages: list[dict[str, Any]] = list(HI)
    for i in range(turns):
        result = await sim.chat(session, messages, max_tokens=8)
        assert result.done is not None
        messages += [result.message, {"role": "user", "content": f"more {i}"}]


async def test_a_turn_spawns_no_task_and_sends_the_controller_no_message(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_simulated_proxy(tokenizer=tokenizer, sim_config=SimConfig(token_interval=0.01)) as sim:
        await _conversation(sim, "warm", 2)  # the session exists: what is counted is a turn's own work
        rounds = Rounds()
        trio.lowlevel.add_instrument(rounds)
        try:
            await _conversation(sim, "warm", 5)
        finally:
            trio.lowlevel.remove_instrument(rounds)
        assert _named(rounds.spawned, "_abort_rest") == 0  # started only when a pause asks for it
        assert _named(rounds.steps, "GenerationController") == 0  # permission and End are method calls
        assert sum(rounds.spawned.values()) == 0, rounds.spawned


async def test_a_pause_aborts_each_generation_in_flight_in_its_own_call(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    """The pause's call asks each turn, and the turn aborts its generation there: the simulated
    engine hears an abort at once, so nothing is left to a task (an HTTP engine's answer is:
    tests/engines/test_pause_counting_engine.py)."""
    async with open_simulated_proxy(tokenizer=tokenizer, sim_config=SimConfig(token_interval=1.0),
                                    partial_rollout=True) as sim:
        rounds = Rounds()
        trio.lowlevel.add_instrument(rounds)
        try:
            async with trio.open_nursery() as nursery:
                for name in ("a", "b"):
                    nursery.start_soon(partial(sim.chat, name, HI, max_tokens=20))
                await sim.wait_for_tokens("a", 3)
                await sim.wait_for_tokens("b", 3)
                ack = await sim.pause()
                assert ack["aborted"] == 2
                assert _named(rounds.spawned, "_abort_rest") == 0
                await sim.resume()
        finally:
            trio.lowlevel.remove_instrument(rounds)
        for name in ("a", "b"):
            await sim.finalize(name)
            [step] = (await sim.read(name))["steps"]
            assert step["preemptions"] == 1 and step["status"] == "completed"


async def test_the_journal_wakes_the_store_once_a_batch_and_commits_within_the_batch_delay(
    tokenizer: Any, tmp_path: Path, mock_clock: trio.testing.MockClock
) -> None:
    """Virtual time moves only when the test says (the store's commits run in a real thread)."""
    config = ProxyConfig.of(port=0, store_kind="sqlite", data_dir=str(tmp_path))

    def journaled() -> int:  # what a crash now would recover
        with sqlite3.connect(tmp_path / "trajectories.sqlite3") as db:
            (count,) = db.execute("SELECT COUNT(*) FROM journal WHERE session_id = 's'").fetchone()
        return int(count)

    async with open_simulated_proxy(config, tokenizer=tokenizer, sim_config=SimConfig(token_interval=0.0)) as sim:
        await _conversation(sim, "warm", 1)
        await sim.runtime.store_stats()  # ordered after the first turn's batch: the store is idle again
        rounds = Rounds()
        trio.lowlevel.add_instrument(rounds)
        try:
            await _conversation(sim, "s", 6)  # no virtual time passes: one batch
            await trio.testing.wait_all_tasks_blocked()
        finally:
            trio.lowlevel.remove_instrument(rounds)
        assert _named(rounds.steps, "TrajectoryStore.run") == 1, rounds.steps  # woken by the first step only
        assert await trio.to_thread.run_sync(journaled) == 0  # the batch waits for more
        mock_clock.jump(st.BATCH_DELAY)
        for _ in range(1000):  # the commit runs in the store's writer thread: wait for it (bounded)
            if await trio.to_thread.run_sync(journaled) == 6:
                break
            await trio.to_thread.run_sync(time.sleep, 0.005)
        assert await trio.to_thread.run_sync(journaled) == 6


async def test_a_new_session_starts_without_a_registry_step(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    """The registry's task does not run for a new session: the turn spawns it by a method call.

    Waiting for the actor to start (``nursery.start``) queued new sessions behind each other
    under load (c = 64: p99 0.3 -> 1.2 s); so did a ``Lookup`` in the registry's mailbox,
    which it reads one message per scheduler round (c = 256: every first turn 1.9 s while
    the others took 0.14 s; docs/decisions.md, "The un-actored pieces").
    """
    async with open_simulated_proxy(tokenizer=tokenizer, sim_config=SimConfig(token_interval=0.01)) as sim:
        await _conversation(sim, "warm", 1)
        rounds = Rounds()
        trio.lowlevel.add_instrument(rounds)
        try:
            for i in range(5):
                await _conversation(sim, f"new-{i}", 1)
        finally:
            trio.lowlevel.remove_instrument(rounds)
        assert _named(rounds.steps, "SessionRegistry.run") == 0, rounds.steps
        assert (await sim.runtime.census())["sessions_started"] == 6
