"""The simulated engine server: one Quart-trio app speaking SGLang, vLLM and llama.cpp.

:func:`serve_sim` is what ``actorproxy sim`` runs; :func:`open_sim_server` is the
same as an async context manager for tests (port 0 by default: read the URL from
the yielded :class:`RunningSim`). SGLang's parsing endpoints (``/parse_function_call``,
``/separate_reasoning``) are in :mod:`.parse_routes`. Routes shared by the engines (``/health``,
``/v1/models``, ``/update_weight_version``) answer in a shape all their clients
accept; ``/openapi.json`` lists the routes served, as FastAPI's does (the vLLM client reads
it); ``/sim/faults`` and ``/sim/requests`` are the simulator's own.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any, cast

import attrs
import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from ..engines.shared_wire import ModelCard, ModelList, UpdateWeightVersionReqInput
from ..errors import BadRequest
from ..http.in_flight import InFlight
from ..http.server import ASGIApp, ConnectionLimits, HTTPServer, ServerPolicy
from ..schema.converter import CONVERTER
from ..serving import served
from ..tokenization.detokenize import byte_table
from ..tokenization.tokenizer import ChatTokenizer, load_tokenizer
from .engine import SimEngine
from .faults import DropConnection, FaultsUpdate, SimFaults
from .llamacpp_routes import llamacpp_blueprint
from .sglang_parse_routes import parse_blueprint
from .sglang_routes import sglang_blueprint
from .state import RequestRecord, SimServerSettings, SimState, served_engine
from .vllm_routes import vllm_blueprint
from .wire import BadField, json_response, read_body

__all__ = [
    "RequestRecord", "RunningSim", "SimFaults", "SimServerSettings", "SimState",
    "create_sim_app", "open_sim_server", "serve_sim", "served_engine", "sim_state",
]

log = logging.getLogger(__name__)

_STATE_KEY = "actorproxy.sim"


@attrs.frozen
class RunningSim:
    """A simulated engine being served: its base URL, engine, faults and server state."""

    url: str
    engine: SimEngine
    faults: SimFaults
    state: SimState


def sim_state(app: QuartTrio) -> SimState:
    """The :class:`SimState` of an app made by :func:`create_sim_app`."""
    state = app.extensions[_STATE_KEY]
    assert isinstance(state, SimState)
    return state


def create_sim_app(engine: SimEngine, *, settings: SimServerSettings) -> QuartTrio:
    """The HTTP app serving ``engine``; its state is :func:`sim_state` (app).

    Whoever serves it runs the state's fault timer (``state.faults.run_timer``) meanwhile.
    """
    state = SimState(engine, settings)
    app = QuartTrio("actorproxy-sim")
    app.extensions[_STATE_KEY] = state
    app.config["RESPONSE_TIMEOUT"] = None  # streams last as long as generations do
    app.config["BODY_TIMEOUT"] = 600
    app.config["MAX_CONTENT_LENGTH"] = 256 * 1024 * 1024

    @app.errorhandler(BadField)
    async def _bad(error: BadField) -> Response:
        return json_response({"error": {"message": error.message}}, error.status)

    @app.errorhandler(BadRequest)
    async def _invalid(error: BadRequest) -> Response:
        return json_response({"error": {"message": error.message, "param": error.param}}, error.status)

    @app.errorhandler(HTTPException)
    async def _http(error: HTTPException) -> Response:
        return json_response({"detail": error.name}, error.code or 500)  # FastAPI's shape

    @app.errorhandler(Exception)
    async def _unexpected(error: Exception) -> Response:
        log.exception("simulated server: unexpected error")
        return json_response({"error": {"message": f"internal error: {type(error).__name__}: {error}"}}, 500)

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        if state.faults.unhealthy or state.closing:
            return json_response({"error": {"code": 503, "message": "unhealthy", "type": "unavailable_error"}}, 503)
        return json_response({"status": "ok"})

    @app.get("/v1/models")
    async def models() -> Response:
        path = settings.model_path
        card = ModelCard(
            id=path, owned_by="actorproxy-sim", root=path, max_model_len=engine.config.max_model_len
        )
        return json_response(CONVERTER.unstructure(ModelList([card])))

    @app.get("/openapi.json")
    async def openapi() -> Response:
        paths: dict[str, dict[str, Any]] = {}
        for rule in app.url_map.iter_rules():
            if rule.rule in state.unlisted or rule.endpoint == "static":
                continue
            path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
            methods = sorted(m.lower() for m in (rule.methods or ()) if m not in ("HEAD", "OPTIONS"))
            paths.setdefault(path, {}).update({m: {} for m in methods})
        return json_response({"openapi": "3.1.0", "info": {"title": "actorproxy-sim"}, "paths": paths})

    async def update_weight_version() -> Response:
        body = await read_body(UpdateWeightVersionReqInput)
        version = body.new_version
        if not version:
            raise BadField("'new_version' must not be empty")
        if body.abort_all_requests:
            state.abort_matching(lambda names: True)
        engine.set_weight_version(version)
        message = f"Weight version updated to {version}"
        return json_response({"success": True, "message": message, "new_version": version})

    if settings.vllm_dev_mode:  # a dev-mode route on vLLM (SGLang always has it)
        app.post("/update_weight_version")(update_weight_version)

    @app.route("/sim/faults", methods=["GET", "POST"])
    async def faults() -> Response:
        if request.method == "POST":
            state.faults.apply(await read_body(FaultsUpdate))
        return json_response(CONVERTER.unstructure(state.faults.snapshot()))

    @app.get("/sim/requests")
    async def requests() -> Response:
        return json_response([record.to_json(engine) for record in state.records.values()])

    @app.get("/sim/requests/<rid>")
    async def one_request(rid: str) -> Response:
        record = state.records.get(rid)
        if record is None:
            return json_response({"detail": "Not Found"}, 404)
        return json_response(record.to_json(engine))

    app.register_blueprint(sglang_blueprint(state))
    app.register_blueprint(parse_blueprint(state))
    app.register_blueprint(vllm_blueprint(state))
    app.register_blueprint(llamacpp_blueprint(state))
    return app


class _NoInjectedDrops(logging.Filter):
    """Injected connection drops are expected: keep their tracebacks out of the error log."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, BaseExceptionGroup):
            # False for a group makes subgroup() look inside it; keep records with any other error.
            rest = error.subgroup(lambda e: not isinstance(e, BaseExceptionGroup | DropConnection | trio.Cancelled))
            return rest is not None
        return not isinstance(error, DropConnection)


