"""The one turn route and the one SSE driver every chat protocol shares.

A protocol is a :class:`~actorproxy.protocols.format.TurnFormat`; :func:`serve_turn`
parses the body with it, resolves who the call belongs to, runs the turn on the
runtime and answers with the format's JSON, or streams the format's frames
through :class:`SSEReply` (with heartbeats while nothing happens, say during a
weight update: the lane sends them). Nothing here knows the HTTP server: the turn lane
(:mod:`actorproxy.server.lane`) writes what :func:`serve_turn` returns.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Protocol, TypeAlias, TypeVar

import attrs
import trio

from ..core.parser import OutputDelta
from ..core.requests import merge_consecutive_messages
from ..core.template_probe import probe_template
from ..core.turn_events import TurnAccepted, TurnDelta, TurnDone, TurnEvent, TurnFailed
from ..errors import BadRequest, EngineError, ProxyError
from ..protocols.format import Headers, ReplyInfo, StreamWriter, TurnCall, TurnFormat
from ..runtime.runtime import Runtime
from ..runtime.turn_stream import TurnStream
from ..schema.jsonio import loads
from ..telemetry import note_warning
from .dressage_api import check_expected_version
from .identity import resolve_identity

C = TypeVar("C", bound=TurnCall)

#: What a turn route answers: a JSON body, or the SSE stream's byte chunks (and its heartbeat).
TurnReply: TypeAlias = "bytes | SSEReply"


class EarlyStart(Protocol):
    """Whoever writes a turn's reply (the turn lane), told the turn is still waiting to start or to answer.

    A streamed reply: ``start_now(heartbeat)`` sends the reply's head (200, SSE), if not sent
    yet, then ``heartbeat``; ``started``: whether the head went. A reply that does not stream:
    ``still_working()`` sends an interim ``102 Processing`` when ``informs`` (its client is
    one that skips it: ``--processing-heartbeats``).
    """

    started: bool

    async def start_now(self, heartbeat: bytes) -> None: ...

    @property
    def informs(self) -> bool: ...

    async def still_working(self) -> None: ...


def still_working(early: EarlyStart | None) -> Callable[[], Awaitable[None]] | None:
    """What a call that does not stream calls each ``--heartbeat-interval`` it waits (``None``: nothing)."""
    return early.still_working if early is not None and early.informs else None


def json_body(raw: bytes) -> Any:
    """A request's JSON body (400 when it is empty or not JSON)."""
    if not raw:
        raise BadRequest("the request body is empty; send a JSON object")
    return loads(raw)


async def serve_turn(
    runtime: Runtime,
    fmt: TurnFormat[C],
    body: Any,
    headers: Headers,
    *,
    url_session: str | None,
    url_instance: str | None,
    confined_to: str | None,
    client: str | None = None,
    early: EarlyStart | None = None,
) -> TurnReply:
    """Run one turn of ``fmt``'s protocol: its JSON reply, or its SSE chunks when the call streams.

    A streamed turn still waiting to start after ``--heartbeat-interval`` (generation paused,
    say) has its reply started by ``early`` then, with a heartbeat each interval, so the
    agent's connection stays alive; it is refused after that with the stream's error event,
    not a status. Within the interval a refusal is a plain status, streamed or not. A call that
    does not stream gets a ``102 Processing`` each interval it waits, when its client takes one.
    """
    call = fmt.parse(body)
    if runtime.config.server.api_dialect == "dressage":
        check_expected_version(runtime, headers)
    session, instance, turn = fmt.body_identity(call, headers)
    identity = resolve_identity(headers, session, instance, turn, url_session=url_session,
                                url_instance=url_instance, confined_to=confined_to, client=client)
    prepared = fmt.prepare(call, identity)
    if runtime.config.trajectory.merge_consecutive_messages:
        prepared = attrs.evolve(prepared, messages=merge_consecutive_messages(prepared.messages))
    if prepared.tools and not probe_template(runtime.tokenizer).renders_tools:
        note_warning(f"the chat template ignores tools: the {len(prepared.tools)} tool(s) offered are not in "
                     "the prompt and the model cannot call them")
    reply = ReplyInfo(fmt.new_id(), call.model or runtime.config.engines.model_name, identity.session_id)
    if not call.stream:
        done = await turn_result(await runtime.start_turn(prepared, identity, still_working(early)))
        fmt.completed(call, identity, reply, done)
        return fmt.render(call, reply, done)

    def on_done(done: TurnDone) -> None:
        fmt.completed(call, identity, reply, done)

    writer = fmt.writer(call, reply)
    heartbeat = runtime.config.server.heartbeat_interval
    try:
        events = await runtime.start_turn(
            prepared, identity, None if early is None else partial(early.start_now, writer.heartbeat()))
    except ProxyError as error:
        if early is None or not early.started:
            raise
        events = TurnStream.failed(error)
    if early is None or not early.started:
        accepted = await turn_accepted(events)  # refused: a plain status, as nothing was sent
        return sse_frames(events, accepted, writer, on_done, heartbeat=heartbeat)
    # The reply has started: its first frames are those of the turn's first event, accepted or refused.
    return sse_frames(events, None, writer, on_done, heartbeat=heartbeat)


