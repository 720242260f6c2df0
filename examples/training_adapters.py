"""From fetched prompt groups to what each RL trainer consumes: verl, slime, OpenRLHF, SkyRL, TRL.

    python examples/training_adapters.py

It serves its own proxy over the simulated engine, runs 2 prompt groups of 3 rollouts
through the gateway, fetches them with ``fetch_batch``, builds one
:class:`~actorproxy.training.TrainingBatch` and hands it to five small adapters, each
giving the fields under the name its trainer uses (docs/training.md has the table). The
adapters build plain numpy arrays and lists: put them into the trainer's own type
(``DataProto.from_dict``, ``Sample(**fields)``, ``GeneratorOutput(**fields)``, ...) where
that trainer runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import trio

from actorproxy import ProxyClient, ProxyConfig, open_proxy
from actorproxy.training import TrainingBatch, build_batch, split_prompt_response


def _rows(batch: TrainingBatch) -> list[tuple[list[int], list[int], list[float], list[int]]]:
    """Each row without its padding: ids, loss mask, sampling logprobs, versions."""
    out = []
    for i in range(batch.num_rows):
        n = int(batch.attention_mask[i].sum())
        out.append((batch.input_ids[i, :n].tolist(), batch.loss_mask[i, :n].tolist(),
                    batch.old_logprobs[i, :n].tolist(), batch.versions[i, :n].tolist()))
    return out


def to_verl(batch: TrainingBatch) -> dict[str, Any]:
    """verl's ``DataProto`` batch: one prompt and one response per row (left-padded prompt, right-padded response)."""
    splits = [(split_prompt_response(ids, mask), mask, lp) for ids, mask, lp, _ in _rows(batch)]
    prompt_len = max(len(p) for (p, _), _, _ in splits)
    response_len = max(len(r) for (_, r), _, _ in splits)
    n = batch.num_rows
    prompts = np.zeros((n, prompt_len), np.int64)
    responses = np.zeros((n, response_len), np.int64)
    response_mask = np.zeros((n, response_len), np.int64)
    rollout_log_probs = np.zeros((n, response_len), np.float32)
    attention_mask = np.zeros((n, prompt_len + response_len), np.int64)
    for i, ((prompt, response), mask, logprobs) in enumerate(splits):
        prompts[i, prompt_len - len(prompt):] = prompt
        responses[i, :len(response)] = response
        response_mask[i, :len(response)] = mask[len(prompt):]
        rollout_log_probs[i, :len(response)] = logprobs[len(prompt):]
        attention_mask[i, prompt_len - len(prompt): prompt_len + len(response)] = 1
    position_ids = np.maximum(np.cumsum(attention_mask, axis=1) - 1, 0)
    return {
        "prompts": prompts, "responses": responses, "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention_mask, "position_ids": position_ids, "response_mask": response_mask,
        "rollout_log_probs": rollout_log_probs,
        "token_level_rewards": _last_token(batch.rewards, response_mask),
        "advantages": batch.advantages[:, None] * response_mask,
        "uid": np.asarray([batch.instance_ids[g] for g in batch.group_index], dtype=object),
    }


def _last_token(rewards: Any, mask: Any) -> Any:
    """A sequence reward on the row's last sampled token (verl's token_level_rewards)."""
    out = np.zeros(mask.shape, np.float32)
    for i, row in enumerate(mask):
        sampled = np.flatnonzero(row)
        if len(sampled):
            out[i, sampled[-1]] = rewards[i]
    return out


def to_slime(batch: TrainingBatch) -> list[dict[str, Any]]:
    """slime's ``Sample`` fields: ``tokens`` (prompt + response), per-response-token mask and logprobs."""
    samples = []
    for i, (ids, mask, logprobs, versions) in enumerate(_rows(batch)):
        prompt, response = split_prompt_response(ids, mask)
        samples.append({
            "index": i, "group_index": int(batch.group_index[i]), "tokens": ids, "response_length": len(response),
            "loss_mask": mask[len(prompt):], "rollout_log_probs": logprobs[len(prompt):],
            "weight_versions": sorted({str(v) for v in versions if v >= 0}), "reward": float(batch.rewards[i]),
            "status": "completed",
        })
    return samples


def to_openrlhf(batch: TrainingBatch) -> dict[str, Any]:
    """OpenRLHF's ``Experience``: whole sequences with an action mask over the sampled tokens."""
    action_mask = batch.loss_mask[:, 1:]  # a token's logprob is predicted from the position before it
    return {"sequences": batch.input_ids, "attention_mask": batch.attention_mask, "action_mask": action_mask,
            "rollout_log_probs": batch.old_logprobs[:, 1:] * action_mask,
            "advantages": batch.advantages[:, None] * action_mask, "rewards": batch.rewards}


def to_skyrl(batch: TrainingBatch) -> dict[str, Any]:
    """SkyRL's ``GeneratorOutput``: prompt ids, response ids, per-token loss masks and logprobs, rewards."""
    out: dict[str, list[Any]] = {"prompt_token_ids": [], "response_ids": [], "loss_masks": [],
                                 "rollout_logprobs": [], "rewards": []}
    for i, (ids, mask, logprobs, _) in enumerate(_rows(batch)):
        prompt, response = split_prompt_response(ids, mask)
        out["prompt_token_ids"].append(prompt)
        out["response_ids"].append(response)
        out["loss_masks"].append(mask[len(prompt):])
        out["rollout_logprobs"].append(logprobs[len(prompt):])
        out["rewards"].append(float(batch.rewards[i]))
    return out


def to_trl(batch: TrainingBatch) -> dict[str, Any]:
    """TRL's GRPO inputs: prompt and completion ids with their masks, sampling logprobs, advantages."""
    verl = to_verl(batch)
    prompt_mask = verl["attention_mask"][:, : verl["prompts"].shape[1]]  # left padding
    return {"prompt_ids": verl["prompts"], "prompt_mask": prompt_mask, "completion_ids": verl["responses"],
            "completion_mask": verl["response_mask"], "sampling_per_token_logps": verl["rollout_log_probs"],
            "advantages": batch.advantages}


async def main() -> None:
    async with open_proxy(ProxyConfig.of(port=0)) as proxy, ProxyClient(proxy.url) as client:
        for group in range(2):
            for r in range(3):
                uid = f"p{group}-r{r}"
                messages = [{"role": "user", "content": f"What is {group} + {r}?"}]
                await client.generate(uid, f"p{group}", messages, max_tokens=24, temperature=0.8)
                await client.complete_trajectory(uid, reward=float(r == group))
        fetched = await client.fetch_batch(groups=2, rollouts_per_group=3)
    batch = build_batch(fetched)
    print(f"batch: {batch.num_rows} rows x {batch.input_ids.shape[1]} tokens, "
          f"{int(batch.loss_mask.sum())} sampled, advantages {[round(float(a), 3) for a in batch.advantages]}")
    # The temperature the trainer divides its logits by (the engine's convention: docs/trajectories.md).
    print(f"sampled at temperature {batch.temperature()}")
    for name, adapter in (("verl", to_verl), ("slime", to_slime), ("openrlhf", to_openrlhf),
                          ("skyrl", to_skyrl), ("trl", to_trl)):
        made = adapter(batch)
        fields = sorted(made) if isinstance(made, dict) else sorted(made[0])
        print(f"{name}: {', '.join(fields)}")


if __name__ == "__main__":
    trio.run(main)
