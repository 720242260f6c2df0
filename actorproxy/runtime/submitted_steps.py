"""Steps a white-box agent submits (``POST /submit_steps``), handled by their session actor.

A submitted step that matches a step the session recorded (same trajectory,
same ``step_index``) attaches its ``reward``, ``is_last`` and ``metadata`` to
it: its ``prompt_ids`` and ``response_ids`` must equal the recorded ones, else
:class:`~actorproxy.errors.Conflict` names the first differing position (the
recorded ids are never overwritten). Annotations are kept by the session and
written onto the segment that holds the step when it closes
(``metadata.step_rewards``, ``metadata.step_metadata``; ``reward`` = the
segment's last rewarded step unless the finalize gave one).

A step the proxy never saw (an agent running its own engine) becomes an
external segment: prompt then response, the response trained, its logprobs
absent (0.0) and flagged (``metadata.source = "external"``,
``logprobs_absent``, ``logprobs_invalid`` and ``invalid_logprob_spans``) so a
trainer masks them; its step joins the session's steps.

Everything is checked before anything is applied (:func:`plan` raises, then
:func:`apply` changes the state), so a refused request changes nothing.
"""

from __future__ import annotations

from array import array
from typing import Any

import attrs

from ..core.records import Segment, Step, build_segment, float_array, int_array, version_array, version_number
from ..core.session_state import SessionState
from ..errors import Conflict
from .actor import Reply


@attrs.frozen
class SubmittedStep:
    """One step of a ``/submit_steps`` body; ``position`` is its place in the request (for errors)."""

    position: int
    prompt_uid: str
    step_index: int
    prompt_ids: array[int]
    response_ids: array[int]
    reward: float | None = None
    policy_version: str | int | None = None
    is_last: bool = False
    metadata: dict[str, Any] = attrs.field(factory=dict)
    #: The logprobs the agent sent with a step this proxy did not record (one per response id).
    rollout_log_probs: array[float] | None = None
    #: The token-in ``/generate`` that produced exactly these ids (claimed by the gateway), if one did.
    generated: Step | None = None


@attrs.frozen
class SubmitSteps:
    """Session message: check (``apply=False``) or check and apply the steps of this session."""

    steps: tuple[SubmittedStep, ...]
    apply: bool
    reply: Reply
    #: The channel the steps were submitted on (``?channel=``); written on the external segments.
    channel: str | None = None


@attrs.frozen
class Annotation:
    """What a submitted step attached to a recorded one."""

    reward: float | None
    is_last: bool
    policy_version: str | int | None
    metadata: dict[str, Any]


@attrs.frozen
class SubmitResult:
    attached: int
    external: int


class StepStored(Conflict):
    """The step's segment already went to the store: nothing can be attached to it any more."""

    default_code = "step_already_stored"


def _first_difference(recorded: array[int] | list[int], submitted: array[int]) -> int | None:
    for position, (a, b) in enumerate(zip(recorded, submitted, strict=False)):
        if a != b:
            return position
    return None if len(recorded) == len(submitted) else min(len(recorded), len(submitted))


def recorded_prompt(state: SessionState, step: Step) -> array[int]:
    """The exact ids the engine was given for ``step``: its segment's earlier steps, then its fragment."""
    ids = int_array()
    for earlier in state.steps:
        if earlier.index >= step.index:
            break
        if earlier.in_segment and earlier.segment_index == step.segment_index:
            ids.extend(earlier.fragment_ids)
            ids.extend(earlier.output_ids)
    ids.extend(step.fragment_ids)
    if len(ids) != step.prompt_len and len(step.fragment_ids) == step.prompt_len:
        return step.fragment_ids  # a prefix rebuilt in place (recompute mode): the fragment is the whole prompt
    return ids


def _check_ids(kind: str, recorded: array[int], submitted: SubmittedStep, session_id: str) -> None:
    given = submitted.prompt_ids if kind == "prompt_ids" else submitted.response_ids
    position = _first_difference(recorded, given)
    if position is None:
        return
    was = recorded[position] if position < len(recorded) else "(end)"
    now = given[position] if position < len(given) else "(end)"
    raise Conflict(
        f"step {submitted.step_index} of trajectory {session_id!r}: {kind} differ from the recorded ids at position "
        f"{position} (recorded {was}, submitted {now}; {len(recorded)} recorded, {len(given)} submitted); "
        "the recorded ids are kept",
        code="ids_mismatch",
        param=f"steps[{submitted.position}].{kind}[{position}]",
    )


def plan(state: SessionState, steps: tuple[SubmittedStep, ...]) -> list[tuple[SubmittedStep, Step | None]]:
    """Match each submitted step to the step recorded at its index (``None``: external); raise if one cannot be."""
    recorded = {step.index: step for step in state.steps}
    open_index = state.segment.index if state.segment is not None else None
    matched: list[tuple[SubmittedStep, Step | None]] = []
    for submitted in steps:
        step = recorded.get(submitted.step_index)
        if step is None:
            if submitted.step_index < state.next_step:
                raise StepStored(
                    f"step {submitted.step_index} of trajectory {state.session_id!r} was recorded and already handed "
                    "to the store; submit steps before the trajectory is completed",
                    param=f"steps[{submitted.position}].step_index",
                )
            matched.append((submitted, None))
            continue
        if step.in_segment and step.segment_index != open_index:
            raise StepStored(
                f"step {submitted.step_index} of trajectory {state.session_id!r} is in segment {step.segment_index}, "
                "already closed and stored (a new segment was opened after it); its reward cannot be attached",
                param=f"steps[{submitted.position}].step_index",
            )
        _check_ids("prompt_ids", recorded_prompt(state, step), submitted, state.session_id)
        _check_ids("response_ids", step.output_ids, submitted, state.session_id)
        matched.append((submitted, step))
    return matched


