"""Segments and steps as stored rows: a JSON text for the fields, raw bytes for the arrays.

Token arrays are never stored as JSON lists: a segment keeps its four arrays as
the bytes of the ``array`` objects (native byte order, 4 bytes a token id,
logprob and version, 1 byte a mask entry); a step packs its seven arrays into
one blob. The JSON a trainer reads is rebuilt from these on demand.
"""

from __future__ import annotations

import json
import struct
from array import array
from typing import Any

from ..core.records import Segment, Step, build_segment, float_array, int_array

#: Keys of ``Step.to_json()`` that are derived from the step's arrays (rebuilt at read).
_STEP_ARRAY_KEYS = (
    "output_ids",
    "output_logprobs",
    "concat_token_ids",
    "concat_response_logprobs",
    "concat_response_mask",
    "concat_versions",
)
_HEADER = struct.Struct("<cI")


def dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def pack_arrays(arrays: list[array[Any]]) -> bytes:
    """Arrays as one blob: per array its typecode, its length and its bytes."""
    parts: list[bytes] = []
    for values in arrays:
        parts.append(_HEADER.pack(values.typecode.encode(), len(values)))
        parts.append(values.tobytes())
    return b"".join(parts)


def unpack_arrays(blob: bytes) -> list[array[Any]]:
    out: list[array[Any]] = []
    pos = 0
    view = memoryview(blob)
    while pos < len(blob):
        code, count = _HEADER.unpack_from(blob, pos)
        pos += _HEADER.size
        values = array(code.decode())
        size = count * values.itemsize
        values.frombytes(view[pos : pos + size])
        pos += size
        out.append(values)
    return out


def array_from(code: str, blob: bytes) -> array[Any]:
    values = array(code)
    values.frombytes(blob)
    return values


# -- segments ------------------------------------------------------------------


def segment_meta(seg: Segment) -> dict[str, Any]:
    """``Segment.to_json()`` without the four arrays (computed without listing them)."""
    meta: dict[str, Any] = {
        "trajectory_id": seg.trajectory_id,
        "parent_traj_id": seg.parent_traj_id,
        "instance_id": seg.instance_id,
        "rollout_id": seg.rollout_id,
        "segment_index": seg.segment_index,
        "num_steps": len(seg.step_indices),
        "step_indices": list(seg.step_indices),
        "num_tokens": len(seg.token_ids),
        "num_trained_tokens": sum(seg.loss_mask),
        "start_reason": seg.start_reason,
        "boundary_reason": seg.boundary_reason,
        "reward": seg.reward,
        "metadata": seg.metadata,
        "created_at": seg.created_at,
    }
    if seg.routed_experts_parts:
        meta["routed_experts_parts"] = seg.routed_experts_parts
    return meta


def segment_blobs(seg: Segment) -> tuple[bytes, bytes, bytes, bytes]:
    return (seg.token_ids.tobytes(), seg.loss_mask.tobytes(), seg.logprobs.tobytes(), seg.versions.tobytes())


def segment_json(meta: dict[str, Any], blobs: tuple[bytes, bytes, bytes, bytes]) -> dict[str, Any]:
    """The segment as ``Segment.to_json()`` shows it, from its stored row."""
    tokens, mask, logprobs, versions = blobs
    return {
        **meta,
        "token_ids": array_from("i", tokens).tolist(),
        "loss_mask": array_from("b", mask).tolist(),
        "logprobs": array_from("f", logprobs).tolist(),
        "versions": array_from("i", versions).tolist(),
    }


def segment_bytes(seg: Segment) -> int:
    """What a segment costs in the store: its arrays plus a rough size of its fields."""
    return 13 * len(seg.token_ids) + 256


# -- steps -----------------------------------------------------------------------


def step_meta(step: Step) -> dict[str, Any]:
    """``Step.to_json()`` without the arrays it derives from the step's arrays."""
    meta = step.to_json(include_arrays=False)
    if step.discarded:
        meta["discarded"] = step.discarded
    if step.routed_experts is not None:
        meta["routed_experts"] = step.routed_experts
    if step.routed_experts_chunks is not None:
        meta["routed_experts_chunks"] = step.routed_experts_chunks
    return meta