async def turn_result(events: TurnStream) -> TurnDone:
    """The turn's final event; a refused or failed turn raises its error."""
    async with events:
        async for event in events:
            match event:
                case TurnFailed():
                    raise event.error
                case TurnDone():
                    return event
    raise EngineError("the turn ended without a result")


async def turn_accepted(events: TurnStream) -> TurnAccepted:
    """Wait until the turn is accepted, so guard failures stay plain 4xx JSON before a stream starts."""
    try:
        first = await events.receive()
    except trio.EndOfChannel:
        first = TurnFailed(EngineError("the turn ended without a result"))
    if isinstance(first, TurnAccepted):
        return first
    events.close()
    raise first.error if isinstance(first, TurnFailed) else EngineError("the turn ended without a result")


class SSEReply:
    """A streamed reply: its chunks as the session produces them (iterate it), and its heartbeat.

    Each chunk holds every frame that is ready: after an event arrives, the events
    already waiting behind it are written with it (one send, one socket write, instead
    of one per token), and nothing is ever held back to wait for more. ``on_done`` sees
    the finished turn before its last frames are written. Closing it (``aclose``)
    closes the events, which stops the generation.

    The heartbeat is the writer's frame that keeps a silent connection alive (say, while
    the generation is paused for a weight update); whoever writes the chunks sends it
    after ``interval`` seconds with nothing sent (the turn lane does, from a task of the
    reply's own). Waiting here with a timeout instead cost a cancel scope per token.

    Given the server's direct write (:meth:`relay`), the deltas that come while the writer
    waits for the next chunk do not come as chunks at all: the session's task renders each
    one's frame and writes it itself (``runtime/turn_stream.py: Relay``); the chunks are then
    what the relay was shut for (the first frames, the end, a delta behind another event).
    """

    def __init__(
        self,
        events: TurnStream,
        accepted: TurnAccepted | None,
        writer: StreamWriter,
        on_done: Callable[[TurnDone], None] | None = None,
        *,
        heartbeat: float,
    ) -> None:
        self.events, self.writer, self.on_done = events, writer, on_done
        self.interval = heartbeat
        #: ``accepted`` ``None``: the reply started before its turn did, whose first event comes as the others.
        self._frames = [writer.start(accepted)] if accepted is not None else []
        self._ended = False
        #: When the session's task last wrote a frame itself (``trio.current_time``; 0: never).
        self.last_write = 0.0
        #: The error whose frame ended the reply, if one did (the metrics count the reply as that error).
        self.failed: ProxyError | None = None

    def relay(self, send_now: Callable[[bytes], Awaitable[None] | None]) -> bool:
        """Let the session's task write each delta's frame with ``send_now`` while no chunk is pending; whether it can.

        ``send_now(frame)`` writes a piece of the body at once (``None``) or returns what
        writes the rest (see ``http/cycle.py: SEND_NOW_EXTENSION``).
        """
        render = self.writer.delta
        clock = trio.lowlevel.current_clock()

        def take(delta: OutputDelta) -> Awaitable[None] | None:
            self.last_write = clock.current_time()
            return send_now(render(delta))

        return self.events.relay_to(take)

    def heartbeat(self) -> bytes:
        return self.writer.heartbeat()

    @property
    def ended(self) -> bool:
        """Whether the chunk last returned holds the reply's last frames (no chunk comes after it)."""
        return self._ended and not self._frames

    def __aiter__(self) -> SSEReply:
        return self

    async def __anext__(self) -> bytes:
        events, frames = self.events, self._frames
        if not frames and not self._ended:  # nothing pending: wait for the next event (taken at once if ready)
            frames.append(self._frame(await self._receive()))
        while True:
            while not self._ended:  # every event that is ready joins this chunk
                try:
                    ready: TurnEvent | None = events.receive_nowait()
                except trio.WouldBlock:
                    break
                except trio.EndOfChannel:
                    ready = None
                frames.append(self._frame(ready))
            if frames and (self._ended or any(frames)):
                chunk = b"".join(frames)
                frames.clear()
                return chunk
            if self._ended:
                raise StopAsyncIteration
            frames.clear()
            frames.append(self._frame(await self._receive()))

    async def _receive(self) -> TurnEvent | None:
        try:
            return await self.events.receive()  # cancel-safe: a memory channel loses nothing
        except trio.EndOfChannel:
            return None

    def _frame(self, event: TurnEvent | None) -> bytes:
        """The frame of ``event`` (``None``: the turn's events ended early); the last one ends the reply."""
        writer = self.writer
        match event:
            case TurnDelta():
                return writer.delta(event.delta)
            case TurnAccepted():
                return writer.start(event)
            case TurnDone():
                self._ended = True
                if self.on_done is not None:
                    self.on_done(event)
                return writer.finish(event)
            case TurnFailed():
                self._ended = True
                self.failed = event.error
                return writer.error(event.error)
            case _:
                self._ended = True
                self.failed = EngineError("the turn ended without a result")
                return writer.error(self.failed)

    async def aclose(self) -> None:
        self._ended = True
        self.events.close()


def sse_frames(
    events: TurnStream,
    accepted: TurnAccepted | None,
    writer: StreamWriter,
    on_done: Callable[[TurnDone], None] | None = None,
    *,
    heartbeat: float,
) -> SSEReply:
    """The stream's frames as the session produces them (see :class:`SSEReply`)."""
    return SSEReply(events, accepted, writer, on_done, heartbeat=heartbeat)
