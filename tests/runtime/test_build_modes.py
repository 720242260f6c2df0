"""last_step build mode, --on-history-rewrite recompute, and --verify-tito (runtime, no HTTP)."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any

from _util import WEATHER_TOOL, RecordingBackend, check_segment_invariants, recording_runtime, reserialise, run_turn

from actorproxy.config import recompute_logprobs_from_env
from actorproxy.runtime.runtime import Runtime
from actorproxy.schema.converter import CONVERTER
from actorproxy.sim import SimConfig, SimEngine

SYSTEM = {"role": "system", "content": "You are terse."}
REPLIES = [
    "<think>\nThe user greets me.\n</think>\n\nHello there, friend.",
    "<think>\nThey ask about Lyon.\n</think>\n\nLyon is on the Rhône.",
    "<think>\nNow Bordeaux.\n</think>\n\nBordeaux makes wine.",
    "<think>\nSummary noted.\n</think>\n\nAnything else?",
]
QUESTIONS = ["Hi!", "Where is Lyon?", "And Bordeaux?"]


def _rig(tokenizer: Any, **config: Any) -> AbstractAsyncContextManager[tuple[Runtime, SimEngine, RecordingBackend]]:
    return recording_runtime(tokenizer, SimConfig(seed=11, token_interval=0.001), **config)


async def _three_turns(runtime: Runtime, engine: SimEngine, session: str) -> list[dict[str, Any]]:
    engine.script(*REPLIES, routing_key=session)
    messages: list[dict[str, Any]] = [SYSTEM]
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        result = await run_turn(runtime, session, messages)
        messages.append(reserialise(result.message))  # the agent drops reasoning_content
    return messages


async def _finalized(runtime: Runtime, session: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    await runtime.finalize(session)
    payload = CONVERTER.unstructure(await runtime.read(session_id=session, include_steps=True))
    return payload["data"], payload["steps"]


def _runs(mask: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i, m in enumerate(mask):
        if m and (not runs or runs[-1][1] != i):
            runs.append([i, i + 1])
        elif m:
            runs[-1][1] = i + 1
    return runs


async def test_last_step_renders_the_last_conversation_and_keeps_its_sampled_ids(tokenizer: Any) -> None:
    async with _rig(tokenizer, trajectory_build_mode="last_step") as (runtime, engine, backend):
        messages = await _three_turns(runtime, engine, "ls")
        (segment,), steps = await _finalized(runtime, "ls")
    last = steps[-1]
    prompt = tokenizer.encode(tokenizer.render(messages[:-1], add_generation_prompt=True)).tolist()
    ids, mask, logprobs = segment["token_ids"], segment["loss_mask"], segment["logprobs"]
    assert ids == prompt + last["output_ids"]
    assert logprobs[len(prompt):] == last["output_logprobs"]
    assert segment["metadata"]["build_mode"] == "last_step"
    runs = _runs(mask)
    # Two earlier replies (found by the template's offsets, reasoning stripped as the template does) and the last.
    assert runs[:2] == segment["metadata"]["invalid_logprob_spans"]
    assert [tokenizer.decode(ids[a:b]) for a, b in runs[:2]] == [
        "Hello there, friend.<|im_end|>", "Lyon is on the Rhône.<|im_end|>"
    ]
    assert runs[2] == [len(prompt), len(ids)]
    assert all(logprobs[i] == 0.0 for a, b in runs[:2] for i in range(a, b))
    assert segment["metadata"]["logprobs_invalid"] is True
    assert segment["metadata"]["foreign_replies"] == 0
    versions = segment["versions"]
    assert all(versions[i] == 0 for a, b in runs for i in range(a, b))
    assert all(versions[i] == -1 for i, m in enumerate(mask) if not m)


async def test_last_step_leaves_replies_the_agent_wrote_untrained(tokenizer: Any) -> None:
    async with _rig(tokenizer, trajectory_build_mode="last_step") as (runtime, engine, backend):
        engine.script(REPLIES[0], routing_key="few")
        shot = [{"role": "user", "content": "Example?"}, {"role": "assistant", "content": "An example answer."}]
        await run_turn(runtime, "few", [SYSTEM, *shot, {"role": "user", "content": "Hi!"}])
        (segment,), steps = await _finalized(runtime, "few")
    assert segment["metadata"]["foreign_replies"] == 1
    assert _runs(segment["loss_mask"]) == [[len(segment["token_ids"]) - len(steps[0]["output_ids"]),
                                            len(segment["token_ids"])]]
    assert segment["metadata"]["logprobs_invalid"] is False


async def _compact_after_three(runtime: Runtime, engine: SimEngine, session: str) -> list[dict[str, Any]]:
    messages = await _three_turns(runtime, engine, session)
    # Compaction: the first exchange becomes a summary; the second and third replies stay.
    compacted = [SYSTEM, {"role": "user", "content": "Summary: we said hello."}, *messages[3:]]
    compacted.append({"role": "user", "content": "Thanks."})
    await run_turn(runtime, session, compacted)
    return compacted


async def test_recompute_rebuilds_in_place_with_engine_logprobs(tokenizer: Any) -> None:
    async with _rig(tokenizer, on_history_rewrite="recompute") as (runtime, engine, backend):
        await _compact_after_three(runtime, engine, "rc")
        segments, steps = await _finalized(runtime, "rc")
        (segment,) = segments
        rebuild = steps[3]
        prompt = backend.prompts[rebuild["rid"]]
        expected = await engine.prompt_logprobs(prompt)
    assert segment["start_reason"] == "session_start" and segment["step_indices"] == [3]
    assert segment["metadata"]["rebuilds"] == ["history_rewrite"]
    assert segment["metadata"]["rebuilt_steps"] == [0, 1, 2]
    assert [s["in_segment"] for s in steps] == [False, False, False, True]
    assert rebuild["boundary_reason"] == "history_rewrite" and rebuild["prefix_rebuilt"] is True
    spans = rebuild["rebuilt_spans"]
    assert [tokenizer.decode(segment["token_ids"][a:b]) for a, b in spans] == [
        "Lyon is on the Rhône.<|im_end|>", "Bordeaux makes wine.<|im_end|>"
    ]
    assert segment["metadata"]["recomputed_logprob_spans"] == spans
    assert segment["metadata"]["invalid_logprob_spans"] == [] and segment["metadata"]["logprobs_invalid"] is False
    for a, b in spans:
        assert segment["logprobs"][a:b] == expected[a:b]
        assert all(lp < 0.0 or lp == 0.0 for lp in segment["logprobs"][a:b])
    assert any(lp != 0.0 for a, b in spans for lp in segment["logprobs"][a:b])
    assert segment["token_ids"][: len(prompt)] == prompt.tolist()
    assert _runs(segment["loss_mask"]) == [*spans, [len(prompt), len(segment["token_ids"])]]


async def test_recompute_switched_off_trains_on_flagged_zeros(tokenizer: Any) -> None:
    async with _rig(tokenizer, on_history_rewrite="recompute", recompute_logprobs=False) as (runtime, engine, backend):
        await _compact_after_three(runtime, engine, "off")
        (segment,), steps = await _finalized(runtime, "off")
        stats = await runtime.store_stats()
    spans = steps[3]["rebuilt_spans"]
    assert spans and segment["metadata"]["invalid_logprob_spans"] == spans
    assert segment["metadata"]["logprobs_invalid"] is True and steps[3]["concat_logprobs_invalid"] is True
    assert all(segment["logprobs"][i] == 0.0 for a, b in spans for i in range(a, b))
    assert stats["rebuilds"] == {"history_rewrite": 1} and stats["boundaries"] == {}


def test_recompute_environment_switch() -> None:
    assert recompute_logprobs_from_env({}) is True
    assert recompute_logprobs_from_env({"ACTORPROXY_RECOMPUTE_MISMATCH_LOGPROBS": "0"}) is False
    assert recompute_logprobs_from_env({"ACTORPROXY_RECOMPUTE_MISMATCH_LOGPROBS": "1"}) is True


async def test_segment_mode_opens_a_new_segment_on_the_same_rewrite(tokenizer: Any) -> None:
    async with _rig(tokenizer) as (runtime, engine, backend):
        await _compact_after_three(runtime, engine, "seg")
        segments, steps = await _finalized(runtime, "seg")
    assert [s["start_reason"] for s in segments] == ["session_start", "history_rewrite"]
    for segment in segments:
        check_segment_invariants(segment, steps, backend.prompts)


async def test_verify_reports_reasoning_stripping_as_expected(tokenizer: Any) -> None:
    async with _rig(tokenizer, verify_tito=True) as (runtime, engine, backend):
        await _three_turns(runtime, engine, "v")
        (segment,), _ = await _finalized(runtime, "v")
        stats = await runtime.store_stats()
    report = segment["metadata"]["verify"]
    assert report["unexpected"] == 0
    # The two earlier replies kept their sampled <think> blocks; a fresh render drops them.
    assert report["by_kind"] == {"reasoning_stripped": 2}
    assert [d["turn"] for d in report["differences"]] == [2, 4]  # system 0, user 1, assistant 2, ...
    assert all(d["expected"] and d["role"] == "assistant" for d in report["differences"])
    assert stats["verify"]["segments_verified"] == 1 and stats["verify"]["expected_only"] == 1
    assert stats["verify"]["by_kind"] == {"reasoning_stripped": 2}


async def test_verify_is_clean_inside_a_tool_loop(tokenizer: Any) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'

    async with _rig(tokenizer, verify_tito=True) as (runtime, engine, backend):
        engine.script(call, call, "It is sunny.", routing_key="t")
        messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Weather in Oslo?"}]
        for _ in range(3):
            result = await run_turn(runtime, "t", messages, tools=[WEATHER_TOOL])
            messages.append(reserialise(result.message))
            for c in result.message.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": c["id"], "content": "sunny, 18 °C"})
        (segment,), _ = await _finalized(runtime, "t")
    report = segment["metadata"]["verify"]
    assert report["unexpected"] == 0
    # Arguments came back re-serialised (indent, sorted keys): expected, matched by meaning.
    assert set(report["by_kind"]) <= {"echo_reserialised"}
