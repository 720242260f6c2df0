"""The GenerationController: running or paused, the weight version, the epoch,
and every generation in flight.

Sessions ask it for permission before they generate (:meth:`request`): while
running the answer comes at once, while paused at resume. Each permitted
generation is registered as a :class:`GenerationHandle`, which the controller
can ask to abort. A pause in ``abort`` mode asks every registered generation
to stop at the next token boundary and answers only when each has ended and
recorded its partial output (:meth:`end`): an *acknowledged* abort. In
``wait`` mode it admits nothing new and answers when the generations in
flight have finished on their own. In ``keep`` mode it admits nothing new and
answers at once: the engines freeze the generations in flight in place (the
runtime asks them), and those go on in the same engine request after resume.

It is a synchronous state machine, not a task with a mailbox: the turns and
the runtime call its methods on the Trio thread, and no method awaits, so each
one runs whole between two scheduler rounds, in the order the calls are made,
as messages to an actor would. A turn that may generate is admitted by a method
call: no message, no reply channel, no scheduler round (issue 12). Only a turn
that must wait (paused) and a pause that must wait for its generations await
a one-shot reply channel, answered when the state changes: a broadcast, no
polling. A turn waits for resume at most ``--pause-wait-timeout``: one task of the
runtime's watches all of them (:meth:`GenerationController.expire_waiting`).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import outcome
import trio

from ..engines.base import AbortBatch, BackendError
from .actor import Reply, answer
from .replies import PauseAck, PauseState, ResumeAck
from .replies import PauseMode as PauseMode

log = logging.getLogger(__name__)


#: Seconds an aborted generation may go without any token arriving before its
#: stream is cut (tokens in flight are then lost, and counted). A stream still
#: delivering tokens (the backlog the engine streamed before it stopped) is read on:
#: they are recorded, not cut off.
ABORT_BOUND = 10.0
#: A stream is cut between ``ABORT_BOUND`` and ``ABORT_BOUND`` + this many seconds after its last
#: token: a token moves the cut (to the far end) only when it would come less than ``ABORT_BOUND``
#: after it, so a stream's tokens move it once a second at most, not each (a moved Trio deadline
#: is ~20,000 instructions; a pause's thousand streams each get a token with their finish).
ABORT_SLACK = 1.0
#: However much keeps arriving, an aborted stream is cut after this many seconds (an
#: engine that ignores its abort calls).
ABORT_LIMIT = 120.0
#: How many tasks held back through a pause's answer (:meth:`GenerationController.wake_later`) are woken a
#: scheduler round: the pause's own task runs among the first, not after a thousand.
RELEASE_SLICE = 64
_ids = itertools.count(1)


@attrs.define(eq=False)
class GenerationHandle:
    """One permitted generation, as the controller sees it.

    The controller only *asks* for an abort (:meth:`request_abort`); the turn
    performs it, in the ``on_abort`` callback it set while its stream is open (run
    within the asking call, so that a pause's abort calls leave before any other
    task runs), so no field is written by two parties: the turn writes ``tokens``
    and ``abort_bound``, the controller sets ``abort_requested``. ``id`` is unique
    per process.
    """

    session_id: str
    id: int = attrs.field(factory=lambda: next(_ids))
    #: A pause in ``abort`` mode asked this generation to stop (set by the controller only).
    abort_requested: bool = False
    #: The pause that asked: aborts asked by one pause may go to an engine as one call.
    abort_batch: AbortBatch | None = None
    #: Tokens this generation has produced so far (this attempt); written by the turn only.
    tokens: int = 0
    #: While the turn reads an aborted stream to its finish: the scope that cuts it
    #: ``ABORT_BOUND`` seconds after its last token (``ABORT_SLACK``), or ``ABORT_LIMIT`` after the abort
    #: (:meth:`bound_abort`, by the turn).
    abort_bound: trio.CancelScope | None = None
    _abort_limit: float = math.inf
    #: The bound asked in a pause's pass, not yet on ``abort_bound``: the pause arms it once its abort calls
    #: are written (:meth:`arm_bound`), so that moving a thousand deadlines does not hold them back.
    _unarmed: float | None = None
    #: While the turn's stream is open: how to start its abort (set by the turn).
    _on_abort: Callable[[], None] | None = None

    def add_tokens(self, n: int) -> None:
        """Count ``n`` more tokens; while aborting, their arrival pushes the cut back."""
        self.tokens += n
        bound = self.abort_bound
        if bound is not None:
            cut = trio.current_time() + ABORT_BOUND
            if cut > bound.deadline and bound.deadline < self._abort_limit:
                bound.deadline = min(self._abort_limit, cut + ABORT_SLACK)

    def bound_abort(self, stream: trio.CancelScope) -> None:
        """The turn: cut ``stream`` if the aborted generation does not end in time (see ``abort_bound``).

        Asked in a pause's pass (its batch open), the bound is armed when the pass ends (:meth:`arm_bound`).
        """
        now = trio.current_time()
        self.abort_bound, self._abort_limit = stream, now + ABORT_LIMIT
        if self.abort_batch is not None and self.abort_batch.open:
            self._unarmed = now + ABORT_BOUND + ABORT_SLACK
        else:
            stream.deadline = min(stream.deadline, now + ABORT_BOUND + ABORT_SLACK)

    def arm_bound(self) -> None:
        """The pause, once its abort calls are written: the bound :meth:`bound_abort` kept, on the stream now."""
        bound, self._unarmed = self._unarmed, None
        if bound is not None and self.abort_bound is not None:
            self.abort_bound.deadline = min(self.abort_bound.deadline, bound)

    def request_abort(self, batch: AbortBatch | None = None) -> None:
        """The controller asks the generation to stop (the turn's ``on_abort`` runs now if its stream is open)."""
        if self.abort_requested:
            return
        self.abort_requested, self.abort_batch = True, batch
        if self._on_abort is not None:
            self._on_abort()

    def on_abort(self, start: Callable[[], None] | None) -> None:
        """The turn: call ``start`` when an abort is asked (at once if it already was); ``None`` stops that."""
        self._on_abort = start
        if start is not None and self.abort_requested:
            start()


@attrs.frozen
class Permit:
    """Permission to generate: the state it was granted under."""

    epoch: int
    weight_version: str


@attrs.define(eq=False)
class Waiting:
    """Where a turn asking while paused gets its :class:`Permit` (given at resume), or ``None`` once it
    waited too long (:meth:`GenerationController.expire_waiting`).

    An event, not a reply channel: every stream a pause aborts asks again as it ends (1,000
    at once), and a memory channel costs ~9 µs to make against ~0.2 µs. Not a deadline of the
    turn's own either: a cancel scope with a deadline, entered and left, is ~60,000
    instructions of Trio's, a thousand times in a pause's acknowledgement.
    """

    #: When the turn began to wait (Trio's clock).
    since: float
    _given: trio.Event = attrs.field(factory=trio.Event)
    _permit: Permit | None = None

    def give(self, permit: Permit | None) -> None:
        self._permit = permit
        self._given.set()

    async def wait(self) -> Permit | None:
        """The permit, once given; ``None`` if the turn waited too long (a checkpoint: cancellable)."""
        await self._given.wait()
        return self._permit


@attrs.define(eq=False)
class _PendingPause:
    reply: Reply
    waiting_for: set[int]
    aborted: int = 0
    partial_tokens: int = 0


async def _read_rest(rest: Callable[[], Awaitable[None]]) -> None:
    """What is left of a pause's abort calls; a failed one is logged (the streams' bounds still cut them)."""
    try:
        await rest()
    except BackendError as exc:
        log.warning("a pause's abort calls failed: %s", exc)


class GenerationController:
    """Owns running/paused, the weight version and epoch, and the generations in flight."""

    def __init__(self, *, weight_version: str = "0", epoch: int = 0) -> None:
        self.paused = False
        self.mode: PauseMode | None = None
        self.weight_version = weight_version
        self.epoch = epoch
        self._in_flight: dict[int, GenerationHandle] = {}
        self._waiting: dict[int, tuple[GenerationHandle, Waiting]] = {}
        self._pending: list[_PendingPause] = []
        #: Set when a turn begins to wait while :meth:`expire_waiting` has nobody to watch.
        self._someone_waits = trio.Event()
        #: Wake-ups of tasks whose generations a pause ended, held until no pause is pending (:meth:`wake_later`).
        self._later: list[Callable[[], None]] = []
        self._release = trio.Event()
        self._releasing = False  # (:meth:`release_held` runs: else nothing is held back)
        self._pauses = 0
        self._resumes = 0
        self._aborted_total = 0

    # -- the turns -------------------------------------------------------------------

    def request(self, handle: GenerationHandle) -> Permit | Waiting:
        """Ask permission to generate: the :class:`Permit` at once while running, else where it will come (at resume).

        A turn that stops waiting (it gave up, was cancelled, or no longer needs
        to generate) must :meth:`withdraw`: it may have been admitted just then.
        """
        if not self.paused:
            return self._admit(handle)
        waiting = self._waiting[handle.id] = (handle, Waiting(trio.current_time()))
        self._someone_waits.set()
        return waiting[1]

    async def expire_waiting(self, longest: float) -> None:
        """Run by the runtime, for ever: a turn that waited ``longest`` seconds for permission gets ``None``.

        One task watches the turns waiting (in the order they began to wait, the order of
        ``_waiting``), each turn's bound without a cancel scope of its own.
        """
        while True:
            while not self._waiting:
                self._someone_waits = trio.Event()
                await self._someone_waits.wait()
            _, first = next(iter(self._waiting.values()))
            await trio.sleep_until(first.since + longest)
            now = trio.current_time()
            while self._waiting:
                key, (_, turn) = next(iter(self._waiting.items()))
                if turn.since + longest > now:
                    break
                del self._waiting[key]
                turn.give(None)  # the turn withdraws and answers 503

    def wake_later(self) -> Callable[[Callable[[], None]], None] | None:
        """Where a task whose generation a pause just ended may leave its wake-up, while a pause is pending.

        A pause's thousand streams end in the relay hub's task as it reads their finishes
        (``TurnGeneration._ended``); each stream's task then has its own step to run (leave the
        generation, count the preemption, ask again), ~40 µs. Held back until no pause is pending,
        those steps come after the pause's answer instead of before it. ``None``: wake now (no pause
        pending, or nothing runs :meth:`release_held`).
        """
        return self._later.append if self._pending and self._releasing else None

    async def release_held(self) -> None:
        """Run by the runtime, for ever: wakes the tasks held back by :meth:`wake_later` once no pause is pending,
        ``RELEASE_SLICE`` a scheduler round."""
        self._releasing = True
        try:
            while True:
                await self._release.wait()
                self._release = trio.Event()
                while self._later:
                    woken, self._later = self._later[:RELEASE_SLICE], self._later[RELEASE_SLICE:]
                    for wake in woken:
                        wake()
                    await trio.lowlevel.checkpoint()
        finally:
            self._releasing = False
            held, self._later = self._later, []
            for wake in held:  # (cancelled: they wake to their own cancellation)
                wake()

    def withdraw(self, handle: GenerationHandle) -> None:
        """A turn stopped waiting for permission (its bound ran out or it was cancelled)."""
        self._waiting.pop(handle.id, None)
        self.end(handle, aborted=False)

    def end(self, handle: GenerationHandle, *, aborted: bool) -> None:
        """A generation ended; its output (partial or whole) is recorded on its step."""
        if self._in_flight.pop(handle.id, None) is None:
            return
        for pending in self._pending:
            if handle.id in pending.waiting_for:
                pending.waiting_for.discard(handle.id)
                if aborted:
                    pending.aborted += 1
                    pending.partial_tokens += handle.tokens
        if self._pending:
            self._settle()

    def _admit(self, handle: GenerationHandle) -> Permit:
        self._in_flight[handle.id] = handle
        return Permit(self.epoch, self.weight_version)

    # -- the trainer (through the runtime) ---------------------------------------------

    async def pause(self, mode: PauseMode) -> PauseAck:
        """Stop admitting; in ``abort`` mode ask every generation in flight to stop. Answers once they ended.

        ``keep``: the generations in flight are left to the engines, which freeze them in place
        (the runtime asks them): the answer comes at once, nothing aborted.
        """
        escalate = self.paused and self.mode in ("wait", "keep") and mode == "abort"
        batch_made: AbortBatch | None = None
        reply, answered = trio.open_memory_channel[outcome.Outcome[Any]](1)
        if self.paused and not escalate:
            # Idempotent: already paused, nothing new to stop.
            pending = _PendingPause(reply, set())
        else:
            if not self.paused:
                self._pauses += 1
            self.paused = True
            self.mode = mode
            pending = _PendingPause(reply, set() if mode == "keep" else set(self._in_flight))
            if mode == "abort":
                batch = batch_made = AbortBatch()
                asked = list(self._in_flight.values())
                try:
                    for handle in asked:
                        handle.request_abort(batch)  # the turn aborts its own generation, now
                finally:
                    batch.close()  # the aborts an engine held back for the batch go out together
                    for handle in asked:
                        handle.arm_bound()  # (after the calls are written: the streams' bounds)
        self._pending.append(pending)
        self._settle()
        with answered:
            if batch_made is None or not batch_made.rest:
                result = await answered.receive()
            else:
                # The rest of the abort calls (reading their answers, a task a connection) runs while the
                # pause waits; once every generation ended, nothing in the answers matters any more.
                async with trio.open_nursery() as nursery:
                    for rest in batch_made.rest:
                        nursery.start_soon(_read_rest, rest)
                    result = await answered.receive()
                    nursery.cancel_scope.cancel()
        ack: PauseAck = result.unwrap()
        return ack

    def _settle(self) -> None:
        """Answer every pause whose generations have all ended (then the tasks held back wake: :meth:`wake_later`)."""
        for pending in [p for p in self._pending if not p.waiting_for]:
            self._pending.remove(pending)
            self._aborted_total += pending.aborted
            answer(
                pending.reply,
                PauseAck(mode=self.mode, aborted=pending.aborted, partial_tokens=pending.partial_tokens,
                         weight_version=self.weight_version, epoch=self.epoch),
            )
        if self._later and not self._pending:
            self._release.set()

    def resume(self, weight_version: str | None, *, bump_epoch: bool = False) -> ResumeAck:
        """Install the weight version (and epoch), run again, and wake the waiting turns."""
        if weight_version is not None:
            self.weight_version = weight_version
        if bump_epoch:
            self.epoch += 1
        was_paused = self.paused
        self.paused = False
        self.mode = None
        if was_paused:
            self._resumes += 1
        # Pauses still waiting for "wait"-mode generations are answered now: the
        # trainer moved on, and those generations keep running.
        for pending in self._pending:
            pending.waiting_for.clear()
        self._settle()
        woken = len(self._waiting)
        waiting, self._waiting = self._waiting, {}
        for handle, turn in waiting.values():
            turn.give(self._admit(handle))
        return ResumeAck(resumed=was_paused, woken=woken, weight_version=self.weight_version, epoch=self.epoch)

    def state(self) -> PauseState:
        return PauseState(
            state="paused" if self.paused else "running",
            mode=self.mode,
            weight_version=self.weight_version,
            epoch=self.epoch,
            in_flight=len(self._in_flight),
            waiting=len(self._waiting),
            pauses=self._pauses,
            resumes=self._resumes,
            aborted_total=self._aborted_total,
            in_flight_tokens={h.session_id: h.tokens for h in self._in_flight.values()},
        )
