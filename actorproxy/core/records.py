"""Steps and segments: what the proxy records and what the trainer reads.

A :class:`Step` is one model call. A :class:`Segment` is one training sample:
four parallel arrays (``token_ids``, ``loss_mask``, ``logprobs``,
``versions``) built from the steps that continued one another. Token arrays
are compact ``array`` objects, never lists of Python ints.

Weight versions are integers on segments: the engine's version label (a string
such as ``"12"`` or ``"step-12"``) maps to its trailing number, ``"default"``
to 0 (and so does a number past 64 bits). Context tokens (not sampled by the policy) carry version -1.
The raw label stays on each step as ``weight_version``. Versions are 64-bit (``array('q')``): a label's
number may be a step count or a timestamp in milliseconds, past 2**31.
"""

from __future__ import annotations

import functools
import re
import time
from array import array
from typing import Any, Literal

import attrs

from .messages import AssistantOutput

StepStatus = Literal[
    "running", "completed", "aborted", "client_disconnected", "error", "rejected", "superseded"
]

CONTEXT_VERSION = -1
_TRAILING_NUMBER = re.compile(r"(\d+)$")


_SUB_AGENT = re.compile(r"^(.+)/(sub-\d+)$")


def sub_agent_of(session_id: str) -> tuple[str, str] | None:
    """``(parent session, "sub-<n>")`` for a sub-agent's child session id, else ``None``."""
    match = _SUB_AGENT.match(session_id)
    return (match.group(1), match.group(2)) if match else None


@functools.lru_cache(maxsize=64)  # read for every delta of a stream, nearly always the same label
def version_number(label: str | int | None) -> int:
    """The integer form of an engine weight-version label (trailing digits, else 0; 0 too past 64 bits)."""
    if label is None:
        return 0
    if isinstance(label, int):
        number = label
    else:
        match = _TRAILING_NUMBER.search(label.strip())
        number = int(match.group(1)) if match else 0
    return number if -(2**63) <= number < 2**63 else 0


def version_array(values: Any = ()) -> array[int]:
    """Per-token weight versions (64-bit)."""
    return array("q", values)


def int_array(values: Any = ()) -> array[int]:
    return array("i", values)


def float_array(values: Any = ()) -> array[float]:
    return array("f", values)


@attrs.define(eq=False)
class Step:
    """One model call, with the exact ids the engine saw and sampled."""

    index: int
    session_id: str
    segment_index: int
    turn_id: str | None
    instance_id: str | None
    #: The messages this call added to the conversation (the history is not copied per step).
    new_messages: list[dict[str, Any]]
    message_count: int
    #: Length of the prompt the engine was given; the prompt is the segment's first ``prompt_len`` ids.
    prompt_len: int
    #: The context ids this step added to its segment (all of the prompt for a segment's first step).
    fragment_ids: array[int]
    max_new_tokens: int
    rid: str = ""
    output_ids: array[int] = attrs.field(factory=int_array)
    output_logprobs: array[float] = attrs.field(factory=float_array)
    output_versions: array[int] = attrs.field(factory=version_array)
    weight_version: str = ""
    finish_reason: str | None = None
    status: StepStatus = "running"
    #: True once the step's fragment and output are part of its segment.
    in_segment: bool = False
    #: Set on the first step of a segment: why that segment was opened.
    boundary_reason: str | None = None
    output: AssistantOutput | None = None
    tool_call_parse_error: bool = False
    logprobs_invalid: bool = False
    incremental_tokenization_failed: bool = False
    error: str | None = None
    #: R3: base64 little-endian int32 ``[prompt + completion - 1, layers, topk]`` from the engine.
    routed_experts: str | None = None
    #: R3 of a generation resumed after pauses: one payload per attempt, in order.
    routed_experts_chunks: list[str] | None = None
    #: How many times a pause interrupted this step's generation.
    preemptions: int = 0
    #: Non-partial mode: attempts interrupted by a pause, kept here and never trained.
    discarded: list[dict[str, Any]] = attrs.field(factory=list)
    #: ``--on-history-rewrite recompute``: this step's fragment is the whole conversation rebuilt,
    #: with the earlier replies in it trained. Per fragment token: loss mask, logprob and version.
    fragment_mask: array[int] | None = None
    fragment_logprobs: array[float] | None = None
    fragment_versions: array[int] | None = None
    #: Token ranges of the fragment holding rebuilt replies (mask 1), relative to the fragment.
    rebuilt_spans: list[tuple[int, int]] = attrs.field(factory=list)
    #: The rebuilt replies' logprobs came from the engine's prompt logprobs (else they are 0.0).
    logprobs_recomputed: bool = False
    #: A retry: the step this one replaced (same ``X-Turn-Id``, or the same request again).
    retry_of: int | None = None
    #: Set when a retry replaced this step (its status is then ``superseded``).
    superseded_by: int | None = None
    #: How the output was sampled: temperature, top-p, top-k, min-p, the three penalties and the seed, by the
    #: engines' own names (``runtime/generate.py: sampling_record``); shared by the steps that sampled alike,
    #: never written to. ``None`` for a step the proxy did not sample (one a client submitted).
    sampling: dict[str, Any] | None = None
    #: The engine's version labels behind ``output_versions`` (number -> label), e.g. ``{7: "weights-v7"}``.
    version_labels: dict[int, str] = attrs.field(factory=dict)
    created_at: float = attrs.field(factory=time.time)
    first_token_at: float | None = None
    finished_at: float | None = None

    def fragment_arrays(self) -> tuple[array[int], array[float], array[int]]:
        """Loss mask, logprobs and versions of the fragment (all context unless it was rebuilt)."""
        n = len(self.fragment_ids)
        if self.fragment_mask is not None and self.fragment_logprobs is not None and self.fragment_versions is not None:
            return self.fragment_mask, self.fragment_logprobs, self.fragment_versions
        return array("b", bytes(n)), float_array(bytes(4 * n)), version_array([CONTEXT_VERSION]) * n