def _quiet_drops() -> None:
    """The HTTP server logs an app that fails mid-response (``actorproxy.http``): not the drops the sim injects."""
    server_log = logging.getLogger("actorproxy.http")
    if not any(isinstance(f, _NoInjectedDrops) for f in server_log.filters):
        server_log.addFilter(_NoInjectedDrops())


#: What a client may hold of the simulated server: a body has the app's ``BODY_TIMEOUT`` (600 s), connections and a
#: reply not read no bound (as the engines' own servers: the proxy reading a stream slowly is back-pressure).
_LIMITS = ConnectionLimits(body_grace=600.0, body_min_rate=1.0, send_stall=None)


async def serve_sim(
    settings: SimServerSettings,
    *,
    engine: SimEngine | None = None,
    tokenizer: ChatTokenizer | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[RunningSim] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until ``shutdown_trigger`` returns (or forever), then abort what runs and stop.

    Without ``engine`` one is built from ``settings`` and ``tokenizer`` (default:
    the tokenizer at ``settings.tokenizer_path``, else the built-in qwen3). Served by the
    project's own HTTP server (:mod:`actorproxy.http.server`), as uvicorn serves the real
    engines: a client's EOF is a hang-up. Stopping aborts every generation, gives the
    responses in flight up to ``shutdown_grace`` seconds to end (a stream's abort event
    and its end), then closes every connection.
    """
    if engine is None:
        if tokenizer is None:
            tokenizer = await trio.to_thread.run_sync(load_tokenizer, settings.tokenizer_path)
        engine = SimEngine(tokenizer, settings.engine_config())
    # The streams' detokenizer table (~0.2-0.3 s for a 150k vocabulary), built now rather than in the first stream.
    await trio.to_thread.run_sync(byte_table, engine.tokenizer)
    app = create_sim_app(engine, settings=settings)
    state = sim_state(app)
    requests = InFlight()
    server = HTTPServer(cast(ASGIApp, app.asgi_app), policy=ServerPolicy(_LIMITS),
                        tracker=requests, half_close=False)
    stop = trio.Event()
    _quiet_drops()

    async def drain() -> None:
        await (shutdown_trigger or trio.sleep_forever)()
        state.closing = True
        state.gate.open()  # requests held by a pause fail fast instead of hanging the shutdown
        state.faults.clear()
        state.abort_matching(lambda names: True)
        with trio.move_on_after(settings.shutdown_grace):
            await requests.wait_idle()
        stop.set()

    async with trio.open_nursery() as background:
        background.start_soon(state.faults.run_timer)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            url = await nursery.start(partial(server.serve, settings.host.strip("[]"), settings.port,
                                              shutdown_trigger=stop.wait))
            task_status.started(RunningSim(url, engine, state.faults, state))
        background.cancel_scope.cancel()


@asynccontextmanager
async def open_sim_server(
    settings: SimServerSettings | None = None,
    *,
    engine: SimEngine | None = None,
    tokenizer: ChatTokenizer | None = None,
) -> AsyncIterator[RunningSim]:
    """Serve a simulated engine inside the caller's Trio code (port 0 by default); stop on exit."""
    async with served(partial(serve_sim, settings or SimServerSettings(port=0), engine=engine,
                              tokenizer=tokenizer)) as running:
        yield running