def apply(
    state: SessionState,
    annotations: dict[int, Annotation],
    matched: list[tuple[SubmittedStep, Step | None]],
    channel: str | None = None,
) -> tuple[SubmitResult, list[Segment]]:
    """Attach the annotations and record the external steps; returns their segments (for the store)."""
    external: list[Segment] = []
    for submitted, step in matched:
        if not state.instance_id:
            state.instance_id = submitted.prompt_uid
        annotations[submitted.step_index] = Annotation(
            submitted.reward, submitted.is_last, submitted.policy_version, dict(submitted.metadata)
        )
        if step is None:
            external.append(_external_segment(state, submitted, channel))
    return SubmitResult(attached=len(matched) - len(external), external=len(external)), external


def _external_segment(state: SessionState, submitted: SubmittedStep, channel: str | None = None) -> Segment:
    """A step this session did not record, as a segment of its own.

    Its logprobs and versions are, in order of trust: those of the token-in ``/generate`` that sampled
    exactly these ids (``source: "generate"``, nothing flagged); the agent's ``rollout_log_probs``
    (``logprobs_source: "agent"``); else absent (0.0, flagged so that a trainer masks them).
    """
    prompt, response = submitted.prompt_ids, submitted.response_ids
    generated = submitted.generated
    if generated is not None:
        return _generated_segment(state, submitted, generated, channel)
    label = "" if submitted.policy_version is None else str(submitted.policy_version)
    agent_logprobs = submitted.rollout_log_probs
    step = Step(
        index=submitted.step_index,
        session_id=state.session_id,
        segment_index=state.next_segment,
        turn_id=None,
        instance_id=submitted.prompt_uid,
        new_messages=[],
        message_count=0,
        prompt_len=len(prompt),
        fragment_ids=int_array(prompt),
        max_new_tokens=len(response),
        output_ids=int_array(response),
        output_logprobs=agent_logprobs if agent_logprobs is not None else float_array(bytes(4 * len(response))),
        output_versions=version_array([version_number(submitted.policy_version)]) * len(response),
        weight_version=label,
        status="completed",
        in_segment=True,
        boundary_reason="external",
        logprobs_invalid=agent_logprobs is None,
    )
    metadata: dict[str, Any] = {"source": "external"}
    if agent_logprobs is None:
        metadata["logprobs_absent"] = True
        metadata["invalid_logprob_spans"] = [[len(prompt), len(prompt) + len(response)]] if response else []
    else:
        metadata["logprobs_source"] = "agent"
    return _one_step_segment(state, submitted, step, metadata, channel)


def _generated_segment(state: SessionState, submitted: SubmittedStep, generated: Step, channel: str | None) -> Segment:
    """A token-in generation claimed by its ids: recorded arrays, this trajectory's numbering."""
    step = attrs.evolve(generated, index=submitted.step_index, session_id=state.session_id,
                        segment_index=state.next_segment, instance_id=submitted.prompt_uid, in_segment=True,
                        boundary_reason="external")
    metadata: dict[str, Any] = {"source": "generate", "generation_id": generated.session_id}
    return _one_step_segment(state, submitted, step, metadata, channel)


def _one_step_segment(
    state: SessionState, submitted: SubmittedStep, step: Step, metadata: dict[str, Any], channel: str | None
) -> Segment:
    source = metadata["source"]
    state.next_step = max(state.next_step, submitted.step_index + 1)
    state.next_segment += 1
    state.steps.append(step)
    metadata = {
        **metadata,
        "policy_version": submitted.policy_version,
        "step_rewards": {str(submitted.step_index): submitted.reward},
        "step_metadata": {str(submitted.step_index): {**submitted.metadata, "source": source}},
    }
    if channel is not None:
        metadata["channel"] = channel
    segment = build_segment(
        [step],
        session_id=state.session_id,
        instance_id=submitted.prompt_uid,
        rollout_id=state.session_id,
        segment_index=step.segment_index,
        start_reason="external",
        # ``is_last`` ends the trajectory: its segment is the last one (a data pool counts the rollout complete).
        boundary_reason="finalize" if submitted.is_last else "external",
        reward=submitted.reward,
        metadata=metadata,
    )
    return segment


def annotate(segments: list[Segment], annotations: dict[int, Annotation]) -> list[Segment]:
    """Write the submitted rewards and metadata onto the segments holding their steps."""
    if not annotations:
        return segments
    out = []
    for segment in segments:
        mine = {i: annotations[i] for i in segment.step_indices if i in annotations}
        if not mine or segment.metadata.get("source") in ("external", "generate"):
            out.append(segment)
            continue
        metadata = {
            **segment.metadata,
            "step_rewards": {str(i): a.reward for i, a in mine.items()},
            "step_metadata": {str(i): {**a.metadata, "is_last": a.is_last, "policy_version": a.policy_version}
                              for i, a in mine.items()},
        }
        reward = segment.reward
        if reward is None:
            rewarded = [a.reward for i, a in sorted(mine.items()) if a.reward is not None]
            reward = rewarded[-1] if rewarded else None
        out.append(attrs.evolve(segment, reward=reward, metadata=metadata))
    return out
