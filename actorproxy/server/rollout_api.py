"""``/v1/rollout/*``: how a trainer pauses and resumes generation around a weight update.

``POST /v1/rollout/pause`` is served on the turn lane (:class:`~.lane.TurnLane`), not by the
Quart app: the lane admits the caller, takes the body already read and calls the controller in
the connection's first task step, so the pause's aborts leave in the scheduling round after the
connection was accepted. Quart starts each request's handler in a task of its own and reads its
body in another: two rounds more, and while a thousand streams relay a backlog of tokens each
round is long (tens of milliseconds on a quiet machine, a second on a loaded one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quart import Response, request
from quart_trio import QuartTrio

from ..protocols.trainer import PauseBody, ResumeBody
from ..runtime.replies import PauseAck
from ..runtime.runtime import Runtime
from ..schema import jsonio
from ..schema.converter import CONVERTER, prepare, structure
from .lane import TurnLane, served_by_the_lane

if TYPE_CHECKING:
    from .dressage_api import DressageApi


def _or_defaults(raw: str | bytes) -> Any:
    """The JSON body, or an empty object when there is none (an empty body means the defaults)."""
    return jsonio.loads(raw) if raw.strip() else {}


async def _optional_body() -> Any:
    return _or_defaults(await request.get_data(cache=False, as_text=False))


def _json(data: Any) -> Response:
    return Response(jsonio.dumps(data), status=200, mimetype="application/json")


async def pause_state_json(runtime: Runtime) -> dict[str, Any]:
    """``GET /v1/rollout/pause_state``'s answer (our shape)."""
    state: dict[str, Any] = CONVERTER.unstructure(await runtime.pause_state())
    del state["in_flight_tokens"]  # per-session detail is for the test harness
    return state


def add_rollout_routes(app: QuartTrio, lane: TurnLane, runtime: Runtime, dressage: DressageApi | None = None) -> None:
    """Register the pause/resume endpoints on ``app`` and ``lane`` (in Dressage's shapes when ``dressage`` is given)."""

    # Made now, not by the first pause while it holds back a thousand streams' abort calls (~1.5 ms); the
    # answer's hook is kept, for cattrs makes a class's hook again after any hook is registered (which the first
    # use of a list type does).
    prepare(read=[PauseBody])
    ack_json = CONVERTER.get_unstructure_hook(PauseAck)

    async def rollout_pause(raw: bytes, *_: Any) -> bytes:
        pause = structure(_or_defaults(raw), PauseBody)
        if dressage is not None:
            return jsonio.dumps(await dressage.pause(pause))
        return jsonio.dumps(ack_json(await runtime.pause(pause.mode)))

    lane.route("/v1/rollout/pause", rollout_pause)
    # The rule routes the other methods (405 with Allow, OPTIONS) and lists the route; the lane serves POST.
    app.add_url_rule("/v1/rollout/pause", view_func=served_by_the_lane, methods=["POST"], endpoint="rollout_pause")

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
