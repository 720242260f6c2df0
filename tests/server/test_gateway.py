"""The gateway surface over real HTTP: white-box /generate, black-box base URLs, rewards, fetch_batch."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
from _util import WEATHER_TOOL

from actorproxy import ProxyConfig, open_proxy
from actorproxy.serve import RunningProxy
from actorproxy.sim import SimConfig, SimEngine


@pytest.fixture
async def engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=6, token_interval=0.0002))


@pytest.fixture
async def proxy(engine: SimEngine, tokenizer: Any) -> AsyncIterator[RunningProxy]:
    config = ProxyConfig.of(port=0, reward_fn="gsm8k", max_pending_groups=50)
    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running:
        yield running


async def test_whitebox_generate_returns_the_exact_ids(http: httpx.AsyncClient, engine: SimEngine,
                                                       tokenizer: Any) -> None:
    engine.script('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
                  "It is 4 °C in Oslo.", routing_key="wb-1")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    first = await http.post("/generate", json={"trajectory_uid": "wb-1", "prompt_uid": "p1", "messages": messages,
                                               "tools": [WEATHER_TOOL], "max_tokens": 64})
    assert first.status_code == 200, first.text
    one = first.json()
    assert one["tool_calls"][0]["function"]["name"] == "get_weather" and one["step_index"] == 0
    assert len(one["response_ids"]) == len(one["logprobs"]) == len(one["versions"])
    messages += [{"role": "assistant", "content": None, "tool_calls": one["tool_calls"]},
                 {"role": "tool", "tool_call_id": one["tool_calls"][0]["id"], "content": "4 °C"}]
    second = (await http.post("/generate", json={"trajectory_uid": "wb-1", "prompt_uid": "p1",
                                                 "messages": messages, "tools": [WEATHER_TOOL]})).json()
    assert second["response_text"] == "It is 4 °C in Oslo." and second["finish_reason"] == "stop"
    # TITO: the second prompt continues the first prompt and the exact sampled ids.
    assert second["prompt_ids"][: len(one["prompt_ids"]) + len(one["response_ids"])] == \
        one["prompt_ids"] + one["response_ids"]
    done = (await http.post("/complete_trajectory/wb-1", json={"reward": 1.0})).json()
    assert done["steps"] == 2 and done["prompt_uid"] == "p1" and done["queued_for_training"]
    stored = (await http.post("/trajectory/read", json={"session_id": "wb-1", "include_steps": True})).json()
    [segment] = stored["data"]
    assert segment["token_ids"] == second["prompt_ids"] + second["response_ids"]
    assert segment["instance_id"] == "p1" and segment["reward"] == 1.0
    trained = [t for t, m in zip(segment["token_ids"], segment["loss_mask"], strict=True) if m]
    assert trained == one["response_ids"] + second["response_ids"]


async def test_blackbox_agent_on_its_base_url(http: httpx.AsyncClient) -> None:
    openai = pytest.importorskip("openai")
    init = (await http.post("/init_trajectory", json={"prompt_uid": "q7"})).json()
    assert init["base_url"].endswith(f"/{init['trajectory_uid']}/q7")
    registered = await http.post(init["base_url"] + "/v1/register_trajectory", json={"channel": "train"})
    assert registered.json()["channel"] == "train"
    async with openai.AsyncOpenAI(base_url=init["base_url"] + "/v1", api_key="-", max_retries=0) as agent:
        reply = await agent.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=16)
    assert reply.choices[0].message.role == "assistant"
    done = (await http.post(init["base_url"] + "/v1/complete_trajectory", json={"reward": 0.5})).json()
    assert done["steps"] == 1 and done["queued_for_training"]
    batch = (await http.post("/trajectory/fetch_batch", json={"groups": 1, "rollouts_per_group": 1})).json()
    assert batch["complete"] and batch["data"][0]["instance_id"] == "q7"
    [trajectory] = batch["data"][0]["trajectories"]
    assert trajectory["trajectory_id"] == init["trajectory_uid"] and trajectory["reward"] == 0.5
    assert sum(trajectory["segments"][0]["loss_mask"]) > 0
    # Drained: each trajectory is handed over once.
    again = await http.post("/trajectory/read", json={"session_id": init["trajectory_uid"]})
    assert again.status_code == 404 or again.json()["data"] == []


async def test_the_validation_channel_never_reaches_training(http: httpx.AsyncClient) -> None:
    init = (await http.post("/init_trajectory", json={"prompt_uid": "v", "channel": "validate"})).json()
    await http.post("/generate", json={"trajectory_uid": init["trajectory_uid"], "prompt_uid": "v",
                                       "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    done = (await http.post(f"/complete_trajectory/{init['trajectory_uid']}", json={})).json()
    assert done["channel"] == "validate" and not done["queued_for_training"]
    batch = (await http.post("/trajectory/fetch_batch",
                             json={"groups": 1, "rollouts_per_group": 1, "timeout_s": 0})).json()
    assert batch == {"data": [], "complete": False}
    kept = (await http.post("/trajectory/read", json={"session_id": init["trajectory_uid"]})).json()
    assert len(kept["data"]) == 1  # read separately


async def test_fetch_batch_returns_complete_groups_fifo_each_once(http: httpx.AsyncClient) -> None:
    groups, per_group = 4, 8
    order = [(g, r) for r in range(per_group) for g in range(groups)]
    order = order[::3] + order[1::3] + order[2::3]  # trajectories finish out of order across groups

    async def rollout(g: int, r: int) -> None:
        uid = f"g{g}-r{r}"
        await http.post("/generate", json={"trajectory_uid": uid, "prompt_uid": f"group-{g}",
                                           "messages": [{"role": "user", "content": f"task {g}"}], "max_tokens": 6})

    async with trio.open_nursery() as nursery:
        for g, r in order:
            nursery.start_soon(rollout, g, r)
    # Complete all but one rollout of group 0 (the oldest once its first trajectory completes).
    for g, r in order:
        if (g, r) != (0, 7):
            assert (await http.post(f"/complete_trajectory/g{g}-r{r}", json={"reward": float(r)})).status_code == 200
    # Group 0 never holding back the complete groups behind it: the first two complete ones come at once.
    early = (await http.post("/trajectory/fetch_batch",
                             json={"groups": 2, "rollouts_per_group": per_group, "timeout_s": 0})).json()
    assert early["complete"], early
    first_two = [d["instance_id"] for d in early["data"]]
    assert "group-0" not in first_two and len(first_two) == 2

    rest: dict[str, Any] = {}

    async def fetch() -> None:  # a long poll: it returns once group 0 fills
        response = await http.post("/trajectory/fetch_batch",
                                   json={"groups": 2, "rollouts_per_group": per_group, "timeout_s": 30})
        rest.update(response.json())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fetch)
        await http.post("/complete_trajectory/g0-r7", json={"reward": 7.0})
    assert rest["complete"]
    seen = first_two + [d["instance_id"] for d in rest["data"]]
    assert sorted(seen) == [f"group-{g}" for g in range(groups)] and len(set(seen)) == groups
    for group in rest["data"]:
        assert len(group["trajectories"]) == per_group
        number = group["instance_id"].removeprefix("group-")
        assert all(t["trajectory_id"].startswith(f"g{number}-") for t in group["trajectories"])


async def test_compute_reward(http: httpx.AsyncClient) -> None:
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "It is 4.\n#### 4"}]
    ok = await http.post("/compute_reward", json={"trajectory_uid": "t", "messages": messages,
                                                  "dataset_fields": {"ground_truth": "#### 4"}})
    assert ok.json()["reward"] == 1.0
    wrong = await http.post("/compute_reward", json={"trajectory_uid": "t", "messages": messages,
                                                     "dataset_fields": {"ground_truth": "5"}})
    assert wrong.json()["reward"] == 0.0
    missing = await http.post("/compute_reward", json={"trajectory_uid": "t", "messages": messages})
    assert missing.status_code == 422 and "gsm8k" in missing.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/generate", {"trajectory_uid": "x", "messages": []}),
        ("/generate", {"trajectory_uid": "x", "prompt_uid": "p", "messages": [], "extra": 1}),
        ("/generate", {"trajectory_uid": 3, "prompt_uid": "p", "messages": []}),
        ("/generate", {"trajectory_uid": "a/b", "prompt_uid": "p", "messages": [{"role": "user", "content": "x"}]}),
        ("/generate", {"trajectory_uid": "x", "prompt_uid": "p", "messages": [{"role": "robot"}]}),
        ("/init_trajectory", {"channel": "a/b"}),
        ("/init_trajectory", {"channel": ""}),
        ("/compute_reward", {"messages": []}),
        ("/trajectory/fetch_batch", {"groups": 0, "rollouts_per_group": 1}),
        ("/trajectory/fetch_batch", {"groups": 1, "rollouts_per_group": 1, "timeout_s": 10_000}),
        ("/complete_trajectory/never-ran", {}),
        ("/complete_trajectory/x", {"reward": "high"}),
    ],
)
async def test_bad_input_is_a_4xx_in_openai_format_and_records_nothing(
    http: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> None:
    response = await http.post(path, content=json.dumps(body))
    assert 400 <= response.status_code < 500, response.text
    assert set(response.json()["error"]) >= {"message", "type", "code"}
    stats = (await http.get("/trajectory/stats")).json()
    assert stats["segments"] == 0 and stats["steps"] == 0
    assert (await http.get("/sessions")).json()["total"] == 0


async def test_ids_that_are_no_token_of_the_model_are_a_400_naming_them(http: httpx.AsyncClient, engine: SimEngine,
                                                                        tokenizer: Any) -> None:
    """A token id the model has no row for would be an engine's embedding index (SGLang's scheduler dies of one) or
    a trainer's: the token-in routes refuse it by its place, before an engine is asked or anything is kept."""
    bound = tokenizer.id_bound
    asked: list[Any] = []
    opened = engine.open_generation
    engine.open_generation = lambda request: asked.append(request) or opened(request)  # type: ignore[method-assign]
    step = {"trajectory_uid": "t", "prompt_uid": "p", "step_index": 0, "prompt_ids": [9707],
            "response_ids": [13, bound], "reward": 1.0, "policy_version": 0, "is_last": True}
    replies = {
        "prompt_ids[1]": await http.post("/generate", json={"prompt_ids": [9707, bound],
                                                            "sampling_params": {"max_tokens": 4}}),
        "steps[0].response_ids[1]": await http.post("/submit_steps", json={"steps": [step]}),
        "response_ids[0]": await http.post("/compute_reward", json={"prompt_ids": [9707], "response_ids": [2**31 - 1]}),
    }
    for param, reply in replies.items():
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param
        assert f"is not a token id of the model (ids are 0 to {bound - 1})" in error["message"], error
    far = await http.post("/submit_steps", json={"steps": [step | {"response_ids": [13, 14],
                                                                   "rollout_log_probs": [-0.5, -1e300]}]})
    assert far.status_code == 400 and far.json()["error"]["param"] == "steps[0].rollout_log_probs[1]", far.text
    assert asked == []
    stats = (await http.get("/trajectory/stats")).json()
    assert stats["segments"] == 0 and stats["steps"] == 0
    fits = await http.post("/generate", json={"prompt_ids": [9707, bound - 1], "sampling_params": {"max_tokens": 2}})
    assert fits.status_code == 200, fits.text


