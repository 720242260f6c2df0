"""The ingress: a thin Quart-trio app over a :class:`Runtime`, with the turns on a lean lane in front of it.

Handlers parse and validate at the edge, send one message to the right actor
and turn its reply into OpenAI or Anthropic JSON or SSE. Every error leaves as
JSON in the caller's own format (Anthropic's on ``/v1/messages`` routes,
OpenAI's elsewhere) with a 4xx/5xx status, never as a traceback. The model
calls themselves (chat completions, messages, responses, ``/generate``) are
served by :class:`~actorproxy.server.lane.TurnLane` at the ASGI level, with the
same checks, errors, access log and metrics, without Quart's per-request cost.

The model routes also exist per session, for black-box agents that can only
be given a base URL: ``/sess/{session}/v1/...`` and Claw-R1's
``/{trajectory_uid}/{prompt_uid}/v1/...``. A session named by the URL beats
any header.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from functools import partial
from typing import Any

import attrs
import trio
from prometheus_client.registry import Collector
from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from ..config import ProxyConfig
from ..errors import BadRequest, Conflict, Gone, NotFound, ProxyError, StorageFull
from ..http.cycle import delivered
from ..protocols.anthropic import AnthropicFormat, parse_messages_body
from ..protocols.format import TurnFormat
from ..protocols.openai_chat import OpenAIChatFormat
from ..protocols.responses_format import ResponsesFormat
from ..protocols.trainer import AckBody, DiscardBody, FinalizeBody, ReadBody
from ..runtime.holds import Settled, lease_lead
from ..runtime.runtime import Runtime
from ..schema import jsonio
from ..schema.converter import CONVERTER, structure
from ..store.base import REMEMBERED, Held, ReadQuery
from ..telemetry import CURRENT
from ..trajectory_file import write_trajectory_file
from . import auth
from .admission import Admission
from .dressage_api import DressageApi, reshape_error
from .gateway_api import add_gateway_routes, generate_turn
from .lane import MOUNTS, TurnLane, served_by_the_lane
from .observe import Observer, add_metrics_route
from .openapi import add_openapi_routes
from .rollout_api import add_rollout_routes, pause_state_json
from .turns import EarlyStart, json_body, serve_turn
from .ui import add_ui_routes

log = logging.getLogger(__name__)

#: The scope extension a worker's private socket sets on a request that holds what its drain reads
#: (``workers/holds.py``): ``scope["extensions"][...](held)`` takes it, still held, once the reply was sent but for
#: its last bytes. The public socket never sets it.
HOLD_EXTENSION = "actorproxy.hold_drain"
#: Largest request body accepted (long agent histories are big, but not this big).
MAX_BODY_BYTES = 64 * 1024 * 1024


def _json(data: Any, status: int = 200) -> Response:
    return Response(jsonio.dumps(data), status=status, mimetype="application/json")


def _error_response(admission: Admission, error: Exception) -> Response:
    failed = admission.refusal(error, method=request.method, path=request.path)
    info = CURRENT.get()
    if info is not None:  # the access log's code: the proxy's own, whatever the body's shape
        info.error_code, info.error_detail = failed.code, failed.detail
    response = _json(failed.data, failed.status)
    for name, value in failed.headers:
        response.headers[name] = value
    return response


def _admit_every_request(app: QuartTrio, admission: Admission) -> None:
    """Ask ``admission`` before every route runs (the turn lane asks it for the turns); ``g.admitted`` holds the
    answer: an agent's route checks the session it resolved against ``g.admitted.confined`` (``check_scope``)."""

    @app.before_request
    async def _admit() -> None:
        # A browser opening the dashboard cannot send a header: /ui (the page only) takes ?token=.
        g.admitted = admission.admit(request.path, request.headers, request.remote_addr,
                                     query_token=request.args.get("token") if request.path == "/ui" else None)


async def _body() -> Any:
    raw = await request.get_data(cache=False, as_text=False)
    assert isinstance(raw, bytes)
    return json_body(raw)


class _App(QuartTrio):
    async def make_default_options_response(self) -> Response:
        """``OPTIONS``: ``Allow`` names the methods of the route the path names (the static one), not those of
        a catch-all that also matches it (``GET /session/<id>`` matches ``/session/finalize``, and answers 405)."""
        methods = _static_methods(self)
        if not methods:
            return await super().make_default_options_response()
        return Response("", headers={"Allow": ", ".join(sorted(methods))})


