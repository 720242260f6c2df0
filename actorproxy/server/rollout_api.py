"""``/v1/rollout/*``: how a trainer pauses and resumes generation around a weight update."""

from __future__ import annotations

from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from ..runtime.runtime import Runtime
from ..wire import jsonio
from ..wire.converter import CONVERTER, structure
from ..wire.trainer import PauseBody, ResumeBody


async def _optional_body() -> Any:
    """The JSON body, or an empty object when there is none (an empty body means the defaults)."""
    raw = await request.get_data(cache=False, as_text=False)
    return jsonio.loads(raw) if raw.strip() else {}


def _json(data: Any) -> Response:
    return Response(jsonio.dumps(data), status=200, mimetype="application/json")


def add_rollout_routes(app: QuartTrio, runtime: Runtime) -> None:
    """Register the pause/resume endpoints on ``app``."""

    @app.post("/v1/rollout/pause")
    async def rollout_pause() -> Response:
        pause = structure(await _optional_body(), PauseBody)
        return _json(CONVERTER.unstructure(await runtime.pause(pause.mode)))

    @app.post("/v1/rollout/resume")
    async def rollout_resume() -> Response:
        body = structure(await _optional_body(), ResumeBody)
        version = None if body.weight_version is None else str(body.weight_version)
        return _json(CONVERTER.unstructure(await runtime.resume(weight_version=version, bump_epoch=body.bump_epoch)))

    @app.get("/v1/rollout/pause_state")
    async def rollout_pause_state() -> Response:
        state = CONVERTER.unstructure(await runtime.pause_state())
        del state["in_flight_tokens"]  # per-session detail is for the test harness
        return _json(state)
