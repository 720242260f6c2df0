"""The trajectory store actor: finalized segments (and their steps) until the trainer reads them.

It is bounded by a token budget: when finalized data would exceed it, the
oldest sessions are dropped whole and counted in ``dropped_sessions`` /
``dropped_tokens`` (a trainer that never drains must not take the proxy down).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

import attrs
import trio

from ..core.records import Segment, Step
from ..errors import NotFound
from .actor import Reply, answer, answer_error


@attrs.define(eq=False)
class _SessionData:
    segments: list[Segment] = attrs.field(factory=list)
    steps: list[Step] = attrs.field(factory=list)
    tokens: int = 0


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
        self._boundaries: Counter[str] = Counter()

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
                answer(msg.reply, msg.session_id in self._sessions)
            case Stats():
                answer(msg.reply, self._stats())

    def _put(self, msg: Put) -> None:
        data = self._sessions.get(msg.session_id)
        if data is None:
            data = self._sessions[msg.session_id] = _SessionData()
        added = sum(s.num_tokens for s in msg.segments) + sum(_step_tokens(s) for s in msg.steps)
        data.segments.extend(msg.segments)
        data.steps.extend(msg.steps)
        data.tokens += added
        self._tokens += added
        self._counters["segments_stored"] += len(msg.segments)
        self._counters["steps_stored"] += len(msg.steps)
        for seg in msg.segments:
            self._boundaries[seg.boundary_reason] += 1
        self._sessions.move_to_end(msg.session_id)
        while self._tokens > self._max_tokens and len(self._sessions) > 1:
            _, dropped = self._sessions.popitem(last=False)
            self._tokens -= dropped.tokens
            self._counters["dropped_sessions"] += 1
            self._counters["dropped_segments"] += len(dropped.segments)
            self._counters["dropped_tokens"] += dropped.tokens

    def _read(self, msg: Read) -> dict[str, Any]:
        if msg.session_id is not None:
            if msg.session_id not in self._sessions:
                raise NotFound(f"no finalized data for session {msg.session_id!r}", param="session_id")
            ids = [msg.session_id]
        elif msg.trajectory_id is not None:
            session_id, _, _ = msg.trajectory_id.rpartition("#")
            data = self._sessions.get(session_id)
            if data is None or not any(s.trajectory_id == msg.trajectory_id for s in data.segments):
                raise NotFound(f"no segment {msg.trajectory_id!r}", param="trajectory_id")
            ids = [session_id]
        else:
            ids = list(self._sessions)
        segments: list[dict[str, Any]] = []
        steps: list[dict[str, Any]] = []
        for session_id in ids:
            data = self._sessions[session_id]
            chosen = [
                s for s in data.segments if msg.trajectory_id is None or s.trajectory_id == msg.trajectory_id
            ]
            segments.extend(s.to_json() for s in chosen)
            if msg.include_steps:
                steps.extend(s.to_json() for s in data.steps)
            if msg.drain:
                self._drain(session_id, data, chosen, whole=msg.trajectory_id is None)
        result: dict[str, Any] = {"data": segments}
        if msg.include_steps:
            result["steps"] = steps
        return result

    def _drain(self, session_id: str, data: _SessionData, chosen: list[Segment], *, whole: bool) -> None:
        if whole:
            del self._sessions[session_id]
            self._tokens -= data.tokens
        else:
            removed = sum(s.num_tokens for s in chosen)
            data.segments = [s for s in data.segments if s not in chosen]
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
            **{k: self._counters[k] for k in (
                "segments_stored", "steps_stored", "segments_drained",
                "dropped_sessions", "dropped_segments", "dropped_tokens",
            )},
        }
