"""What the proxy records, as the trainer reads it: the converter's hooks for steps, segments and verify reports.

:func:`register_record_hooks` teaches a converter (``wire.converter.CONVERTER``)
the JSON of :class:`~actorproxy.core.records.Segment`,
:class:`~actorproxy.core.records.Step` (and :class:`StepSummary`, a step
without its arrays) and :class:`~actorproxy.core.verify.VerifyReport`. The
records stay plain attrs classes in ``core/``; only here do they get names on
the wire (``index`` is ``step_index``, ``prompt_len`` is ``prompt_tokens``),
derived counts (``num_tokens``, ``completion_tokens``) and arrays as lists.

The key order is part of the contract (trainers diff the bytes, and
``tests/golden/`` pins them), and derived keys sit between fields. So the
segment and step hooks are written out in wire order rather than generated and
reordered: that is also the fastest form for ``/trajectory/read``, where the
arrays' ``tolist()`` is nearly all the cost. A segment's JSON is read back
into a :class:`Segment` (``structure``: the client's typed segments; a durable
store's rows, by :func:`segment_from`); its derived keys are recomputed, never
trusted.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import attrs
import cattrs
from cattrs.gen import make_dict_unstructure_fn, override

from ..core.messages import AssistantOutput
from ..core.records import Segment, Step
from ..core.verify import Difference, VerifyFailure, VerifyReport


@attrs.frozen(eq=False)
class StepSummary:
    """A step at a glance (``GET /session/{id}``): its JSON without arrays, long payloads counted."""

    step: Step


@attrs.define(eq=False)
class StoredStep:
    """A step as a durable store keeps it: its JSON without arrays (``meta``) and its packed arrays.

    A row is read back as it was written (its text is never re-derived), so old rows read unchanged.
    """

    meta: dict[str, Any]
    #: ``fragment, output, output logprobs, output versions, fragment mask, logprobs, versions``.
    arrays: list[array[Any]]


@attrs.frozen(eq=False)
class ReadResult:
    """What a store read found (``/trajectory/read``'s body): the segments, and the steps when asked for."""

    data: list[Segment]
    #: A live store's steps, or a durable store's rows (the same JSON); ``None`` unless asked for.
    steps: list[Step | StoredStep] | None = None


@attrs.frozen(eq=False)
class StoredRead:
    """What a durable store's read found, each row decoded only when it is taken.

    Encoded (``/trajectory/read``), a read holds one segment or step as Python
    objects at a time, never all it read: a drain of thousands of turns would
    otherwise hold them all at once, and that peak stays with the process's
    allocator. :func:`~actorproxy.runtime.store_messages.keep` makes it a
    :class:`ReadResult` (every row decoded, in lists) for an in-process read.
    """

    data: Sequence[Segment]
    steps: Sequence[StoredStep] | None = None


#: What a store read hands its ``finish``: the records themselves, or a durable store's rows.
Found = ReadResult | StoredRead


def read_json(result: Found) -> dict[str, Any]:
    """The converter's hook for :class:`ReadResult` and :class:`StoredRead` (written out: the trainer's hot path)."""
    data: dict[str, Any] = {"data": [segment_json(seg) for seg in result.data]}
    if result.steps is not None:
        data["steps"] = [step_json(s) if isinstance(s, Step) else stored_step_json(s) for s in result.steps]
    return data


def output_json(output: AssistantOutput) -> dict[str, Any]:
    return {
        "content": output.content,
        "reasoning_content": output.reasoning,
        "tool_calls": [call.to_openai() for call in output.tool_calls],
    }


def step_fields(step: Step, *, payloads: bool = True) -> dict[str, Any]:
    """A step's JSON without the arrays; ``payloads=False`` counts the long payloads instead of listing them."""
    out = len(step.output_ids)
    data: dict[str, Any] = {
        "step_index": step.index,
        "session_id": step.session_id,
        "segment_index": step.segment_index,
        "turn_id": step.turn_id,
        "instance_id": step.instance_id,
        "rid": step.rid,
        "status": step.status,
        "in_segment": step.in_segment,
        "boundary_reason": step.boundary_reason,
        "finish_reason": step.finish_reason,
        "weight_version": step.weight_version,
        "prompt_tokens": step.prompt_len,
        "completion_tokens": out,
        "max_new_tokens": step.max_new_tokens,
        "sampling": step.sampling,
        "message_count": step.message_count,
        "new_messages": step.new_messages,
        "tool_call_parse_error": step.tool_call_parse_error,
        "error": step.error,
        "concat_context_token_count": len(step.fragment_ids),
        "concat_output_token_count": out,
        "concat_logprobs_invalid": step.logprobs_invalid,
        "prefix_rebuilt": step.fragment_mask is not None,
        "rebuilt_spans": [list(span) for span in step.rebuilt_spans],
        "logprobs_recomputed": step.logprobs_recomputed,
        "concat_incremental_tokenization_failed": step.incremental_tokenization_failed,
        "created_at": step.created_at,
        "first_token_at": step.first_token_at,
        "finished_at": step.finished_at,
    }
    if step.output is not None:
        data["output"] = output_json(step.output)
    data["preemptions"] = step.preemptions
    data["retry_of"] = step.retry_of
    data["superseded_by"] = step.superseded_by
    if step.discarded:
        data["discarded"] = step.discarded if payloads else len(step.discarded)
    if step.routed_experts is not None:
        data["routed_experts"] = step.routed_experts if payloads else "..."
    if step.routed_experts_chunks is not None:
        chunks = step.routed_experts_chunks
        data["routed_experts_chunks"] = chunks if payloads else len(chunks)
    return data


def with_step_arrays(
    fields: dict[str, Any], fragment: array[int], output: array[int], output_logprobs: array[float],
    output_versions: array[int], mask: array[int], fragment_logprobs: array[float], fragment_versions: array[int],
) -> dict[str, Any]:
    """A step's JSON: its ``fields`` then the arrays, from its fragment's and its output's arrays."""
    out_ids = output.tolist()
    out_logprobs = output_logprobs.tolist()
    return {
        **fields,
        "output_ids": out_ids,
        "output_logprobs": out_logprobs,
        "concat_token_ids": fragment.tolist() + out_ids,
        "concat_response_logprobs": fragment_logprobs.tolist() + out_logprobs,
        "concat_response_mask": mask.tolist() + [1] * len(out_ids),
        "concat_versions": fragment_versions.tolist() + output_versions.tolist(),
    }


def stored_step_json(stored: StoredStep) -> dict[str, Any]:
    """The converter's hook for :class:`StoredStep`: the same JSON as the :class:`Step` it was."""
    return with_step_arrays(stored.meta, *stored.arrays)


def step_json(step: Step) -> dict[str, Any]:
    """The converter's hook for :class:`Step`: every field, the TITO fragment and output arrays as lists."""
    mask, logprobs, versions = step.fragment_arrays()
    return with_step_arrays(step_fields(step), step.fragment_ids, step.output_ids, step.output_logprobs,
                            step.output_versions, mask, logprobs, versions)


def segment_fields(seg: Segment) -> dict[str, Any]:
    """A segment's JSON without its four arrays (what a store keeps as text)."""
    return {**_segment_head(seg), **_segment_tail(seg)}


def _segment_head(seg: Segment) -> dict[str, Any]:
    return {
        "trajectory_id": seg.trajectory_id,
        "parent_traj_id": seg.parent_traj_id,
        "instance_id": seg.instance_id,
        "rollout_id": seg.rollout_id,
        "segment_index": seg.segment_index,
    }


def _segment_tail(seg: Segment) -> dict[str, Any]:
    tail: dict[str, Any] = {
        "num_steps": len(seg.step_indices),
        "step_indices": list(seg.step_indices),
        "num_tokens": len(seg.token_ids),
        "num_trained_tokens": seg.num_trained_tokens,
        "start_reason": seg.start_reason,
        "boundary_reason": seg.boundary_reason,
        "reward": seg.reward,
        "metadata": _metadata_json(seg.metadata),
        "created_at": seg.created_at,
    }
    if seg.routed_experts_parts:
        tail["routed_experts_parts"] = seg.routed_experts_parts
    return tail


def segment_json(seg: Segment) -> dict[str, Any]:
    """The converter's hook for :class:`Segment`: the training sample as the trainer reads it."""
    return {
        **_segment_head(seg),
        "token_ids": seg.token_ids.tolist(),
        "loss_mask": seg.loss_mask.tolist(),
        "logprobs": seg.logprobs.tolist(),
        "versions": seg.versions.tolist(),
        **_segment_tail(seg),
    }


def _metadata_json(metadata: dict[str, Any]) -> dict[str, Any]:
    """The metadata as JSON: a verify report in it (the only record there) is unstructured."""
    report = metadata.get("verify")
    if isinstance(report, VerifyReport | VerifyFailure):
        return {**metadata, "verify": verify_json(report)}
    return metadata


def verify_json(report: VerifyReport | VerifyFailure) -> dict[str, Any]:
    """A verify report as JSON: its counts and at most ``report.max_listed`` differences (the converter's hook)."""
    if isinstance(report, VerifyFailure):
        return {"error": report.error}
    return {
        "clean": report.clean,
        "turns": report.turns,
        "recorded_tokens": report.recorded_tokens,
        "fresh_tokens": report.fresh_tokens,
        "expected": report.expected,
        "unexpected": report.unexpected,
        "by_kind": report.by_kind,
        "differences": [_difference_json(d) for d in report.differences[: max(0, report.max_listed)]],
    }


def segment_from(
    meta: dict[str, Any], token_ids: array[int], loss_mask: array[int], logprobs: array[float], versions: array[int]
) -> Segment:
    """The :class:`Segment` of a segment's JSON fields and its arrays (derived counts are not read)."""
    return Segment(
        trajectory_id=meta["trajectory_id"],
        parent_traj_id=meta["parent_traj_id"],
        instance_id=meta.get("instance_id"),
        rollout_id=meta["rollout_id"],
        segment_index=meta["segment_index"],
        token_ids=token_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        versions=versions,
        step_indices=tuple(meta["step_indices"]),
        start_reason=meta["start_reason"],
        boundary_reason=meta["boundary_reason"],
        reward=meta.get("reward"),
        metadata=meta.get("metadata", {}),
        routed_experts_parts=meta.get("routed_experts_parts"),
        created_at=meta["created_at"],
    )


def structure_segment(data: Any, _: Any = None) -> Segment:
    """The converter's structure hook for :class:`Segment`: a segment's JSON, its lists as the stores' arrays."""
    return segment_from(data, array("i", data["token_ids"]), array("b", data["loss_mask"]),
                        array("f", data["logprobs"]), array("q", data["versions"]))


#: A difference's JSON: its fields in order, the token ranges as lists (cattrs keeps a tuple a tuple).
_difference_json = make_dict_unstructure_fn(
    Difference, cattrs.Converter(), recorded=override(unstruct_hook=list), fresh=override(unstruct_hook=list)
)


def register_record_hooks(converter: cattrs.Converter) -> None:
    """Teach ``converter`` the records' JSON (see the module docstring)."""
    # By predicate: registering by class would resolve the classes' annotations, and ``array[int]``
    # cannot be evaluated before Python 3.12.
    hooks: dict[type, Any] = {
        ReadResult: read_json,
        StoredRead: read_json,
        Step: step_json,
        StoredStep: stored_step_json,
        StepSummary: lambda summary: step_fields(summary.step, payloads=False),
        Segment: segment_json,
        VerifyReport: verify_json,
        VerifyFailure: verify_json,
        Difference: _difference_json,
    }
    for cls, hook in hooks.items():
        converter.register_unstructure_hook_func(lambda t, cls=cls: t is cls, hook)  # type: ignore[misc]
    converter.register_structure_hook_func(lambda t: t is Segment, structure_segment)
