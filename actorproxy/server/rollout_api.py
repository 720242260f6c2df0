"""``/v1/rollout/*``: how a trainer pauses and resumes generation around a weight update."""

from __future__ import annotations

import json
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from ..errors import BadRequest
from ..runtime.runtime import Runtime

_PAUSE_FIELDS = frozenset({"mode"})
_RESUME_FIELDS = frozenset({"weight_version", "bump_epoch"})


async def _optional_body(allowed: frozenset[str]) -> dict[str, Any]:
    """A JSON object of our own protocol, or nothing at all (an empty body means defaults)."""
    raw = await request.get_data(cache=False, as_text=False)
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field(s) {unknown}; expected some of {sorted(allowed)}", param=unknown[0])
    return body


def _json(data: Any) -> Response:
    return Response(json.dumps(data), status=200, mimetype="application/json")


def add_rollout_routes(app: QuartTrio, runtime: Runtime) -> None:
    """Register the pause/resume endpoints on ``app``."""

    @app.post("/v1/rollout/pause")
    async def rollout_pause() -> Response:
        body = await _optional_body(_PAUSE_FIELDS)
        mode = body.get("mode", "abort")
        if mode not in ("abort", "wait"):
            raise BadRequest("'mode' must be 'abort' or 'wait'", param="mode")
        return _json(await runtime.pause(mode))

    @app.post("/v1/rollout/resume")
    async def rollout_resume() -> Response:
        body = await _optional_body(_RESUME_FIELDS)
        version = body.get("weight_version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, str | int)):
            raise BadRequest("'weight_version' must be a string or an integer", param="weight_version")
        bump = body.get("bump_epoch", False)
        if not isinstance(bump, bool):
            raise BadRequest("'bump_epoch' must be a boolean", param="bump_epoch")
        return _json(await runtime.resume(weight_version=None if version is None else str(version), bump_epoch=bump))

    @app.get("/v1/rollout/pause_state")
    async def rollout_pause_state() -> Response:
        state = await runtime.pause_state()
        state.pop("in_flight_tokens", None)  # per-session detail is for the test harness
        return _json(state)
