"""``/v1/rollout/*``: how a trainer pauses and resumes generation around a weight update."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quart import Response, request
from quart_trio import QuartTrio

from ..protocols.trainer import PauseBody, ResumeBody
from ..runtime.runtime import Runtime
from ..schema import jsonio
from ..schema.converter import CONVERTER, structure

if TYPE_CHECKING:
    from .dressage_api import DressageApi


async def _optional_body() -> Any:
    """The JSON body, or an empty object when there is none (an empty body means the defaults)."""
    raw = await request.get_data(cache=False, as_text=False)
    return jsonio.loads(raw) if raw.strip() else {}


def _json(data: Any) -> Response:
    return Response(jsonio.dumps(data), status=200, mimetype="application/json")


async def pause_state_json(runtime: Runtime) -> dict[str, Any]:
    """``GET /v1/rollout/pause_state``'s answer (our shape)."""
    state: dict[str, Any] = CONVERTER.unstructure(await runtime.pause_state())
    del state["in_flight_tokens"]  # per-session detail is for the test harness
    return state


def add_rollout_routes(app: QuartTrio, runtime: Runtime, dressage: DressageApi | None = None) -> None:
    """Register the pause/resume endpoints on ``app`` (in Dressage's shapes when ``dressage`` is given)."""

    @app.post("/v1/rollout/pause")
    async def rollout_pause() -> Response:
        pause = structure(await _optional_body(), PauseBody)
        if dressage is not None:
            return _json(await dressage.pause(pause))
        return _json(CONVERTER.unstructure(await runtime.pause(pause.mode)))

    @app.post("/v1/rollout/resume")
    async def rollout_resume() -> Response:
        body = structure(await _optional_body(), ResumeBody)
        if dressage is not None:
            return _json(await dressage.resume(body))
        given = body.weight_version if body.weight_version is not None else body.version
        version = None if given is None else str(given)
        return _json(CONVERTER.unstructure(await runtime.resume(weight_version=version, bump_epoch=body.bump_epoch)))

    @app.get("/v1/rollout/pause_state")
    async def rollout_pause_state() -> Response:
        state = await pause_state_json(runtime)
        return _json(dressage.pause_state(state) if dressage is not None else state)