@attrs.frozen(eq=False)
class Segment:
    """One training sample: four arrays of equal length plus its identity."""

    trajectory_id: str
    parent_traj_id: str
    instance_id: str | None
    rollout_id: str
    segment_index: int
    token_ids: array[int]
    loss_mask: array[int]
    logprobs: array[float]
    versions: array[int]
    step_indices: tuple[int, ...]
    #: Why the segment was opened (``session_start``, ``history_rewrite``, ...).
    start_reason: str
    #: Why it was closed (``finalize``, ``history_rewrite``, ``idle_evicted``, ...).
    boundary_reason: str
    reward: float | None = None
    metadata: dict[str, Any] = attrs.field(factory=dict)
    #: R3 per step: ``{"step_index", "routed_experts"}`` or ``{"step_index", "routed_experts_chunks"}``.
    routed_experts_parts: list[dict[str, Any]] | None = None
    created_at: float = attrs.field(factory=time.time)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_trained_tokens(self) -> int:
        """Tokens with loss mask 1. A mask holds only 0 and 1: counting its bytes is ~10x faster than ``sum``."""
        mask = self.loss_mask
        return mask.tobytes().count(1) if mask.itemsize == 1 else sum(mask)


def build_segment(
    steps: list[Step],
    *,
    session_id: str,
    instance_id: str | None,
    rollout_id: str,
    segment_index: int,
    start_reason: str,
    boundary_reason: str,
    parent_traj_id: str | None = None,
    reward: float | None = None,
    metadata: dict[str, Any] | None = None,
    mask_nonlast_version: bool = False,
) -> Segment:
    """Stitch the in-segment steps' fragments and outputs into one sample (concat mode).

    ``mask_nonlast_version`` sets the loss mask to 0 on sampled tokens whose
    weight version is older than the newest in the segment (partial rollout
    across a weight update).
    """
    token_ids = int_array()
    loss_mask = array("b")
    logprobs = float_array()
    versions = version_array()
    recomputed: list[list[int]] = []
    invalid: list[list[int]] = []
    for step in steps:
        start = len(token_ids)
        out = len(step.output_ids)
        frag_mask, frag_logprobs, frag_versions = step.fragment_arrays()
        token_ids.extend(step.fragment_ids)
        token_ids.extend(step.output_ids)
        loss_mask.extend(frag_mask)
        loss_mask.extend(b"\x01" * out)
        logprobs.extend(frag_logprobs)
        logprobs.extend(step.output_logprobs)
        versions.extend(frag_versions)
        versions.extend(step.output_versions)
        spans = recomputed if step.logprobs_recomputed else invalid
        spans.extend([start + a, start + b] for a, b in step.rebuilt_spans)
    meta = dict(metadata or {})
    meta.setdefault("build_mode", "concat")
    meta.setdefault("recomputed_logprob_spans", recomputed)
    meta.setdefault("invalid_logprob_spans", invalid)
    meta.setdefault("logprobs_invalid", bool(invalid) or any(s.logprobs_invalid for s in steps))
    return finish_segment(
        steps,
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        versions=versions,
        session_id=session_id,
        parent_traj_id=parent_traj_id,
        instance_id=instance_id,
        rollout_id=rollout_id,
        segment_index=segment_index,
        start_reason=start_reason,
        boundary_reason=boundary_reason,
        reward=reward,
        metadata=meta,
        mask_nonlast_version=mask_nonlast_version,
    )


def finish_segment(
    steps: list[Step],
    *,
    token_ids: array[int],
    loss_mask: array[int],
    logprobs: array[float],
    versions: array[int],
    session_id: str,
    parent_traj_id: str | None,
    instance_id: str | None,
    rollout_id: str,
    segment_index: int,
    start_reason: str,
    boundary_reason: str,
    reward: float | None,
    metadata: dict[str, Any],
    mask_nonlast_version: bool,
) -> Segment:
    """The :class:`Segment` of finished arrays, with the fields every build mode shares."""
    if mask_nonlast_version and versions:
        newest = max(versions)
        for i, version in enumerate(versions):
            if loss_mask[i] and version < newest:
                loss_mask[i] = 0
    parts = [
        {"step_index": s.index, **({"routed_experts_chunks": s.routed_experts_chunks}
                                  if s.routed_experts_chunks is not None else {"routed_experts": s.routed_experts})}
        for s in steps
        if s.routed_experts is not None or s.routed_experts_chunks is not None
    ]
    metadata.setdefault("tool_call_parse_errors", sum(s.tool_call_parse_error for s in steps))
    metadata.setdefault("sampling", segment_sampling(steps))
    return Segment(
        trajectory_id=f"{session_id}#{segment_index}",
        parent_traj_id=parent_traj_id or session_id,
        instance_id=instance_id,
        rollout_id=rollout_id,
        segment_index=segment_index,
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        versions=versions,
        step_indices=tuple(s.index for s in steps),
        start_reason=start_reason,
        boundary_reason=boundary_reason,
        reward=reward,
        metadata=metadata,
        routed_experts_parts=parts or None,
    )


def segment_sampling(steps: list[Step]) -> dict[str, Any] | list[dict[str, Any] | None] | None:
    """How a segment's sampled tokens were drawn: its steps' one ``sampling`` when they all sampled alike (the
    common case), else each step's, in the order of ``step_indices``; ``None`` when no step was sampled here."""
    records = [step.sampling for step in steps]
    first = records[0] if records else None
    if all(record is first or record == first for record in records):
        return first
    return records
