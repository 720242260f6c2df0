"""The one turn route and the one SSE driver every chat protocol shares.

A protocol is a :class:`~actorproxy.wire.format.TurnFormat`; :func:`serve_turn`
parses the body with it, resolves who the call belongs to, runs the turn on the
runtime and answers with the format's JSON, or streams the format's frames
through :func:`sse_frames` (with heartbeats while nothing happens, say during a
weight update).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import trio
from quart import Response

from ..errors import EngineError
from ..runtime.messages import TurnAccepted, TurnDelta, TurnDone, TurnEvent, TurnFailed
from ..runtime.runtime import Runtime
from ..runtime.turn_stream import TurnStream
from ..wire.format import Headers, ReplyInfo, StreamWriter, TurnCall, TurnFormat
from ..wire.jsonio import dumps
from .identity import resolve_identity

C = TypeVar("C", bound=TurnCall)


def json_response(data: Any, status: int = 200) -> Response:
    return Response(dumps(data), status=status, mimetype="application/json")


def sse_response(frames: AsyncIterator[bytes]) -> Response:
    response = Response(
        frames, mimetype="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    response.timeout = None  # a long generation must not be cut off
    return response


async def serve_turn(
    runtime: Runtime,
    fmt: TurnFormat[C],
    body: Any,
    headers: Headers,
    *,
    url_session: str | None,
    url_instance: str | None,
    confined_to: str | None,
) -> Response:
    """Run one turn of ``fmt``'s protocol and answer it (JSON, or SSE when the call streams)."""
    call = fmt.parse(body)
    session, instance, turn = fmt.body_identity(call, headers)
    identity = resolve_identity(headers, session, instance, turn, url_session=url_session,
                                url_instance=url_instance, confined_to=confined_to)
    events = await runtime.start_turn(fmt.prepare(call, identity), identity)
    reply = ReplyInfo(fmt.new_id(), call.model or runtime.config.engines.model_name, identity.session_id)
    if not call.stream:
        done = await turn_result(events)
        fmt.completed(call, identity, reply, done)
        return json_response(fmt.render(call, reply, done))
    accepted = await turn_accepted(events)

    def on_done(done: TurnDone) -> None:
        fmt.completed(call, identity, reply, done)

    writer = fmt.writer(call, reply)
    heartbeat = runtime.config.server.heartbeat_interval
    return sse_response(sse_frames(events, accepted, writer, on_done, heartbeat=heartbeat))


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

    After ``heartbeat`` seconds with nothing sent (say, the generation is
    paused for a weight update) the writer's heartbeat goes out, so the
    connection stays alive. ``on_done`` sees the finished turn before its
    last frames are written.
    """
    with events:
        yield writer.start(accepted)
        deadline = trio.current_time() + heartbeat
        while True:
            event: TurnEvent | None = None
            with trio.move_on_at(deadline) as waiting:
                try:
                    event = await events.receive()  # cancel-safe: a memory channel loses nothing
                except trio.EndOfChannel:
                    pass
            frame = b""
            match event:
                case None if waiting.cancelled_caught:
                    frame = writer.heartbeat()
                case TurnDelta():
                    frame = writer.delta(event.delta)
                case TurnDone():
                    if on_done is not None:
                        on_done(event)
                    yield writer.finish(event)
                    return
                case TurnFailed():
                    yield writer.error(event.error)
                    return
                case _:
                    yield writer.error(EngineError("the turn ended without a result"))
                    return
            if frame:
                yield frame
                deadline = trio.current_time() + heartbeat
