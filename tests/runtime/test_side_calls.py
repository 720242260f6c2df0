"""Side calls are not the main agent (issue 19 §4): the main conversation is the one that continues.

opencode asks a title generator before its agent loop; Claude Code sends one-shot
helper calls. Whatever comes first, the session's main trajectory is the
conversation that goes on, the one-shots are segments flagged ``side_call``, and
however late that is decided, every step is in exactly one segment.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from _util import WEATHER_TOOL, RecordingBackend, check_segment_invariants, finalized, recording_runtime, run_turn

from actorproxy.runtime.runtime import Runtime
from actorproxy.sim import SimConfig, SimEngine

TITLE = [{"role": "system", "content": "You are a title generator. Output only a title."},
         {"role": "user", "content": "Generate a title for this conversation:\n"},
         {"role": "user", "content": "Look at notes.txt and tell me what it says."}]
AGENT = [{"role": "system", "content": "You are opencode, a coding agent."},
         {"role": "user", "content": "Look at notes.txt and tell me what it says."}]
HELPER = [{"role": "system", "content": "Summarise the conversation in one line."},
          {"role": "user", "content": "The user asked about notes.txt."}]
CALL = "<tool_call>\n" + json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}}) + "\n</tool_call>"


#: The simulated engine of every test here.
SIM = SimConfig(seed=3, token_interval=0.0)


@pytest.fixture
async def rig(tokenizer: Any) -> AsyncIterator[tuple[Runtime, SimEngine, RecordingBackend]]:
    async with recording_runtime(tokenizer, SIM) as value:
        yield value


def _each_step_once(segments: list[dict[str, Any]], steps: list[dict[str, Any]], backend: RecordingBackend) -> None:
    """Every completed step is in exactly one segment (unless kept as a step only); none lost or counted twice."""
    placed = Counter((seg["trajectory_id"].rpartition("#")[0], i) for seg in segments for i in seg["step_indices"])
    assert all(n == 1 for n in placed.values()), placed
    completed = {(s["session_id"], s["step_index"]) for s in steps if s["status"] == "completed" and s["in_segment"]}
    assert set(placed) == completed
    assert len({(s["session_id"], s["step_index"]) for s in steps}) == len(steps)
    for segment in segments:
        mine = [s for s in steps if segment["trajectory_id"].startswith(s["session_id"] + "#")]
        check_segment_invariants(segment, mine, backend.prompts)


async def _agent_loop(runtime: Runtime, session: str, turns: int) -> None:
    """The agent: ``turns`` calls, each but the last answered by a tool result."""
    messages = list(AGENT)
    for turn in range(turns):
        reply = await run_turn(runtime, session, messages, tools=[WEATHER_TOOL])
        if turn < turns - 1:
            call = reply.message["tool_calls"][0]
            messages += [reply.message, {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]


async def _finalized(runtime: Runtime, session: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """:func:`finalized`, checking that the finalize reply counts the segments the store holds of the session."""
    summary, segments, steps = await finalized(runtime, session)
    assert summary["segments"] == len([s for s in segments if s["trajectory_id"].rpartition("#")[0] == session])
    return segments, steps


async def test_a_title_call_first_is_a_side_call(rig: Any) -> None:
    """opencode's order: the title generator, then the agent loop; the loop is the main trajectory."""
    runtime, engine, backend = rig
    engine.script("Notes file contents", CALL, CALL, "It says ship it.", routing_key="oc")
    await run_turn(runtime, "oc", TITLE)
    await _agent_loop(runtime, "oc", 3)
    segments, steps = await _finalized(runtime, "oc")
    assert {s["session_id"] for s in steps} == {"oc"}  # no sub-agent: the loop is not "oc/sub-1"
    by_kind = {bool(s["metadata"].get("side_call")): s for s in segments}
    assert len(segments) == 2 and set(by_kind) == {True, False}
    main, side = by_kind[False], by_kind[True]
    assert (main["num_steps"], main["start_reason"], main["step_indices"]) == (3, "session_start", [1, 2, 3])
    assert (side["num_steps"], side["start_reason"], side["step_indices"]) == (1, "session_start", [0])
    assert "sub_agent" not in side["metadata"] and side["parent_traj_id"] == "oc"
    _each_step_once(segments, steps, backend)
    stats = await runtime.store_stats()
    assert stats["boundaries"] == {} and stats["side_call_segments"] == 1


