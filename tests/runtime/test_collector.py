"""An abort pause holds the cyclic collector while its generations read their abort finish (runtime/collector.py)."""

from __future__ import annotations

import gc
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from actorproxy.runtime import collector
from actorproxy.sim import SimConfig
from actorproxy.testing import SimulatedProxy, open_simulated_proxy

USER = [{"role": "user", "content": "Tell me a story."}]
STREAMS = 3


@attrs.define(eq=False)
class CollectorWhilePending(trio.abc.Instrument):
    """Whether the collector was enabled after each task step while a pause waited for its generations."""

    sim: SimulatedProxy
    seen: list[bool] = attrs.field(factory=list)

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        state = self.sim.runtime.controller.state()
        if state.state == "paused" and state.in_flight:
            self.seen.append(gc.isenabled())


@pytest.fixture
def owned_collector(monkeypatch: pytest.MonkeyPatch) -> Any:
    """This process's collector as a serving proxy owns it (``serve.tune_gc``)."""
    monkeypatch.setattr(collector, "_hold", True)
    assert gc.isenabled()
    try:
        yield
    finally:
        gc.enable()


async def _pause_with_streams(tokenizer: Any, mode: str) -> tuple[CollectorWhilePending, dict[str, Any]]:
    ids = tokenizer.encode("Once upon a time there was a very long story indeed, and it went on.").tolist()
    async with open_simulated_proxy(
        tokenizer=tokenizer, sim_config=SimConfig(token_interval=0.01), partial_rollout=True
    ) as sim:
        for i in range(STREAMS):
            sim.engine.script(ids + [tokenizer.eot_token_id], routing_key=f"s{i}")
        watch = CollectorWhilePending(sim)
        async with trio.open_nursery() as nursery:
            for i in range(STREAMS):
                nursery.start_soon(sim.chat, f"s{i}", USER)
            for i in range(STREAMS):
                await sim.wait_for_tokens(f"s{i}", 3)
            trio.lowlevel.add_instrument(watch)
            try:
                ack = await sim.pause(mode)  # type: ignore[arg-type]
            finally:
                trio.lowlevel.remove_instrument(watch)
            await trio.testing.wait_all_tasks_blocked()
            assert gc.isenabled()  # given back once the pause answered (a round later)
            await sim.resume()
    return watch, ack


async def test_an_abort_pause_holds_the_collector_until_it_answers(
    tokenizer: Any, autojump_clock: trio.testing.MockClock, owned_collector: Any
) -> None:
    # At 1,000 streams a young collection (45-49 ms) fell inside nearly every pause: each
    # stream allocates as it reads its abort finish. Before the hold the collector ran on.
    watch, ack = await _pause_with_streams(tokenizer, "abort")
    assert ack["aborted"] == STREAMS
    assert watch.seen and not any(watch.seen)


async def test_a_wait_pause_and_an_embedded_proxy_leave_the_collector_alone(
    tokenizer: Any, autojump_clock: trio.testing.MockClock, owned_collector: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A wait pause lasts as long as its generations run on: it does not hold the collector.
    watch, _ = await _pause_with_streams(tokenizer, "wait")
    assert watch.seen and all(watch.seen)
    # An embedded proxy's host owns its collector: an abort pause leaves it as it is.
    monkeypatch.setattr(collector, "_hold", False)
    watch, _ = await _pause_with_streams(tokenizer, "abort")
    assert watch.seen and all(watch.seen)
