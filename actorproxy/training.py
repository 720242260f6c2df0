"""Fetched prompt groups as the padded batch a policy-gradient trainer consumes.

::

    from actorproxy import ProxyClient
    from actorproxy.training import build_batch

    async with ProxyClient(url, admin_token=token) as client:
        fetched = await client.fetch_batch(groups=8, rollouts_per_group=4)
    batch = build_batch(fetched, pad_token_id=tokenizer.pad_token_id)
    tensors = batch.to_torch()          # or batch.arrays(): numpy, no torch needed

One row per segment (a rollout whose agent rewrote its history has several), right-padded
to the longest row. ``loss_mask`` is 1 on the tokens the policy sampled (the tokens a
trainer takes gradients on), ``old_logprobs`` their sampling logprobs (0.0 elsewhere),
``versions`` the weight version that sampled each (-1 on context). A rollout's reward is
its trajectory's; the GRPO advantage normalises it within its prompt group and every
segment of the rollout carries it. What each trainer calls these fields is in
docs/training.md.

Accepted inputs: the reply of ``POST /trajectory/fetch_batch`` (its JSON, or
:class:`ProxyClient.fetch_batch`'s typed result), and the Ray data pool's
:class:`actorproxy.ray.PromptGroup` list. numpy is a dependency of the proxy already;
torch is imported only by :meth:`TrainingBatch.to_torch`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

__all__ = ["Rollout", "TrainingBatch", "build_batch", "grpo_advantages", "rollout_groups", "split_prompt_response"]


@attrs.frozen
class Rollout:
    """One trajectory of a prompt group: its reward and its segments (``/trajectory/read`` JSON)."""

    trajectory_id: str
    reward: float | None
    segments: tuple[Mapping[str, Any], ...]


def _field(obj: Any, name: str) -> Any:
    return obj[name] if isinstance(obj, Mapping) else getattr(obj, name)


def rollout_groups(fetched: Any) -> list[tuple[str, list[Rollout]]]:
    """``(instance_id, rollouts)`` per prompt group, from any accepted input (see the module docstring)."""
    if isinstance(fetched, Mapping) or hasattr(fetched, "data"):
        groups = _field(fetched, "data")
    else:
        groups = fetched
    out: list[tuple[str, list[Rollout]]] = []
    for group in groups:
        instance = str(_field(group, "instance_id"))
        if isinstance(group, Mapping) and "trajectories" in group or hasattr(group, "trajectories"):
            rollouts = [Rollout(str(_field(t, "trajectory_id")), _field(t, "reward"), tuple(_field(t, "segments")))
                        for t in _field(group, "trajectories")]
        else:  # the Ray pool's PromptGroup: segments of its rollouts, each naming its session
            by_rollout: dict[str, list[Mapping[str, Any]]] = {str(r): [] for r in _field(group, "rollouts")}
            for segment in _field(group, "segments"):
                by_rollout.setdefault(str(segment["parent_traj_id"]), []).append(segment)
            rollouts = [Rollout(rid, _segment_reward(rid, segs), tuple(segs)) for rid, segs in by_rollout.items()]
        out.append((instance, rollouts))
    return out


def _segment_reward(rollout: str, segments: Sequence[Mapping[str, Any]]) -> float | None:
    rewards = {float(s["reward"]) for s in segments if s.get("reward") is not None}
    if len(rewards) > 1:
        raise ValueError(f"rollout {rollout!r} has segments with different rewards: {sorted(rewards)}")
    return rewards.pop() if rewards else None


def grpo_advantages(rewards: Sequence[float], *, norm_by_std: bool = True, eps: float = 1e-6) -> list[float]:
    """GRPO's outcome advantage within one group: ``(r - mean) / (std + eps)``.

    ``std`` is the unbiased sample standard deviation, as verl computes it; a group of
    one has mean 0 and std 1 (its advantage is its reward), as in verl.
    ``norm_by_std=False`` subtracts the mean only (Dr. GRPO).
    """
    values = np.asarray(rewards, dtype=np.float64)
    if len(values) == 1:
        mean, std = 0.0, 1.0
    else:
        mean, std = float(values.mean()), float(values.std(ddof=1))
    centred = values - mean
    return [float(a) for a in (centred / (std + eps) if norm_by_std else centred)]


@attrs.frozen(eq=False)
class TrainingBatch:
    """Padded arrays, one row per segment; ``[rows, length]`` unless said otherwise."""

    input_ids: npt.NDArray[np.int64]
    attention_mask: npt.NDArray[np.int64]
    position_ids: npt.NDArray[np.int64]
    #: 1 on sampled tokens (verl's ``response_mask``, slime's ``loss_mask``, TRL's ``completion_mask``).
    loss_mask: npt.NDArray[np.int64]
    #: The engine's logprob of each sampled token (0.0 elsewhere).
    old_logprobs: npt.NDArray[np.float32]
    #: The weight version that sampled each token (-1 on context and padding).
    versions: npt.NDArray[np.int64]
    #: ``[rows]``: the rollout's reward, and its GRPO advantage within its group.
    rewards: npt.NDArray[np.float32]
    advantages: npt.NDArray[np.float32]
    #: ``[rows]``: the row's prompt group, as an index into :attr:`instance_ids`.
    group_index: npt.NDArray[np.int64]
    instance_ids: tuple[str, ...]
    #: Per row: the rollout and the segment (``<session>#<k>``) it came from.
    rollout_ids: tuple[str, ...]
    segment_ids: tuple[str, ...]
    #: Per row: how its sampled tokens were drawn, the segment's ``metadata.sampling`` (one record when its steps
    #: sampled alike, else one a step; ``None`` when not recorded).
    samplings: tuple[Any, ...] = ()

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    def token_advantages(self) -> npt.NDArray[np.float32]:
        """``[rows, length]``: each row's advantage on its sampled tokens, 0 elsewhere."""
        return (self.advantages[:, None] * self.loss_mask).astype(np.float32)

    def arrays(self) -> dict[str, npt.NDArray[Any]]:
        """Every array by name (numpy)."""
        return {
            "input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids,
            "loss_mask": self.loss_mask, "old_logprobs": self.old_logprobs, "versions": self.versions,
            "rewards": self.rewards, "advantages": self.advantages, "group_index": self.group_index,
        }

    def to_torch(self, device: Any = None) -> dict[str, Any]:
        """Every array as a torch tensor (imports torch; ``pip install torch``)."""
        import torch

        return {name: torch.from_numpy(np.ascontiguousarray(value)).to(device)
                for name, value in self.arrays().items()}

    def temperature(self) -> float:
        """The one temperature every sampled token of the batch was drawn at: what the trainer divides its logits
        by to compute logprobs comparable with :attr:`old_logprobs`.

        A :class:`ValueError` names the segments when they were sampled at different temperatures, or a segment
        that does not say (stored before the proxy recorded it): one temperature for the batch would then be wrong.
        """
        seen: dict[float, str] = {}
        samplings = self.samplings or (None,) * len(self.segment_ids)  # a batch made without them says nothing
        for segment, sampling in zip(self.segment_ids, samplings, strict=True):
            records = sampling if isinstance(sampling, list) else [sampling]
            for record in records:
                if not isinstance(record, Mapping) or not isinstance(record.get("temperature"), int | float):
                    raise ValueError(f"segment {segment!r} does not say at what temperature it was sampled")
                seen.setdefault(float(record["temperature"]), segment)
        if len(seen) > 1:
            named = ", ".join(f"{temperature} ({segment!r})" for temperature, segment in sorted(seen.items()))
            raise ValueError(f"the batch was sampled at several temperatures: {named}")
        if not seen:
            raise ValueError("the batch has no rows")
        return next(iter(seen))

    def stale_tokens(self, version: int) -> int:
        """How many sampled tokens were sampled under a version other than ``version`` (off-policy)."""
        return int(((self.versions != version) & (self.loss_mask == 1)).sum())