@pytest.mark.parametrize("order", ["title_first", "agent_first"])
async def test_two_one_shots_the_agent_with_tools_is_main(rig: Any, order: str) -> None:
    """Neither continues (the agent answered at once): the one offered tools is the main one, in any order."""
    runtime, engine, backend = rig
    session = f"one-{order}"
    calls = [TITLE, AGENT] if order == "title_first" else [AGENT, TITLE]
    engine.script("A short answer.", "Another short answer.", routing_key=session)
    for messages in calls:
        await run_turn(runtime, session, messages, tools=[WEATHER_TOOL] if messages is AGENT else None)
    segments, steps = await _finalized(runtime, session)
    main = [s for s in segments if not s["metadata"].get("side_call")]
    agent_step = calls.index(AGENT)
    assert [s["step_indices"] for s in main] == [[agent_step]]
    assert {s["session_id"] for s in steps} == {session}
    _each_step_once(segments, steps, backend)


async def test_a_helper_call_between_turns_keeps_the_main_segment_whole(rig: Any) -> None:
    """The main conversation continues after a one-shot helper: still one append-only segment."""
    runtime, engine, backend = rig
    engine.script("Hello.", "Summary.", "More.", routing_key="h")
    first = [{"role": "system", "content": "You are a chat assistant."}, {"role": "user", "content": "Hi"}]
    reply = await run_turn(runtime, "h", first)
    await run_turn(runtime, "h", HELPER)  # before the main one continued: a lane of its own
    await run_turn(runtime, "h", [*first, reply.message, {"role": "user", "content": "Tell me more."}])
    segments, steps = await _finalized(runtime, "h")
    assert [(s["step_indices"], bool(s["metadata"].get("side_call"))) for s in segments] == [
        ([0, 2], False), ([1], True)]
    assert all(s["start_reason"] == "session_start" for s in segments)
    _each_step_once(segments, steps, backend)


async def test_once_the_main_is_known_a_one_shot_is_a_side_call_child(rig: Any) -> None:
    """After the main conversation continued, another conversation is a sub-agent; ended after one turn, a side call."""
    runtime, engine, backend = rig
    engine.script(CALL, "Done.", routing_key="cc")
    engine.script("A one-line summary.", routing_key="cc/sub-1")
    engine.script("Found it.", "Nothing else.", routing_key="cc/sub-2")
    messages = list(AGENT)
    reply = await run_turn(runtime, "cc", messages, tools=[WEATHER_TOOL])  # a tool call: it continues
    assert (await run_turn(runtime, "cc", HELPER)).done.session_id == "cc/sub-1"  # type: ignore[union-attr]
    task = [{"role": "system", "content": "You are a search sub-agent."}, {"role": "user", "content": "Find it."}]
    found = await run_turn(runtime, "cc", task)
    await run_turn(runtime, "cc", [*task, found.message, {"role": "user", "content": "Anything else?"}])
    call = reply.message["tool_calls"][0]
    await run_turn(runtime, "cc", [*messages, reply.message, {"role": "tool", "tool_call_id": call["id"],
                                                                "content": "sunny"}], tools=[WEATHER_TOOL])
    segments, steps = await _finalized(runtime, "cc")
    labels = {s["trajectory_id"]: (s["num_steps"], s["metadata"].get("sub_agent"), s["metadata"].get("side_call"))
              for s in segments}
    assert labels == {"cc#0": (2, None, None), "cc/sub-1#0": (1, "sub-1", True), "cc/sub-2#0": (2, "sub-2", None)}
    _each_step_once(segments, steps, backend)


@pytest.mark.parametrize("mode", ["log", "off"])
async def test_side_call_modes(tokenizer: Any, mode: str) -> None:
    """log: the side call's step is kept, no segment; off: the first conversation is the main one (as before)."""
    async with recording_runtime(tokenizer, SIM, side_calls=mode) as (runtime, engine, backend):
        engine.script("Notes file contents", routing_key="m")
        engine.script(CALL, "It says ship it.", routing_key="m/sub-1" if mode == "off" else "m")
        await run_turn(runtime, "m", TITLE)
        await _agent_loop(runtime, "m", 2)
        segments, steps = await _finalized(runtime, "m")
        if mode == "log":
            assert [(s["trajectory_id"], s["step_indices"]) for s in segments] == [("m#1", [1, 2])]
            assert [(s["step_index"], s["in_segment"]) for s in steps] == [(0, False), (1, True), (2, True)]
        else:
            assert [s["trajectory_id"] for s in segments] == ["m#0", "m/sub-1#0"]
            assert not any(s["metadata"].get("side_call") for s in segments)
        _each_step_once(segments, steps, backend)