def step_blob(step: Step) -> bytes:
    mask, logprobs, versions = step.fragment_arrays()
    if mask.typecode != "b":
        mask = array("b", mask)
    return pack_arrays(
        [step.fragment_ids, step.output_ids, step.output_logprobs, step.output_versions, mask, logprobs, versions]
    )


def step_json(meta: dict[str, Any], blob: bytes) -> dict[str, Any]:
    """The step as ``Step.to_json()`` shows it, from its stored row."""
    frag, out, out_lp, _out_ver, mask, frag_lp, frag_ver = unpack_arrays(blob)
    out_list = out.tolist()
    out_lp_list = out_lp.tolist()
    return {
        **meta,
        "output_ids": out_list,
        "output_logprobs": out_lp_list,
        "concat_token_ids": frag.tolist() + out_list,
        "concat_response_logprobs": frag_lp.tolist() + out_lp_list,
        "concat_response_mask": mask.tolist() + [1] * len(out_list),
        "concat_versions": frag_ver.tolist() + _out_ver.tolist(),
    }


def decode_step(meta: dict[str, Any], blob: bytes) -> Step:
    """Enough of a :class:`Step` to rebuild its segment (recovery after a crash)."""
    frag, out, out_lp, out_ver, mask, frag_lp, frag_ver = unpack_arrays(blob)
    step = Step(
        index=int(meta["step_index"]),
        session_id=str(meta["session_id"]),
        segment_index=int(meta["segment_index"]),
        turn_id=meta.get("turn_id"),
        instance_id=meta.get("instance_id"),
        new_messages=[],
        message_count=int(meta.get("message_count", 0)),
        prompt_len=int(meta.get("prompt_tokens", 0)),
        fragment_ids=int_array(frag),
        max_new_tokens=int(meta.get("max_new_tokens", 0)),
        output_ids=int_array(out),
        output_logprobs=float_array(out_lp),
        output_versions=int_array(out_ver),
        weight_version=str(meta.get("weight_version", "")),
        status=meta.get("status", "completed"),
        in_segment=bool(meta.get("in_segment", True)),
        boundary_reason=meta.get("boundary_reason"),
    )
    if meta.get("prefix_rebuilt"):
        step.fragment_mask, step.fragment_logprobs, step.fragment_versions = mask, frag_lp, frag_ver
    step.rebuilt_spans = [(int(a), int(b)) for a, b in meta.get("rebuilt_spans", [])]
    step.logprobs_recomputed = bool(meta.get("logprobs_recomputed", False))
    step.logprobs_invalid = bool(meta.get("concat_logprobs_invalid", False))
    step.routed_experts = meta.get("routed_experts")
    step.routed_experts_chunks = meta.get("routed_experts_chunks")
    return step


def recovered_segment(session_id: str, parent: str, steps: list[Step]) -> tuple[Segment, list[Step]]:
    """The open segment of a session that was never finalized, rebuilt from its journaled steps.

    ``--on-history-rewrite recompute`` rebuilds a segment in place: the step that
    rebuilt it carries the whole conversation as its fragment, and the steps
    before it left the segment (journaled before the rebuild, they do not say
    so). The segment is therefore the last rebuilding step and those after it;
    the steps it replaced are returned (now out of the segment), as a clean
    close records them in ``metadata.rebuilt_steps``.
    """
    rebuilt_at = [k for k, step in enumerate(steps) if step.fragment_mask is not None]
    cut = rebuilt_at[-1] if rebuilt_at else 0
    replaced, members = steps[:cut], steps[cut:]
    for step in replaced:
        step.in_segment = False
    metadata: dict[str, Any] = {"recovered": True}
    if parent != session_id:
        metadata["sub_agent"] = session_id.rpartition("/")[2]
    if rebuilt_at:
        metadata["rebuilds"] = [steps[k].boundary_reason or "history_rewrite" for k in rebuilt_at]
        metadata["rebuilt_steps"] = [step.index for step in replaced]
    instance_id = next((s.instance_id for s in steps if s.instance_id), None)
    segment = build_segment(
        members,
        session_id=session_id,
        instance_id=instance_id,
        rollout_id=parent,
        parent_traj_id=parent,
        segment_index=steps[0].segment_index,
        start_reason=steps[0].boundary_reason or "session_start",
        boundary_reason="recovered",
        metadata=metadata,
    )
    return segment, replaced