def build_batch(
    fetched: Any,
    *,
    pad_token_id: int = 0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    missing_reward: float | None = None,
    max_length: int | None = None,
) -> TrainingBatch:
    """The batch of ``fetched`` prompt groups (see the module docstring).

    A rollout without a reward is a :class:`ValueError` naming it, unless
    ``missing_reward`` gives the value to use. A segment longer than ``max_length``
    is a :class:`ValueError` too: truncating a sample silently would train on a
    different sequence than the one sampled.
    """
    groups = rollout_groups(fetched)
    rows: list[tuple[int, str, Mapping[str, Any], float, float]] = []
    for index, (instance, rollouts) in enumerate(groups):
        if not rollouts:
            continue
        rewards = []
        for rollout in rollouts:
            reward = rollout.reward if rollout.reward is not None else missing_reward
            if reward is None:
                raise ValueError(f"rollout {rollout.trajectory_id!r} of group {instance!r} has no reward "
                                 "(finalize it with one, or pass missing_reward=)")
            rewards.append(float(reward))
        advantages = grpo_advantages(rewards, norm_by_std=norm_by_std, eps=eps)
        for rollout, reward, advantage in zip(rollouts, rewards, advantages, strict=True):
            for segment in rollout.segments:
                rows.append((index, rollout.trajectory_id, segment, reward, advantage))
    length = max((len(r[2]["token_ids"]) for r in rows), default=0)
    if max_length is not None and length > max_length:
        longest = max(rows, key=lambda r: len(r[2]["token_ids"]))[2]
        raise ValueError(f"segment {longest.get('trajectory_id')!r} has {length} tokens, over max_length={max_length}")
    n = len(rows)
    input_ids = np.full((n, length), pad_token_id, dtype=np.int64)
    attention = np.zeros((n, length), dtype=np.int64)
    loss_mask = np.zeros((n, length), dtype=np.int64)
    logprobs = np.zeros((n, length), dtype=np.float32)
    versions = np.full((n, length), -1, dtype=np.int64)
    for i, (_, _, segment, _, _) in enumerate(rows):
        size = len(segment["token_ids"])
        arrays = [segment[key] for key in ("token_ids", "loss_mask", "logprobs", "versions")]
        if any(len(a) != size for a in arrays):
            raise ValueError(f"segment {segment.get('trajectory_id')!r}: its four arrays differ in length")
        input_ids[i, :size] = arrays[0]
        attention[i, :size] = 1
        loss_mask[i, :size] = arrays[1]
        logprobs[i, :size] = arrays[2]
        versions[i, :size] = arrays[3]
    position_ids = np.maximum(np.cumsum(attention, axis=1) - 1, 0) * attention
    return TrainingBatch(
        input_ids=input_ids, attention_mask=attention, position_ids=position_ids, loss_mask=loss_mask,
        old_logprobs=logprobs, versions=versions,
        rewards=np.asarray([r[3] for r in rows], dtype=np.float32),
        advantages=np.asarray([r[4] for r in rows], dtype=np.float32),
        group_index=np.asarray([r[0] for r in rows], dtype=np.int64),
        instance_ids=tuple(instance for instance, _ in groups),
        rollout_ids=tuple(r[1] for r in rows),
        segment_ids=tuple(str(r[2].get("trajectory_id", "")) for r in rows),
        samplings=tuple((r[2].get("metadata") or {}).get("sampling") for r in rows),
    )


def split_prompt_response(token_ids: Sequence[int], loss_mask: Sequence[int]) -> tuple[list[int], list[int]]:
    """A segment as a prompt (everything before its first sampled token) and a response (the rest).

    Trainers built around one prompt and one response per sample (verl, SkyRL, TRL) take
    a multi-turn segment this way: the response holds every later turn, tool outputs
    included, with the loss mask telling sampled tokens from context.
    """
    first = next((i for i, m in enumerate(loss_mask) if m), len(token_ids))
    return list(token_ids[:first]), list(token_ids[first:])
