"""The one turn route and the one SSE driver every chat protocol shares.

A protocol is a :class:`~actorproxy.wire.format.TurnFormat`; :func:`serve_turn`
parses the body with it, resolves who the call belongs to, runs the turn on the
runtime and answers with the format's JSON, or streams the format's frames
through :func:`sse_frames` (with heartbeats while nothing happens, say during a
weight update). Nothing here knows the HTTP server: the turn lane
(:mod:`actorproxy.server.lane`) writes what :func:`serve_turn` returns.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import trio

from ..errors import BadRequest, EngineError
from ..runtime.messages import TurnAccepted, TurnDelta, TurnDone, TurnEvent, TurnFailed
from ..runtime.runtime import Runtime
from ..runtime.turn_stream import TurnStream
from ..wire.format import Headers, ReplyInfo, StreamWriter, TurnCall, TurnFormat
from ..wire.jsonio import dumps, loads
from .identity import resolve_identity

C = TypeVar("C", bound=TurnCall)

#: What a turn route answers: a JSON body, or the SSE stream's byte chunks.
TurnReply = bytes | AsyncIterator[bytes]


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
) -> TurnReply:
    """Run one turn of ``fmt``'s protocol: its JSON reply, or its SSE chunks when the call streams."""
    call = fmt.parse(body)
    session, instance, turn = fmt.body_identity(call, headers)
    identity = resolve_identity(headers, session, instance, turn, url_session=url_session,
                                url_instance=url_instance, confined_to=confined_to)
    events = await runtime.start_turn(fmt.prepare(call, identity), identity)
    reply = ReplyInfo(fmt.new_id(), call.model or runtime.config.engines.model_name, identity.session_id)
    if not call.stream:
        done = await turn_result(events)
        fmt.completed(call, identity, reply, done)
        return dumps(fmt.render(call, reply, done))
    accepted = await turn_accepted(events)

    def on_done(done: TurnDone) -> None:
        fmt.completed(call, identity, reply, done)

    writer = fmt.writer(call, reply)
    heartbeat = runtime.config.server.heartbeat_interval
    return sse_frames(events, accepted, writer, on_done, heartbeat=heartbeat)


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


async def sse_frames(
    events: TurnStream,
    accepted: TurnAccepted,
    writer: StreamWriter,
    on_done: Callable[[TurnDone], None] | None = None,
    *,
    heartbeat: float,
) -> AsyncIterator[bytes]:
    """The stream's frames as the session produces them; closing ``events`` stops the generation.

    Each chunk holds every frame that is ready: after an event arrives, the
    events already waiting behind it are written with it (one send, one socket
    write, instead of one per token), and nothing is ever held back to wait for
    more. After ``heartbeat`` seconds with nothing sent (say, the generation is
    paused for a weight update) the writer's heartbeat goes out, so the
    connection stays alive. ``on_done`` sees the finished turn before its last
    frames are written.
    """

    def frame(event: TurnEvent | None) -> tuple[bytes, bool]:
        """The frame of ``event`` (``None``: the turn's events ended early), and whether it is the last."""
        match event:
            case TurnDelta():
                return writer.delta(event.delta), False
            case TurnDone():
                if on_done is not None:
                    on_done(event)
                return writer.finish(event), True
            case TurnFailed():
                return writer.error(event.error), True
            case _:
                return writer.error(EngineError("the turn ended without a result")), True

    with events:
        frames = [writer.start(accepted)]
        deadline = trio.current_time() + heartbeat
        while True:
            last = False
            while not last:  # every event that is ready joins this chunk
                try:
                    ready: TurnEvent | None = events.receive_nowait()
                except trio.WouldBlock:
                    break
                except trio.EndOfChannel:
                    ready = None
                piece, last = frame(ready)
                frames.append(piece)
            chunk = b"".join(frames)
            frames = []
            if chunk:
                yield chunk
                deadline = trio.current_time() + heartbeat
            if last:
                return
            event: TurnEvent | None = None
            with trio.move_on_at(deadline) as waiting:
                try:
                    event = await events.receive()  # cancel-safe: a memory channel loses nothing
                except trio.EndOfChannel:
                    pass
            if waiting.cancelled_caught:
                frames.append(writer.heartbeat())
                deadline = trio.current_time() + heartbeat
                continue
            piece, last = frame(event)
            frames.append(piece)
            if last:
                yield b"".join(frames)
                return
