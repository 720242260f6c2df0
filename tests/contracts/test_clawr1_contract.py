"""Claw-R1's shipped code (AgentR1/Claw-R1 @ 4e1dec6) against actorproxy: its requests, replies, flags, statuses.

The facts come from that commit: the trainer's gateway argv (``ray_agent_trainer.py``), the flows' calls
(``agent_flow.py``, ``single_step_single_turn_agent_flow.py``, ``multi_step_agent_flow.py``,
``blackbox_agent_flow.py``, ``gsm8k_agent.py``) and its DataPool's methods (``data_pool.py``,
``async_trainer.py``, ``async_rollouter.py``). Every body below is one those files send.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import types
from array import array
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest

from actorproxy import ProxyConfig, open_proxy
from actorproxy.cli import build_parser, config_from_args
from actorproxy.engines.base import GenerateRequest, SamplingParams
from actorproxy.errors import StartupError
from actorproxy.reward_worker import RayRewardWorker
from actorproxy.serve import RunningProxy
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.sim.generation import SimGeneration
from actorproxy.store.codec import segment_blobs, segment_meta
from actorproxy.store.ray_pool import ClawR1Step, DataPool

#: ``RayAgentTrainer._start_gateway_server``'s argv after ``python -m claw_r1.gateway.gateway`` (verl reports
#: replica addresses as host:port).
TRAINER_ARGV = (
    "--data-pool-name data_pool --vllm-addresses 10.0.0.7:41233,10.0.0.8:41233 --tokenizer-path {tokenizer} "
    "--prompt-length 1024 --response-length 64 --reward-worker-name reward_loop_worker "
    "--ray-address 10.0.0.1:6379 --ray-namespace 5b0c2d4e --port 8100"
)
#: ``AgentFlowWorkerBase.generate_sequences``'s sampling params (calculate_log_probs on).
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "repetition_penalty": 1.0, "logprobs": True}
CHECK_ANSWER = {"type": "function", "function": {"name": "check_answer", "description": "Check an answer.",
                                                 "parameters": {"type": "object", "properties": {
                                                     "answer": {"type": "string"}}, "required": ["answer"]}}}


class RecordingEngine(SimEngine):
    """The simulator, remembering the ids each generation was given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: list[list[int]] = []
        self.samplings: list[SamplingParams] = []

    def open_generation(self, request: GenerateRequest) -> SimGeneration:
        self.prompts.append(list(request.input_ids))
        self.samplings.append(request.sampling)
        return super().open_generation(request)


@pytest.fixture
async def engine(tokenizer: Any) -> RecordingEngine:
    return RecordingEngine(tokenizer, SimConfig(seed=3, token_interval=0.0002))


@pytest.fixture
async def proxy(engine: RecordingEngine, tokenizer: Any) -> AsyncIterator[RunningProxy]:
    # What the trainer's launch line sets (see test_the_trainer_launch_line), on a free port.
    config = ProxyConfig.of(port=0, reward_fn="gsm8k", max_prompt_tokens=1024, default_max_tokens=64,
                            init_base_url="v1", tool_call_format="none")
    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running:
        yield running


