"""What every trajectory store does, and the counters they share.

A store backend is plain synchronous code: the store actor
(:mod:`actorproxy.runtime.store`) calls it, inline for the memory store and in
one worker thread for the durable ones, and batches writes between commits.
A sub-agent's child session (``<session>/sub-<n>``) is kept with its parent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import attrs

from ..core.records import Segment, Step, sub_agent_of
from ..core.verify import VerifyFailure, VerifyReport
from ..errors import NotFound
from ..schema.records import Found as Found
from ..schema.records import ReadResult as ReadResult

T = TypeVar("T")

#: Segment-level counters reported by ``/trajectory/stats``.
_VERIFY_KINDS = ("segments_verified", "clean", "expected_only", "unexpected", "failed")
COUNTER_NAMES = (
    "segments_stored", "steps_stored", "segments_drained", "superseded_steps",
    "sub_agent_sessions", "sub_agent_segments", "sub_agent_steps", "side_call_segments",
    "recovered_sessions", "recovered_segments", "recovered_steps",
)


def session_key(session_id: str) -> str:
    """Where a session's data lives: with its parent for a sub-agent's child session."""
    parent = sub_agent_of(session_id)
    return parent[0] if parent is not None else session_id


def step_tokens(step: Step) -> int:
    return len(step.fragment_ids) + len(step.output_ids)


@attrs.frozen
class ReadQuery:
    """What a read asks for: a session's segments, one segment, or all (neither named); drained or not."""

    session_id: str | None = None
    trajectory_id: str | None = None
    drain: bool = False
    include_steps: bool = False

    @property
    def drains_all(self) -> bool:
        """A drain of the whole store (neither a session nor a segment named)."""
        return self.drain and self.session_id is None and self.trajectory_id is None

    def missing(self) -> NotFound:
        if self.session_id is not None:
            return NotFound(f"no finalized data for session {self.session_id!r}", param="session_id")
        return NotFound(f"no segment {self.trajectory_id!r}", param="trajectory_id")


#: The longest lease a trainer's drain or fetch may take, in seconds (every way a trainer takes data: the HTTP
#: drains, ``fetch_batch``, the Ray data pool): held data is never held for long.
LONGEST_LEASE = 3600.0
#: Leases a trainer may hold unacknowledged, at most, per keeper (another is refused).
MAX_LEASES = 64
#: Settled leases a keeper remembers, at most, how each ended (a repeated acknowledgement is answered as the first
#: was): the oldest is forgotten first.
REMEMBERED = 4096


@attrs.define(eq=False)
class Held:
    """What a drain read and delivers before it is deleted (:meth:`StoreBackend.hold`).

    Until :meth:`StoreBackend.drain_held` (its reply was sent whole) or :meth:`StoreBackend.release`
    (it was not), no other drain reads it, and it stays in the store: a trainer whose connection
    breaks before the reply ends loses nothing. ``segments`` and ``steps`` are the backend's own
    handles (rows, or the objects themselves).
    """

    query: ReadQuery
    only: str | None
    segments: list[Any]
    steps: list[Any]
    #: The sessions the read covered (a backend that needs them: memory).
    sessions: list[str] = attrs.field(factory=list)


class HeldDrains:
    """:meth:`StoreBackend.read`, ``hold``, ``drain_held`` and ``release`` over a backend's own ``_read`` (what a
    query reads, serialised by ``finish``, and what its drain deletes: nothing another drain holds), ``_drain``
    (delete that) and ``_hold`` (keep other drains from it, or no longer)."""

    def _read(self, query: ReadQuery, finish: Callable[[Found], T]) -> tuple[T, Held]:
        raise NotImplementedError

    def _drain(self, held: Held) -> None:
        raise NotImplementedError

    def _hold(self, held: Held, holding: bool) -> None:
        raise NotImplementedError

    def read(self, query: ReadQuery, finish: Callable[[Found], T]) -> T:
        done, held = self._read(query, finish)
        if query.drain:
            self._drain(held)
        return done

    def hold(self, query: ReadQuery, finish: Callable[[Found], T]) -> tuple[T, Held]:
        done, held = self._read(query, finish)
        self._hold(held, True)
        return done, held

    def drain_held(self, held: Held) -> None:
        self._hold(held, False)  # (a drain that fails leaves what it read for the next one)
        self._drain(held)

    def release(self, held: Held) -> None:
        self._hold(held, False)


@attrs.frozen
class Usage:
    tokens: int
    bytes: int


#: Per session: the next step and segment index a recovered session continues from.
Recovered = dict[str, tuple[int, int]]


