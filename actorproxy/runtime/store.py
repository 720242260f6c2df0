"""The trajectory store actor: the one owner of the store backend (memory, SQLite or Ray).

A sub-agent's child session (``<session>/sub-<n>``) is kept with its parent:
reading the parent returns both, reading the child returns only its own.

Writes are batched: a ``Put`` or ``Journal`` waits at most ``batch_delay``
seconds for others before one commit makes them all durable, and a ``Put`` that
carries a reply (a finalize) is answered only once it is committed. A durable
backend runs in one worker thread (a limiter of one writer), so the event loop
never waits for the disk. Reads are ordered after the writes before them.

A completed turn's step is journaled by a method call (:meth:`TrajectoryStore.journal`),
not a message: it joins a list the next batch takes first, and only the first step
of a batch wakes the store (one scheduler round per batch, not per turn). A batch
takes the list when it runs, so every step journaled before a message in the batch
is written before it (a finalize's ``Put`` removes the steps it carries from the
journal: they must be there first).

Nothing is dropped: once the data not yet read reaches ``max_tokens`` or
``max_bytes``, :attr:`StoreGauge.full` is set and new turns are refused
(507 + ``Retry-After``) until a trainer drains it; every refusal is counted.

A failing disk (full, read-only, I/O errors) is bounded and loud: a batch that
cannot be committed is retried ``COMMIT_ATTEMPTS`` times with a doubling
backoff; then the store is *failed*: new turns are refused (507
``store_failed`` + ``Retry-After``), the writes not committed are kept in memory
in order (bounded: no new turn is taken meanwhile) and tried again every few
seconds, a finalize waiting for them is told to retry, and ``/health`` and
``/metrics`` show it. The first commit that succeeds writes them all and the
store takes turns again.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import outcome
import trio

from ..core.records import Segment, Step
from ..errors import StorageFull
from ..schema.records import segment_fields
from ..store.base import Found, ReadQuery, Recovered, StoreBackend, session_key
from .actor import Reply, answer, answer_error
from .store_messages import (
    FAILED_RETRY,
    FAILED_RETRY_MAX,
    FULL_RETRY_AFTER,
    WRITES,
    Close,
    Journal,
    Knows,
    Put,
    Read,
    Settle,
    Stats,
    StoreGauge,
    StoreMessage,
    Wake,
    answer_outcome,
    capture,
    encode_body,
    encode_parts,
    keep,
    refuse_queued,
)

__all__ = [
    "BATCH_DELAY", "FULL_RETRY_AFTER", "Close", "Journal", "Knows", "Put", "Read", "Settle", "Stats", "StoreGauge",
    "StoreMessage",
    "TrajectoryStore", "encode_body", "encode_parts",
]

log = logging.getLogger(__name__)

#: Seconds a write waits for more writes before the batch is committed.
BATCH_DELAY = 0.05
_MAX_BATCH = 512
#: Seconds a closing store (shutdown) still tries to hand its last segments to the data pool.
FINAL_FORWARD = 10.0
#: Attempts to commit a batch before the store is declared failed, the first wait between them (doubled each time).
COMMIT_ATTEMPTS = 4
FIRST_RETRY = 0.1


class TrajectoryStore:
    """Owns the store backend; reached only through its mailbox."""

    def __init__(
        self,
        backend: StoreBackend,
        *,
        max_tokens: int | None = None,
        max_bytes: int | None = None,
        batch_delay: float = BATCH_DELAY,
        encode: Callable[[Found], list[bytes]] | None = None,
    ) -> None:
        self.backend = backend
        self.gauge = StoreGauge()
        self._max_tokens = max_tokens
        self._max_bytes = max_bytes
        self._delay = batch_delay
        self._encode = encode
        self._limiter = trio.CapacityLimiter(1)
        #: The last segments handed to the store, summarised (for the dashboard; bounded).
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT_SEGMENTS)
        self.closed = False
        #: Set when segments were committed (and at start): the forwarder has work.
        self._outbox_ready = trio.Event()
        self._outbox_ready.set()
        #: The batch being applied: its first message not yet committed, and the answers so far by index.
        self._done = 0
        self._answers: dict[int, tuple[Reply, outcome.Outcome[Any]]] = {}
        #: While the disk fails: the writes not committed, in order (their finalizes were told to retry).
        self._pending: list[Put | Journal] = []
        self._next_retry = 0.0
        self._failures: Counter[str] = Counter()
        #: Steps journaled since the last batch (``journal``), and the mailbox to wake the store with.
        self._journals: list[Journal] = []
        self._wake: trio.MemorySendChannel[StoreMessage] | None = None
        self._woken = False
        #: A read of this batch that failed on the disk (set in the writer thread, handled by the actor).
        self._read_failure: str = ""
        #: Why the store could not close cleanly (shutdown): data lost, or the file not closed. Empty: clean.
        self.close_failure: str = ""

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run backend work: in the writer thread for a durable backend, inline otherwise."""
        if not self.backend.blocking:
            return fn(*args)
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    def journal(self, session_id: str, step: Step) -> None:
        """Journal a completed step of an open session: written with the next batch, within ``batch_delay``.

        Never blocks and never waits for a scheduler round; only the first step
        after a batch wakes the store. A backend without a journal (memory) is not told.
        """
        if self.closed:
            raise trio.ClosedResourceError("the trajectory store has stopped")
        if not self.backend.journals:
            return
        self._journals.append(Journal(session_id, step))
        if not self._woken and self._wake is not None:
            try:
                self._wake.send_nowait(Wake())
                self._woken = True
            except trio.WouldBlock:
                pass  # a full mailbox: the store is busy, and each batch takes the journal list anyway

    def _take_journals(self) -> list[Journal]:
        journals, self._journals, self._woken = self._journals, [], False
        return journals

    async def recover(self) -> Recovered:
        recovered: Recovered = await self.call(self.backend.recover)
        self._update_gauge()
        return recovered

    async def run(
        self, *, task_status: trio.TaskStatus[trio.MemorySendChannel[StoreMessage]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        send, inbox = trio.open_memory_channel[StoreMessage](256)
        self._wake = send.clone()
        task_status.started(send)
        try:
            async with inbox, trio.open_nursery() as nursery:
                if hasattr(self.backend, "outbox"):
                    nursery.start_soon(self._forward_forever)
                while not self.closed:
                    try:
                        with trio.move_on_at(self._next_retry if self._pending else math.inf):
                            batch = [await inbox.receive()]
                            await self._gather(inbox, batch)
                            if self._pending and trio.current_time() >= self._next_retry:
                                await self._retry_pending()  # due: the disk may work again
                            await self._execute(batch)
                            continue
                    except trio.EndOfChannel:
                        break
                    await self._retry_pending()  # the disk fails and nothing came for a while: try it again
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._close()
            refuse_queued(inbox)

    # -- forwarding to a data pool (--store ray) -------------------------------------

    async def _forward_forever(self) -> None:
        """Send committed segments to the pool; each leaves the local file only once acknowledged."""
        while True:
            await self._outbox_ready.wait()
            self._outbox_ready = trio.Event()
            await self._forward_outbox()

    async def _forward_outbox(self) -> None:
        backend: Any = self.backend
        delay = 0.1
        while True:
            try:
                batch = await self.call(backend.outbox)
                if not batch:
                    return
                await trio.to_thread.run_sync(backend.send, [p for _, p in batch], abandon_on_cancel=True)
                await self.call(backend.acknowledged, [seq for seq, _ in batch])
                delay = 0.1
            except Exception as exc:  # Ray down or slow, or the disk fails: keep the segments, retry with backoff
                log.warning("data pool forwarding failed (%s); the segments are kept locally, retrying in %.1f s",
                            exc, delay)
                await self.call(backend.failed)
                await trio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _gather(self, inbox: trio.MemoryReceiveChannel[StoreMessage], batch: list[StoreMessage]) -> None:
        """Take what is queued; while there are only writes nobody waits for, wait up to ``batch_delay``."""
        while len(batch) < _MAX_BATCH:
            try:
                batch.append(inbox.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        if not self.backend.blocking or self._pending or not all(
                isinstance(m, Journal | Wake) or (isinstance(m, Put) and m.reply is None) for m in batch):
            return
        with trio.move_on_after(self._delay):
            while len(batch) < _MAX_BATCH:
                try:
                    msg = await inbox.receive()
                except trio.EndOfChannel:
                    return
                batch.append(msg)
                if not isinstance(msg, WRITES) or (isinstance(msg, Put) and msg.reply is not None):
                    return

    # -- applying a batch: commit, retry a few times, else keep it in memory (failed) --------

    async def _execute(self, batch: list[StoreMessage]) -> None:
        """Run the batch in order (one thread hop), commit, then answer."""
        journals = self._take_journals()
        if journals:  # journaled before every message here was received: written first
            batch = [*journals, *(m for m in batch if not isinstance(m, Wake))]
        self._done, self._answers = 0, {}
        if not self._pending:
            for attempt in range(COMMIT_ATTEMPTS):
                try:
                    await self.call(self._apply, batch)
                    break
                except Exception as exc:  # the disk fails: the uncommitted part was undone; retry it
                    self._failures["commit_failures"] += 1
                    if attempt + 1 == COMMIT_ATTEMPTS:
                        self._fail(exc)
                        break
                    wait = FIRST_RETRY * 2**attempt
                    log.warning("the trajectory store could not commit (%s); attempt %d of %d in %.1f s", exc,
                                attempt + 2, COMMIT_ATTEMPTS, wait)
                    await trio.sleep(wait)
        committed, rest = batch[: self._done], batch[self._done:]
        self._committed(committed)
        for i, (reply, result) in self._answers.items():
            if i < self._done:
                answer_outcome(reply, result)
        wrote = any(isinstance(m, Put | Journal) or (isinstance(m, Read) and m.query.drain and not m.hold)
                    or (isinstance(m, Settle) and m.delivered) for m in committed)
        if not self._read_failed() and wrote and not rest and not self._pending:
            self._disk_works()
        for msg in rest:  # failed: the writes are kept in memory, the questions answered without the disk
            await self._without_disk(msg)
        if any(isinstance(m, Close) for m in batch):
            await self._close()
            for msg in batch:
                if isinstance(msg, Close):
                    answer(msg.reply, True)

    def _apply(self, batch: list[StoreMessage]) -> None:
        """Apply ``batch[self._done:]`` and commit; ``self._done`` moves past each commit (a retry resumes there).

        On an error the uncommitted part is rolled back before the writer thread is let go.
        """
        try:
            self._apply_all(batch)
        except BaseException:
            self.backend.rollback()
            raise

    def _apply_all(self, batch: list[StoreMessage]) -> None:
        backend = self.backend
        for i in range(self._done, len(batch)):
            match batch[i]:
                case Put() as msg:
                    backend.put(msg.session_id, msg.segments, msg.steps)
                case Journal() as msg:
                    backend.journal(msg.session_id, msg.step)
                case Wake():
                    pass
                case Read() as msg:
                    backend.commit()  # what came before is durable, and never applied twice
                    finish = (self._encode or encode_parts) if msg.encode else keep
                    self._answers[i] = (msg.reply, self._read(msg.query, finish, msg.hold))
                    self._done = i + 1  # a drain commits (or rolls back) on its own
                case Settle() as msg:
                    backend.commit()
                    settled = self._settle(msg)
                    if msg.reply is not None:
                        self._answers[i] = (msg.reply, settled)
                    self._done = i + 1  # (as a drain)
                case Knows() as msg:
                    self._answers[i] = (msg.reply, capture(backend.knows, msg.session_id))
                case Stats() as msg:
                    self._answers[i] = (msg.reply, outcome.capture(self._stats))
        backend.commit()
        self._done = len(batch)

    def _read(self, query: ReadQuery, finish: Callable[[Found], Any], hold: bool = False) -> outcome.Outcome[Any]:
        """A read (in the writer thread); one that fails on the disk is noted for :meth:`_read_failed`.

        ``hold``: a drain that deletes nothing yet (``backend.hold``: answered with what it holds).
        """
        return self._noted(capture(self.backend.hold if hold else self.backend.read, query, finish))

    def _settle(self, msg: Settle) -> outcome.Outcome[Any]:
        """Held drains settled (in the writer thread): what they read deleted, or let go of.

        All are let go of first: one whose delete fails leaves what it read to the next drain."""
        backend = self.backend
        for held in msg.held:
            backend.release(held)

        def drain_all() -> None:
            for held in msg.held:
                backend.drain_held(held)

        return self._noted(capture(drain_all if msg.delivered else lambda: None))

    def _noted(self, result: outcome.Outcome[Any]) -> outcome.Outcome[Any]:
        """``result``; one that failed on the disk is noted for :meth:`_read_failed`."""
        if isinstance(result, outcome.Error) and getattr(result.error, "code", "") == "store_failed":
            self._read_failure = str(result.error)
        return result

    def _read_failed(self) -> bool:
        """A read failed on the disk (a drain on a full disk with no room left): the store is failed, loudly."""
        failure, self._read_failure = self._read_failure, ""
        if not failure:
            return False
        if not self.gauge.failure and not self._pending:
            self._failures["store_failures"] += 1
        self.gauge.failure, self.gauge.retry_after = failure, FAILED_RETRY
        log.critical(
            "THE TRAJECTORY STORE FAILED: a read could not run on its disk (%s). New turns are refused (507 "
            "store_failed) until a write or a drain works again; free space or fix %s", failure,
            getattr(self.backend, "path", "the disk"))
        return True

    def _disk_works(self) -> None:
        """Everything asked of the disk worked: a store failed (with nothing kept in memory) works again."""
        if self.gauge.failure:
            log.warning("the trajectory store can write again (%s is over); new turns are taken again",
                        self.gauge.failure)
            self.gauge.failure, self.gauge.retry_after = "", FAILED_RETRY

    def _committed(self, writes: Sequence[StoreMessage]) -> None:
        """Writes just committed: answer their finalizes, note their segments, wake the forwarder."""
        puts = [m for m in writes if isinstance(m, Put)]
        for msg in puts:
            self._recent.extend(_summary(seg) for seg in msg.segments)
            if msg.reply is not None:
                answer(msg.reply, True)
        self._update_gauge()
        if any(m.segments for m in puts):
            self._outbox_ready.set()

    def _fail(self, exc: Exception) -> None:
        if not self._pending:
            self._failures["store_failures"] += 1
            self._next_retry = trio.current_time() + FAILED_RETRY
        self.gauge.failure, self.gauge.retry_after = f"{type(exc).__name__}: {exc}", FAILED_RETRY
        log.critical(
            "THE TRAJECTORY STORE FAILED: it could not commit after %d attempts (%s). New turns are refused "
            "(507 store_failed) and the writes not committed are kept in memory until the disk works again; "
            "free space or fix %s", COMMIT_ATTEMPTS, self.gauge.failure, getattr(self.backend, "path", "the disk"))

    async def _without_disk(self, msg: StoreMessage) -> None:
        """A message while the store is failed."""
        match msg:
            case Put() | Journal():
                if isinstance(msg, Put) and msg.reply is not None:
                    answer_error(msg.reply, self._failed_error())
                    msg = attrs.evolve(msg, reply=None)
                self._pending.append(msg)
            case Knows() if any(m.session_id == msg.session_id for m in self._pending):
                answer_error(msg.reply, self._failed_error())  # its finalize is not durable yet
            case Knows():
                answer_outcome(msg.reply, await self.call(capture, self.backend.knows, msg.session_id))
            case Stats():
                answer(msg.reply, await self.call(self._stats))
            case Read() if msg.query.session_id is not None and any(
                    session_key(m.session_id) == session_key(msg.query.session_id) for m in self._pending):
                answer_error(msg.reply, self._failed_error())  # part of it is not in the file yet
            case Read():
                # What the file holds: a trainer's drain is the way out of a full disk (it frees room), so it
                # runs while the store is failed; the writes kept in memory are tried again right after it.
                finish = (self._encode or encode_parts) if msg.encode else keep
                result = await self.call(self._read, msg.query, finish, msg.hold)
                failed = self._read_failed()
                answer_outcome(msg.reply, result)
                if msg.query.drain and not msg.hold and not failed and await self._retry_pending():
                    self._disk_works()
            case Settle():
                result = await self.call(self._settle, msg)  # a delivered drain frees room, as above
                failed = self._read_failed()
                if msg.reply is not None:
                    answer_outcome(msg.reply, result)
                if msg.delivered and not failed and await self._retry_pending():
                    self._disk_works()

    def _failed_error(self) -> StorageFull:
        error = StorageFull(
            f"the trajectory store cannot write to its disk ({self.gauge.failure}); what was sent is kept in "
            "memory and committed once the disk works again: retry later",
            code="store_failed",
        )
        error.retry_after = self.gauge.retry_after
        return error

    async def _retry_pending(self) -> bool:
        """Try to commit what the failed store keeps in memory; True once it is written (the store works again)."""
        if not self._pending:
            return True
        self._done, pending = 0, list(self._pending)
        try:
            await self.call(self._apply, pending)
        except Exception as exc:
            self._failures["commit_failures"] += 1
            wait = min(max(self.gauge.retry_after * 2, 0.1), FAILED_RETRY_MAX)  # never a spin
            self.gauge.failure, self.gauge.retry_after = f"{type(exc).__name__}: {exc}", wait
            self._next_retry = trio.current_time() + wait
            log.error("the trajectory store still cannot commit (%s); %d write(s) kept in memory, next attempt in "
                      "%.0f s", self.gauge.failure, len(pending), wait)
            return False
        self._pending = []
        failed, self.gauge.failure, self.gauge.retry_after = self.gauge.failure, "", FAILED_RETRY
        self._committed(pending)
        if failed:
            log.warning("the trajectory store can write again: %d write(s) kept in memory were committed; new "
                        "turns are taken again", len(pending))
        return True

    def _stats(self) -> dict[str, Any]:
        try:
            backend = self.backend.stats()
        except Exception as exc:  # the disk fails: say so rather than fail /health and /metrics
            backend = {"store": self.backend.name, "stats_error": f"{type(exc).__name__}: {exc}"}
        return {
            **backend,
            "max_tokens": self._max_tokens,
            "max_bytes": self._max_bytes,
            "full": self.gauge.full,
            "failed": bool(self.gauge.failure),
            "failure": self.gauge.failure or None,
            "pending_writes": len(self._pending),
            "pending_steps": sum(len(m.steps) if isinstance(m, Put) else 1 for m in self._pending),
            "pending_segments": sum(len(m.segments) for m in self._pending if isinstance(m, Put)),
            "commit_failures": self._failures["commit_failures"],
            "store_failures": self._failures["store_failures"],
            "refused_turns": self.gauge.refused,
            "recent_segments": list(reversed(self._recent)),
        }

    def _update_gauge(self) -> None:
        usage = self.backend.usage()
        if self._max_tokens is not None and usage.tokens >= self._max_tokens:
            self.gauge.full, self.gauge.reason = True, f"{usage.tokens} tokens not yet read (--store-max-tokens)"
        elif self._max_bytes is not None and usage.bytes >= self._max_bytes:
            self.gauge.full, self.gauge.reason = True, f"{usage.bytes} bytes not yet read (--store-max-bytes)"
        else:
            self.gauge.full, self.gauge.reason = False, ""

    async def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._pending.extend(self._take_journals())  # journaled since the last batch: written now
        if self._pending and not await self._retry_pending():
            counts = self._stats()
            self.close_failure = (f"the disk still fails ({self.gauge.failure}): {counts['pending_steps']} step(s) "
                                  f"and {counts['pending_segments']} segment(s) kept in memory could not be written "
                                  "and are lost")
            log.critical("the trajectory store closes: %s", self.close_failure)
        if hasattr(self.backend, "outbox"):
            with trio.move_on_after(FINAL_FORWARD):  # what is left is sent at the next start
                await self._forward_outbox()
        try:
            await self.call(self.backend.close)
        except Exception as exc:
            where = getattr(self.backend, "path", "")
            failure = f"{where} could not be closed cleanly ({type(exc).__name__}: {exc})".lstrip()
            self.close_failure = f"{self.close_failure}; {failure}" if self.close_failure else failure
            log.critical("the trajectory store: %s; the next start recovers what its journal holds", failure)


#: Segments the store remembers for the dashboard's "recent segments".
RECENT_SEGMENTS = 20


#: The fields of a stored segment (:func:`segment_fields`) the dashboard shows after its id and session.
_SUMMARY_FIELDS = ("instance_id", "start_reason", "boundary_reason", "num_tokens",
                   "num_trained_tokens", "reward", "created_at")


def _summary(segment: Segment) -> dict[str, Any]:
    """What the dashboard shows of a stored segment (no arrays): its session is its parent trajectory."""
    fields = segment_fields(segment)
    return {"trajectory_id": segment.trajectory_id, "session_id": segment.parent_traj_id,
            **{name: fields[name] for name in _SUMMARY_FIELDS}}
