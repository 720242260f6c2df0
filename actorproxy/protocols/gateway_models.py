"""The gateway's bodies and replies as attrs classes: the routes validate with them (through the wire
converter), :class:`~actorproxy.client.ProxyClient` structures replies into them, and ``/openapi.json``
is generated from them.

Bodies are ours (:func:`~actorproxy.schema.converter.ours`): unknown fields are refused. Replies tolerate
fields they do not know, so an older client keeps working against a newer proxy.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..schema.converter import at_least, at_most, int64, ours
from ..store.base import LONGEST_LEASE

#: ``train`` goes to the training hand-off; any other channel (ours say ``validate``, Claw-R1's ``val``) never does.
Channel = str


# -- bodies -------------------------------------------------------------------------------


@ours
@attrs.frozen
class GenerateBody:
    """``POST /generate``: one turn of session ``trajectory_uid`` in prompt group ``prompt_uid``."""

    trajectory_uid: str
    prompt_uid: str
    messages: list[Any]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[Any] | None = None
    #: A string or a list of strings (checked as chat completions check it).
    stop: Any = None
    chat_template_kwargs: dict[str, Any] | None = None


@ours
@attrs.frozen
class TokenSampling:
    """``sampling_params`` of a token-in ``POST /generate`` (the Claw-R1 gateway's)."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    #: Passed to the engine (0 < value <= 2).
    repetition_penalty: float | None = None
    #: Return ``log_probs`` when true (a bool, or a count as vLLM takes it); they are recorded either way.
    logprobs: Any = None
    #: The engine serves one model: any name is accepted.
    model: str | None = None
    seed: int | None = attrs.field(default=None, validator=int64)


@ours
@attrs.frozen
class TokenGenerateBody:
    """``POST /generate`` as the Claw-R1 gateway's flows send it: the prompt as ids, rendered by the agent."""

    prompt_ids: list[int]
    sampling_params: TokenSampling = attrs.field(factory=TokenSampling)
    #: Text only: a non-empty list is refused.
    image_data: list[Any] | None = None
    video_data: list[Any] | None = None


@ours
@attrs.frozen
class StepBody:
    """One step of ``POST /submit_steps``."""

    trajectory_uid: str
    prompt_uid: str
    prompt_ids: list[int]
    response_ids: list[int]
    step_index: int
    reward: float | None = None
    policy_version: str | int | None = None
    is_last: bool = False
    #: ``null`` is the same as ``{}`` (Claw-R1's flows send ``null`` when they have none).
    metadata: dict[str, Any] | None = attrs.field(factory=dict)
    #: The sampled ids' logprobs as the agent got them (one per response id); for steps this proxy did not
    #: generate. A step it generated keeps its recorded logprobs.
    rollout_log_probs: list[float] | None = None
    #: Claw-R1's step fields for MoE routing and images: only ``null`` is accepted.
    routed_experts: Any = None
    multi_modal_data: dict[str, Any] | None = None


@ours
@attrs.frozen
class SubmitStepsBody:
    """``POST /submit_steps``: steps of one or more trajectories, applied all or nothing."""

    steps: list[StepBody]


@ours
@attrs.frozen
class InitBody:
    """``POST /init_trajectory`` (the body is optional)."""

    prompt_uid: str | None = None
    channel: Channel = "train"
    metadata: dict[str, Any] = attrs.field(factory=dict)


@ours
@attrs.frozen
class RegisterBody:
    """``POST {base_url}/v1/register_trajectory`` (the body is optional)."""

    channel: Channel = "train"
    metadata: dict[str, Any] = attrs.field(factory=dict)


@ours
@attrs.frozen
class CompleteBody:
    """``POST {base_url}/v1/complete_trajectory`` and ``POST /complete_trajectory/{trajectory_uid}``."""

    reward: float | None = None
    channel: Channel | None = None


@ours
@attrs.frozen
class RewardBody:
    """``POST /compute_reward``."""

    trajectory_uid: str
    messages: list[Any]
    dataset_fields: dict[str, Any] = attrs.field(factory=dict)


@ours
@attrs.frozen
class TokenRewardBody:
    """``POST /compute_reward`` as the Claw-R1 gateway's flows send it: one sample as ids."""

    prompt_ids: list[int]
    response_ids: list[int]
    multi_modal_data: dict[str, Any] | None = None
    num_turns: int = 2
    extra_fields: dict[str, Any] = attrs.field(factory=dict)
    dataset_fields: dict[str, Any] = attrs.field(factory=dict)


@ours
@attrs.frozen
class FetchBatchBody:
    """``POST /trajectory/fetch_batch``."""

    groups: int
    rollouts_per_group: int
    timeout_s: float = 30.0
    #: Ours: seconds the batch stays held for ``POST /trajectory/ack`` (deleted then); given back (its groups
    #: first in the queue again) if none came.
    lease: float | None = attrs.field(default=None, validator=[at_least(1), at_most(LONGEST_LEASE)])


# -- replies ------------------------------------------------------------------------------


@attrs.frozen
class GenerateResult:
    """The reply of ``/generate``: the exact ids the engine was given and sampled."""

    trajectory_uid: str
    prompt_uid: str
    response_text: str
    response_ids: list[int]
    prompt_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str
    step_index: int
    tool_calls: list[dict[str, Any]] = attrs.field(factory=list)
    reasoning_content: str | None = None


@attrs.frozen
class TokenGenerateResult:
    """The reply of a token-in ``/generate`` (the Claw-R1 gateway's fields, then ours)."""

    token_ids: list[int]
    #: One per sampled id when ``sampling_params.logprobs`` asked for them, else ``null``.
    log_probs: list[float] | None
    stop_reason: str
    #: The weight version that sampled each id.
    versions: list[int] = attrs.field(factory=list)
    weight_version: str = ""


@attrs.frozen
class SubmitStepsResult:
    """``accepted`` steps: ``attached`` to recorded ones plus ``external``; ``completed`` trajectories."""

    accepted: int
    attached: int = 0
    external: int = 0
    completed: list[str] = attrs.field(factory=list)


@attrs.frozen
class RewardResult:
    trajectory_uid: str
    reward: float


@attrs.frozen
class TokenRewardResult:
    """The reply of ``/compute_reward`` for the token body (the Claw-R1 gateway's)."""

    reward_score: float
    reward_extra_info: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class InitResult:
    trajectory_uid: str
    prompt_uid: str
    channel: Channel
    base_url: str
    #: The trajectory's key with ``--agent-auth session-key``.
    api_key: str | None = None


@attrs.frozen
class RegisterResult:
    status: str
    trajectory_uid: str
    prompt_uid: str
    channel: Channel


@attrs.frozen
class CompleteResult:
    status: str
    trajectory_uid: str
    prompt_uid: str | None
    channel: Channel
    queued_for_training: bool
    segments: int = 0
    steps: int = 0


@attrs.frozen
class HandedTrajectory:
    trajectory_id: str
    reward: float | None
    #: The trajectory's segments, as ``/trajectory/read`` returns them.
    segments: list[dict[str, Any]]


@attrs.frozen
class GroupBatch:
    instance_id: str
    trajectories: list[HandedTrajectory]


@attrs.frozen
class Lease:
    """A leased drain's: what to acknowledge (``POST /trajectory/ack {"lease": id}``), within ``seconds``."""

    id: str
    seconds: float


@attrs.frozen
class FetchBatchResult:
    __wire_omit_if_default__ = ("lease",)

    data: list[GroupBatch]
    complete: bool
    #: Asked for with ``lease``: the batch is deleted once acknowledged.
    lease: Lease | None = None


@attrs.frozen
class ReadyResult:
    status: str


@attrs.frozen
class NotReady:
    """``GET /ready`` while not ready (503), in the seed's format."""

    detail: str
