"""``--reward-worker-name NAME``: ``POST /compute_reward`` (the token body) asks a Ray actor for the score.

The Claw-R1 trainer starts a ``RewardLoopWorker`` actor and passes its name to the
gateway; the actor's ``compute_score(input_data)`` takes one sample as a verl
``DataProto`` and returns ``{"reward_score": float, "reward_extra_info": {...}}``.
The sample is laid out as verl lays out a rollout: the prompt left-padded to
``--prompt-length``, the response right-padded to ``--response-length``,
``attention_mask``, ``input_ids`` and ``position_ids`` over both, the dataset
fields (and ``__num_turns__``, ``tool_extra_fields``) as one-element arrays.
Building it needs numpy, torch, tensordict and verl (the trainer's environment):
without them, or without the actor, the proxy refuses to start, in one line.
Every call is bounded by ``--reward-timeout``.
"""

from __future__ import annotations

import importlib
from typing import Any

import trio

from .errors import BadRequest, RewardFailed, RewardTimeout, StartupError
from .store.ray_pool import init_ray

#: The modules a verl DataProto needs.
_NEEDED = ("numpy", "torch", "tensordict", "verl.protocol")


class RayRewardWorker:
    """A handle on the named reward actor and the sample layout it expects."""

    def __init__(self, name: str, *, address: str | None, namespace: str, pad_id: int, prompt_length: int,
                 response_length: int, timeout: float) -> None:
        self.name, self._address, self._namespace = name, address, namespace
        self._pad, self._prompt_length, self._response_length = pad_id, prompt_length, response_length
        self._timeout = timeout
        self._actor: Any = None
        self._modules: dict[str, Any] = {}
        self._limiter = trio.CapacityLimiter(4)

    def connect(self) -> None:
        """Import what a DataProto needs and find the actor (blocking); a :class:`StartupError` otherwise."""
        for module in _NEEDED:
            try:
                self._modules[module] = importlib.import_module(module)
            except ImportError as exc:
                raise StartupError("--reward-worker-name", f"building the reward worker's sample needs {module} "
                                   f"({exc}); install numpy, torch, tensordict and verl, as the trainer has "
                                   "them, or use --reward-fn") from None

        ray = init_ray(self._address, self._namespace)
        try:
            self._actor = ray.get_actor(self.name, namespace=self._namespace)
        except ValueError:
            raise StartupError("--reward-worker-name", f"no Ray actor {self.name!r} in namespace "
                               f"{self._namespace!r} (--ray-namespace); start the trainer's reward worker "
                               "first") from None

    def sample(self, prompt_ids: list[int], response_ids: list[int], num_turns: int, extra_fields: dict[str, Any],
               dataset_fields: dict[str, Any]) -> Any:
        """The verl DataProto of one sample (see the module docstring)."""
        if len(prompt_ids) > self._prompt_length:
            raise BadRequest(f"'prompt_ids' holds {len(prompt_ids)} ids; the reward worker's layout takes "
                             f"{self._prompt_length} (--prompt-length)", param="prompt_ids")
        if len(response_ids) > self._response_length:
            raise BadRequest(f"'response_ids' holds {len(response_ids)} ids; the reward worker's layout takes "
                             f"{self._response_length} (--response-length)", param="response_ids")
        np, torch = self._modules["numpy"], self._modules["torch"]
        tensordict, protocol = self._modules["tensordict"], self._modules["verl.protocol"]
        left = self._prompt_length - len(prompt_ids)
        right = self._response_length - len(response_ids)
        prompt = torch.tensor([[self._pad] * left + list(prompt_ids)], dtype=torch.long)
        response = torch.tensor([list(response_ids) + [self._pad] * right], dtype=torch.long)
        mask = torch.tensor([[0] * left + [1] * len(prompt_ids) + [1] * len(response_ids) + [0] * right],
                            dtype=torch.long)
        positions = torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0)
        batch = tensordict.TensorDict({
            "prompts": prompt, "responses": response, "attention_mask": mask,
            "input_ids": torch.cat([prompt, response], dim=1), "position_ids": positions,
        }, batch_size=1)
        fields: dict[str, Any] = {key: np.array([value]) for key, value in dataset_fields.items()}
        fields["__num_turns__"] = np.array([num_turns])
        fields["tool_extra_fields"] = np.array([extra_fields], dtype=object)
        return protocol.DataProto(batch=batch, non_tensor_batch=fields)

    def _score(self, data: Any) -> tuple[float, dict[str, Any]]:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            # By keyword, as the worker names it: a process without the worker's class sees (**kwargs) only.
            result = ray.get(self._actor.compute_score.remote(input_data=data), timeout=self._timeout)
        except GetTimeoutError:
            raise RewardTimeout(f"reward worker {self.name!r} took longer than {self._timeout:g} s "
                                "(--reward-timeout)") from None
        except Exception as exc:  # the worker's own failure: say so, never a 500
            raise RewardFailed(f"reward worker {self.name!r} failed: {type(exc).__name__}: {exc}") from None
        try:
            score = float(result["reward_score"])
            extra = dict(result.get("reward_extra_info") or {})
        except (TypeError, KeyError, ValueError) as exc:
            raise RewardFailed(f"reward worker {self.name!r} returned no reward_score: {exc}") from None
        return score, extra

    async def score(self, prompt_ids: list[int], response_ids: list[int], num_turns: int,
                    extra_fields: dict[str, Any], dataset_fields: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """``(reward_score, reward_extra_info)`` for one sample, from the actor (in a worker thread)."""
        data = self.sample(prompt_ids, response_ids, num_turns, extra_fields, dataset_fields)
        return await trio.to_thread.run_sync(self._score, data, limiter=self._limiter, abandon_on_cancel=True)
