"""The running proxy without HTTP: actors started in one nursery, and a facade to reach them.

:func:`open_runtime` starts the store and the session registry (each with
``nursery.start``), and on exit finalizes every open session into the store
(bounded by ``shutdown_grace``) before cancelling. The ingress, the tests and
``actorproxy.testing`` all drive the proxy through :class:`Runtime`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import trio

from ..config import ProxyConfig
from ..core.template_probe import probe_template
from ..core.turn_events import TurnEvent, TurnMoved, TurnWaiting
from ..engines.base import Backend, BackendError, ModelInfo
from ..engines.connection import age_prompt_json
from ..engines.engine_check import check_engine_tokenizer
from ..engines.sglang.parse import SGLangParseClient
from ..errors import BadRequest, EngineError, NotFound, Overloaded, ShutdownError, ShuttingDown
from ..http.in_flight import InFlight
from ..store.base import LONGEST_LEASE, MAX_LEASES, Held, ReadQuery
from ..tokenization.detokenize import byte_table
from ..tokenization.tokenizer import ChatTokenizer, load_tokenizer
from . import collector, freed_memory
from . import controller as ctl
from . import registry as reg
from . import store as st
from .actor import ActorGone, ask
from .backends import (
    context_window_for,
    forward_to_engines,
    freeze_refusal,
    make_backend,
    open_store_backend,
    output_format_for,
    wait_for_engine,
)
from .controller import PauseMode
from .generate import Samplings
from .holds import Holds
from .messages import (
    Census,
    ChatRequest,
    CloseAll,
    DescribeSession,
    FinalizeSession,
    Identity,
    ListLive,
    Lookup,
    RegistryMessage,
    RunTurn,
    SessionCounters,
    SessionDescription,
)
from .offload import Offload
from .output import OutputFormat
from .replies import FinalizeResult, PauseAck, PauseState, ReadResult, ResumeAck
from .session import SessionActor, SessionServices
from .still_waiting import StillWaiting
from .turn_stream import Relay, TurnStream

log = logging.getLogger(__name__)

#: Events a turn may queue before the session waits for the ingress (backpressure).
_TURN_EVENT_BUFFER = 16


@attrs.define(eq=False)
class Runtime:
    """Handles to the live actors; every method is a message to one of them (or a call on the controller)."""

    config: ProxyConfig
    tokenizer: ChatTokenizer
    backend: Backend
    context_window: int
    store: trio.MemorySendChannel[st.StoreMessage]
    registry: trio.MemorySendChannel[RegistryMessage]
    controller: ctl.GenerationController
    #: Seconds the last pause took to be acknowledged (for the metrics).
    last_pause_seconds: float | None = attrs.field(default=None, init=False)
    #: A ``keep`` pause froze the engines: the resume installs the version, then thaws them.
    frozen: bool = attrs.field(default=False, init=False)
    #: Is the store full (new turns refused)? Read without a message.
    store_gauge: st.StoreGauge = attrs.field(factory=st.StoreGauge)
    #: Set at shutdown: new turns get 503 + Retry-After while the turns in flight finish.
    draining: bool = False
    #: The turns handed to the agents' requests and not closed yet (what shutdown's drain waits for).
    turns: InFlight = attrs.field(factory=InFlight, init=False)
    #: Tells the turns whose callers wait for their first event, each ``--heartbeat-interval`` (its task runs
    #: with the runtime's).
    still_waiting: StillWaiting = attrs.field(
        default=attrs.Factory(lambda self: StillWaiting(self.config.server.heartbeat_interval), takes_self=True))
    #: The registry actor itself: a turn finds or spawns its session without a message (``mailbox_for_turn``).
    sessions: reg.SessionRegistry | None = None
    #: How outputs are parsed (the sessions' too); a token-in generation runs with it.
    output_format: OutputFormat = attrs.field(factory=OutputFormat)
    #: Called at shutdown before the sessions are flushed, while the store still takes data.
    before_close: list[Callable[[], Awaitable[None]]] = attrs.field(factory=list)
    #: Called after each drain of the whole store, before what it freed goes back to the system: the
    #: routes' body memos (their messages and kept bodies) and the tokenizer's prompt cache drop what no
    #: turn used since the last drain (the drained sessions' conversations).
    after_drain: list[Callable[[], None]] = attrs.field(factory=list)
    #: Leased drains' reads, held until the trainer acknowledges them (``POST /trajectory/ack``) or their lease
    #: ends (``runtime/holds.py``; its task runs with the runtime's).
    leases: Holds = attrs.field(init=False, default=attrs.Factory(
        lambda self: Holds(self, limit=MAX_LEASES, seconds=LONGEST_LEASE, what="a leased drain"), takes_self=True))

    def check_admission(self) -> None:
        """Raise the refusal a new turn would get now (shutting down: 503; store full or failing: 507)."""
        if self.draining:
            error = ShuttingDown("the proxy is shutting down; retry on another replica or after its restart")
            error.retry_after = 5
            raise error
        refusal = self.store_gauge.refusal()  # full, or its disk fails: 507 + Retry-After
        if refusal is not None:
            raise refusal

    async def start_turn(
        self, request: ChatRequest, identity: Identity, waiting: Callable[[], Awaitable[object]] | None = None
    ) -> TurnStream:
        """Queue a turn on its session and wait until the session takes it up.

        The returned stream's first event is ``TurnAccepted`` or ``TurnFailed``
        (a guard refused the turn: nothing was recorded). A non-streaming
        request is not told it was accepted: it waits here until its result (its
        first event is then the result, or ``TurnFailed``). Close the stream
        (``with``/``async with``) when done: a closed stream tells the session
        the agent went away, and the generation stops; so does cancelling this
        call while it waits (the agent's request was cancelled: it hung up).
        ``waiting``, if given, is awaited after each ``--heartbeat-interval`` this
        call waits (a streamed reply's start and heartbeats, while paused).
        """
        self.check_admission()
        for attempt in range(4):
            # Typed by the names, not by ``open_memory_channel[TurnEvent](...)``: calling the subscripted form
            # builds a generic alias each time and then fails (an AttributeError formatted and dropped) to
            # stamp ``__orig_class__`` on the tuple it returns.
            send: trio.MemorySendChannel[TurnEvent]
            recv: trio.MemoryReceiveChannel[TurnEvent]
            send, recv = trio.open_memory_channel(_TURN_EVENT_BUFFER)
            relay = Relay()
            session_id = identity.session_id
            # The session's mailbox (its actor spawned if none is live) comes off the registry directly,
            # not through the registry's mailbox; a retry asks, so that it comes after whatever the
            # registry has queued (a retirement).
            client = identity.client
            mailbox = (self.sessions.mailbox_for_turn(session_id, client)
                       if self.sessions is not None and not attempt else None)
            if mailbox is None:
                mailbox = await ask(self.registry, lambda r: Lookup(session_id, True, r, client))  # noqa: B023
            try:  # queued without a scheduler round when the mailbox has room (the receive below waits anyway)
                try:
                    mailbox.send_nowait(RunTurn(request, identity, send, relay))
                except trio.WouldBlock:
                    await mailbox.send(RunTurn(request, identity, send, relay))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                recv.close()
                continue  # the session retired between lookup and send: ask again
            try:
                if waiting is None:
                    first = await recv.receive()
                else:
                    first = await self._first_event(send, recv, waiting)
            except trio.EndOfChannel:
                recv.close()
                raise EngineError("the session ended the turn without an answer") from None
            except BaseException:
                recv.close()  # cancelled (the agent hung up): the session sees its channel closed
                relay.agent_left()  # and stops waiting for it, if it waits (a paused turn)
                raise
            if isinstance(first, TurnMoved):
                recv.close()
                if first.session_id is not None:
                    identity = attrs.evolve(identity, session_id=first.session_id)  # a sub-agent's turn
                continue  # the session was retiring: its successor takes the turn
            self.turns.started()
            return TurnStream(first, recv, self.turns.finished, relay)
        raise Overloaded(f"session {identity.session_id!r} is restarting; retry")

    async def _first_event(self, send: trio.MemorySendChannel[TurnEvent], recv: trio.MemoryReceiveChannel[TurnEvent],
                           waiting: Callable[[], Awaitable[object]]) -> TurnEvent:
        """A turn's first event, calling ``waiting`` after each ``--heartbeat-interval`` without it."""
        still_waiting = self.still_waiting
        still_waiting.add(send)
        try:
            while type(first := await recv.receive()) is TurnWaiting:
                await waiting()
            return first
        finally:
            still_waiting.remove(send)

    async def finalize(
        self,
        session_id: str,
        *,
        reward: float | None = None,
        instance_id: str | None = None,
        channel: str | None = None,
        metadata: dict[str, Any] | None = None,
        label: Any = None,
        reason: str = "finalize",
    ) -> FinalizeResult:
        """Close the session's open segment into the store; the session actor then retires.

        ``label`` (any JSON) goes on the segments this call closes, as ``metadata.label``.
        """
        mailbox = await ask(self.registry, lambda r: Lookup(session_id, False, r))
        labelled = None if label is None else {"label": label}
        if mailbox is not None:
            try:
                result: FinalizeResult = await ask(
                    mailbox,
                    lambda r: FinalizeSession(
                        reward=reward, reason=reason, reply=r, instance_id=instance_id, channel=channel,
                        metadata=metadata, segment_metadata=labelled,
                    ),
                )
                return result
            except ActorGone:
                pass  # retired meanwhile: its data is in the store
        if await ask(self.store, lambda r: st.Knows(session_id, r)):
            return FinalizeResult(session_id, segments=0, steps=0)
        raise NotFound(f"unknown session {session_id!r}", param="session_id")

    async def discard(self, session_id: str) -> tuple[bool, int]:
        """Drop a session: its live actor (its turns closed as ``discard``) and everything stored of it.

        Returns whether a live session was removed and how many segments the store held before. Idempotent.
        """
        try:
            stored = len((await self.read(session_id=session_id)).data)
        except NotFound:
            stored = 0
        live = await ask(self.registry, lambda r: Lookup(session_id, False, r)) is not None
        if live:
            try:
                await self.finalize(session_id, reason="discard")
            except NotFound:
                live = False  # retired and drained meanwhile
        try:
            await self.read(session_id=session_id, drain=True)
        except NotFound:
            pass
        return live, stored

    async def describe_session(self, session_id: str) -> SessionDescription:
        mailbox = await ask(self.registry, lambda r: Lookup(session_id, False, r))
        if mailbox is None:
            raise NotFound(f"no live session {session_id!r}", param="session_id")
        try:
            description: SessionDescription = await ask(mailbox, lambda r: DescribeSession(r))
            return description
        except ActorGone:
            raise NotFound(f"no live session {session_id!r}", param="session_id") from None

    async def read(
        self,
        *,
        session_id: str | None = None,
        trajectory_id: str | None = None,
        drain: bool = False,
        include_steps: bool = False,
    ) -> ReadResult:
        """The stored segments (of a session, or one segment, or all), and their steps if asked for."""
        query = ReadQuery(session_id, trajectory_id, drain, include_steps)
        result: ReadResult = await ask(self.store, lambda r: st.Read(query, r))
        await self._after_read(query.drains_all)
        return result

    async def read_reply(self, query: ReadQuery, keep: Callable[[tuple[Held, ...]], None] | None = None,
                         delivered: Callable[[], Awaitable[bool]] | None = None, *, lead: bytes = b"",
                         given_up: Callable[[], None] | None = None) -> AsyncIterator[bytes]:
        """:meth:`read` as its JSON body in parts (``st.encode_parts``), to be sent one by one and each let go of
        once sent; all are serialised before anything is drained (a drain is all or nothing).

        A drain deletes what it read only once every byte of its reply but the last two was sent
        (``_Parts``): until then no other drain reads it, and a reply not sent whole (the client
        gone, its connection broken) deletes nothing (``st.Settle``). After a drain of the whole
        store, the memory it freed goes back to the system then. ``keep``: a drain's reply sent but
        for its last bytes deletes nothing yet; what it read goes to ``keep``, still held, for the
        caller to delete (:meth:`drained`) or let go of (:meth:`let_go`) later (a worker's part of a
        drain across workers, settled once the merged reply reached the trainer). ``delivered``: whether
        what was sent of the reply reached its client, asked (and waited for) before anything is deleted
        (``http/cycle.py: delivered``: the server's ``send`` into a connection a write closed returns as if it
        had sent, and a write returns once the kernel has the bytes). ``lead``: JSON members the reply's object
        begins with (a lease's, ending in a comma); ``given_up``: as :meth:`delivered_reply`.
        """
        if not query.drain:
            return _Parts(self, await ask(self.store, lambda r: st.Read(query, r, encode=True)), ())
        parts, held = await self._held_read(lambda r: st.Read(query, r, encode=True, hold=True))
        if lead:
            parts[0] = b"{" + lead + parts[0][1:]
        return _Parts(self, parts, (held,), given_up, keep, delivered)

    async def hold_read(self, query: ReadQuery) -> tuple[ReadResult, Held]:
        """A drain's read (``query.drain``) that deletes nothing yet: what it read is held (no other drain reads
        it) until the reply made by :meth:`delivered_reply` is sent (deleted) or given up (let go of)."""
        found: tuple[ReadResult, Held] = await self._held_read(lambda r: st.Read(query, r, hold=True))
        return found

    async def _held_read(self, build: Callable[[Any], st.Read]) -> Any:
        """A drain's read that holds what it read, not given up while the store answers it (the answer, and so
        what it holds, would be lost, held for good); a caller cancelled meanwhile lets it go, then is cancelled."""
        with trio.CancelScope(shield=True):
            answer = await ask(self.store, build)
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except BaseException:
            await self.let_go((answer[1],))
            raise
        return answer

    def delivered_reply(self, body: bytes, held: Sequence[Held], given_up: Callable[[], None] | None = None,
                        keep: Callable[[tuple[Held, ...]], None] | None = None,
                        delivered: Callable[[], Awaitable[bool]] | None = None) -> AsyncIterator[bytes]:
        """``body`` as a reply that deletes what ``held`` read once it was sent (but for its last two bytes, sent
        after; ``keep``, ``delivered``: as :meth:`read_reply`); a reply given up (the client gone) lets it go,
        undeleted, and calls ``given_up``."""
        return _Parts(self, [body], tuple(held), given_up, keep, delivered)

    async def drained(self, held: tuple[Held, ...]) -> None:
        """A drain's reply was sent but for its last bytes: delete what it read (``held``); after a drain of the
        whole store, give the memory it freed back to the system.

        Raises the store's error if it cannot delete (the disk fails): the reply is then cut short, and what it
        read is read again by the next drain.
        """
        await ask(self.store, lambda r: st.Settle(held, True, r))
        await self._after_read(any(h.query.drains_all for h in held))

    async def let_go(self, held: tuple[Held, ...]) -> None:
        """What a drain whose reply was not sent whole read: undeleted, for the next drain (no answer awaited).

        Safe to await while cancelled: it sends without a checkpoint, or shielded when the mailbox is full."""
        if not held:
            return
        settle = st.Settle(held, False)
        try:
            self.store.send_nowait(settle)
        except trio.WouldBlock:
            with trio.CancelScope(shield=True):
                await self.store.send(settle)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the store stopped: nothing is held any more

    async def _after_read(self, drained_all: bool) -> None:
        """After a drain of the whole store, the caches let go (``after_drain``) and the memory freed is given
        back to the system."""
        if drained_all:
            for forget in self.after_drain:
                forget()
            await trio.to_thread.run_sync(freed_memory.give_back)

    async def store_stats(self) -> dict[str, Any]:
        return dict(await ask(self.store, lambda r: st.Stats(r)))

    async def list_sessions(self, offset: int = 0, limit: int = 50) -> tuple[int, list[str]]:
        """How many sessions are live, and the ids of a page of them (newest first)."""
        total, ids = await ask(self.registry, lambda r: ListLive(offset, limit, r))
        return int(total), list(ids)

    async def census(self) -> dict[str, Any]:
        return dict(await ask(self.registry, lambda r: Census(r)))

    async def pause(self, mode: PauseMode = "abort") -> PauseAck:
        """Pause generation; answers once every generation in flight stopped and recorded its output.

        ``abort`` stops them at the next token boundary; ``wait`` lets them finish
        but admits nothing new. With ``engine_pause`` the engines are paused too.
        ``keep`` freezes them in the engines (every engine must be able to: else
        :class:`BadRequest` names the one that cannot, and nothing is paused).
        """
        started = trio.current_time()
        if mode == "keep":
            refusal = await freeze_refusal(self.backend)
            if refusal is not None:
                raise BadRequest(f"pause mode keep: {refusal}", param="mode")
            ack = await self.controller.pause(mode)
            if not self.frozen:
                self.frozen = True
                ack = attrs.evolve(ack, engines=await forward_to_engines(self.backend, "freeze"))
            self.last_pause_seconds = trio.current_time() - started
            return ack
        if mode == "abort":
            with collector.held():  # no young collection while the streams read their abort finish
                ack = await self.controller.pause(mode)
        else:
            ack = await self.controller.pause(mode)
        self.last_pause_seconds = trio.current_time() - started
        if self.config.preemption.engine_pause and mode == "abort":
            # Only an abort pause is forwarded: engines have no "let running requests finish"
            # mode (SGLang: abort|retract|in_place), and in wait mode the proxy admits nothing new.
            ack = attrs.evolve(ack, engines=await forward_to_engines(self.backend, "pause", "abort"))
        return ack

    async def resume(self, *, weight_version: str | None = None, bump_epoch: bool = False) -> ResumeAck:
        """Install the new weight version (given, or asked of the engine) and wake waiting turns.

        After a ``keep`` pause the version is installed in the engines before they thaw, so
        that every token sampled after the resume carries it.
        """
        if self.frozen:
            self.frozen = False
            if weight_version is not None:
                await forward_to_engines(self.backend, "set_weight_version", weight_version)
            await forward_to_engines(self.backend, "thaw")
            return self.controller.resume(weight_version, bump_epoch=bump_epoch)
        if self.config.preemption.engine_pause:
            await forward_to_engines(self.backend, "resume")
        if weight_version is None:
            try:
                weight_version = (await self.backend.model_info()).weight_version
            except BackendError as exc:
                log.warning("resume: could not ask the engine for its weight version: %s", exc)
        else:
            await forward_to_engines(self.backend, "set_weight_version", weight_version)
        return self.controller.resume(weight_version, bump_epoch=bump_epoch)

    async def backend_healthy(self) -> bool:
        """False only when an engine pool knows every engine is down (no probe is sent)."""
        stats = getattr(self.backend, "statistics", None)
        if stats is None:
            return True
        return any(engine["healthy"] for engine in stats()["engines"])

    async def pause_state(self) -> PauseState:
        return self.controller.state()

    async def close_all(self, reason: str = "shutdown") -> int:
        """Finalize every live session; returns how many there were."""
        return int(await ask(self.registry, lambda r: CloseAll(reason, r)))


class ClientGone(trio.BrokenResourceError):
    """A drain's reply found its client gone before it deleted what it read (``delivered``): let go of, for the
    next drain; nothing more of the reply is sent."""


class _Parts:
    """A read's body parts (``Runtime.read_reply``, ``Runtime.delivered_reply``), each let go of as soon as it is
    taken (a drain's reply is never held whole).

    A drain's (``held``) last bytes wait until what it read is deleted: once every other byte of its reply was
    sent, it is deleted (or handed to ``keep``, still held), then they go. If it cannot be (the disk fails), the
    reply is cut short before them, so the trainer never takes a reply whose data stays in the store for the
    next drain. If the body is closed
    before its end (the client gone, its connection broken), or dropped unclosed, what it read is let go of,
    undeleted, for the next drain, and ``given_up`` is called; so it is when ``delivered`` says, before the
    delete, that what was sent did not reach the client (its next part raises :class:`ClientGone` then).
    """

    def __init__(self, runtime: Runtime, parts: list[bytes], held: tuple[Held, ...],
                 given_up: Callable[[], None] | None = None,
                 keep: Callable[[tuple[Held, ...]], None] | None = None,
                 delivered: Callable[[], Awaitable[bool]] | None = None) -> None:
        if held and len(parts[-1]) > _LAST_BYTES:  # its end ("]}"): left to write once it is deleted
            parts[-1:] = [parts[-1][:-_LAST_BYTES], parts[-1][-_LAST_BYTES:]]
        parts.reverse()
        self._runtime, self._parts, self._held, self._given_up = runtime, parts, held, given_up
        self._keep, self._delivered = keep, delivered

    def __aiter__(self) -> _Parts:
        return self

    async def __anext__(self) -> bytes:
        parts = self._parts
        if len(parts) == 1 and self._held:
            if self._delivered is not None and not await self._delivered():
                await self.aclose()  # what it read is let go of, for the next drain
                raise ClientGone("the client is gone: what the drain read was let go of")
            # Asked for the last bytes once every other byte is sent: what it read goes now (before the reply's
            # end, so a drain the trainer sends next comes after it), then they do.
            held, self._held, self._given_up = self._held, (), None
            if self._keep is not None:
                self._keep(held)  # still held: deleted or let go of when its keeper is told
            else:
                with trio.CancelScope(shield=True):
                    await self._runtime.drained(held)
        if parts:
            return parts.pop()
        self._given_up = None  # every part was sent (asked for the next once the last went out): not given up
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Not sent whole (the client gone, its connection broken): the next drain reads it again."""
        self._parts.clear()
        held, self._held = self._held, ()
        if held:
            await self._runtime.let_go(held)
        self._give_up()

    def _give_up(self) -> None:
        given_up, self._given_up = self._given_up, None
        if given_up is not None:
            given_up()

    def __del__(self) -> None:
        held, self._held = self._held, ()
        if held:  # dropped unclosed: let go of it without waiting (a full mailbox: kept held)
            with contextlib.suppress(Exception):
                self._runtime.store.send_nowait(st.Settle(held, False))
        with contextlib.suppress(Exception):
            self._give_up()


#: A drain's reply's last bytes, sent once what it read is deleted (its JSON object's end).
_LAST_BYTES = 2


@asynccontextmanager
async def open_runtime(
    config: ProxyConfig,
    *,
    backend: Backend | None = None,
    tokenizer: ChatTokenizer | None = None,
    offload: Offload | None = None,
) -> AsyncIterator[Runtime]:
    """Start the actors; on exit finalize every session into the store, then stop.

    ``offload`` runs the sessions' CPU work (default: worker threads, inline under a MockClock).
    """
    freed_memory.limit_heaps()  # before the threads it starts make heaps of their own
    offload = offload or Offload.for_current_run()
    tok = tokenizer or load_tokenizer(config.engines.tokenizer_path)
    engine = backend or make_backend(config, tok)
    info: ModelInfo | None = None
    with trio.move_on_after(config.engines.engine_startup_timeout):
        info = await wait_for_engine(engine)
    if info is None:
        waited = config.engines.engine_startup_timeout
        raise BackendError(f"the inference engine did not answer within {waited:g} s", status=503)
    if not config.engines.skip_tokenizer_check:
        await check_engine_tokenizer(tok, engine)
    window = context_window_for(config, info)
    output_format = output_format_for(config, tok)
    await offload.run(lambda: _warm_up(tok))
    async with AsyncExitStack() as resources, trio.open_nursery() as nursery:
        if config.parsing.parse_backend != "local" and config.parse_url:
            output_format.client = await resources.enter_async_context(SGLangParseClient(config.parse_url))
        health_loop = getattr(engine, "run", None)
        if health_loop is not None:
            await nursery.start(health_loop)  # the engine pool's health checks
        store = st.TrajectoryStore(
            await trio.to_thread.run_sync(open_store_backend, config),
            max_tokens=config.store.store_max_tokens,
            max_bytes=config.store.store_max_bytes,
        )
        recovered = await store.recover()
        store_box = await nursery.start(store.run)
        controller = ctl.GenerationController(weight_version=info.weight_version)
        nursery.start_soon(controller.expire_waiting, config.preemption.pause_wait_timeout)
        nursery.start_soon(controller.release_held)
        registry_box: trio.MemorySendChannel[RegistryMessage] | None = None
        samplings = Samplings(tok.stop_token_ids)  # every session's turns: one object per sampling setting

        def factory(session_id: str, counters: SessionCounters) -> SessionActor:
            assert registry_box is not None
            services = SessionServices(config, tok, engine, store_box, registry_box, controller, window,
                                       output_format, offload, journal=store.journal, samplings=samplings)
            return SessionActor(session_id, services, counters)

        known = {sid: SessionCounters(step, segment) for sid, (step, segment) in recovered.items()}
        registry = reg.SessionRegistry(factory, max_sessions=config.limits.max_sessions, known=known,
                                       max_sessions_per_client=config.limits.max_sessions_per_client)
        del recovered, known  # the registry keeps what it remembers; this frame lives as long as the runtime
        registry_box = await nursery.start(registry.run)
        runtime = Runtime(config, tok, engine, window, store_box, registry_box, controller, store.gauge,
                          sessions=registry, output_format=output_format)
        nursery.start_soon(runtime.still_waiting.run)
        nursery.start_soon(runtime.leases.run)
        runtime.after_drain.append(tok.age_prompts)  # its prompts are the drained sessions' conversations
        runtime.after_drain.append(age_prompt_json)  # so are the engine requests' kept prompts
        try:
            yield runtime
        finally:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(config.server.shutdown_grace):
                    for hook in runtime.before_close:
                        await hook()
                    try:
                        closed = await runtime.close_all("shutdown")
                        log.info(
                            "shutdown: %d open session(s) finalized into the store (boundary_reason 'shutdown'); "
                            "read them with /trajectory/read",
                            closed,
                        )
                    except ActorGone:
                        # The actors were already cancelled (an outer scope is unwinding).
                        log.warning("shutdown: the session registry was already gone; open sessions were not flushed")
                    try:  # every flush above was committed; close the database cleanly
                        await ask(store_box, lambda r: st.Close(r))
                    except ActorGone:
                        pass
                nursery.cancel_scope.cancel()
                if backend is None:
                    await engine.aclose()
    if store.close_failure:  # after the nursery: one error, not a group
        raise ShutdownError("--data-dir", f"the trajectory store did not stop cleanly: {store.close_failure}")


def _warm_up(tokenizer: ChatTokenizer) -> None:
    """Build what the first turn would otherwise build on the event loop (once per tokenizer, cached)."""
    byte_table(tokenizer)  # every turn's detokenizer: ~0.3 s for a 150k vocabulary
    try:
        probe_template(tokenizer)  # lets a session's first short turns be prepared inline
    except Exception:  # a template that fails its probe fails the first turn that needs it, as before
        log.debug("the chat template could not be probed at start", exc_info=True)