def admission_for(config: ProxyConfig) -> Admission:
    """The admission step of a proxy with ``config``: its access policy, its body limits, its error dialect."""
    return Admission(auth.AccessPolicy.from_config(config), max_body=MAX_BODY_BYTES, body_timeout=600.0,
                     reshape=reshape_error if config.server.api_dialect == "dressage" else None)


def create_app(runtime: Runtime, admission: Admission | None = None, *,
               collectors: Sequence[Collector] = ()) -> QuartTrio:
    """The HTTP app serving ``runtime``; ``admission``: the step it asks (``admission_for`` its config when not
    given; a worker of ``--workers N`` passes the one its router and fan-out ask too); ``collectors``: more
    metrics for its ``/metrics`` (a worker's holds, ``workers/holds.py: HoldMetrics``)."""
    app = _App("actorproxy")
    # Long generations stream for minutes: Quart's 60 s response timeout would cut them.
    app.config["RESPONSE_TIMEOUT"] = None
    admission = admission or admission_for(runtime.config)
    policy = admission.policy
    dressage = runtime.config.server.api_dialect == "dressage"
    # Quart reads the bodies of its own routes within the same limits.
    app.config["BODY_TIMEOUT"] = admission.body_timeout
    app.config["MAX_CONTENT_LENGTH"] = admission.max_body
    # Rendering a long prompt for count_tokens is blocking work: a few threads at most.
    render_limiter = trio.CapacityLimiter(4)
    observer = Observer()
    for collector in collectors:
        observer.registry.register(collector)
    observer.install(app)  # first: a request refused by the checks below is logged and counted too
    add_metrics_route(app, runtime, observer)
    add_ui_routes(app, runtime, observer)
    _admit_every_request(app, admission)
    auth.add_open_session_route(app, policy)
    gateway = add_gateway_routes(app, runtime, policy)
    observer.handoff = gateway.handoff
    observer.generations = gateway.generations
    add_openapi_routes(app)
    lane = TurnLane(app.asgi_app, observer=observer, admission=admission,
                    processing=runtime.config.server.processing_heartbeats)
    dialect = DressageApi(runtime)
    app.asgi_app = lane  # type: ignore[method-assign,assignment]

    def mount(rule: str, view: Any, method: str) -> None:
        for prefix in MOUNTS:
            app.add_url_rule(prefix + rule, view_func=view, methods=[method], endpoint=prefix + rule)

    @app.errorhandler(ProxyError)
    async def _proxy_error(error: ProxyError) -> Response:
        return _error_response(admission, error)

    @app.errorhandler(HTTPException)
    async def _http_error(error: HTTPException) -> Response:
        return _error_response(admission, error)

    @app.errorhandler(Exception)
    async def _unexpected(error: Exception) -> Response:
        return _error_response(admission, error)

    def turn_route(suffix: str, fmt: TurnFormat[Any]) -> None:
        async def handler(raw: bytes, headers: Any, url_session: str | None, url_instance: str | None,
                          confined_to: str | None, client: str | None, early: EarlyStart | None) -> Any:
            return await serve_turn(runtime, fmt, fmt.load(raw), headers, url_session=url_session,
                                    url_instance=url_instance, confined_to=confined_to, client=client, early=early)

        lane.mount(suffix, handler)
        mount(suffix, served_by_the_lane, "POST")
        runtime.after_drain.append(fmt.age)  # its memo lets the drained sessions' messages go

    async def count_tokens(url_session: str | None = None, url_instance: str | None = None) -> Response:
        """The prompt length the next turn would have if it started a segment (a fresh render)."""
        chat = parse_messages_body(await _body(), count_only=True).request

        def count() -> int:
            text = runtime.tokenizer.render(chat.messages, tools=chat.tools, add_generation_prompt=True,
                                            enable_thinking=chat.enable_thinking)
            return len(runtime.tokenizer.encode_prompt(text))  # what earlier prompts shared: not tokenized again

        try:
            tokens = await trio.to_thread.run_sync(count, limiter=render_limiter)
        except Exception as exc:  # the template rejects these messages
            raise BadRequest(f"the chat template cannot render these messages: {exc}", param="messages") from exc
        return _json({"input_tokens": tokens})

    async def models(url_session: str | None = None, url_instance: str | None = None) -> Response:
        info = await runtime.backend.model_info()
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": runtime.config.engines.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "actorproxy",
                        "root": info.model_id,
                        "max_model_len": runtime.context_window,
                    }
                ],
            }
        )

    turn_route("/v1/chat/completions", OpenAIChatFormat(runtime.tokenizer, usage_by_default=dressage))
    turn_route("/v1/messages", AnthropicFormat())
    turn_route("/v1/responses", ResponsesFormat(runtime.tokenizer))

    async def generate(raw: bytes, _headers: Any, _session: Any, _instance: Any, _confined: Any,
                       client: str | None, early: EarlyStart | None) -> bytes:
        return await generate_turn(runtime, gateway, raw, client, early)

    lane.route("/generate", generate)
    mount("/v1/messages/count_tokens", count_tokens, "POST")
    mount("/v1/models", models, "GET")

    @app.post("/session/finalize")
    async def finalize() -> Response:
        body = structure(await _body(), FinalizeBody)
        session_id = body.session_id
        if dressage:
            answer = await dialect.finalize(body)
            if runtime.config.server.trajectory_dir is not None:
                answer = {**answer, "trajectory_file": await _write_trajectory_file(runtime, session_id)}
            return _json(answer)
        result = await runtime.finalize(session_id, reward=body.reward, instance_id=body.instance_id,
                                        label=body.label)
        if runtime.config.server.trajectory_dir is not None:
            result = attrs.evolve(result, trajectory_file=await _write_trajectory_file(runtime, session_id))
        return _json({"status": "ok", **CONVERTER.unstructure(result)})

    @app.post("/session/discard")
    async def discard() -> Response:
        body = structure(await _body(), DiscardBody)
        return _json(await dialect.discard(body.session_id))

    @app.get("/integration/capabilities")
    async def capabilities() -> Response:
        return _json(await dialect.capabilities())

    @app.post("/trajectory/read")
    async def trajectory_read() -> Response:
        body = structure(await _body(), ReadBody)
        # Asked on a worker's private socket as its part of a drain across workers, what a drain reads is kept
        # held once its reply was sent but for its last bytes (HOLD_EXTENSION), deleted when settled.
        extensions: Any = request.scope.get("extensions") or {}
        keep: Callable[[tuple[Held, ...]], None] | None = extensions.get(HOLD_EXTENSION)
        reached = partial(delivered, request.scope)
        if dressage:
            if body.lease is not None:
                raise BadRequest("'lease' is not a read field of the Dressage dialect (its batch read drains)",
                                 param="lease")
            answer, held = await dialect.read(body)
            if not held:
                return _json(answer)
            return Response(runtime.delivered_reply(jsonio.dumps(answer), held, keep=keep, delivered=reached),
                            mimetype="application/json")
        if body.instance_id is not None or body.max_groups is not None or body.segment_view is not None:
            raise BadRequest("'instance_id', 'max_groups' and 'segment_view' are the Dressage dialect's read "
                             "fields (--api-dialect dressage)", param="instance_id")
        # serialised before a drain deletes anything
        query = ReadQuery(body.session_id, body.trajectory_id, body.drain, body.include_steps)
        if body.lease is not None and not body.drain:
            raise BadRequest("'lease' holds what a drain reads until the trainer acknowledges it: it needs "
                             '"drain": true', param="lease")
        if body.lease is None or keep is not None:  # (held for a drain across workers: its fanning worker leases)
            return Response(await runtime.read_reply(query, keep, reached), status=200, mimetype="application/json")
        leases = runtime.leases
        lease = leases.new_lease()
        try:
            reply = await runtime.read_reply(query, partial(leases.keep, lease, seconds=body.lease), reached,
                                             lead=lease_lead(lease, body.lease), given_up=partial(leases.drop, lease))
        except BaseException:
            leases.drop(lease)
            raise
        return Response(reply, status=200, mimetype="application/json")

    @app.post("/trajectory/ack")
    async def trajectory_ack() -> Response:
        body = structure(await _body(), AckBody)
        if runtime.leases.sending(body.lease):
            raise Conflict("that leased drain's reply is still being sent: acknowledge it once it was read whole",
                           code="lease_reply_unfinished", param="lease")
        return _json(acknowledged(body.lease, await runtime.leases.acknowledge(body.lease, not body.release)))

    @app.get("/trajectory/stats")
    async def trajectory_stats() -> Response:
        return _json(await runtime.store_stats())

    @app.get("/session/<path:session_id>")
    async def describe_session(session_id: str) -> Response:
        _refuse_shadowed_route(app)
        return _json(CONVERTER.unstructure(await runtime.describe_session(session_id)))

    @app.get("/health")
    async def health() -> Response:
        # "degraded": an engine pool with no healthy engine, or a store whose disk fails (turns would fail).
        status = "ok" if await runtime.backend_healthy() and not runtime.store_gauge.failure else "degraded"
        if not policy.is_admin(request.headers):  # liveness for anyone, details for the admin
            return _json({"status": status})
        return _json(
            {
                "status": status,
                # "open": no admin token, every route (rewards, finalize, drain, pause) is anyone's (docs/security.md)
                "access": policy.access,
                **await runtime.census(),
                "store": await runtime.store_stats(),
                "backend": runtime.backend.kind,
                **({"engines": runtime.backend.statistics()} if hasattr(runtime.backend, "statistics") else {}),
                "context_window": runtime.context_window,
                "tokenizer": runtime.tokenizer.name,
                "config": {**runtime.config.public(), **(dialect.health_config() if dressage else {})},
                **({"rollout_pause": dialect.pause_state(await pause_state_json(runtime))} if dressage else {}),
            }
        )

    add_rollout_routes(app, lane, runtime, dialect if dressage else None)
    return app


