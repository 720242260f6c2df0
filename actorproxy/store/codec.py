"""Segments and steps as stored rows: a JSON text for the fields, raw bytes for the arrays.

Token arrays are never stored as JSON lists: a segment keeps its four arrays as
the bytes of the ``array`` objects (native byte order, 4 bytes a token id,
logprob and version, 1 byte a mask entry); a step packs its seven arrays into
one blob. The JSON a trainer reads is rebuilt from these on demand, by the
wire converter's hooks (:mod:`actorproxy.schema.records`): a segment row is read
back into a :class:`Segment`, a step row into a :class:`StoredStep` (its text
as written, its arrays unpacked), each only when a read takes it (:class:`Rows`).
"""

from __future__ import annotations

import json
import struct
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar, overload

import orjson

from ..core.records import Segment, Step, build_segment, float_array, int_array, version_array
from ..schema.converter import CONVERTER
from ..schema.records import StoredStep, segment_fields, segment_from, step_fields

_HEADER = struct.Struct("<cI")
R = TypeVar("R")


def dumps(data: Any) -> str:
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def fast_dumps(data: Any) -> str:
    """:func:`dumps` through orjson (about ten times faster): the same JSON values, not always the same text.

    Only for data without non-finite floats: orjson writes ``NaN`` and ``Infinity`` as
    ``null``. Floats may be spelled otherwise (``1e-7`` for ``1e-07``), which reads back
    as the same value. What orjson refuses (an integer past 64 bits, a key that is not a
    string, a lone surrogate) goes through :func:`dumps`, as before.
    """
    try:
        return orjson.dumps(data).decode()
    except TypeError:
        return dumps(data)


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


class Rows(Sequence[R]):
    """Stored rows, each decoded only when it is taken: iterated, one decoded row is alive at a time."""

    def __init__(self, rows: list[Any], decode: Callable[[Any], R]) -> None:
        self._rows = rows
        self._decode = decode

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> R: ...

    @overload
    def __getitem__(self, index: slice) -> list[R]: ...

    def __getitem__(self, index: int | slice) -> R | list[R]:
        if isinstance(index, slice):
            return [self._decode(row) for row in self._rows[index]]
        return self._decode(self._rows[index])

    def __iter__(self) -> Iterator[R]:
        return map(self._decode, self._rows)


def array_from(code: str, blob: bytes) -> array[Any]:
    values = array(code)
    values.frombytes(blob)
    return values


# -- segments ------------------------------------------------------------------


def segment_meta(seg: Segment) -> dict[str, Any]:
    """The segment's JSON without its four arrays (the row's text)."""
    return segment_fields(seg)


def segment_blobs(seg: Segment) -> tuple[bytes, bytes, bytes, bytes]:
    return (seg.token_ids.tobytes(), seg.loss_mask.tobytes(), seg.logprobs.tobytes(), _narrow(seg.versions).tobytes())


def _narrow(versions: array[int]) -> array[int]:
    """Versions as 32-bit integers when they fit (every store written before versions were 64-bit holds them
    so), else as they are (64-bit): a segment's blob is told apart by its length (:func:`decode_segment`), a
    step's names its typecode."""
    try:
        return array("i", versions)
    except OverflowError:
        return versions


def decode_segment(meta: dict[str, Any], blobs: tuple[bytes, bytes, bytes, bytes]) -> Segment:
    """The :class:`Segment` of a stored row (its derived counts are recomputed from the arrays)."""
    tokens, mask, logprobs, versions = blobs
    wide = len(versions) == 2 * len(tokens) > 0  # 8 bytes a token against the ids' 4 (_narrow)
    return segment_from(meta, array_from("i", tokens), array_from("b", mask), array_from("f", logprobs),
                        version_array(array_from("q" if wide else "i", versions)))


def segment_json(meta: dict[str, Any], blobs: tuple[bytes, bytes, bytes, bytes]) -> dict[str, Any]:
    """A stored row as the trainer reads the segment."""
    data: dict[str, Any] = CONVERTER.unstructure(decode_segment(meta, blobs))
    return data


def segment_bytes(seg: Segment) -> int:
    """What a segment costs in the store: its arrays plus a rough size of its fields."""
    return 13 * len(seg.token_ids) + 256


# -- steps -----------------------------------------------------------------------


def step_meta(step: Step) -> dict[str, Any]:
    """The step's JSON without the arrays (the row's text)."""
    return step_fields(step)


def journal_meta(step: Step) -> str:
    """The step's JSON text for the journal, which only recovery reads back (as values: ``json.loads``).

    Every float of a step's fields is a timestamp, except the logprobs of discarded
    attempts (``-inf`` is a logprob): a step with those goes through :func:`dumps`.
    """
    meta = step_meta(step)
    return dumps(meta) if step.discarded else fast_dumps(meta)


def step_blob(step: Step) -> bytes:
    mask, logprobs, versions = step.fragment_arrays()
    if mask.typecode != "b":
        mask = array("b", mask)
    return pack_arrays([step.fragment_ids, step.output_ids, step.output_logprobs, _narrow(step.output_versions), mask,
                        logprobs, _narrow(versions)])


def stored_step(meta: dict[str, Any], blob: bytes) -> StoredStep:
    """A stored step row, read back as written (its JSON adds the arrays)."""
    return StoredStep(meta, unpack_arrays(blob))


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
        sampling=meta.get("sampling"),
        output_ids=int_array(out),
        output_logprobs=float_array(out_lp),
        output_versions=version_array(out_ver),
        weight_version=str(meta.get("weight_version", "")),
        status=meta.get("status", "completed"),
        in_segment=bool(meta.get("in_segment", True)),
        boundary_reason=meta.get("boundary_reason"),
    )
    if meta.get("prefix_rebuilt"):
        step.fragment_mask, step.fragment_logprobs, step.fragment_versions = mask, frag_lp, version_array(frag_ver)
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
