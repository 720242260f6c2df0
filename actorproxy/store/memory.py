"""The memory store: everything in this process, gone when it exits (``--store memory``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from ..core.records import Segment, Step
from .base import Found, ReadQuery, ReadResult, Recovered, StoreCounters, Usage, session_key, step_tokens
from .codec import dumps, segment_bytes

T = TypeVar("T")


@attrs.define(eq=False)
class _SessionData:
    segments: list[Segment] = attrs.field(factory=list)
    steps: list[Step] = attrs.field(factory=list)
    tokens: int = 0
    bytes: int = 0
    #: Sub-agent child sessions stored with this one.
    children: set[str] = attrs.field(factory=set)


def _step_bytes(step: Step) -> int:
    return 13 * step_tokens(step) + len(dumps(step.new_messages)) + 512


class MemoryStore:
    """Finalized segments and retired steps in dicts; the journal is not kept (nothing survives a crash)."""

    blocking = False
    journals = False  # nothing survives the process anyway
    name = "memory"

    def __init__(self) -> None:
        self._sessions: OrderedDict[str, _SessionData] = OrderedDict()
        self._tokens = 0
        self._bytes = 0
        self._counts = StoreCounters()

    def put(self, session_id: str, segments: tuple[Segment, ...], steps: tuple[Step, ...]) -> None:
        key = session_key(session_id)
        data = self._sessions.get(key)
        if data is None:
            data = self._sessions[key] = _SessionData()
        if key != session_id and session_id not in data.children:
            data.children.add(session_id)
            self._counts.counters["sub_agent_sessions"] += 1
        tokens = sum(s.num_tokens for s in segments) + sum(step_tokens(s) for s in steps)
        size = sum(segment_bytes(s) for s in segments) + sum(_step_bytes(s) for s in steps)
        data.segments.extend(segments)
        data.steps.extend(steps)
        data.tokens += tokens
        data.bytes += size
        self._tokens += tokens
        self._bytes += size
        self._counts.count_put(session_id, segments, steps)
        self._sessions.move_to_end(key)

    def journal(self, session_id: str, step: Step) -> None:
        pass

    def commit(self) -> None:
        pass

    def rollback(self) -> None:
        pass  # nothing can fail half-way in memory

    def read(self, query: ReadQuery, finish: Callable[[Found], T]) -> T:
        only: str | None = None  # a child session's own data only
        if query.session_id is not None:
            key = session_key(query.session_id)
            data = self._sessions.get(key)
            if data is None or (key != query.session_id and query.session_id not in data.children):
                raise query.missing()
            keys = [key]
            only = query.session_id if key != query.session_id else None
        elif query.trajectory_id is not None:
            key = session_key(query.trajectory_id.rpartition("#")[0])
            data = self._sessions.get(key)
            if data is None or not any(s.trajectory_id == query.trajectory_id for s in data.segments):
                raise query.missing()
            keys = [key]
        else:
            keys = list(self._sessions)
        segments: list[Segment] = []
        steps: list[Step] = []
        chosen_by_key: list[tuple[str, list[Segment]]] = []
        for key in keys:
            data = self._sessions[key]
            if query.trajectory_id is not None:
                chosen = [s for s in data.segments if s.trajectory_id == query.trajectory_id]
            elif only is not None:
                chosen = [s for s in data.segments if s.trajectory_id.startswith(only + "#")]
            else:
                chosen = list(data.segments)
            segments.extend(chosen)
            if query.include_steps:
                steps.extend(s for s in data.steps if only is None or s.session_id == only)
            chosen_by_key.append((key, chosen))
        # Serialise first: a failure here deletes nothing.
        done = finish(ReadResult(segments, list(steps) if query.include_steps else None))
        if query.drain:
            whole = query.trajectory_id is None and only is None
            for key, chosen in chosen_by_key:
                self._drain(key, chosen, whole=whole, only=only)
        return done

    def _drain(self, key: str, chosen: list[Segment], *, whole: bool, only: str | None) -> None:
        data = self._sessions[key]
        if whole:
            del self._sessions[key]
            self._tokens -= data.tokens
            self._bytes -= data.bytes
        else:
            gone = {id(s) for s in chosen}
            tokens = sum(s.num_tokens for s in chosen)
            size = sum(segment_bytes(s) for s in chosen)
            data.segments = [s for s in data.segments if id(s) not in gone]
            if only is not None:  # a child's steps go with its segments
                leaving = [s for s in data.steps if s.session_id == only]
                data.steps = [s for s in data.steps if s.session_id != only]
                tokens += sum(step_tokens(s) for s in leaving)
                size += sum(_step_bytes(s) for s in leaving)
                data.children.discard(only)
            data.tokens -= tokens
            data.bytes -= size
            self._tokens -= tokens
            self._bytes -= size
        self._counts.counters["segments_drained"] += len(chosen)

    def knows(self, session_id: str) -> bool:
        return session_key(session_id) in self._sessions

    def usage(self) -> Usage:
        return Usage(self._tokens, self._bytes)

    def stats(self) -> dict[str, Any]:
        return {
            "store": self.name,
            "sessions": len(self._sessions),
            "segments": sum(len(d.segments) for d in self._sessions.values()),
            "steps": sum(len(d.steps) for d in self._sessions.values()),
            "tokens": self._tokens,
            "bytes": self._bytes,
            "journal_steps": 0,
            **self._counts.stats(),
        }

    def recover(self) -> Recovered:
        return {}

    def close(self) -> None:
        pass