def acknowledged(lease: str, ended: Settled | None) -> dict[str, Any]:
    """``POST /trajectory/ack``'s answer for how lease ``lease`` ended: 200 ``deleted`` / ``released`` (``repeated``
    when an acknowledgement settled it before; ``unsettled_workers``: a leased drain across workers whose workers
    did not all confirm their delete, their part comes again), else the error that says what became of its data."""
    if ended is None:
        raise NotFound(f"no leased drain {lease!r} was made here, or it was settled so long ago that it is forgotten "
                       f"(the last {REMEMBERED} are remembered)", code="unknown_lease", param="lease")
    if ended.status == "expired":
        when = datetime.fromtimestamp(ended.at, UTC).isoformat(timespec="seconds")
        raise Gone(f"leased drain {lease!r} was not acknowledged in time: it was given back at {when}, nothing of it "
                   "deleted, and what it read comes again in a later drain", code="lease_expired", param="lease")
    if ended.status == "failed":  # (the first acknowledgement's own error, answered again)
        if ended.error is not None:
            raise copy.copy(ended.error)
        raise Gone(f"leased drain {lease!r} could not be deleted (its acknowledgement failed): it was given back, "
                   "and what it read comes again in a later drain", code="lease_delete_failed", param="lease")
    return {"lease": lease, "status": ended.status,
            **({"unsettled_workers": list(ended.unsettled)} if ended.unsettled else {}),
            **({"repeated": True} if ended.repeated else {})}


