"""TITO recording through the runtime (no HTTP): exactness over long tool-using sessions."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from _util import (
    SEARCH_TOOL,
    WEATHER_TOOL,
    RecordingBackend,
    check_segment_invariants,
    recording_runtime,
    reserialise,
    run_turn,
)

from actorproxy.config import ProxyConfig
from actorproxy.runtime.runtime import Runtime, open_runtime
from actorproxy.schema.converter import CONVERTER
from actorproxy.sim import SimConfig, SimEngine


@pytest.fixture
async def rig(tokenizer: Any) -> AsyncIterator[tuple[Runtime, RecordingBackend]]:
    async with recording_runtime(tokenizer, SimConfig(seed=7, token_interval=0.001, tool_call_probability=0.8)) as (
        runtime, _engine, backend
    ):
        yield runtime, backend


async def _agent_loop(
    runtime: Runtime, session: str, turns: int, *, tools: list[dict[str, Any]], echo: Any = reserialise
) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful assistant."},
        {"role": "user", "content": "Plan a trip to Paris and Lyon; check the weather first."},
    ]
    for turn in range(turns):
        result = await run_turn(runtime, session, messages, tools=tools, max_tokens=256)
        reply = result.message
        messages.append(echo(reply))
        if reply.get("tool_calls"):
            for call in reply["tool_calls"]:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"result {turn}: 18°C ☀"})
        else:
            messages.append({"role": "user", "content": f"Thanks. Now question {turn}: what about café prices?"})
    return messages


async def test_twenty_turn_tool_session_is_exact(rig: tuple[Runtime, RecordingBackend]) -> None:
    runtime, backend = rig
    await _agent_loop(runtime, "trip", 20, tools=[WEATHER_TOOL, SEARCH_TOOL])
    await runtime.finalize("trip")
    payload = CONVERTER.unstructure(await runtime.read(session_id="trip", drain=True, include_steps=True))
    segments, steps = payload["data"], payload["steps"]
    assert len(steps) == 20
    assert any(s["output"]["tool_calls"] for s in steps), "the loop never called a tool"
    assert len(segments) == 1, [s["boundary_reason"] for s in segments]
    segment = segments[0]
    assert segment["num_steps"] == 20
    assert segment["start_reason"] == "session_start"
    assert segment["boundary_reason"] == "finalize"
    check_segment_invariants(segment, steps, backend.prompts)
    # Sampled ids were never re-tokenized: every step's output equals what the engine emitted.
    for step in steps:
        assert step["output_ids"] == list(backend.inner.stats(step["rid"]).token_ids)


async def test_rewrite_tools_and_system_changes_open_new_segments(
    rig: tuple[Runtime, RecordingBackend],
) -> None:
    runtime, backend = rig
    tools = [WEATHER_TOOL]
    messages = await _agent_loop(runtime, "s", 3, tools=tools)
    # 1. a history rewrite: the first user message is edited.
    rewritten = [messages[0], {"role": "user", "content": "Plan a trip to Rome instead."}]
    first = await run_turn(runtime, "s", rewritten, tools=tools)
    rewritten += [reserialise(first.message), {"role": "user", "content": "ok"}]
    await run_turn(runtime, "s", rewritten, tools=tools)
    # 2. the tool list changes.
    await run_turn(runtime, "s", rewritten, tools=[WEATHER_TOOL, SEARCH_TOOL])
    # 3. the system prompt changes.
    changed = [{"role": "system", "content": "You are terse."}, *rewritten[1:], {"role": "user", "content": "?"}]
    await run_turn(runtime, "s", changed, tools=[WEATHER_TOOL, SEARCH_TOOL])
    await runtime.finalize("s")
    payload = CONVERTER.unstructure(await runtime.read(session_id="s", include_steps=True))
    segments = payload["data"]
    assert [(s["start_reason"], s["boundary_reason"], s["num_steps"]) for s in segments] == [
        ("session_start", "history_rewrite", 3),
        ("history_rewrite", "tool_schema_change", 2),
        ("tool_schema_change", "system_changed", 1),
        ("system_changed", "finalize", 1),
    ]
    assert {s["parent_traj_id"] for s in segments} == {"s"}
    assert [s["segment_index"] for s in segments] == [0, 1, 2, 3]
    for segment in segments:
        check_segment_invariants(segment, payload["steps"], backend.prompts)
    boundaries = [s["boundary_reason"] for s in payload["steps"]]
    assert boundaries == ["session_start", None, None, "history_rewrite", None, "tool_schema_change", "system_changed"]


async def test_echo_may_keep_reasoning_and_change_spacing(rig: tuple[Runtime, RecordingBackend]) -> None:
    runtime, backend = rig

    def verbatim(message: dict[str, Any]) -> dict[str, Any]:
        return dict(message)

    await _agent_loop(runtime, "v", 6, tools=[WEATHER_TOOL], echo=verbatim)
    await _agent_loop(runtime, "r", 6, tools=[WEATHER_TOOL], echo=reserialise)
    for session in ("v", "r"):
        await runtime.finalize(session)
        payload = CONVERTER.unstructure(await runtime.read(session_id=session, include_steps=True))
        assert len(payload["data"]) == 1
        check_segment_invariants(payload["data"][0], payload["steps"], backend.prompts)


async def test_segment_equals_full_render_when_template_keeps_history(tokenizer: Any) -> None:
    """In a tool loop after the last user turn Qwen3 keeps reasoning: one tokenization of
    the whole conversation then equals the concatenated fragments and sampled ids."""
    engine = SimEngine(tokenizer, SimConfig(seed=3, token_interval=0.001))
    engine.script(
        '<think>\nNeed the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>',
        "<think>\nIt said sunny.\n</think>\n\nIt is sunny in Paris.",
    )
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer) as runtime:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Paris?"}]
        first = await run_turn(runtime, "f", messages, tools=[WEATHER_TOOL])
        assert first.done is not None and first.done.finish_reason == "tool_calls"
        call = first.message["tool_calls"][0]
        messages += [first.message, {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
        second = await run_turn(runtime, "f", messages, tools=[WEATHER_TOOL])
        await runtime.finalize("f")
        [segment] = CONVERTER.unstructure(await runtime.read(session_id="f"))["data"]
    assert second.message["content"] == "It is sunny in Paris."
    assert second.message["reasoning_content"] == "It said sunny."
    full = tokenizer.render(messages + [second.message], tools=[WEATHER_TOOL], add_generation_prompt=False)
    # The template ends the last turn with "<|im_end|>\n"; the sampled turn ends at <|im_end|>.
    assert segment["token_ids"] == tokenizer.encode(full).tolist()[:-1]


async def test_client_gone_leaves_segment_untouched(rig: tuple[Runtime, RecordingBackend]) -> None:
    runtime, backend = rig
    messages = [{"role": "user", "content": "hello"}]
    first = await run_turn(runtime, "g", messages, tools=[])
    messages += [first.message, {"role": "user", "content": "tell me more"}]
    from actorproxy.core.requests import ChatRequest, Identity
    from actorproxy.core.turn_events import TurnDelta

    # Streaming: a non-streaming turn hands its deltas over with the result (test_hotpath.py).
    events = await runtime.start_turn(ChatRequest(messages=messages, stream=True), Identity("g"))
    async with events:
        async for event in events:
            if isinstance(event, TurnDelta):
                break  # the agent hangs up mid-generation
    # The same turn again (a retry) continues the segment as if the first try never happened.
    again = await run_turn(runtime, "g", messages)
    assert again.done is not None
    await runtime.finalize("g")
    payload = CONVERTER.unstructure(await runtime.read(session_id="g", include_steps=True))
    statuses = [s["status"] for s in payload["steps"]]
    assert statuses == ["completed", "client_disconnected", "completed"]
    assert payload["steps"][1]["in_segment"] is False
    assert len(payload["data"]) == 1
    check_segment_invariants(payload["data"][0], payload["steps"], backend.prompts)
    # The engine stopped decoding for nobody, and every token it generated was recorded.
    aborted = backend.inner.stats(payload["steps"][1]["rid"])
    assert aborted.aborted and aborted.finish_reason == "abort"
    assert payload["steps"][1]["output_ids"] == list(aborted.token_ids)


@pytest.mark.parametrize("closed_by_eot", [True, False])
def test_fragment_refuses_a_message_that_quotes_the_stand_in_marker(tokenizer: Any, closed_by_eot: bool) -> None:
    from actorproxy.core.tito import _MARKER, FragmentError, render_fragment

    quoting = [{"role": "user", "content": f"quote: {_MARKER} end"}]
    with pytest.raises(FragmentError):
        render_fragment(tokenizer, quoting, tools=None, closed_by_eot=closed_by_eot, enable_thinking=None)
    plain = render_fragment(tokenizer, [{"role": "user", "content": "quote: end"}], tools=None,
                            closed_by_eot=closed_by_eot, enable_thinking=None)
    assert plain.endswith("quote: end<|im_end|>\n<|im_start|>assistant\n")
