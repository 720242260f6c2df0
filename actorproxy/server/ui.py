"""``GET /sessions`` and the live dashboard at ``/ui`` (assets shipped in the package, no CDN).

The page polls two JSON routes: ``/ui/api/overview`` (the last minutes of
throughput and latency, engines, pause state, the busiest sessions, the store's
boundary and close reasons) and ``/ui/api/session/<id>`` (a session's steps,
and its stored segments as runs of tokens coloured by loss mask, as a trainer
would check them). Like every operator route, they need the admin token when
one is set; the page itself also takes it as ``?token=`` (a browser cannot send
a header when it opens a page) and sends it on as a header.
"""

from __future__ import annotations

from importlib import resources
from typing import Any

import orjson
import trio
from quart import Response, request
from quart_trio import QuartTrio

from ..errors import BadRequest, NotFound
from ..runtime.messages import SessionDescription
from ..runtime.runtime import Runtime
from ..schema.converter import CONVERTER
from .observe import Observer, gather_state

_ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
#: Sessions scanned at most when /sessions filters (each is one question to its actor).
_SCAN_LIMIT = 10_000
#: Tokens of a session shown in the dashboard at most (the rest is summarised).
_TOKEN_LIMIT = 20_000


def _json(data: Any) -> Response:
    return Response(orjson.dumps(data), status=200, mimetype="application/json")


def _int_arg(name: str, default: int, low: int, high: int) -> int:
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise BadRequest(f"'{name}' must be an integer, got {raw[:40]!r}", param=name) from None
    if not low <= value <= high:
        raise BadRequest(f"'{name}' must be between {low} and {high}", param=name)
    return value


def session_summary(description: SessionDescription) -> dict[str, Any]:
    """One row of ``/sessions`` from a live session's description."""
    recent = [summary.step for summary in description.recent_steps]
    last = recent[-1] if recent else None
    return {
        "session_id": description.session_id,
        "state": "generating" if any(s.status == "running" for s in recent) else "idle",
        "steps": description.steps,
        "instance_id": last.instance_id if last is not None else None,
        "open_segment": CONVERTER.unstructure(description.open_segment),
        "sub_agents": description.sub_agents,
        "last_step_at": (last.finished_at or last.created_at) if last is not None else None,
    }


async def list_sessions(
    runtime: Runtime, *, offset: int, limit: int, state: str | None, instance: str | None
) -> dict[str, Any]:
    """A page of live sessions, newest first, optionally filtered by state and prompt group."""
    filtered = state is not None or instance is not None
    total, ids = await runtime.list_sessions(0 if filtered else offset, _SCAN_LIMIT if filtered else limit)
    rows = []
    for session_id in ids:
        try:
            row = session_summary(await runtime.describe_session(session_id))
        except NotFound:
            continue  # retired between the listing and the question
        if (state is None or row["state"] == state) and (instance is None or row["instance_id"] == instance):
            rows.append(row)
    if filtered:
        total, rows = len(rows), rows[offset : offset + limit]
    return {"total": total, "offset": offset, "limit": limit, "data": rows}


def token_runs(tokenizer: Any, token_ids: list[int], mask: list[int]) -> list[dict[str, Any]]:
    """Consecutive tokens with the same loss mask, decoded together: ``[{"text", "mask", "tokens"}]``."""
    runs: list[dict[str, Any]] = []
    start = 0
    for i in range(1, len(token_ids) + 1):
        if i == len(token_ids) or mask[i] != mask[start]:
            text = tokenizer.decode(token_ids[start:i])
            runs.append({"text": text, "mask": mask[start], "tokens": i - start})
            start = i
    return runs


def add_ui_routes(app: QuartTrio, runtime: Runtime, observer: Observer) -> None:
    """Register ``/sessions``, ``/ui`` and its JSON and asset routes."""

    @app.get("/sessions")
    async def sessions() -> Response:
        state = request.args.get("state")
        if state is not None and state not in ("idle", "generating"):
            raise BadRequest("'state' must be 'idle' or 'generating'", param="state")
        page = await list_sessions(
            runtime,
            offset=_int_arg("offset", 0, 0, 10**9),
            limit=_int_arg("limit", 50, 1, 500),
            state=state,
            instance=request.args.get("instance"),
        )
        return _json(page)

    @app.get("/ui")
    async def dashboard() -> Response:
        page = resources.files(__package__).joinpath("ui_assets/index.html").read_bytes()
        return Response(page, status=200, mimetype="text/html")

    @app.get("/ui/assets/<name>")
    async def asset(name: str) -> Response:
        if name not in _ASSETS:
            raise NotFound(f"no dashboard asset {name!r}")
        body = resources.files(__package__).joinpath(f"ui_assets/{name}").read_bytes()
        return Response(body, status=200, mimetype=_ASSETS[name])

    @app.get("/ui/api/overview")
    async def overview() -> Response:
        state = await gather_state(runtime)
        store = state["store"]
        return _json({
            "now": trio.current_time(),
            "history": observer.recent(300),
            "census": state["census"],
            "pause": {k: v for k, v in state["pause"].items() if k != "in_flight_tokens"},
            "engines": state["engines"],
            "backend": runtime.config.engines.backend,
            "busiest": observer.busiest(),
            "store": {k: store.get(k) for k in ("sessions", "segments", "tokens", "boundaries", "closed_by")},
            "recent_segments": store.get("recent_segments", []),
            "last_pause_seconds": state["last_pause_seconds"],
        })

    @app.get("/ui/api/session/<path:session_id>")
    async def session_detail(session_id: str) -> Response:
        live: dict[str, Any] | None
        try:
            live = CONVERTER.unstructure(await runtime.describe_session(session_id))
        except NotFound:
            live = None
        stored = await runtime.read(session_id=session_id, include_steps=False)
        segments = []
        budget = _TOKEN_LIMIT
        for segment in stored.data:
            ids, mask = segment.token_ids[:budget].tolist(), segment.loss_mask[:budget].tolist()
            budget -= len(ids)
            runs = await trio.to_thread.run_sync(token_runs, runtime.tokenizer, ids, mask)
            segments.append({
                "trajectory_id": segment.trajectory_id,
                "start_reason": segment.start_reason,
                "boundary_reason": segment.boundary_reason,
                "reward": segment.reward,
                "num_tokens": segment.num_tokens,
                "num_trained_tokens": segment.num_trained_tokens,
                "shown_tokens": len(ids),
                "runs": runs,
            })
        if live is None and not segments:
            raise NotFound(f"no session {session_id!r}, live or stored", param="session_id")
        return _json({"session_id": session_id, "live": live, "segments": segments})
