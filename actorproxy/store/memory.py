"""The memory store: everything in this process, gone when it exits (``--store memory``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import attrs

from ..core.records import Segment, Step
from .base import (
    Found,
    Held,
    HeldDrains,
    ReadQuery,
    ReadResult,
    Recovered,
    StoreCounters,
    Usage,
    session_key,
    step_tokens,
)
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


class MemoryStore(HeldDrains):
    """Finalized segments and retired steps in dicts; the journal is not kept (nothing survives a crash)."""

    blocking = False
    journals = False  # nothing survives the process anyway
    name = "memory"

    def __init__(self) -> None:
        self._sessions: OrderedDict[str, _SessionData] = OrderedDict()
        self._tokens = 0
        self._bytes = 0
        self._counts = StoreCounters()
        #: What drains hold while their replies are sent (:meth:`hold`): the segments' and steps' ``id``.
        self._held: set[int] = set()

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

    def _hold(self, held: Held, holding: bool) -> None:
        ids = [id(item) for _, item in held.segments] + [id(item) for _, item in held.steps]
        if holding:
            self._held.update(ids)
        else:
            self._held.difference_update(ids)

    def _read(self, query: ReadQuery, finish: Callable[[Found], T]) -> tuple[T, Held]:
        """``finish`` of what ``query`` reads, and what a drain of it deletes (nothing another drain holds)."""
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
        whole = query.trajectory_id is None and only is None
        held = self._held if query.drain else set()  # (another drain delivers those)
        segments: list[Segment] = []
        steps: list[Step] = []
        drained = Held(query, only, [], [], keys)
        for key in keys:
            data = self._sessions[key]
            if query.trajectory_id is not None:
                chosen = [s for s in data.segments if s.trajectory_id == query.trajectory_id]
            elif only is not None:
                chosen = [s for s in data.segments if s.trajectory_id.startswith(only + "#")]
            else:
                chosen = list(data.segments)
            if held:
                chosen = [s for s in chosen if id(s) not in held]
            segments.extend(chosen)
            drained.segments.extend((key, s) for s in chosen)
            if query.include_steps or (query.drain and (whole or only)):
                kept = [s for s in data.steps if (only is None or s.session_id == only) and id(s) not in held]
                if query.include_steps:
                    steps.extend(kept)
                if whole or only:  # a child's steps go with its segments
                    drained.steps.extend((key, s) for s in kept)
        # Serialise first: a failure here deletes nothing.
        done = finish(ReadResult(segments, list(steps) if query.include_steps else None))
        return done, drained

    def _drain(self, held: Held) -> None:
        """Delete what ``held`` holds; a session goes once nothing of it is left (a child: from its parent's list)."""
        gone = {id(item) for _, item in held.segments} | {id(item) for _, item in held.steps}
        query, only = held.query, held.only
        for key in held.sessions:
            data = self._sessions.get(key)
            if data is None:
                continue
            tokens = sum(s.num_tokens for s in data.segments if id(s) in gone)
            tokens += sum(step_tokens(s) for s in data.steps if id(s) in gone)
            size = sum(segment_bytes(s) for s in data.segments if id(s) in gone)
            size += sum(_step_bytes(s) for s in data.steps if id(s) in gone)
            data.segments = [s for s in data.segments if id(s) not in gone]
            data.steps = [s for s in data.steps if id(s) not in gone]
            data.tokens -= tokens
            data.bytes -= size
            self._tokens -= tokens
            self._bytes -= size
            if query.trajectory_id is None:
                if only is not None:
                    data.children.discard(only)
                elif not data.segments and not data.steps:
                    del self._sessions[key]
        self._counts.counters["segments_drained"] += len(held.segments)

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