class StoreBackend(Protocol):
    """Durable or not, a store keeps finalized segments and retired steps until they are read."""

    #: Run in a worker thread (it does I/O), else inline on the event loop.
    blocking: bool
    #: Keeps a journal (a crash can be recovered from): ``journal`` does something.
    journals: bool
    name: str

    def put(self, session_id: str, segments: tuple[Segment, ...], steps: tuple[Step, ...]) -> None: ...

    def journal(self, session_id: str, step: Step) -> None:
        """Keep a completed step of an open session until its session is flushed."""

    def commit(self) -> None:
        """Make every write so far durable (one transaction)."""

    def rollback(self) -> None:
        """Undo every write since the last commit, counters included (a failed commit is retried whole)."""

    def read(self, query: ReadQuery, finish: Callable[[Found], T]) -> T:
        """``finish(found)`` (serialise it); only if that succeeds, drain what was read.

        A durable store's rows are decoded as ``finish`` takes them, never all at once
        (:class:`~actorproxy.schema.records.StoredRead`). A drain reads nothing another
        drain holds (:meth:`hold`).
        """

    def hold(self, query: ReadQuery, finish: Callable[[Found], T]) -> tuple[T, Held]:
        """A drain's read as :meth:`read`, deleting nothing yet: what it read is held for :meth:`drain_held`."""

    def drain_held(self, held: Held) -> None:
        """Delete what ``held`` holds (its reply was delivered); the session goes too once nothing of it is left."""

    def release(self, held: Held) -> None:
        """Let go of ``held`` undeleted (its reply was not delivered): the next drain reads it again."""

    def knows(self, session_id: str) -> bool: ...

    def usage(self) -> Usage: ...

    def stats(self) -> dict[str, Any]: ...

    def recover(self) -> Recovered:
        """Rebuild what a crash left open (journaled steps); the sessions' next indexes."""

    def close(self) -> None: ...


class StoreCounters:
    """Counters by reason and kind, for ``/trajectory/stats``; kept as one JSON object by durable stores."""

    def __init__(self, saved: dict[str, Any] | None = None) -> None:
        saved = saved or {}
        self.counters: Counter[str] = Counter(saved.get("counters", {}))
        #: Segments by the reason they were closed (``finalize``, ``history_rewrite``, ...).
        self.closed_by: Counter[str] = Counter(saved.get("closed_by", {}))
        #: Broken append-only contracts by reason: new segments, plus prefixes rebuilt in place.
        self.boundaries: Counter[str] = Counter(saved.get("boundaries", {}))
        self.rebuilds: Counter[str] = Counter(saved.get("rebuilds", {}))
        self.verify: Counter[str] = Counter(saved.get("verify", {}))
        self.verify_kinds: Counter[str] = Counter(saved.get("verify_kinds", {}))
        #: Echoed replies matched although the client rewrote them, by rewrite (``reformatted``, ...).
        self.echo_tolerated: Counter[str] = Counter(saved.get("echo_tolerated", {}))

    def to_json(self) -> dict[str, Any]:
        return {
            "counters": dict(self.counters), "closed_by": dict(self.closed_by), "boundaries": dict(self.boundaries),
            "rebuilds": dict(self.rebuilds), "verify": dict(self.verify), "verify_kinds": dict(self.verify_kinds),
            "echo_tolerated": dict(self.echo_tolerated),
        }

    def count_put(self, session_id: str, segments: tuple[Segment, ...], steps: tuple[Step, ...]) -> None:
        self.counters["segments_stored"] += len(segments)
        self.counters["steps_stored"] += len(steps)
        self.counters["superseded_steps"] += sum(s.status == "superseded" for s in steps)
        if session_key(session_id) != session_id:
            self.counters["sub_agent_segments"] += len(segments)
            self.counters["sub_agent_steps"] += len(steps)
        for seg in segments:
            self.count_segment(seg)

    def count_segment(self, seg: Segment) -> None:
        self.closed_by[seg.boundary_reason] += 1
        if seg.start_reason != "session_start":
            self.boundaries[seg.start_reason] += 1
        for reason in seg.metadata.get("rebuilds", ()):
            self.rebuilds[reason] += 1
        self.echo_tolerated.update(seg.metadata.get("echo_tolerated", {}))
        if seg.metadata.get("side_call"):
            self.counters["side_call_segments"] += 1
        report = seg.metadata.get("verify")
        if isinstance(report, VerifyReport | VerifyFailure):
            self.verify["segments_verified"] += 1
            if isinstance(report, VerifyFailure):
                self.verify["failed"] += 1
            elif report.unexpected:
                self.verify["unexpected"] += 1
            elif report.expected:
                self.verify["expected_only"] += 1
            else:
                self.verify["clean"] += 1
            if isinstance(report, VerifyReport):
                self.verify_kinds.update(report.by_kind)

    def stats(self) -> dict[str, Any]:
        return {
            "boundaries": dict(self.boundaries),
            "rebuilds": dict(self.rebuilds),
            "closed_by": dict(self.closed_by),
            "echo_tolerated": dict(self.echo_tolerated),
            "verify": {**{k: self.verify[k] for k in _VERIFY_KINDS}, "by_kind": dict(self.verify_kinds)},
            **{k: self.counters[k] for k in COUNTER_NAMES},
        }
