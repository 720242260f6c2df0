"""POST /submit_steps and the typed ProxyClient gateway methods, over real HTTP (port 0)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from actorproxy import ProxyConfig, open_proxy
from actorproxy.client import GenerateResult, ProxyClient, ProxyError, StepBody
from actorproxy.serve import RunningProxy
from actorproxy.sim import SimConfig, SimEngine

CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>'


@pytest.fixture
async def engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=8, token_interval=0.0002))


@pytest.fixture
async def proxy(engine: SimEngine, tokenizer: Any) -> AsyncIterator[RunningProxy]:
    async with open_proxy(ProxyConfig.of(port=0, reward_fn="gsm8k"), backend=engine, tokenizer=tokenizer) as running:
        yield running


@pytest.fixture
async def client(proxy: RunningProxy) -> AsyncIterator[ProxyClient]:
    async with ProxyClient(proxy.url, timeout=60) as c:
        yield c


async def whitebox_turns(client: ProxyClient, engine: SimEngine, uid: str, prompt_uid: str = "p") -> list[
        GenerateResult]:
    """Three /generate turns: two tool calls, then the answer."""
    engine.script(CALL % "48/2", CALL % "48+24", "48 + 24 = 72.\n#### 72", routing_key=uid)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Clips in April and May? End with #### n."}]
    turns = []
    for _ in range(3):
        turn = await client.generate(uid, prompt_uid, messages, tools=[CALC], max_tokens=64)
        turns.append(turn)
        messages.append({"role": "assistant", "content": turn.response_text or None,
                         **({"tool_calls": turn.tool_calls} if turn.tool_calls else {})})
        for call in turn.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "24"})
    assert [bool(t.tool_calls) for t in turns] == [True, True, False]
    return turns


def step(uid: str, turn: GenerateResult, reward: float | None, *, is_last: bool = False, **changes: Any) -> StepBody:
    fields: dict[str, Any] = {"trajectory_uid": uid, "prompt_uid": turn.prompt_uid, "prompt_ids": turn.prompt_ids,
                              "response_ids": turn.response_ids, "reward": reward, "step_index": turn.step_index,
                              "policy_version": 3, "is_last": is_last, "metadata": {"turn": turn.step_index}}
    return StepBody(**{**fields, **changes})


async def test_whitebox_flow_attaches_rewards_and_is_last_completes(client: ProxyClient, engine: SimEngine) -> None:
    turns = await whitebox_turns(client, engine, "wb")
    result = await client.submit_steps([step("wb", t, 0.1 * t.step_index, is_last=t is turns[-1]) for t in turns])
    assert (result.accepted, result.attached, result.external, result.completed) == (3, 3, 0, ["wb"])
    # is_last finalized the trajectory and queued it: the trainer takes it with its rewards.
    batch = await client.fetch_batch(1, 1, timeout_s=5)
    assert batch.complete and batch.data[0].instance_id == "p"
    [handed] = batch.data[0].trajectories
    assert handed.trajectory_id == "wb" and handed.reward == pytest.approx(0.2)
    [segment] = handed.segments
    assert segment["reward"] == pytest.approx(0.2) and segment["boundary_reason"] == "finalize"
    assert segment["metadata"]["step_rewards"] == {"0": 0.0, "1": pytest.approx(0.1), "2": pytest.approx(0.2)}
    assert segment["metadata"]["step_metadata"]["2"] == {"turn": 2, "is_last": True, "policy_version": 3}
    # The recorded ids were kept: the segment is the last prompt and the exact sampled ids.
    assert segment["token_ids"] == turns[-1].prompt_ids + turns[-1].response_ids
    trained = [t for t, m in zip(segment["token_ids"], segment["loss_mask"], strict=True) if m]
    assert trained == [i for t in turns for i in t.response_ids]


async def test_rewards_may_come_before_is_last(client: ProxyClient, engine: SimEngine) -> None:
    turns = await whitebox_turns(client, engine, "early")
    first = await client.submit_steps([step("early", turns[0], 0.5)])
    assert first.completed == [] and first.attached == 1
    await client.submit_steps([step("early", turns[2], 1.0, is_last=True)])
    stored = await client.read_trajectory(session_id="early")
    [segment] = stored["data"]
    assert segment["metadata"]["step_rewards"] == {"0": 0.5, "2": 1.0} and segment["reward"] == 1.0


@pytest.mark.parametrize(("kind", "position"), [("response_ids", 3), ("prompt_ids", 5), ("response_ids", None)])
async def test_mismatched_ids_are_a_409_naming_the_position_and_change_nothing(
    client: ProxyClient, engine: SimEngine, kind: str, position: int | None
) -> None:
    turns = await whitebox_turns(client, engine, "mm")
    wrong = list(getattr(turns[1], kind))
    if position is None:
        position = len(wrong)
        wrong.append(7)  # one id too many: the first difference is where the recorded ids end
    else:
        wrong[position] += 1
    external = StepBody(trajectory_uid="ext-good", prompt_uid="p", prompt_ids=[1], response_ids=[2], step_index=0,
                        reward=1.0, is_last=True)
    with pytest.raises(ProxyError) as refused:
        await client.submit_steps([external, step("mm", turns[0], 0.5), step("mm", turns[1], 1.0, **{kind: wrong})])
    error = refused.value
    assert error.status == 409 and error.code == "ids_mismatch"
    assert f"position {position}" in error.message and error.body["error"]["param"] == f"steps[2].{kind}[{position}]"
    # All or nothing: the good step was not applied either (the trajectory is still open, no reward attached).
    assert (await client.stats())["segments"] == 0
    done = await client.complete_trajectory("mm")
    assert done.segments == 1
    [segment] = (await client.read_trajectory(session_id="mm"))["data"]
    assert "step_rewards" not in segment["metadata"] and segment["reward"] is None
    trained = [t for t, m in zip(segment["token_ids"], segment["loss_mask"], strict=True) if m]
    assert trained == [i for t in turns for i in t.response_ids]  # the recorded ids, never overwritten


async def test_external_steps_become_flagged_segments(client: ProxyClient) -> None:
    prompt, first, second = [11, 12, 13, 14], [21, 22, 23], [31, 32]
    steps = [
        {"trajectory_uid": "ext", "prompt_uid": "pe", "prompt_ids": prompt, "response_ids": first, "reward": 0.0,
         "step_index": 0, "policy_version": 7, "is_last": False, "metadata": {"engine": "mine"}},
        {"trajectory_uid": "ext", "prompt_uid": "pe", "prompt_ids": prompt + first + [15], "response_ids": second,
         "reward": 1.0, "step_index": 1, "policy_version": 7, "is_last": True, "metadata": {}},
    ]
    result = await client.submit_steps(steps)
    assert (result.attached, result.external, result.completed) == (0, 2, ["ext"])
    batch = await client.fetch_batch(1, 1, timeout_s=5)
    [handed] = batch.data[0].trajectories
    assert handed.trajectory_id == "ext" and handed.reward == 1.0
    one, two = sorted(handed.segments, key=lambda s: s["step_indices"])
    assert one["token_ids"] == prompt + first and one["loss_mask"] == [0] * 4 + [1] * 3
    assert one["versions"] == [-1] * 4 + [7] * 3 and one["logprobs"] == [0.0] * 7
    meta = one["metadata"]
    assert meta["source"] == "external" and meta["logprobs_absent"] and meta["logprobs_invalid"]
    assert meta["invalid_logprob_spans"] == [[4, 7]] and meta["step_metadata"]["0"]["engine"] == "mine"
    assert two["token_ids"] == prompt + first + [15] + second and two["reward"] == 1.0
    assert two["instance_id"] == "pe"


async def test_an_external_step_after_recorded_ones_continues_the_numbering(
    client: ProxyClient, engine: SimEngine
) -> None:
    turns = await whitebox_turns(client, engine, "mix")
    ext = {"trajectory_uid": "mix", "prompt_uid": "p", "prompt_ids": [1, 2], "response_ids": [3], "step_index": 3,
           "reward": 1.0, "is_last": True}
    result = await client.submit_steps([step("mix", turns[2], 0.5), ext])
    assert (result.attached, result.external, result.completed) == (1, 1, ["mix"])
    stored = (await client.read_trajectory(session_id="mix"))["data"]
    assert sorted(tuple(s["step_indices"]) for s in stored) == [(0, 1, 2), (3,)]
    # A step recorded, stored and submitted again later is refused, never silently re-recorded.
    with pytest.raises(ProxyError) as late:
        await client.submit_steps([step("mix", turns[0], 1.0)])
    assert late.value.status == 409 and late.value.code == "step_already_stored"


@pytest.mark.parametrize(
    "steps",
    [
        [],
        [{"trajectory_uid": "x", "prompt_uid": "p", "prompt_ids": [1], "response_ids": [2], "step_index": -1}],
        [{"trajectory_uid": "x", "prompt_uid": "p", "prompt_ids": [1], "response_ids": ["a"], "step_index": 0}],
        [{"trajectory_uid": "x", "prompt_uid": "p", "prompt_ids": [-4], "response_ids": [2], "step_index": 0}],
        [{"trajectory_uid": "x", "prompt_uid": "p", "prompt_ids": [1], "response_ids": [2], "step_index": 0,
          "surprise": 1}],
        [{"trajectory_uid": "x/y", "prompt_uid": "p", "prompt_ids": [1], "response_ids": [2], "step_index": 0}],
        [{"trajectory_uid": "x", "prompt_uid": "p", "prompt_ids": [1], "response_ids": [2], "step_index": 0,
          "reward": "high"}],
        [{"trajectory_uid": "x", "prompt_uid": "p", "prompt_ids": [1], "response_ids": [2], "step_index": 0},
         {"trajectory_uid": "x", "prompt_uid": "p", "prompt_ids": [1], "response_ids": [2], "step_index": 0}],
        [{"trajectory_uid": "x", "prompt_uid": "p", "prompt_ids": [1], "response_ids": [2], "step_index": 0},
         {"trajectory_uid": "x", "prompt_uid": "q", "prompt_ids": [1], "response_ids": [2], "step_index": 1}],
        [{"trajectory_uid": "x", "prompt_uid": "p", "prompt_ids": [1], "response_ids": [2], "step_index": 0,
          "is_last": True},
         {"trajectory_uid": "x", "prompt_uid": "p", "prompt_ids": [1], "response_ids": [2], "step_index": 1}],
        [{"trajectory_uid": "x", "prompt_uid": "p", "prompt_ids": [1], "step_index": 0}],
        # A good external step with a bad one: neither is recorded.
        [{"trajectory_uid": "good", "prompt_uid": "p", "prompt_ids": [1], "response_ids": [2], "step_index": 0},
         {"trajectory_uid": "x", "prompt_uid": "p", "prompt_ids": [1], "response_ids": [2], "step_index": 0,
          "metadata": []}],
    ],
)
async def test_bad_steps_are_a_4xx_and_record_nothing(proxy: RunningProxy, steps: list[Any]) -> None:
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        response = await http.post("/submit_steps", content=json.dumps({"steps": steps}))
        assert 400 <= response.status_code < 500, response.text
        assert set(response.json()["error"]) >= {"message", "type", "code", "param"}
        stats = (await http.get("/trajectory/stats")).json()
        assert stats["segments"] == 0 and stats["steps"] == 0
        assert (await http.get("/sessions")).json()["total"] == 0


async def test_typed_client_methods(client: ProxyClient) -> None:
    init = await client.init_trajectory(prompt_uid="tq", metadata={"ground_truth": "4"})
    assert init.base_url.endswith(f"/{init.trajectory_uid}/tq") and init.channel == "train"
    turn = await client.generate(init.trajectory_uid, "tq", [{"role": "user", "content": "2+2?"}], max_tokens=8)
    assert len(turn.response_ids) == len(turn.logprobs) == len(turn.versions) > 0
    reward = await client.compute_reward(init.trajectory_uid, [{"role": "assistant", "content": "#### 4"}],
                                         {"ground_truth": "4"})
    assert reward.reward == 1.0
    done = await client.complete_trajectory(init.trajectory_uid, reward=reward.reward)
    assert done.queued_for_training and done.steps == 1 and done.prompt_uid == "tq"
    batch = await client.fetch_batch(1, 1, timeout_s=5)
    assert batch.complete and batch.data[0].trajectories[0].reward == 1.0
    empty = await client.fetch_batch(1, 1, timeout_s=0)
    assert empty.data == [] and not empty.complete


async def test_a_step_whose_segment_was_already_stored_is_refused(client: ProxyClient, engine: SimEngine) -> None:
    first = await client.generate("rw", "p", [{"role": "user", "content": "first question"}], max_tokens=8)
    # A rewritten history (another first message) closes segment 0 into the store and opens segment 1.
    second = await client.generate("rw", "p", [{"role": "user", "content": "another question"}], max_tokens=8)
    with pytest.raises(ProxyError) as refused:
        await client.submit_steps([step("rw", first, 1.0), step("rw", second, 1.0, is_last=True)])
    assert refused.value.status == 409 and refused.value.code == "step_already_stored"
    assert refused.value.body["error"]["param"] == "steps[0].step_index"
    result = await client.submit_steps([step("rw", second, 1.0, is_last=True)])  # the open segment's step is fine
    assert result.completed == ["rw"]
    stored = {s["segment_index"]: s for s in (await client.read_trajectory(session_id="rw"))["data"]}
    assert "step_rewards" not in stored[0]["metadata"] and stored[1]["metadata"]["step_rewards"] == {"1": 1.0}
