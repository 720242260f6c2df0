"""What the trajectory store actor understands: its messages, its gauge and the answers it gives.

The ingress reads :class:`StoreGauge` without a message to refuse new turns
while the store is full or its disk fails (507 + ``Retry-After``); sessions and
the runtime send the messages; :mod:`actorproxy.runtime.store` answers them.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable
from typing import Any

import attrs
import orjson
import outcome
import trio

from ..core.records import Segment, Step
from ..errors import ProxyError, StorageFull, release
from ..schema.converter import CONVERTER
from ..schema.records import Found, ReadResult, StoredRead, StoredStep, segment_json, step_json, stored_step_json
from ..store.base import Held, ReadQuery
from .actor import ActorGone, Reply, answer, answer_error

log = logging.getLogger("actorproxy.runtime.store")

#: Seconds a full store asks turns to wait before retrying.
FULL_RETRY_AFTER = 10.0
#: While failed: the first and the longest wait between attempts to commit what is kept in memory.
FAILED_RETRY = 1.0
FAILED_RETRY_MAX = 10.0


@attrs.frozen
class Put:
    """Hand over closed segments and retired steps of a session; ``reply`` answers once committed."""

    session_id: str
    segments: tuple[Segment, ...]
    steps: tuple[Step, ...] = ()
    reply: Reply | None = None


@attrs.frozen
class Journal:
    """A completed step of an open session (kept until its session is flushed; no reply)."""

    session_id: str
    step: Step


@attrs.frozen
class Wake:
    """Steps were journaled (:meth:`TrajectoryStore.journal`): a batch should take them (no reply)."""


@attrs.frozen
class Read:
    query: ReadQuery
    reply: Reply
    #: Answer with the JSON body (bytes), serialised before anything is drained.
    encode: bool = False
    #: A drain that deletes nothing yet: answered ``(answer, held)``, what it read held for :class:`Settle`.
    hold: bool = False


@attrs.frozen
class Settle:
    """Held drains' reply was sent whole (``delivered``: delete what they read), or not (let it go, undeleted)."""

    held: tuple[Held, ...]
    delivered: bool
    reply: Reply | None = None


@attrs.frozen
class Knows:
    session_id: str
    reply: Reply


@attrs.frozen
class Stats:
    reply: Reply


@attrs.frozen
class Close:
    """Commit, close the backend and stop (the last message at shutdown)."""

    reply: Reply


#: Everything the trajectory store's mailbox carries.
StoreMessage = Put | Journal | Wake | Read | Settle | Knows | Stats | Close


@attrs.define
class StoreGauge:
    """Read by the ingress without a message: does the store refuse new turns (full, or its disk fails)?"""

    full: bool = False
    reason: str = ""
    refused: int = 0
    #: Set while the disk fails (what failed); new turns are refused until a commit succeeds again.
    failure: str = ""
    #: Seconds until the failed store tries its disk again (the refusal's ``Retry-After``).
    retry_after: float = FAILED_RETRY
    _last_log: float = 0.0

    def refusal(self) -> StorageFull | None:
        """The error a new turn gets now, if any (counted, and logged at most every 10 s)."""
        if self.failure:
            error = StorageFull(
                f"the trajectory store cannot write to its disk ({self.failure}): new turns are refused until it "
                "can; nothing recorded was lost (what is not yet committed is kept in memory)",
                code="store_failed",
            )
            error.retry_after = self.retry_after
        elif self.full:
            error = StorageFull(
                f"the trajectory store is full ({self.reason}): a trainer must read (drain) it before new turns "
                "are taken; nothing recorded was dropped",
                code="store_full",
            )
            error.retry_after = FULL_RETRY_AFTER
        else:
            return None
        self.refuse()
        return error

    def refuse(self) -> None:
        """Count a refused turn; log loudly (at most every 10 s)."""
        self.refused += 1
        now = time.monotonic()
        if now - self._last_log > 10.0:
            self._last_log = now
            if self.failure:
                log.error("store failed (%s): refusing new turns (%d so far) until its disk works again",
                          self.failure, self.refused)
            else:
                log.warning("store full (%s): refusing new turns (%d so far); drain /trajectory/read", self.reason,
                            self.refused)


