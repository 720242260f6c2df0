"""Session actors under Trio's MockClock: interleaving, serialisation, idle eviction."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from _util import RecordingBackend, run_turn, runtime_over

from actorproxy.core.requests import ChatRequest, Identity
from actorproxy.core.turn_events import TurnDelta
from actorproxy.errors import NotFound, ShuttingDown
from actorproxy.runtime.replies import FinalizeResult
from actorproxy.schema.converter import CONVERTER
from actorproxy.sim import SimConfig, SimEngine

INTERVAL = 0.01


def _engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=1, token_interval=INTERVAL))


def _ten_tokens(tokenizer: Any) -> list[int]:
    ids = tokenizer.encode("one two three four five six seven eight nine").tolist()[:9]
    return ids + [tokenizer.eot_token_id]


async def test_two_sessions_interleave(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    engine = _engine(tokenizer)
    engine.script(_ten_tokens(tokenizer), routing_key="a")
    engine.script(_ten_tokens(tokenizer), routing_key="b")
    finished: dict[str, float] = {}
    async with runtime_over(engine, tokenizer) as runtime:
        start = trio.current_time()

        async def turn(session: str) -> None:
            result = await run_turn(runtime, session, [{"role": "user", "content": "go"}])
            assert result.done is not None and result.done.completion_tokens == 10
            finished[session] = trio.current_time() - start

        async with trio.open_nursery() as nursery:
            nursery.start_soon(turn, "a")
            nursery.start_soon(turn, "b")
    # Both generated at once: each took ten token intervals, not twenty.
    assert finished == {"a": 10 * INTERVAL, "b": 10 * INTERVAL}


async def test_turns_of_one_session_are_serialised(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    engine = _engine(tokenizer)
    backend = RecordingBackend(engine)
    engine.script(_ten_tokens(tokenizer), _ten_tokens(tokenizer), routing_key="s")
    finished: list[float] = []
    peak = 0
    async with runtime_over(backend, tokenizer) as runtime:
        start = trio.current_time()

        async def turn(text: str) -> None:
            result = await run_turn(runtime, "s", [{"role": "user", "content": text}])
            assert result.done is not None
            finished.append(trio.current_time() - start)

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, engine.running)
                await trio.sleep(INTERVAL / 2)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as turns:
                turns.start_soon(turn, "first")
                turns.start_soon(turn, "second")
            nursery.cancel_scope.cancel()
        await runtime.finalize("s")
        payload = CONVERTER.unstructure(await runtime.read(session_id="s", include_steps=True))
    assert finished == [10 * INTERVAL, 20 * INTERVAL]
    assert peak == 1
    assert [s["step_index"] for s in payload["steps"]] == [0, 1]
    assert all(s["status"] == "completed" for s in payload["steps"])


async def test_idle_session_is_evicted_into_the_store(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with runtime_over(_engine(tokenizer), tokenizer, session_ttl=30.0) as runtime:
        messages = [{"role": "user", "content": "hi"}]
        first = await run_turn(runtime, "idle", messages)
        assert (await runtime.census())["active_sessions"] == 1
        await trio.sleep(29.0)
        await trio.testing.wait_all_tasks_blocked()
        assert (await runtime.census())["active_sessions"] == 1
        assert (await runtime.store_stats())["segments"] == 0
        await trio.sleep(2.0)
        await trio.testing.wait_all_tasks_blocked()
        census = await runtime.census()
        assert census["active_sessions"] == 0 and census["sessions_evicted"] == 1
        payload = CONVERTER.unstructure(await runtime.read(session_id="idle", include_steps=True))
        [segment] = payload["data"]
        assert segment["boundary_reason"] == "idle_evicted"
        assert segment["token_ids"][-len(payload["steps"][0]["output_ids"]) :] == payload["steps"][0]["output_ids"]
        # The agent comes back: a fresh actor continues the numbering.
        messages += [first.message, {"role": "user", "content": "again"}]
        await run_turn(runtime, "idle", messages)
        described = await runtime.describe_session("idle")
        assert described.next_step == 2
        assert described.open_segment is not None and described.open_segment.segment_index == 1


async def test_the_idle_clock_starts_again_after_each_message(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with runtime_over(_engine(tokenizer), tokenizer, session_ttl=30.0) as runtime:
        await run_turn(runtime, "idle", [{"role": "user", "content": "hi"}])
        for _ in range(3):  # a message every 20 s: 60 s in all, never 30 idle
            await trio.sleep(20.0)
            await runtime.describe_session("idle")
        await trio.sleep(29.0)
        await trio.testing.wait_all_tasks_blocked()
        assert (await runtime.census())["active_sessions"] == 1
        await trio.sleep(2.0)
        await trio.testing.wait_all_tasks_blocked()
        census = await runtime.census()
        assert census["active_sessions"] == 0 and census["sessions_evicted"] == 1
        [segment] = CONVERTER.unstructure(await runtime.read(session_id="idle"))["data"]
        assert segment["boundary_reason"] == "idle_evicted"


async def test_shutdown_finalizes_open_sessions(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    engine = _engine(tokenizer)
    engine.script(_ten_tokens(tokenizer), routing_key="y")
    async with runtime_over(engine, tokenizer) as runtime:
        await run_turn(runtime, "x", [{"role": "user", "content": "hi"}])
        async with trio.open_nursery() as nursery:
            # "y" is mid-generation when shutdown begins: its turn finishes first.
            nursery.start_soon(run_turn, runtime, "y", [{"role": "user", "content": "hi"}])
            await trio.sleep(3 * INTERVAL)
            assert await runtime.close_all("shutdown") == 2
            assert trio.current_time() >= 10 * INTERVAL  # waited for y's turn to complete
        for session in ("x", "y"):
            payload = CONVERTER.unstructure(await runtime.read(session_id=session, include_steps=True))
            assert [s["boundary_reason"] for s in payload["data"]] == ["shutdown"]
            assert [s["status"] for s in payload["steps"]] == ["completed"]
        with pytest.raises(ShuttingDown):
            await runtime.start_turn(ChatRequest(messages=[{"role": "user", "content": "late"}]), Identity("z"))


async def test_max_steps_guard(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    async with runtime_over(_engine(tokenizer), tokenizer, max_steps_per_session=2) as runtime:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
        for text in ("b", "c"):
            result = await run_turn(runtime, "m", messages)
            messages += [result.message, {"role": "user", "content": text}]
        refused = await run_turn(runtime, "m", messages)
        assert refused.error is not None and refused.error.code == "max_steps_exceeded"
        assert refused.error.status == 400
        described = await runtime.describe_session("m")
        assert described.steps == 2


async def test_context_overflow_and_clamp(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    engine = _engine(tokenizer)
    async with runtime_over(engine, tokenizer, context_window=64) as runtime:
        long = [{"role": "user", "content": "word " * 100}]
        refused = await run_turn(runtime, "c", long)
        assert refused.error is not None and refused.error.code == "context_overflow"
        ok = await run_turn(runtime, "c", [{"role": "user", "content": "hi"}], max_tokens=1000)
        assert ok.done is not None
        prompt = ok.done.prompt_tokens
        assert ok.done.prompt_tokens + ok.done.completion_tokens <= 64
        described = await runtime.describe_session("c")
        assert described.recent_steps[0].step.max_new_tokens == 64 - prompt


async def test_a_long_turn_is_not_cut_by_the_idle_timer(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    engine = _engine(tokenizer)
    engine.script(tokenizer.encode("word" + " word" * 98).tolist() + [tokenizer.eot_token_id], routing_key="long")
    async with runtime_over(engine, tokenizer, session_ttl=0.5) as runtime:
        result = await run_turn(runtime, "long", [{"role": "user", "content": "talk"}], max_tokens=200)
        assert result.done is not None and result.done.completion_tokens == 100
        assert trio.current_time() >= 100 * INTERVAL > runtime.config.limits.session_ttl
        described = await runtime.describe_session("long")
        assert described.recent_steps[-1].step.status == "completed"


async def test_finalize_frees_the_slot_and_numbering_continues(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with runtime_over(_engine(tokenizer), tokenizer, max_sessions=1) as runtime:
        await run_turn(runtime, "a", [{"role": "user", "content": "hi"}])
        summary = CONVERTER.unstructure(await runtime.finalize("a", instance_id="group-1"))
        assert summary == {"session_id": "a", "segments": 1, "steps": 1}
        await trio.testing.wait_all_tasks_blocked()
        assert (await runtime.census())["active_sessions"] == 0
        await run_turn(runtime, "b", [{"role": "user", "content": "hi"}])  # the slot is free again
        await runtime.finalize("b")
        await run_turn(runtime, "a", [{"role": "user", "content": "again"}])
        described = await runtime.describe_session("a")
        assert described.next_step == 2
        assert described.open_segment is not None and described.open_segment.segment_index == 1
        [segment] = CONVERTER.unstructure(await runtime.read(session_id="a"))["data"]
        assert segment["instance_id"] == "group-1"
        # Finalizing twice is harmless; an unknown session is a 404.
        await runtime.finalize("a")
        assert await runtime.finalize("a") == FinalizeResult("a", segments=0, steps=0)
        with pytest.raises(NotFound):
            await runtime.finalize("never-seen")


async def test_a_refused_first_turn_holds_no_slot(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    async with runtime_over(_engine(tokenizer), tokenizer, context_window=32, max_sessions=1) as runtime:
        refused = await run_turn(runtime, "big", [{"role": "user", "content": "word " * 100}])
        assert refused.error is not None and refused.error.code == "context_overflow"
        await trio.testing.wait_all_tasks_blocked()  # the actor retires right after answering
        assert (await runtime.census())["active_sessions"] == 0
        ok = await run_turn(runtime, "small", [{"role": "user", "content": "hi"}], max_tokens=4)
        assert ok.done is not None


async def test_agent_gone_before_the_result_keeps_the_reply_out(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    engine = _engine(tokenizer)
    engine.script("first reply", routing_key="late")
    engine.script("Hello world", routing_key="late")
    async with runtime_over(engine, tokenizer) as runtime:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        first = await run_turn(runtime, "late", messages)
        messages += [first.message, {"role": "user", "content": "more"}]
        # Streaming: a non-streaming turn hands its deltas after the first over with the result (test_hotpath.py).
        async with await runtime.start_turn(ChatRequest(messages=messages, stream=True), Identity("late")) as events:
            text = ""
            async for event in events:
                if isinstance(event, TurnDelta):
                    text += event.delta.content
                    if text == "Hello world":
                        break  # every visible token arrived, but not the result
        retry = await run_turn(runtime, "late", messages)
        assert retry.done is not None
        await runtime.finalize("late")
        payload = CONVERTER.unstructure(await runtime.read(session_id="late", include_steps=True))
    assert [s["status"] for s in payload["steps"]] == ["completed", "client_disconnected", "completed"]
    assert [s["num_steps"] for s in payload["data"]] == [2]