def _prompt(tokenizer: Any, text: str) -> list[int]:
    """What ``AgentFlowBase.apply_chat_template`` sends: the agent renders and tokenizes its own prompt."""
    rendered = tokenizer.render([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(tokenizer.encode(rendered))


def _step(uid: str, prompt_uid: str, prompt_ids: list[int], gen: dict[str, Any], index: int, *,
          is_last: bool, reward: float | None = None) -> dict[str, Any]:
    """``AgentFlowBase.gateway_submit_steps``'s payload for one Step."""
    return {"prompt_ids": prompt_ids, "response_ids": gen["token_ids"][:64], "reward": reward,
            "rollout_log_probs": gen["log_probs"], "trajectory_uid": uid, "prompt_uid": prompt_uid,
            "step_index": index, "policy_version": 0, "is_last": is_last,
            "metadata": {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "72"}}}


# -- launch ---------------------------------------------------------------------------------


def test_the_trainer_launch_line(tmp_path: Any, tokenizer: Any) -> None:
    tokenizer.hf.save_pretrained(str(tmp_path))
    argv = ["run", *TRAINER_ARGV.format(tokenizer=tmp_path).split()]
    config = config_from_args(build_parser().parse_args(argv), argv)
    assert config.engines.backend == "vllm"
    assert config.engines.backend_urls == ("http://10.0.0.7:41233", "http://10.0.0.8:41233")  # as the gateway reads
    assert config.gateway.reward_worker_name == "reward_loop_worker"
    assert config.store.store_kind == "ray" and config.store.data_pool == "data_pool"
    assert config.store.ray_address == "10.0.0.1:6379" and config.store.ray_namespace == "5b0c2d4e"
    assert config.server.port == 8100 and config.limits.max_prompt_tokens == 1024
    assert config.limits.default_max_tokens == 64
    # The gateway's behaviour: base_url ends in /v1, tool calls stay in the content as text.
    assert config.gateway.init_base_url == "v1" and config.parsing.tool_call_format == "none"


def test_a_missing_reward_worker_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # the trainer's environment is not this one
    worker = RayRewardWorker("reward_loop_worker", address=None, namespace="ns", pad_id=0, prompt_length=8,
                             response_length=8, timeout=5)
    with pytest.raises(StartupError) as refused:
        worker.connect()
    assert str(refused.value).startswith("--reward-worker-name: building the reward worker's sample needs torch")
    assert "\n" not in str(refused.value)


def test_the_reward_worker_sample_is_laid_out_as_verl_lays_out_a_rollout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompt left-padded, response right-padded, masks and positions over both, fields as 1-arrays."""
    fake_torch = types.SimpleNamespace(
        long="long", tensor=lambda rows, dtype=None: np.array(rows), cat=lambda xs, dim=0: np.concatenate(xs, dim),
        cumsum=lambda x, dim=-1: np.cumsum(x, axis=dim), clip=lambda x, min=None: np.clip(x, min, None))
    fake_td = types.SimpleNamespace(TensorDict=lambda data, batch_size: {"batch_size": batch_size, **data})
    fake_verl = types.SimpleNamespace(DataProto=lambda batch, non_tensor_batch: (batch, non_tensor_batch))
    worker = RayRewardWorker("w", address=None, namespace="ns", pad_id=0, prompt_length=4, response_length=3,
                             timeout=5)
    worker._modules = {"numpy": np, "torch": fake_torch, "tensordict": fake_td, "verl.protocol": fake_verl}
    batch, fields = worker.sample([11, 12], [21], 3, {"tool": 1}, {"data_source": "gsm8k"})
    assert batch["prompts"].tolist() == [[0, 0, 11, 12]] and batch["responses"].tolist() == [[21, 0, 0]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 0, 0]]
    assert batch["input_ids"].tolist() == [[0, 0, 11, 12, 21, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 0, 0, 1, 2, 2, 2]] and batch["batch_size"] == 1
    assert fields["data_source"].tolist() == ["gsm8k"] and fields["__num_turns__"].tolist() == [3]
    assert fields["tool_extra_fields"].tolist() == [{"tool": 1}]


# -- white-box, as shipped --------------------------------------------------------------------


async def test_single_step_flow_token_in_generate_then_submit(http: httpx.AsyncClient, engine: RecordingEngine,
                                                             tokenizer: Any) -> None:
    prompt_ids = _prompt(tokenizer, "Natalia sold clips to 48 friends... #### n")
    reply = await http.post("/generate", json={"prompt_ids": prompt_ids, "sampling_params": SAMPLING})
    assert reply.status_code == 200, reply.text
    gen = reply.json()
    assert engine.prompts[-1] == prompt_ids  # exactly the agent's ids: no template applied
    assert gen["stop_reason"] in ("stop", "length") and len(gen["log_probs"]) == len(gen["token_ids"]) > 0
    submitted = await http.post("/submit_steps", json={"steps": [_step("t1", "uid-1", prompt_ids, gen, 0,
                                                                       is_last=True)]})
    assert submitted.status_code == 200 and submitted.json()["accepted"] == 1
    batch = (await http.post("/trajectory/fetch_batch", json={"groups": 1, "rollouts_per_group": 1,
                                                             "timeout_s": 5})).json()
    [group] = batch["data"]
    assert group["instance_id"] == "uid-1"
    [segment] = group["trajectories"][0]["segments"]
    response = gen["token_ids"][:64]
    assert segment["token_ids"] == prompt_ids + response
    assert segment["loss_mask"] == [0] * len(prompt_ids) + [1] * len(response)
    # The sampled ids' real logprobs, as recorded: not 0.0, not flagged.
    assert segment["logprobs"][len(prompt_ids):] == pytest.approx(gen["log_probs"][:64])
    assert segment["metadata"]["source"] == "generate" and "logprobs_absent" not in segment["metadata"]


async def test_without_logprobs_asked_log_probs_is_null(http: httpx.AsyncClient, tokenizer: Any) -> None:
    body = {"prompt_ids": _prompt(tokenizer, "hi"), "sampling_params": {**SAMPLING, "logprobs": False}}
    gen = (await http.post("/generate", json=body)).json()
    assert gen["log_probs"] is None and gen["token_ids"]
    # It waits for its /submit_steps, and /metrics says so.
    metrics = (await http.get("/metrics")).text
    assert "actorproxy_token_in_generations_waiting 1.0" in metrics


async def test_multi_step_flow_with_compute_reward(http: httpx.AsyncClient, engine: RecordingEngine,
                                                   tokenizer: Any) -> None:
    engine.script("Each clip costs 24. #### 72", "I checked it. #### 72")
    first = _prompt(tokenizer, "How many clips? #### n")
    gen0 = (await http.post("/generate", json={"prompt_ids": first, "sampling_params": SAMPLING})).json()
    assert (await http.post("/submit_steps", json={"steps": [_step("t2", "uid-2", first, gen0, 0, is_last=False)]}
                            )).status_code == 200
    second = first + gen0["token_ids"] + _prompt(tokenizer, "Please verify your answer.")
    gen1 = (await http.post("/generate", json={"prompt_ids": second, "sampling_params": SAMPLING})).json()
    reward = await http.post("/compute_reward", json={
        "prompt_ids": second, "response_ids": gen1["token_ids"], "num_turns": 4, "extra_fields": {},
        "dataset_fields": {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "72"}}})
    assert reward.status_code == 200, reward.text
    assert reward.json() == {"reward_score": 1.0, "reward_extra_info": {}}
    done = await http.post("/submit_steps", json={"steps": [_step("t2", "uid-2", second, gen1, 1, is_last=True,
                                                                  reward=1.0)]})
    assert done.json()["completed"] == ["t2"]
    read = (await http.post("/trajectory/read", json={"session_id": "t2"})).json()
    assert [s["metadata"]["source"] for s in read["data"]] == ["generate", "generate"]
    assert read["data"][-1]["reward"] == 1.0 and read["data"][-1]["boundary_reason"] == "finalize"


async def test_validation_steps_never_reach_the_training_batch(http: httpx.AsyncClient, tokenizer: Any) -> None:
    prompt_ids = _prompt(tokenizer, "validation question")
    gen = (await http.post("/generate", json={"prompt_ids": prompt_ids, "sampling_params": SAMPLING})).json()
    submitted = await http.post("/submit_steps", params={"channel": "val"},
                                json={"steps": [_step("v1", "uid-v", prompt_ids, gen, 0, is_last=True)]})
    assert submitted.status_code == 200
    batch = (await http.post("/trajectory/fetch_batch", json={"groups": 1, "rollouts_per_group": 1,
                                                             "timeout_s": 0})).json()
    assert batch == {"data": [], "complete": False}
    [segment] = (await http.post("/trajectory/read", json={"session_id": "v1"})).json()["data"]
    assert segment["metadata"]["channel"] == "val"


async def test_a_repetition_penalty_reaches_the_engine(http: httpx.AsyncClient, engine: RecordingEngine) -> None:
    prompt_ids = [1, 2, 3]
    for penalty in (1.3, None):
        sampling = {"max_tokens": 4} | ({} if penalty is None else {"repetition_penalty": penalty})
        got = await http.post("/generate", json={"prompt_ids": prompt_ids, "sampling_params": sampling})
        assert got.status_code == 200, got.text
    assert [s.repetition_penalty for s in engine.samplings] == [1.3, 1.0]


async def test_shipped_bodies_with_bad_fields_are_4xx(http: httpx.AsyncClient) -> None:
    bad = [
        ("/generate", {"prompt_ids": [1, 2], "sampling_params": {"repetition_penalty": 0}}),
        ("/generate", {"prompt_ids": [1, 2], "sampling_params": {"repetition_penalty": 2.5}}),
        ("/generate", {"prompt_ids": [1, -2], "sampling_params": {}}),
        ("/generate", {"prompt_ids": [1], "sampling_params": {"best_of": 2}}),
        ("/generate", {"prompt_ids": [1], "image_data": [{"url": "x"}]}),
        ("/submit_steps", {"steps": [{"trajectory_uid": "t", "prompt_uid": "p", "prompt_ids": [1],
                                      "response_ids": [2, 3], "rollout_log_probs": [-0.1], "step_index": 0}]}),
        ("/submit_steps", {"steps": [{"trajectory_uid": "t", "prompt_uid": "p", "prompt_ids": [1],
                                      "response_ids": [2], "routed_experts": [[1]], "step_index": 0}]}),
        ("/compute_reward", {"prompt_ids": [1], "response_ids": ["x"]}),
    ]
    for path, body in bad:
        response = await http.post(path, json=body)
        assert 400 <= response.status_code < 500, (path, body, response.text)
        assert "error" in response.json()
    assert (await http.post("/submit_steps", params={"channel": "a/b"}, json={"steps": []})).status_code == 400


# -- black-box, as shipped -----------------------------------------------------------------------


async def test_blackbox_flow_on_the_gateways_base_url(http: httpx.AsyncClient, engine: RecordingEngine) -> None:
    openai = pytest.importorskip("openai")
    init = await http.post("/init_trajectory")  # BlackBoxAgentFlowBase.run posts no body
    assert init.status_code == 200
    base_from_init = init.json()["base_url"]
    assert base_from_init.endswith("/v1")
    parts = base_from_init.rsplit("/", 2)
    base_url = f"{parts[0]}/uid-7/v1"  # the flow puts the real prompt uid in
    registered = await http.post(f"{base_url}/register_trajectory", json={
        "channel": "train", "metadata": {"data_source": "openai/gsm8k", "policy_version": 0}})
    assert registered.status_code == 200
    call = '<tool_call>\n{"name": "check_answer", "arguments": {"answer": "72"}}\n</tool_call>'
    engine.script(call)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="not-needed", max_retries=0) as client:
        reply = await client.chat.completions.create(model="default", messages=[
            {"role": "user", "content": "How many clips?"}], tools=[CHECK_ANSWER])
    message = reply.choices[0].message
    assert "<tool_call>" in (message.content or "") and not message.tool_calls  # GSM8KAgent parses the text
    done = await http.post(f"{base_url}/complete_trajectory")  # no body
    assert done.status_code == 200
    batch = (await http.post("/trajectory/fetch_batch", json={"groups": 1, "rollouts_per_group": 1,
                                                             "timeout_s": 5})).json()
    assert batch["data"][0]["instance_id"] == "uid-7"
    # What register_trajectory said (the dataset fields a trainer computes rewards from) is on the segment.
    [segment] = batch["data"][0]["trajectories"][0]["segments"]
    assert segment["metadata"]["trajectory_metadata"] == {"data_source": "openai/gsm8k", "policy_version": 0}


async def test_a_token_in_generation_never_claimed_is_stored_at_shutdown(
        engine: RecordingEngine, tokenizer: Any, tmp_path: Any) -> None:
    config = ProxyConfig.of(port=0, store_kind="sqlite", data_dir=str(tmp_path))
    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=60) as client:
            body = {"prompt_ids": _prompt(tokenizer, "never submitted"), "sampling_params": SAMPLING}
            gen = (await client.post("/generate", json=body)).json()
    with sqlite3.connect(tmp_path / "trajectories.sqlite3") as db:
        rows = db.execute("SELECT session_id, arrays FROM steps WHERE session_id LIKE 'generate-%'").fetchall()
    assert len(rows) == 1 and gen["token_ids"]


def test_waiting_generations_are_claimed_by_their_ids_and_age_out() -> None:
    from actorproxy.core.records import Step, float_array, int_array, version_array
    from actorproxy.runtime.token_in import TokenInGenerations

    def generated(prompt: list[int], output: list[int]) -> Step:
        return Step(index=0, session_id="generate-x", segment_index=0, turn_id=None, instance_id=None,
                    new_messages=[], message_count=0, prompt_len=len(prompt), fragment_ids=int_array(prompt),
                    max_new_tokens=8, output_ids=int_array(output),
                    output_logprobs=float_array([-0.5] * len(output)), output_versions=version_array([2] * len(output)))

    waiting = TokenInGenerations(ttl=10.0)
    waiting.add(generated([1, 2], [7, 8, 9]))
    waiting.add(generated([1, 2], [5, 6]))  # a second rollout of the same prompt
    assert waiting.claim(array("i", [1, 2]), array("i", [4])) is None
    cut = waiting.claim(array("i", [1, 2]), array("i", [7, 8]))  # the flow kept the first response_length ids
    assert cut is not None and list(cut.output_ids) == [7, 8] and list(cut.output_logprobs) == [-0.5, -0.5]
    assert waiting.statistics() == {"waiting": 1, "claimed": 1, "unclaimed_stored": 0}
    assert waiting.expired(now=0.0) == []
    [old] = waiting.expired(now=1e12)
    assert list(old.output_ids) == [5, 6] and waiting.statistics()["waiting"] == 0


# -- the DataPool, as Claw-R1's trainer calls it ---------------------------------------------------


def _segment(rollout: str, instance: str, *, channel: str | None = None, reason: str = "finalize",
             registered: dict[str, Any] | None = None) -> dict[str, Any]:
    from actorproxy.core.records import Segment

    metadata: dict[str, Any] = {"channel": channel} if channel else {}
    if registered:
        metadata["trajectory_metadata"] = registered
    seg = Segment(trajectory_id=f"{rollout}#0", parent_traj_id=rollout, instance_id=instance, rollout_id=rollout,
                  segment_index=0, token_ids=array("i", [1, 2, 3, 4, 5]), loss_mask=array("b", [0, 0, 1, 0, 1]),
                  logprobs=array("f", [0, 0, -0.5, 0, -0.25]), versions=array("q", [0, 0, 3, 0, 3]),
                  step_indices=(0, 1), start_reason="session_start", boundary_reason=reason, reward=1.0,
                  metadata={**metadata, "step_metadata": {"0": {"data_source": "gsm8k", "source": "generate"}}})
    return {"meta": segment_meta(seg), "arrays": list(segment_blobs(seg))}


class _Backend:
    """Stands in for Claw-R1's VerlBackend: ``convert(list[Step])``."""

    def convert(self, steps: list[ClawR1Step]) -> dict[str, Any]:
        return {"steps": steps}


def test_the_trainers_calls_on_actorproxys_pool() -> None:
    async def scenario() -> None:
        pool = DataPool(types.SimpleNamespace(n_rollouts=2), _Backend())
        await pool.put([_segment("a", "g1"), _segment("v", "g1", channel="val"), _segment("b", "g1")])
        batch = await asyncio.wait_for(pool.fetch_batch(batch_size=1), 5)
        steps = batch["steps"]
        assert [(s.trajectory_uid, s.step_index) for s in steps] == [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
        first, last = steps[0], steps[1]
        assert first.prompt_ids == [1, 2] and first.response_ids == [3] and first.rollout_log_probs == [-0.5]
        assert first.prompt_uid == "g1" and first.policy_version == 3 and first.metadata == {"data_source": "gsm8k"}
        assert last.prompt_ids == [1, 2, 3, 4] and last.response_ids == [5] and last.is_last and last.reward == 1.0
        assert last.metadata is None  # no metadata submitted for step 1, none registered
        # The validation rollout stayed out of the training batch; it is fetched on its own channel.
        val = await asyncio.wait_for(pool.fetch_batch(batch_size=1, n_rollouts=1, channel="val"), 5)
        assert {s.trajectory_uid for s in val["steps"]} == {"v"}
        stats = pool.get_statistics()
        assert stats["fetch_count"] == 2 and stats["queue_size"] == 0 and not stats["shutdown"]
        pool.put_validate(b"metrics")
        assert pool.get_validate() == b"metrics" and pool.get_validate() is None
        waiting = asyncio.ensure_future(pool.fetch_batch(batch_size=1))
        await asyncio.sleep(0)
        pool.shutdown()
        assert await asyncio.wait_for(waiting, 5) is None

    asyncio.run(scenario())


def test_registered_metadata_becomes_the_steps_metadata() -> None:
    async def scenario() -> None:
        pool = DataPool(types.SimpleNamespace(n_rollouts=1), _Backend())
        registered = {"data_source": "gsm8k", "reward_model": {"ground_truth": 72}}
        await pool.put([_segment("bb", "g5", registered=registered)])
        steps = (await asyncio.wait_for(pool.fetch_batch(batch_size=1), 5))["steps"]
        assert steps[1].metadata == registered

    asyncio.run(scenario())


def test_a_group_that_never_fills_does_not_hold_back_the_pool() -> None:
    async def scenario() -> None:
        pool = DataPool(max_pending_groups=10)
        await pool.put([_segment("crashed", "g0", reason="history_rewrite"), _segment("x", "g1"),
                        _segment("y", "g2")])
        groups = await pool.fetch_batch(2, 1, 0.0)
        assert [g["instance_id"] for g in groups] == ["g1", "g2"]
        assert pool.stats()["pending_groups"] == 1

    asyncio.run(scenario())