#: A read's reply is sent in parts of about this many bytes, each freed once it is sent.
PART_BYTES = 1 << 20


def encode_parts(result: Found) -> list[bytes]:
    """A read's JSON body (:func:`encode_body`'s bytes, joined) in parts of about :data:`PART_BYTES`.

    Each segment and step is unstructured and encoded on its own: the whole body is
    never held as Python objects (every array a list of numbers: eight times its JSON),
    and a durable store's rows are decoded one by one as they are encoded
    (:class:`~actorproxy.schema.records.StoredRead`): one row is alive at a time.
    Text that is not valid Unicode (a lone surrogate) is escaped, in the whole body.
    """
    try:
        return _parts(result, orjson.dumps)
    except TypeError:  # orjson refuses str that is not valid UTF-8 (a lone surrogate): escape it instead
        return _parts(result, _escaped)


def _escaped(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _parts(result: Found, dumps: Callable[[Any], bytes]) -> list[bytes]:
    parts: list[bytes] = []
    pending: list[bytes] = [b'{"data":[']
    size = 0

    def add(piece: bytes) -> None:
        nonlocal size
        pending.append(piece)
        size += len(piece)
        if size >= PART_BYTES:
            parts.append(b"".join(pending))
            pending.clear()
            size = 0

    for i, segment in enumerate(result.data):
        add(b"," + dumps(segment_json(segment)) if i else dumps(segment_json(segment)))
    pending.append(b"]")
    if result.steps is not None:
        pending.append(b',"steps":[')
        for i, step in enumerate(result.steps):
            encoded = dumps(step_json(step) if isinstance(step, Step) else stored_step_json(step))
            add(b"," + encoded if i else encoded)
        pending.append(b"]")
    pending.append(b"}")
    parts.append(b"".join(pending))
    return parts


def encode_body(result: Any) -> bytes:
    """A reply (a read's :class:`ReadResult`) as its JSON body, by the wire converter.

    Text that is not valid Unicode (a lone surrogate) is escaped, never fatal.
    """
    data = CONVERTER.unstructure(result)
    try:
        return orjson.dumps(data)
    except TypeError:  # orjson refuses str that is not valid UTF-8 (a lone surrogate): escape it instead
        return json.dumps(data, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def refuse_queued(inbox: trio.MemoryReceiveChannel[StoreMessage]) -> None:
    """Questions still queued once the store stopped: tell their askers it is gone (never leave them waiting)."""
    while True:
        try:
            msg = inbox.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return
        reply = None if isinstance(msg, Journal | Wake) else msg.reply
        if reply is not None:
            answer_error(reply, ActorGone("the trajectory store has stopped"))


def keep(found: Found) -> ReadResult:
    """An in-process read's answer: the records themselves, in lists (a durable store's rows all decoded)."""
    if isinstance(found, StoredRead):
        steps: list[Step | StoredStep] | None = None if found.steps is None else [*found.steps]
        return ReadResult(list(found.data), steps)
    return found


WRITES = (Put, Journal, Wake)


def answer_outcome(reply: Reply, result: outcome.Outcome[Any]) -> None:
    if isinstance(result, outcome.Value):
        answer(reply, result.value)
    elif isinstance(result, outcome.Error):
        answer_error(reply, result.error)


def capture(fn: Callable[..., Any], *args: Any) -> outcome.Outcome[Any]:
    """``fn(*args)``'s outcome; a disk error (not the caller's fault) becomes a 507 ``store_failed``."""
    result: outcome.Outcome[Any] = outcome.capture(fn, *args)
    if isinstance(result, outcome.Error) and isinstance(result.error, sqlite3.Error | OSError):
        log.error("the trajectory store failed to read: %s", result.error)
        release(result.error)  # (logged by its message: its traceback would make the cycle below)
        error = StorageFull(f"the trajectory store could not read its disk ({type(result.error).__name__}: "
                            f"{result.error}); retry later", code="store_failed")
        error.retry_after = FAILED_RETRY
        return outcome.Error(error)
    if isinstance(result, outcome.Error) and isinstance(result.error, ProxyError):
        # An answer (a 404): its traceback holds the frames that called the read, and each keeps the one that
        # called it; this frame, which keeps the outcome, among them: a reference cycle.
        release(result.error)
    return result
