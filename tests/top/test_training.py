"""``actorproxy.training``: fetched prompt groups as a trainer's padded batch, GRPO advantages included."""

from __future__ import annotations

import math
from typing import Any

import attrs
import httpx
import numpy as np
import pytest

from actorproxy import ProxyClient
from actorproxy.serve import RunningProxy
from actorproxy.sim import SimEngine
from actorproxy.training import build_batch, grpo_advantages, rollout_groups, split_prompt_response

REWARDS = {0: [1.0, 0.0, 0.5], 1: [2.0, 2.0, 2.0]}


async def _rollouts(http: httpx.AsyncClient, engine: SimEngine) -> None:
    """Two prompt groups of three rollouts; g0-r1 rewrites its history (two segments)."""
    for g, rewards in REWARDS.items():
        for r, reward in enumerate(rewards):
            uid = f"g{g}-r{r}"
            engine.script("Four.", "Eight." * (r + 1), routing_key=uid)
            first = [{"role": "user", "content": f"Question {g}: 2 + 2?"}]
            await http.post("/generate", json={"trajectory_uid": uid, "prompt_uid": f"group-{g}", "messages": first})
            second = [*first, {"role": "assistant", "content": "Four."}, {"role": "user", "content": "Double it."}]
            if (g, r) == (0, 1):  # a rewritten history: a new segment of the same rollout
                second = [{"role": "user", "content": "Start over: 4 + 4?"}]
            await http.post("/generate", json={"trajectory_uid": uid, "prompt_uid": f"group-{g}", "messages": second})
            done = await http.post(f"/complete_trajectory/{uid}", json={"reward": reward})
            assert done.status_code == 200, done.text


async def test_a_fetched_batch_is_one_padded_row_per_segment(
    http: httpx.AsyncClient, proxy: RunningProxy, engine: SimEngine
) -> None:
    await _rollouts(http, engine)
    async with ProxyClient(proxy.url) as client:
        fetched = await client.fetch_batch(groups=2, rollouts_per_group=3)
    raw = [(g.instance_id, [(t.trajectory_id, t.reward, t.segments) for t in g.trajectories]) for g in fetched.data]
    batch = build_batch(fetched, pad_token_id=151643)
    segments = [s for _, rollouts in raw for _, _, segs in rollouts for s in segs]
    assert batch.num_rows == len(segments) == 7  # g0-r1 has two segments
    assert batch.instance_ids == ("group-0", "group-1")
    length = max(len(s["token_ids"]) for s in segments)
    assert batch.input_ids.shape == batch.loss_mask.shape == batch.old_logprobs.shape == (7, length)
    for row, segment in enumerate(segments):
        n = len(segment["token_ids"])
        assert batch.segment_ids[row] == segment["trajectory_id"]
        assert batch.input_ids[row, :n].tolist() == segment["token_ids"]
        assert (batch.input_ids[row, n:] == 151643).all()
        assert batch.attention_mask[row].tolist() == [1] * n + [0] * (length - n)
        assert batch.position_ids[row, :n].tolist() == list(range(n)) and not batch.position_ids[row, n:].any()
        assert batch.loss_mask[row, :n].tolist() == segment["loss_mask"] and not batch.loss_mask[row, n:].any()
        assert np.allclose(batch.old_logprobs[row, :n], segment["logprobs"])
        assert batch.versions[row, :n].tolist() == segment["versions"] and (batch.versions[row, n:] == -1).all()
        assert batch.samplings[row] == segment["metadata"]["sampling"]
    # GRPO within each group; every segment of a rollout carries its rollout's advantage.
    expected = {f"g{g}-r{r}": a for g, rewards in REWARDS.items()
                for r, a in enumerate(grpo_advantages(rewards))}
    assert [round(float(a), 5) for a in batch.advantages] == [round(expected[r], 5) for r in batch.rollout_ids]
    assert batch.rollout_ids.count("g0-r1") == 2
    assert batch.group_index.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert not batch.advantages[batch.group_index == 1].any()  # equal rewards: no signal
    token = batch.token_advantages()
    assert np.array_equal(token != 0, (batch.loss_mask == 1) & (batch.advantages[:, None] != 0))
    assert batch.stale_tokens(0) == 0 and batch.stale_tokens(1) == int(batch.loss_mask.sum())
    assert batch.temperature() == 1.0


