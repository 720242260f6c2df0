"""Retries replace the earlier generation; sub-agents get child sessions (runtime, no HTTP)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from _util import (
    WEATHER_TOOL,
    RecordingBackend,
    check_segment_invariants,
    finalized,
    recording_runtime,
    reserialise,
    run_turn,
)

from actorproxy.runtime.runtime import Runtime
from actorproxy.schema.converter import CONVERTER
from actorproxy.sim import SimConfig, SimEngine

SYSTEM = {"role": "system", "content": "You are the main coding agent."}
TASK = {"role": "user", "content": "Fix the failing test in utils.py."}
SUB_SYSTEM = {"role": "system", "content": "You are a search sub-agent. Report findings briefly."}


#: The simulated engine of every test here.
SIM = SimConfig(seed=3, token_interval=0.001)


@pytest.fixture
async def rig(tokenizer: Any) -> AsyncIterator[tuple[Runtime, SimEngine, RecordingBackend]]:
    async with recording_runtime(tokenizer, SIM) as value:
        yield value


async def test_same_turn_id_replaces_the_earlier_generation(rig: Any) -> None:
    runtime, engine, backend = rig
    engine.script("First answer.", "Retried answer.", "Next answer.", routing_key="r")
    messages = [SYSTEM, TASK]
    first = await run_turn(runtime, "r", messages, turn_id="t1")
    retry = await run_turn(runtime, "r", messages, turn_id="t1")
    assert first.message["content"] == "First answer." and retry.message["content"] == "Retried answer."
    messages = [*messages, retry.message, {"role": "user", "content": "Go on."}]
    await run_turn(runtime, "r", messages, turn_id="t2")
    _, segments, steps = await finalized(runtime, "r")
    assert [s["status"] for s in steps] == ["superseded", "completed", "completed"]
    assert steps[0]["superseded_by"] == 1 and steps[1]["retry_of"] == 0
    assert steps[0]["in_segment"] is False
    assert len(segments) == 1 and segments[0]["step_indices"] == [1, 2]
    assert segments[0]["start_reason"] == "session_start"
    check_segment_invariants(segments[0], steps, backend.prompts)
    # The retry ran on the same prompt as the generation it replaced.
    assert backend.prompts[steps[0]["rid"]] == backend.prompts[steps[1]["rid"]]
    stats = await runtime.store_stats()
    assert stats["superseded_steps"] == 1 and stats["boundaries"] == {}


async def test_identical_message_list_is_a_retry_of_a_later_turn(rig: Any) -> None:
    runtime, engine, backend = rig
    engine.script("One.", "Two.", "Two again.", "Three.", routing_key="s")
    messages = [SYSTEM, TASK]
    one = await run_turn(runtime, "s", messages)
    messages = [*messages, reserialise(one.message), {"role": "user", "content": "And?"}]
    await run_turn(runtime, "s", messages)
    # The agent timed out and sent the same list again (copied, so not the same dicts).
    again = await run_turn(runtime, "s", [dict(m) for m in messages])
    assert again.message["content"] == "Two again."
    messages = [*messages, again.message, {"role": "user", "content": "Last."}]
    await run_turn(runtime, "s", messages)
    _, segments, steps = await finalized(runtime, "s")
    assert [s["status"] for s in steps] == ["completed", "superseded", "completed", "completed"]
    assert len(segments) == 1 and segments[0]["step_indices"] == [0, 2, 3]
    check_segment_invariants(segments[0], steps, backend.prompts)


async def test_a_changed_request_is_not_a_retry(rig: Any) -> None:
    runtime, engine, _ = rig
    engine.script("One.", "Two.", routing_key="c")
    await run_turn(runtime, "c", [SYSTEM, TASK])
    edited = {"role": "user", "content": "Fix the failing test in helpers.py."}
    await run_turn(runtime, "c", [SYSTEM, edited])
    _, segments, steps = await finalized(runtime, "c")
    assert [s["status"] for s in steps] == ["completed", "completed"]
    assert [s["start_reason"] for s in segments] == ["session_start", "history_rewrite"]


async def test_retry_of_the_first_turn_keeps_the_segment_reason(rig: Any) -> None:
    runtime, engine, backend = rig
    engine.script("A.", "B.", "B2.", routing_key="f")
    await run_turn(runtime, "f", [SYSTEM, TASK])
    other = {"role": "user", "content": "Different task."}
    await run_turn(runtime, "f", [SYSTEM, other])  # history_rewrite: a new segment
    await run_turn(runtime, "f", [SYSTEM, other])  # its only turn retried
    _, segments, steps = await finalized(runtime, "f")
    assert [s["start_reason"] for s in segments] == ["session_start", "history_rewrite"]
    assert segments[1]["step_indices"] == [2]
    assert steps[1]["status"] == "superseded"
    for segment in segments:
        check_segment_invariants(segment, steps, backend.prompts)


async def test_sub_agent_turns_go_to_a_child_session(rig: Any) -> None:
    runtime, engine, backend = rig
    engine.script("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>",
                  "Main continues.", routing_key="cc")
    engine.script("Found it in utils.py line 3.", "Done searching.", routing_key="cc/sub-1")
    engine.script("Other sub-agent.", routing_key="cc/sub-2")
    main = [SYSTEM, TASK]
    reply = await run_turn(runtime, "cc", main, tools=[WEATHER_TOOL])
    sub = [SUB_SYSTEM, {"role": "user", "content": "Find where parse_date is defined."}]
    sub_reply = await run_turn(runtime, "cc", sub)
    assert sub_reply.message["content"] == "Found it in utils.py line 3."
    assert sub_reply.done is not None and sub_reply.done.session_id == "cc/sub-1"
    sub = [*sub, sub_reply.message, {"role": "user", "content": "Anything else?"}]
    await run_turn(runtime, "cc", sub)
    # The same sub-agent prompt with another task is another child.
    await run_turn(runtime, "cc", [SUB_SYSTEM, {"role": "user", "content": "Find the tests."}])
    call = reply.message["tool_calls"][0]
    main = [*main, reply.message, {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
    await run_turn(runtime, "cc", main, tools=[WEATHER_TOOL])
    _, segments, steps = await finalized(runtime, "cc")
    by_session: dict[str, list[dict[str, Any]]] = {}
    for segment in segments:
        by_session.setdefault(segment["trajectory_id"].rpartition("#")[0], []).append(segment)
    assert sorted(by_session) == ["cc", "cc/sub-1", "cc/sub-2"]
    assert [s["num_steps"] for s in by_session["cc"]] == [2]  # the parent's segment is unbroken
    assert [s["num_steps"] for s in by_session["cc/sub-1"]] == [2]
    assert by_session["cc/sub-1"][0]["metadata"]["sub_agent"] == "sub-1"
    assert all(s["parent_traj_id"] == "cc" for s in segments)
    assert {s["session_id"] for s in steps} == {"cc", "cc/sub-1", "cc/sub-2"}
    for segment in segments:
        mine = [s for s in steps if segment["trajectory_id"].startswith(s["session_id"] + "#")]
        check_segment_invariants(segment, mine, backend.prompts)
    child = CONVERTER.unstructure(await runtime.read(session_id="cc/sub-1", include_steps=True))
    assert len(child["data"]) == 1 and len(child["steps"]) == 2
    stats = await runtime.store_stats()
    assert stats["sub_agent_sessions"] == 2 and stats["sub_agent_segments"] == 2
    assert stats["boundaries"] == {}


async def test_a_changed_system_prompt_over_the_same_conversation_stays(rig: Any) -> None:
    runtime, engine, _ = rig
    engine.script("One.", "Two.", routing_key="sc")
    one = await run_turn(runtime, "sc", [SYSTEM, TASK])
    changed = {"role": "system", "content": "You are the main coding agent. Today is Friday."}
    await run_turn(runtime, "sc", [changed, TASK, one.message, {"role": "user", "content": "More."}])
    _, segments, steps = await finalized(runtime, "sc")
    assert {s["session_id"] for s in steps} == {"sc"}
    assert [s["start_reason"] for s in segments] == ["session_start", "system_changed"]


@pytest.mark.parametrize("mode", ["log", "off"])
async def test_sub_agent_modes(tokenizer: Any, mode: str) -> None:
    async with recording_runtime(tokenizer, SIM, sub_agents=mode) as (runtime, engine, _):
        # The main agent's reply calls a tool: it goes on, so it is the main conversation (see test_side_calls).
        engine.script("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>",
                      routing_key="m")
        engine.script("Sub.", routing_key="m/sub-1" if mode == "log" else "m")
        await run_turn(runtime, "m", [SYSTEM, TASK], tools=[WEATHER_TOOL])
        await run_turn(runtime, "m", [SUB_SYSTEM, {"role": "user", "content": "Search."}], tools=[WEATHER_TOOL])
        _, segments, steps = await finalized(runtime, "m")
        if mode == "log":
            assert [s["session_id"] for s in steps] == ["m", "m/sub-1"]
            assert [s["trajectory_id"] for s in segments] == ["m#0"]  # the child's steps only
        else:
            assert [s["session_id"] for s in steps] == ["m", "m"]
            assert [s["start_reason"] for s in segments] == ["session_start", "system_changed"]
