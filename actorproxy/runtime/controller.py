"""The GenerationController actor: running or paused, the weight version, the epoch,
and every generation in flight.

Sessions ask it for permission before they generate (:class:`Begin`): while
running the answer comes at once; while paused it comes at resume. Each
permitted generation is registered as a :class:`GenerationHandle`, which the
controller can ask to abort. A pause in ``abort`` mode asks every registered
generation to stop at the next token boundary and answers only when each has
ended and recorded its partial output (:class:`End`): an *acknowledged*
abort. In ``wait`` mode it admits nothing new and answers when the generations
in flight have finished on their own.

State changes reach the waiting sessions as replies to their ``Begin``
questions: a broadcast over memory channels, no polling.
"""

from __future__ import annotations

import itertools
import logging

import attrs
import trio

from .actor import Reply, answer
from .replies import PauseAck, PauseState, ResumeAck
from .replies import PauseMode as PauseMode

log = logging.getLogger(__name__)


#: Seconds an aborted generation may go without any token arriving before its
#: stream is cut (tokens in flight are then lost, and counted). A stream still
#: delivering tokens (the backlog the engine streamed before it stopped) is read on:
#: they are recorded, not cut off.
ABORT_BOUND = 10.0
#: However much keeps arriving, an aborted stream is cut after this many seconds (an
#: engine that ignores its abort calls).
ABORT_LIMIT = 120.0
_ids = itertools.count(1)


@attrs.define(eq=False)
class GenerationHandle:
    """One permitted generation, as the controller sees it.

    The controller only *asks* for an abort (``abort_requested``); the turn's
    own task performs it (``TurnGeneration._abort_when_asked``), so no field is
    written by two actors: the turn writes ``tokens``, the controller sets the
    event. ``id`` is unique per process.
    """

    session_id: str
    id: int = attrs.field(factory=lambda: next(_ids))
    abort_requested: trio.Event = attrs.field(factory=trio.Event)
    #: Tokens this generation has produced so far (this attempt); written by the turn only.
    tokens: int = 0
    #: While the turn reads an aborted stream to its finish: the scope that cuts it
    #: after ``ABORT_BOUND`` seconds without a token (set by the turn).
    abort_bound: trio.CancelScope | None = None

    def add_tokens(self, n: int) -> None:
        """Count ``n`` more tokens; while aborting, their arrival pushes the cut back."""
        self.tokens += n
        if self.abort_bound is not None:
            self.abort_bound.deadline = trio.current_time() + ABORT_BOUND


@attrs.frozen
class Permit:
    """Permission to generate: the state it was granted under."""

    epoch: int
    weight_version: str


@attrs.frozen
class Begin:
    handle: GenerationHandle
    reply: Reply


@attrs.frozen
class Withdraw:
    """A session stopped waiting for permission (its bound ran out or its agent left)."""

    handle: GenerationHandle


@attrs.frozen
class End:
    """A generation ended; its output (partial or whole) is recorded on its step."""

    handle: GenerationHandle
    aborted: bool


@attrs.frozen
class Pause:
    mode: PauseMode
    reply: Reply


@attrs.frozen
class Resume:
    weight_version: str | None
    bump_epoch: bool
    reply: Reply


@attrs.frozen
class State:
    reply: Reply


ControllerMessage = Begin | Withdraw | End | Pause | Resume | State


@attrs.define(eq=False)
class _PendingPause:
    reply: Reply
    waiting_for: set[int]
    aborted: int = 0
    partial_tokens: int = 0


class GenerationController:
    """Owns running/paused, the weight version and epoch, and the generations in flight."""

    def __init__(self, *, weight_version: str = "0", epoch: int = 0) -> None:
        self.paused = False
        self.mode: PauseMode | None = None
        self.weight_version = weight_version
        self.epoch = epoch
        self._in_flight: dict[int, GenerationHandle] = {}
        self._waiting: dict[int, tuple[GenerationHandle, Reply]] = {}
        self._pending: list[_PendingPause] = []
        self._pauses = 0
        self._resumes = 0
        self._aborted_total = 0

    async def run(
        self, *, task_status: trio.TaskStatus[trio.MemorySendChannel[ControllerMessage]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        send, inbox = trio.open_memory_channel[ControllerMessage](256)
        async with inbox:
            task_status.started(send)
            async for msg in inbox:
                self.handle(msg)

    def handle(self, msg: ControllerMessage) -> None:
        match msg:
            case Begin():
                if self.paused:
                    self._waiting[msg.handle.id] = (msg.handle, msg.reply)
                else:
                    self._admit(msg.handle, msg.reply)
            case Withdraw():
                # It may have been admitted just as it gave up: forget it either way.
                self._waiting.pop(msg.handle.id, None)
                self._end(End(msg.handle, aborted=False))
            case End():
                self._end(msg)
            case Pause():
                self._pause(msg)
            case Resume():
                self._resume(msg)
            case State():
                answer(msg.reply, self.state())

    def _admit(self, handle: GenerationHandle, reply: Reply) -> None:
        self._in_flight[handle.id] = handle
        answer(reply, Permit(self.epoch, self.weight_version))

    def _end(self, msg: End) -> None:
        handle = self._in_flight.pop(msg.handle.id, None)
        if handle is None:
            return
        for pending in list(self._pending):
            if handle.id in pending.waiting_for:
                pending.waiting_for.discard(handle.id)
                if msg.aborted:
                    pending.aborted += 1
                    pending.partial_tokens += handle.tokens
        self._settle()

    def _pause(self, msg: Pause) -> None:
        escalate = self.paused and self.mode == "wait" and msg.mode == "abort"
        if self.paused and not escalate:
            # Idempotent: already paused, nothing new to stop.
            pending = _PendingPause(msg.reply, set())
        else:
            if not self.paused:
                self._pauses += 1
            self.paused = True
            self.mode = msg.mode
            pending = _PendingPause(msg.reply, set(self._in_flight))
            if msg.mode == "abort":
                for handle in self._in_flight.values():
                    handle.abort_requested.set()  # the turn aborts its own generation
        self._pending.append(pending)
        self._settle()

    def _settle(self) -> None:
        """Answer every pause whose generations have all ended."""
        for pending in [p for p in self._pending if not p.waiting_for]:
            self._pending.remove(pending)
            self._aborted_total += pending.aborted
            answer(
                pending.reply,
                PauseAck(mode=self.mode, aborted=pending.aborted, partial_tokens=pending.partial_tokens,
                         weight_version=self.weight_version, epoch=self.epoch),
            )

    def _resume(self, msg: Resume) -> None:
        if msg.weight_version is not None:
            self.weight_version = msg.weight_version
        if msg.bump_epoch:
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
        for handle, reply in waiting.values():
            self._admit(handle, reply)
        answer(
            msg.reply,
            ResumeAck(resumed=was_paused, woken=woken, weight_version=self.weight_version, epoch=self.epoch),
        )

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