async def test_token_in_generate_keeps_to_the_output_cap_and_a_64_bit_seed(engine: SimEngine, tokenizer: Any
                                                                          ) -> None:
    """``--max-output-tokens`` caps a token-in ``/generate`` as it caps a turn; a seed past 64 bits is a 400."""
    async with open_proxy(ProxyConfig.of(port=0, max_output_tokens=3), backend=engine, tokenizer=tokenizer) as running:
        async with httpx.AsyncClient(base_url=running.url) as http:
            capped = await http.post("/generate", json={"prompt_ids": [9707], "sampling_params": {
                "max_tokens": 50, "seed": -(2**63)}})
            seed = await http.post("/generate", json={"prompt_ids": [9707], "sampling_params": {"seed": 2**63}})
    assert capped.status_code == 200, capped.text
    assert len(capped.json()["token_ids"]) <= 3 and capped.json()["stop_reason"] == "length", capped.text
    assert seed.status_code == 400 and seed.json()["error"]["param"] == "sampling_params.seed", seed.text


async def test_ready_and_no_reward_function(engine: SimEngine, tokenizer: Any) -> None:
    async with open_proxy(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer) as running:
        async with httpx.AsyncClient(base_url=running.url) as http:
            assert (await http.get("/ready")).json() == {"status": "ready"}
            response = await http.post("/compute_reward", json={"trajectory_uid": "t", "messages": []})
            assert response.status_code == 501 and "--reward-fn" in response.json()["error"]["message"]


async def test_fetch_batch_drains_only_after_its_reply_is_serialised(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from actorproxy.server import gateway_api

    await http.post("/generate", json={"trajectory_uid": "d-0", "prompt_uid": "pd",
                                       "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6})
    await http.post("/complete_trajectory/d-0", json={"reward": 1.0})

    def cannot_serialise(result: Any) -> bytes:
        raise TypeError("the reply cannot be serialised")

    monkeypatch.setattr(gateway_api, "encode_body", cannot_serialise, raising=False)
    failed = await http.post("/trajectory/fetch_batch", json={"groups": 1, "rollouts_per_group": 1, "timeout_s": 0})
    assert failed.status_code == 500
    # Nothing was drained: the segments are still in the store and the group still in the hand-off.
    kept = (await http.post("/trajectory/read", json={"session_id": "d-0"})).json()
    assert len(kept["data"]) == 1
    monkeypatch.undo()
    batch = (await http.post("/trajectory/fetch_batch", json={"groups": 1, "rollouts_per_group": 1})).json()
    assert batch["complete"] and batch["data"][0]["trajectories"][0]["segments"] == kept["data"]
    gone = await http.post("/trajectory/read", json={"session_id": "d-0"})
    assert gone.status_code == 404
