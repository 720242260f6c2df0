"""The trajectory store actor: finalized segments (and their steps) until the trainer reads them.

A sub-agent's child session (``<session>/sub-<n>``) is kept with its parent:
reading the parent returns both, reading the child returns only its own.

It is bounded by a token budget: when finalized data would exceed it, the
oldest sessions are dropped whole and counted in ``dropped_sessions`` /
``dropped_tokens`` (a trainer that never drains must not take the proxy down).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

import attrs
import trio

from ..core.records import Segment, Step, sub_agent_of
from ..errors import NotFound
from .actor import Reply, answer, answer_error


@attrs.define(eq=False)
class _SessionData:
    segments: list[Segment] = attrs.field(factory=list)
    steps: list[Step] = attrs.field(factory=list)
    tokens: int = 0
    #: Sub-agent child sessions stored with this one.
    children: set[str] = attrs.field(factory=set)


def _key(session_id: str) -> str:
    """Where a session's data lives: with its parent for a sub-agent's child session."""
    parent = sub_agent_of(session_id)
    return parent[0] if parent is not None else session_id


#: Segment-level counters reported by ``/trajectory/stats``.
_VERIFY_KINDS = ("segments_verified", "clean", "expected_only", "unexpected", "failed")


@attrs.frozen
class Put:
    """Hand over closed segments and retired steps of a session (no reply)."""

    session_id: str
    segments: tuple[Segment, ...]
    steps: tuple[Step, ...] = ()


@attrs.frozen
class Read:
    session_id: str | None
    trajectory_id: str | None
    drain: bool
    include_steps: bool
    reply: Reply


@attrs.frozen
class Knows:
    session_id: str
    reply: Reply


@attrs.frozen
class Stats:
    reply: Reply


def _step_tokens(step: Step) -> int:
    return len(step.fragment_ids) + len(step.output_ids)


class TrajectoryStore:
    """Owns every finalized segment; reached only through its mailbox."""

    def __init__(self, *, max_tokens: int) -> None:
        self._max_tokens = max_tokens
        self._sessions: OrderedDict[str, _SessionData] = OrderedDict()
        self._tokens = 0
        self._counters: Counter[str] = Counter()
        #: Segments by the reason they were closed (``finalize``, ``history_rewrite``, ...).
        self._closed_by: Counter[str] = Counter()
        #: Broken append-only contracts by reason: new segments, plus prefixes rebuilt in place.
        self._boundaries: Counter[str] = Counter()
        self._rebuilds: Counter[str] = Counter()
        self._verify: Counter[str] = Counter()
        self._verify_kinds: Counter[str] = Counter()

    async def run(
        self, *, task_status: trio.TaskStatus[trio.MemorySendChannel[Any]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        send, inbox = trio.open_memory_channel[Any](64)
        task_status.started(send)
        async with inbox:
            async for msg in inbox:
                self.handle(msg)

    def handle(self, msg: Any) -> None:
        match msg:
            case Put():
                self._put(msg)
            case Read():
                try:
                    answer(msg.reply, self._read(msg))
                except NotFound as exc:
                    answer_error(msg.reply, exc)
            case Knows():
                answer(msg.reply, _key(msg.session_id) in self._sessions)
            case Stats():
                answer(msg.reply, self._stats())

    def _put(self, msg: Put) -> None:
        key = _key(msg.session_id)
        data = self._sessions.get(key)
        if data is None:
            data = self._sessions[key] = _SessionData()
        if key != msg.session_id and msg.session_id not in data.children:
            data.children.add(msg.session_id)
            self._counters["sub_agent_sessions"] += 1
        added = sum(s.num_tokens for s in msg.segments) + sum(_step_tokens(s) for s in msg.steps)
        data.segments.extend(msg.segments)
        data.steps.extend(msg.steps)
        data.tokens += added
        self._tokens += added
        self._counters["segments_stored"] += len(msg.segments)
        self._counters["steps_stored"] += len(msg.steps)
        self._counters["superseded_steps"] += sum(s.status == "superseded" for s in msg.steps)
        if key != msg.session_id:
            self._counters["sub_agent_segments"] += len(msg.segments)
            self._counters["sub_agent_steps"] += len(msg.steps)
        for seg in msg.segments:
            self._count_segment(seg)
        self._sessions.move_to_end(key)
        while self._tokens > self._max_tokens and len(self._sessions) > 1:
            _, dropped = self._sessions.popitem(last=False)
            self._tokens -= dropped.tokens
            self._counters["dropped_sessions"] += 1
            self._counters["dropped_segments"] += len(dropped.segments)
            self._counters["dropped_tokens"] += dropped.tokens

    def _count_segment(self, seg: Segment) -> None:
        self._closed_by[seg.boundary_reason] += 1
        if seg.start_reason != "session_start":
            self._boundaries[seg.start_reason] += 1
        for reason in seg.metadata.get("rebuilds", ()):
            self._rebuilds[reason] += 1
        report = seg.metadata.get("verify")
        if isinstance(report, dict):
            self._verify["segments_verified"] += 1
            if "error" in report:
                self._verify["failed"] += 1
            elif report.get("unexpected"):
                self._verify["unexpected"] += 1
            elif report.get("expected"):
                self._verify["expected_only"] += 1
            else:
                self._verify["clean"] += 1
            self._verify_kinds.update(report.get("by_kind", {}))

    def _read(self, msg: Read) -> dict[str, Any]:
        only: str | None = None  # a child session's own data only
        if msg.session_id is not None:
            key = _key(msg.session_id)
            data = self._sessions.get(key)
            if data is None or (key != msg.session_id and msg.session_id not in data.children):
                raise NotFound(f"no finalized data for session {msg.session_id!r}", param="session_id")
            ids = [key]
            only = msg.session_id if key != msg.session_id else None
        elif msg.trajectory_id is not None:
            session_id, _, _ = msg.trajectory_id.rpartition("#")
            data = self._sessions.get(_key(session_id))
            if data is None or not any(s.trajectory_id == msg.trajectory_id for s in data.segments):
                raise NotFound(f"no segment {msg.trajectory_id!r}", param="trajectory_id")
            ids = [_key(session_id)]
        else:
            ids = list(self._sessions)
        segments: list[dict[str, Any]] = []
        steps: list[dict[str, Any]] = []
        for key in ids:
            data = self._sessions[key]
            if msg.trajectory_id is not None:
                chosen = [s for s in data.segments if s.trajectory_id == msg.trajectory_id]
            elif only is not None:
                chosen = [s for s in data.segments if s.trajectory_id.startswith(only + "#")]
            else:
                chosen = list(data.segments)
            segments.extend(s.to_json() for s in chosen)
            if msg.include_steps:
                steps.extend(s.to_json() for s in data.steps if only is None or s.session_id == only)
            if msg.drain:
                self._drain(key, data, chosen, whole=msg.trajectory_id is None and only is None, only=only)
        result: dict[str, Any] = {"data": segments}
        if msg.include_steps:
            result["steps"] = steps
        return result

    def _drain(
        self, key: str, data: _SessionData, chosen: list[Segment], *, whole: bool, only: str | None
    ) -> None:
        if whole:
            del self._sessions[key]
            self._tokens -= data.tokens
        else:
            removed = sum(s.num_tokens for s in chosen)
            data.segments = [s for s in data.segments if s not in chosen]
            if only is not None:  # a child's steps go with its segments
                kept = [s for s in data.steps if s.session_id != only]
                removed += sum(_step_tokens(s) for s in data.steps if s.session_id == only)
                data.steps = kept
                data.children.discard(only)
            data.tokens -= removed
            self._tokens -= removed
        self._counters["segments_drained"] += len(chosen)

    def _stats(self) -> dict[str, Any]:
        return {
            "sessions": len(self._sessions),
            "segments": sum(len(d.segments) for d in self._sessions.values()),
            "steps": sum(len(d.steps) for d in self._sessions.values()),
            "tokens": self._tokens,
            "max_tokens": self._max_tokens,
            "boundaries": dict(self._boundaries),
            "rebuilds": dict(self._rebuilds),
            "closed_by": dict(self._closed_by),
            "verify": {**{k: self._verify[k] for k in _VERIFY_KINDS}, "by_kind": dict(self._verify_kinds)},
            **{k: self._counters[k] for k in (
                "segments_stored", "steps_stored", "segments_drained", "superseded_steps",
                "sub_agent_sessions", "sub_agent_segments", "sub_agent_steps",
                "dropped_sessions", "dropped_segments", "dropped_tokens",
            )},
        }