def test_grpo_advantages_as_verl_computes_them() -> None:
    advantages = grpo_advantages([1.0, 0.0, 0.5])
    mean, std = 0.5, math.sqrt(((0.5**2) * 2) / 2)  # unbiased: divide by n - 1
    assert advantages == pytest.approx([(r - mean) / (std + 1e-6) for r in (1.0, 0.0, 0.5)])
    assert grpo_advantages([3.0]) == pytest.approx([3.0])  # a group of one: mean 0, std 1
    assert grpo_advantages([1.0, 0.0], norm_by_std=False) == [0.5, -0.5]


def _segment(sid: str, tokens: list[int], mask: list[int], reward: float | None) -> dict[str, Any]:
    return {"trajectory_id": f"{sid}#0", "parent_traj_id": sid, "token_ids": tokens, "loss_mask": mask,
            "logprobs": [-0.5 * m for m in mask], "versions": [m - 1 for m in mask], "reward": reward}


def test_ray_pool_groups_missing_rewards_and_overlong_segments() -> None:
    from actorproxy.ray import PromptGroup

    group = PromptGroup("p", ("a", "b"), (_segment("a", [1, 2, 3], [0, 1, 1], 1.0),
                                          _segment("b", [1, 2], [0, 1], 0.0)))
    assert [(r.trajectory_id, r.reward) for r in rollout_groups([group])[0][1]] == [("a", 1.0), ("b", 0.0)]
    batch = build_batch([group])
    assert batch.input_ids.tolist() == [[1, 2, 3], [1, 2, 0]] and batch.rollout_ids == ("a", "b")
    unrewarded = PromptGroup("p", ("a",), (_segment("a", [1, 2], [0, 1], None),))
    with pytest.raises(ValueError, match="'a' of group 'p' has no reward"):
        build_batch([unrewarded])
    assert build_batch([unrewarded], missing_reward=0.0).rewards.tolist() == [0.0]
    with pytest.raises(ValueError, match="over max_length=2"):
        build_batch([group], max_length=2)
    assert split_prompt_response([1, 2, 3, 4], [0, 0, 1, 0]) == ([1, 2], [3, 4])


def _fetched(samplings: list[Any]) -> dict[str, Any]:
    """A fetched batch of one group, a rollout a segment, each segment's ``metadata.sampling`` as given."""
    segment = {"token_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "logprobs": [0.0, -0.5, -0.25], "versions": [-1, 0, 0]}
    trajectories = [{"trajectory_id": f"r{i}", "reward": 1.0,
                     "segments": [{**segment, "trajectory_id": f"r{i}#0", "metadata": {"sampling": sampling}}]}
                    for i, sampling in enumerate(samplings)]
    return {"data": [{"instance_id": "g", "trajectories": trajectories}]}


def test_the_batch_says_at_what_temperature_it_was_sampled() -> None:
    """The trainer's logprobs are comparable with the recorded ones only at the temperature that sampled them."""
    warm, cool = {"temperature": 0.7, "top_p": 1.0}, {"temperature": 1.0, "top_p": 1.0}
    assert build_batch(_fetched([warm, [warm, warm]])).temperature() == 0.7
    with pytest.raises(ValueError, match=r"several temperatures: 0\.7 \('r0#0'\), 1\.0 \('r1#0'\)"):
        build_batch(_fetched([warm, cool])).temperature()
    with pytest.raises(ValueError, match=r"several temperatures"):
        build_batch(_fetched([[warm, cool]])).temperature()
    with pytest.raises(ValueError, match=r"'r1#0' does not say"):
        build_batch(_fetched([warm, None])).temperature()
    with pytest.raises(ValueError, match=r"'r0#0' does not say"):  # a batch made without them
        attrs.evolve(build_batch(_fetched([warm])), samplings=()).temperature()
