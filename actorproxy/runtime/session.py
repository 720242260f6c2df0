"""The session actor: one Trio task per session id, a thin shell around :class:`SessionState`.

Its mailbox serialises the session's turns, so a session never races with
itself. The sans-IO :class:`~actorproxy.core.session_state.SessionState` plans
and records; its CPU work (rendering, tokenizing, assembling and verifying a
segment) runs through :class:`Offload`, in a worker thread, so it never holds
the event loop (a turn that renders only a short new message is prepared on
the loop: :mod:`.turn_cost`). A :class:`~.generate.TurnGeneration` runs each turn's
generation. Nothing is recorded into the segment unless the generation
finished and the agent was there to receive it.

A session fails alone: an unexpected error while it handles a message answers
that message with a 400 ``session_failed``, hands the session's steps (and its
open segment, if it can still be closed) to the store, and retires the actor;
the runtime and every other session keep running.

After ``session_ttl`` idle seconds, on finalize, or when the registry evicts it
to make room (``Evict``), the actor retires: its open segment and steps go to
the store first, then it tells the registry it is gone.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Any

import attrs
import trio

from ..config import ProxyConfig
from ..core.records import Step, version_number
from ..core.session_state import Moved, Planned, Prepared, Refusal, SessionState
from ..core.turn_events import TurnFailed, TurnMoved
from ..errors import BadRequest, Conflict, ProxyError, StorageFull
from ..schema.records import StepSummary
from ..tokenization.tokenizer import ChatTokenizer
from . import store as store_msgs
from . import submitted_steps
from .actor import ActorGone, answer, answer_error, ask
from .controller import GenerationController, Permit
from .generate import GenerationServices, GenerationSettings, Samplings, TurnGeneration
from .messages import (
    DescribeSession,
    Evict,
    FinalizeSession,
    Lookup,
    OpenSegmentSummary,
    RegistryMessage,
    RunTurn,
    SessionCounters,
    SessionDescription,
    SessionMessage,
    SessionRetired,
)
from .offload import Offload
from .output import OutputFormat, recompute_logprobs
from .replies import FinalizeResult
from .submitted_steps import Annotation, SubmitSteps
from .turn_cost import may_be_small, small_turn
from .turn_end import tell

log = logging.getLogger(__name__)

#: Messages a session's mailbox holds before a sender waits (a turn at a time is the norm).
SESSION_MAILBOX = 8


class SessionFailed(BadRequest):
    """The session could not handle a request; it was closed and its recorded data kept."""

    default_code = "session_failed"


@attrs.frozen(eq=False)
class SessionServices:
    """What every session actor of a runtime shares: the settings, the tokenizer, the engine, the other actors."""

    config: ProxyConfig
    tokenizer: ChatTokenizer
    backend: Any
    store: trio.MemorySendChannel[store_msgs.StoreMessage]
    registry: trio.MemorySendChannel[RegistryMessage]
    controller: GenerationController
    context_window: int
    output_format: OutputFormat = attrs.field(factory=OutputFormat)
    offload: Offload = attrs.field(factory=Offload.inline)
    #: Journals a completed step (``TrajectoryStore.journal``: a method call, no message per turn).
    journal: Callable[[str, Step], None] | None = None
    #: The sampling settings turns ask for, one object per setting while it repeats (every session's).
    samplings: Samplings = attrs.field(
        default=attrs.Factory(lambda self: Samplings(self.tokenizer.stop_token_ids), takes_self=True))


class SessionActor:
    """Owns one session's mailbox; its state lives in a :class:`SessionState`."""

    def __init__(self, session_id: str, services: SessionServices, counters: SessionCounters | None = None) -> None:
        self.session_id = session_id
        self.token = object()
        counters = counters or SessionCounters()
        config = services.config
        self.state = SessionState(
            session_id,
            config=config,
            tokenizer=services.tokenizer,
            context_window=services.context_window,
            next_step=counters.next_step,
            next_segment=counters.next_segment,
        )
        self._config = config
        self._tok = services.tokenizer
        self._backend = services.backend
        self._store = services.store
        self._registry = services.registry
        self._offload = services.offload
        self._journal = services.journal
        self._generation = GenerationServices(services.tokenizer, services.backend, services.controller,
                                              GenerationSettings.of(config), services.output_format,
                                              services.samplings)
        self._first_permit: Permit | None = None
        #: Rewards and metadata of steps submitted with /submit_steps, written onto their segments at close.
        self.submitted: dict[int, Annotation] = {}
        #: Turns a guard refused, by error code (a fixed set): the finalize reports them.
        self.refused: Counter[str] = Counter()
        self._failed = False

    # -- the actor loop ------------------------------------------------------

    _side: trio.Nursery  # opened by run()

    async def run(self, inbox: trio.MemoryReceiveChannel[SessionMessage]) -> None:
        """Serve the session's mailbox (the registry makes it); ``inbox`` is closed however this ends.

        Its side nursery holds what a turn starts beside itself: a pause's abort task.
        """
        async with inbox, trio.open_nursery() as self._side:
            ttl = self._config.limits.session_ttl
            done = False
            while not done:
                # The idle clock runs only while waiting: a long turn is never cut by it. One scope times
                # message after message, its deadline set as each wait begins and lifted as it ends (a scope
                # made and closed for each wait cost ~76,000 instructions a turn); a new scope is made only
                # after one expired as a message came (that message is handled outside it).
                msg: SessionMessage | None = None
                with trio.CancelScope() as idle:
                    while not done:
                        msg = None
                        idle.deadline = trio.current_time() + ttl
                        msg = await inbox.receive()
                        idle.deadline = math.inf
                        if idle.cancel_called:
                            break
                        done = await self._take(msg)
                if done:
                    break
                if msg is None:
                    await self._flush("idle_evicted", reward=None)
                    break
                done = await self._take(msg)
            await self._retire(inbox)

    async def _take(self, msg: SessionMessage) -> bool:
        """Handle one message of the mailbox; whether the actor is done with it (it retires)."""
        if isinstance(msg, Evict):
            await self._flush("capacity_evicted", reward=None)
            return True
        if not await self._handle_alone(msg):
            return True
        # Finalized (or never recorded anything): free the slot now.
        return isinstance(msg, FinalizeSession) or self.state.next_step == 0

    async def _handle_alone(self, msg: SessionMessage) -> bool:
        """Handle one message; on an unexpected error fail this session alone (returns ``False``)."""
        # A turn's event channel is closed only once the turn's outcome, or its failure, is sent.
        with msg.events if isinstance(msg, RunTurn) else nullcontext():
            try:
                await (self._run_turn(msg) if isinstance(msg, RunTurn) else self._handle(msg))
            except Exception as exc:
                await self._fail(exc, msg)
                return False
        return True

    async def _fail(self, exc: Exception, msg: SessionMessage) -> None:
        """This session cannot go on: answer the message with ``session_failed``, salvage, retire."""
        log.exception("session %s failed on %s; it retires, its recorded steps go to the store",
                      self.session_id, type(msg).__name__)
        self._failed = True
        error = SessionFailed(
            f"the session could not handle this request ({type(exc).__name__}: {exc}); it was closed and "
            f"its recorded steps kept; a new turn starts it again"
        )
        match msg:
            case RunTurn():
                await tell(msg.events, TurnFailed(error))
            case FinalizeSession() | DescribeSession() | SubmitSteps():
                answer_error(msg.reply, error)
        await self._salvage(error)

    async def _salvage(self, error: SessionFailed) -> None:
        """Hand what a failed session recorded to the store: its steps always, its segment if it still closes."""
        for step in self.state.steps:
            if step.status == "running":  # the turn it failed in
                step.status, step.error = "error", error.message
        segments: list[Any] = []
        try:
            segments = await self._offload.run(lambda: self.state.close("session_failed"))
            segments = submitted_steps.annotate(segments, self.submitted)
        except Exception:
            log.exception("session %s: its open segment cannot be closed; its steps are kept", self.session_id)
        steps = self.state.take_steps()
        if segments or steps:
            await self._store.send(store_msgs.Put(self.session_id, tuple(segments), steps))

    async def _retire(self, inbox: trio.MemoryReceiveChannel[SessionMessage]) -> None:
        """Leave the registry, bounce what is still queued, close the mailbox.

        From here no turn runs in this actor, so the counters handed to the
        registry are final: a successor can never reuse a step or segment index.
        Bounced turns are retried by the ingress and reach the successor.
        """
        counters = SessionCounters(self.state.next_step, self.state.next_segment)
        await self._registry.send(SessionRetired(self.session_id, self.token, counters, failed=self._failed))
        while True:
            try:
                msg = inbox.receive_nowait()
            except trio.WouldBlock:
                break
            match msg:
                case RunTurn():
                    with msg.events:
                        await tell(msg.events, TurnMoved())
                case Evict():
                    pass
                case _:
                    await self._handle_alone(msg)
        # No await since the last receive_nowait: nothing can slip in before the close.
        inbox.close()

    async def _handle(self, msg: FinalizeSession | DescribeSession | Evict | SubmitSteps) -> None:
        match msg:
            case FinalizeSession():
                if msg.instance_id and not self.state.instance_id:
                    self.state.instance_id = msg.instance_id
                if msg.channel is not None:
                    self.state.channel = msg.channel
                if msg.metadata:
                    self.state.trajectory_metadata = msg.metadata
                try:
                    summary = await self._flush(msg.reason, reward=msg.reward, metadata=msg.segment_metadata)
                except StorageFull as exc:  # the store's disk fails: it keeps the data; the caller retries
                    answer_error(msg.reply, exc)
                    return
                if self.state.children:
                    summary = attrs.evolve(summary, sub_agents=await self._finalize_children(msg))
                answer(msg.reply, summary)
            case DescribeSession():
                answer(msg.reply, self.describe())
            case SubmitSteps():
                await self._submit(msg)

    async def _submit(self, msg: SubmitSteps) -> None:
        """Check submitted steps against the recorded ones; with ``apply``, attach them (external ones stored)."""
        try:
            # Comparing ids copies prompts: CPU work, off the event loop like rendering and tokenizing.
            matched = await self._offload.run(lambda: submitted_steps.plan(self.state, msg.steps))
        except ProxyError as exc:
            answer_error(msg.reply, exc)  # refused: nothing changed, the session goes on
            return
        if not msg.apply:
            answer(msg.reply, None)
            return
        if msg.channel is not None:
            self.state.channel = msg.channel
        result, segments = submitted_steps.apply(self.state, self.submitted, matched, msg.channel)
        if segments:
            await ask(self._store, lambda r: store_msgs.Put(self.session_id, tuple(segments), (), r))
        answer(msg.reply, result)

    async def _finalize_children(self, msg: FinalizeSession) -> list[FinalizeResult]:
        """Finalize the sub-agents' child sessions with the parent (same reward, same reason)."""
        summaries: list[FinalizeResult] = []
        instance_id = msg.instance_id or self.state.instance_id
        for child in self.state.children:
            mailbox = await ask(self._registry, lambda r, c=child: Lookup(c, False, r))  # type: ignore[misc]
            if mailbox is None:
                continue  # already retired (idle): its data is in the store
            try:
                summaries.append(await ask(mailbox, lambda r: FinalizeSession(
                    reward=msg.reward, reason=msg.reason, reply=r, instance_id=instance_id,
                    segment_metadata=msg.segment_metadata,
                )))
            except ActorGone:
                pass
        return summaries

    def describe(self) -> SessionDescription:
        state, seg = self.state, self.state.segment
        return SessionDescription(
            session_id=self.session_id,
            sub_agents=sorted(state.children),
            steps=len(state.steps),
            next_step=state.next_step,
            open_segment=None if seg is None else OpenSegmentSummary(
                seg.index, steps=len(seg.steps), tokens=len(seg.context_ids), start_reason=seg.start_reason
            ),
            # Copies: the reply is read after the next turn may have changed the steps.
            recent_steps=[StepSummary(attrs.evolve(s)) for s in state.steps[-3:]],
        )

    async def _flush(
        self, reason: str, *, reward: float | None, metadata: Mapping[str, Any] | None = None
    ) -> FinalizeResult:
        """Close the open segment and hand it, with every step, to the store (``metadata`` goes on its segments)."""
        segments = await self._offload.run(lambda: self.state.close(reason, reward, metadata))
        segments = submitted_steps.annotate(segments, self.submitted)
        steps = self.state.take_steps()
        if segments or steps:  # answered once committed: a finalize is durable when it returns
            try:
                await ask(self._store, lambda r: store_msgs.Put(self.session_id, tuple(segments), steps, r))
            except StorageFull:
                if reason == "finalize":
                    raise
                # Nobody waits for this flush (eviction, shutdown): the failed store keeps it in memory.
                log.warning("session %s: flushed (%s) while the store's disk fails; kept in memory until it "
                            "works again", self.session_id, reason)
        return FinalizeResult(self.session_id, segments=len(segments), steps=len(steps),
                              refused=dict(self.refused) or None)

    # -- a turn ------------------------------------------------------------

    def _check_version_span(self, permit: Permit) -> None:
        cap = self._config.preemption.max_partial_rollout_preempts
        if cap is None:
            return
        versions = {v for step in self.state.steps if step.status == "completed" for v in step.output_versions}
        versions.add(version_number(permit.weight_version))
        if len(versions) - 1 > cap:
            raise Conflict(
                f"this partial rollout would span {len(versions)} weight versions (--max-partial-rollout-preempts "
                f"{cap} allows {cap + 1}); start a new session",
                code="partial_rollout_staleness_exceeded",
            )

    async def _prepare(self, msg: RunTurn) -> Prepared | Refusal | Moved:
        """Plan and render the turn; a short one on the loop (the thread hand-off would cost more: ``turn_cost``)."""
        state, offload = self.state, self._offload
        if offload.limiter is None:
            return state.prepare(msg.request, msg.identity)
        if not may_be_small(state, msg.request, self._tok):
            return await offload.run(lambda: state.prepare(msg.request, msg.identity))
        planned = state.plan(msg.request, msg.identity)  # cheap: the messages not seen last turn are few
        if not isinstance(planned, Planned):
            return planned
        return await offload.run(lambda: state.render(planned), inline=small_turn(planned))

    async def _run_turn(self, msg: RunTurn) -> None:
        """Run one turn; the caller closes its event channel."""
        events = msg.events
        prepared = await self._prepare(msg)
        match prepared:
            case Moved():
                await tell(events, TurnMoved(session_id=prepared.session_id))
                return
            case Refusal():
                self.refused[prepared.error.code] += 1
                await tell(events, TurnFailed(prepared.error))
                return
        if prepared.closed:
            closed = submitted_steps.annotate(prepared.closed, self.submitted)
            await self._store.send(store_msgs.Put(self.session_id, tuple(closed)))
        if self._config.trajectory.recompute_logprobs:  # off: rebuilt replies are trained on 0.0, flagged
            await recompute_logprobs(self._backend, prepared.step, prepared.input_ids)
        turn = TurnGeneration(prepared, self._generation, events=events, relay=msg.relay, side=self._side,
                              check_permit=self._check_version)
        result = await turn.run()
        self.state.commit(result)
        if result.completed:  # journaled: the step survives a crash once its batch commits (within 50 ms)
            if self._journal is not None:
                self._journal(self.session_id, result.prepared.step)
            else:
                await self._store.send(store_msgs.Journal(self.session_id, result.prepared.step))

    def _check_version(self, permit: Permit) -> None:
        """Without partial rollout a session's turns must all run under one weight version and epoch.

        With it, ``--max-partial-rollout-preempts N`` bounds the versions a session's tokens span to N+1.
        """
        if self._generation.settings.partial_rollout:
            self._check_version_span(permit)
            return
        if self._first_permit is None:
            self._first_permit = permit
            return
        if permit != self._first_permit:
            raise Conflict(
                f"the weight version or rollout epoch changed during this trajectory "
                f"(started at version {self._first_permit.weight_version!r} epoch {self._first_permit.epoch}, "
                f"now {permit.weight_version!r} epoch {permit.epoch}); start a new session",
                code="trajectory_version_changed",
            )

