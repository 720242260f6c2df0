"""The ingress: a thin Quart-trio app over a :class:`Runtime`.

Handlers parse and validate at the edge, send one message to the right actor
and turn its reply into OpenAI JSON or SSE. Every error leaves as JSON in
OpenAI's format with a 4xx/5xx status, never as a traceback.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from ..errors import BadRequest, EngineError, ProxyError
from ..runtime.messages import TurnAccepted, TurnDelta, TurnDone, TurnEvent, TurnFailed
from ..runtime.runtime import Runtime, TurnStream
from .identity import resolve_identity
from .openai_api import ChunkWriter, completion_json, new_completion_id, parse_chat_body

log = logging.getLogger(__name__)

#: Largest request body accepted (long agent histories are big, but not this big).
MAX_BODY_BYTES = 64 * 1024 * 1024


def _json_error(error: ProxyError) -> Response:
    response = Response(
        _dumps(error.to_openai()), status=error.status, mimetype="application/json"
    )
    return response


def _dumps(data: Any) -> str:
    import json

    return json.dumps(data, ensure_ascii=False)


def _json(data: Any, status: int = 200) -> Response:
    return Response(_dumps(data), status=status, mimetype="application/json")


async def _body() -> Any:
    raw = await request.get_data(cache=False, as_text=False)
    if not raw:
        raise BadRequest("the request body is empty; send a JSON object")
    import json

    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if not isinstance(value, bool):
        raise BadRequest(f"'{name}' must be a boolean", param=name)
    return value


def _object(body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    """A body of our own protocol: a JSON object with no unknown keys (typos fail loudly)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; expected some of {sorted(allowed)}", param=unknown[0])
    return body


_FINALIZE_FIELDS = frozenset({"session_id", "reward", "instance_id"})
_READ_FIELDS = frozenset({"session_id", "trajectory_id", "drain", "include_steps"})


def _str_field(body: dict[str, Any], name: str, *, required: bool) -> str | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise BadRequest(f"'{name}' must be a non-empty string", param=name)
    return value


def create_app(runtime: Runtime) -> QuartTrio:
    """The HTTP app serving ``runtime``."""
    app = QuartTrio("actorproxy")
    # Long generations stream for minutes: Quart's 60 s response timeout would cut them.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 600
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES

    @app.errorhandler(ProxyError)
    async def _proxy_error(error: ProxyError) -> Response:
        return _json_error(error)

    @app.errorhandler(HTTPException)
    async def _http_error(error: HTTPException) -> Response:
        status = error.code or 500
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        body = {"error": {"message": error.description or error.name, "type": kind, "param": None,
                          "code": error.name.lower().replace(" ", "_")}}
        return _json(body, status)

    @app.errorhandler(Exception)
    async def _unexpected(error: Exception) -> Response:
        log.exception("unexpected error handling %s %s", request.method, request.path)
        body = {"error": {"message": f"internal error: {type(error).__name__}", "type": "server_error",
                          "param": None, "code": "internal_error"}}
        return _json(body, 500)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        call = parse_chat_body(await _body())
        identity = resolve_identity(request.headers, call.session_id, call.instance_id, call.turn_id)
        model = call.model or runtime.config.model_name
        events = await runtime.start_turn(call.request, identity)
        completion_id = new_completion_id()
        if not call.stream:
            async with events:
                async for event in events:
                    match event:
                        case TurnFailed():
                            raise event.error
                        case TurnDone():
                            return _json(
                                completion_json(event, completion_id=completion_id, model=model,
                                                session_id=identity.session_id)
                            )
            raise EngineError("the turn ended without a result")
        # Streaming: wait for the turn to be accepted so guard failures are plain 4xx JSON.
        try:
            first = await events.receive()
        except trio.EndOfChannel:
            events.close()
            raise EngineError("the turn ended without a result") from None
        if isinstance(first, TurnFailed):
            events.close()
            raise first.error
        writer = ChunkWriter(completion_id=completion_id, model=model)
        response = Response(
            _sse(events, first, writer, include_usage=call.include_usage),
            mimetype="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        response.timeout = None
        return response

    @app.post("/session/finalize")
    async def finalize() -> Response:
        body = _object(await _body(), _FINALIZE_FIELDS)
        session_id = _str_field(body, "session_id", required=True)
        assert session_id is not None
        reward = body.get("reward")
        if reward is not None and (
            isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward)
        ):
            raise BadRequest("'reward' must be a finite number", param="reward")
        result = await runtime.finalize(
            session_id,
            reward=None if reward is None else float(reward),
            instance_id=_str_field(body, "instance_id", required=False),
        )
        return _json({"status": "ok", **result})

    @app.post("/trajectory/read")
    async def trajectory_read() -> Response:
        body = _object(await _body(), _READ_FIELDS)
        session_id = _str_field(body, "session_id", required=False)
        trajectory_id = _str_field(body, "trajectory_id", required=False)
        result = await runtime.read(
            session_id=session_id,
            trajectory_id=trajectory_id,
            drain=_flag(body, "drain"),
            include_steps=_flag(body, "include_steps"),
        )
        return _json(result)

    @app.get("/trajectory/stats")
    async def trajectory_stats() -> Response:
        return _json(await runtime.store_stats())

    @app.get("/session/<path:session_id>")
    async def describe_session(session_id: str) -> Response:
        return _json(await runtime.describe_session(session_id))

    @app.get("/health")
    async def health() -> Response:
        return _json(
            {
                "status": "ok",
                **await runtime.census(),
                "store": await runtime.store_stats(),
                "backend": runtime.backend.kind,
                **({"engines": runtime.backend.statistics()} if hasattr(runtime.backend, "statistics") else {}),
                "context_window": runtime.context_window,
                "tokenizer": runtime.tokenizer.name,
                "config": runtime.config.public(),
            }
        )

    @app.get("/v1/models")
    async def models() -> Response:
        info = await runtime.backend.model_info()
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": runtime.config.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "actorproxy",
                        "root": info.model_id,
                        "max_model_len": runtime.context_window,
                    }
                ],
            }
        )

    return app


async def _sse(
    events: TurnStream,
    first: TurnEvent,
    writer: ChunkWriter,
    *,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    """SSE frames as the session produces them; closing ``events`` stops the generation."""
    with events:
        assert isinstance(first, TurnAccepted)
        yield writer.start()
        async for event in events:
            match event:
                case TurnDelta():
                    frame = writer.delta(event.delta)
                    if frame:
                        yield frame
                case TurnDone():
                    yield writer.finish(event, include_usage=include_usage)
                    return
                case TurnFailed():
                    yield writer.error(event.error.to_openai())
                    return
        yield writer.error(EngineError("the turn ended without a result").to_openai())