def _refuse_shadowed_route(app: QuartTrio) -> None:
    """405 when a catch-all route matched the path of a route that takes other methods.

    ``GET /session/<id>`` also matches ``GET /session/finalize``: that is a wrong
    method on the finalize route, not a lookup of a session called "finalize".
    """
    methods = _static_methods(app)
    if methods:
        raise MethodNotAllowed(valid_methods=sorted(methods))


def _static_methods(app: QuartTrio) -> set[str]:
    """The methods of the routes without variables whose path is the request's (empty: no such route)."""
    return {method for rule in app.url_map.iter_rules()
            if not rule.arguments and rule.rule == request.path for method in rule.methods or ()}


async def _write_trajectory_file(runtime: Runtime, session_id: str) -> str:
    """Write the finalized session's ``proxy_trajectory.json`` (off the event loop); its path."""
    assert runtime.config.server.trajectory_dir is not None
    stored = await runtime.read(session_id=session_id, include_steps=True)
    directory = runtime.config.server.trajectory_dir
    try:  # the JSON too is built off the event loop
        path = await trio.to_thread.run_sync(
            lambda: write_trajectory_file(directory, session_id, CONVERTER.unstructure(stored))
        )
    except OSError as exc:
        error = StorageFull(
            f"session {session_id!r} is finalized and kept in the store, but its trajectory file could "
            f"not be written ({exc}); read it with /trajectory/read, or finalize again to retry the file",
            code="trajectory_file_failed",
        )
        raise error from exc
    return str(path)
