"""One admission step: a request is admitted or refused alike on the turn lane and on the Quart app.

The same table of requests (no credential, a wrong key, another session's key,
the admin token, an oversized or empty body, another content type, too many
sessions...) goes to a turn route served by the lane and to the same route
served by the Quart app (its view running the same turn handler, as the app
served turns before the lane): every status and body must be the same.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest
from _asgi import open_client
from quart import Response, g, request

from actorproxy import ProxyConfig
from actorproxy.core.requests import ChatRequest, Identity
from actorproxy.core.turn_events import TurnAccepted
from actorproxy.runtime.runtime import Runtime, open_runtime
from actorproxy.schema import jsonio
from actorproxy.server import app as app_module
from actorproxy.server.app import create_app
from actorproxy.server.auth import AccessPolicy
from actorproxy.server.lane import TurnLane, served_by_the_lane
from actorproxy.sim import SimConfig, SimEngine

ADMIN = "s3cret-admin"
SECRET = "keys-secret"
MAX_BODY = 4000
HI = [{"role": "user", "content": "hi"}]
CHAT = jsonio.dumps({"model": "m", "max_tokens": 4, "messages": HI})
GENERATE = jsonio.dumps({"trajectory_uid": "gen-a", "prompt_uid": "p", "messages": HI, "max_tokens": 4})
BIG = jsonio.dumps({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "x" * MAX_BODY}]})
KEYS = AccessPolicy.build(admin_token=ADMIN, agent_auth="session-key", session_key_secret=SECRET)


def bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


JSON = {"content-type": "application/json"}
#: (name, path, headers, body): each sent to the lane and to the Quart app.
TABLE: list[tuple[str, str, dict[str, str], bytes]] = [
    ("no credential", "/sess/a/v1/chat/completions", JSON, CHAT),
    ("no credential, Anthropic's route", "/sess/a/v1/messages", JSON, CHAT),
    ("a wrong key", "/sess/a/v1/chat/completions", {**JSON, **bearer("ap1.YQ.0000")}, CHAT),
    ("a wrong x-api-key", "/sess/a/v1/messages", {**JSON, "x-api-key": "nope"}, CHAT),
    ("the admin token as x-api-key", "/sess/a/v1/messages", {**JSON, "x-api-key": ADMIN}, CHAT),
    ("another session's key", "/sess/a/v1/chat/completions", {**JSON, **bearer(KEYS.session_key("b"))}, CHAT),
    # Refused before the body is read: only the admission step's check of the URL's session can say so.
    ("another session's key, a bad body", "/sess/a/v1/chat/completions", {**JSON, **bearer(KEYS.session_key("b"))},
     b"{nope"),
    ("another session's key, a prompt group's URL", "/a/p/v1/messages", {**JSON, "x-api-key": KEYS.session_key("b")},
     b"{nope"),
    ("another session's key, by header", "/v1/chat/completions",
     {**JSON, **bearer(KEYS.session_key("b")), "x-session-id": "a"}, CHAT),
    ("the session's own key", "/sess/a/v1/chat/completions", {**JSON, **bearer(KEYS.session_key("a"))}, CHAT),
    ("the key names the session", "/v1/chat/completions", {**JSON, **bearer(KEYS.session_key("k"))}, CHAT),
    ("the admin token", "/sess/t/v1/chat/completions", {**JSON, **bearer(ADMIN)}, CHAT),
    ("a lower-case bearer scheme", "/sess/t/v1/chat/completions", {**JSON, "authorization": f"bearer {ADMIN}"},
     CHAT),
    ("another content type", "/sess/a/v1/chat/completions",
     {"content-type": "text/plain", **bearer(KEYS.session_key("a"))}, CHAT),
    ("a form content type", "/sess/a/v1/messages",
     {"content-type": "application/x-www-form-urlencoded", "x-api-key": KEYS.session_key("a")}, CHAT),
    ("an oversized body", "/sess/a/v1/chat/completions", {**JSON, **bearer(KEYS.session_key("a"))}, BIG),
    ("an oversized body, no credential", "/sess/a/v1/messages", JSON, BIG),
    ("an empty body", "/sess/a/v1/chat/completions", {**JSON, **bearer(KEYS.session_key("a"))}, b""),
    ("not JSON", "/sess/a/v1/messages", {**JSON, "x-api-key": KEYS.session_key("a")}, b"{nope"),
    ("a session id with a control character", "/v1/chat/completions",
     {**JSON, **bearer(ADMIN), "x-session-id": "a\x01b"}, CHAT),
    ("no session at all", "/v1/responses", {**JSON, **bearer(ADMIN)},
     jsonio.dumps({"model": "m", "input": "hi", "max_output_tokens": 4})),
    ("/generate without the admin token", "/generate", {**JSON, **bearer(KEYS.session_key("gen-a"))}, GENERATE),
    ("/generate with the admin token", "/generate", {**JSON, **bearer(ADMIN)}, GENERATE),
]
#: Sent while the client's one session is busy (``--max-sessions-per-client 1``).
CROWDED: list[tuple[str, str, dict[str, str], bytes]] = [
    ("too many sessions", "/sess/more/v1/chat/completions", {**JSON, **bearer("the-key")}, CHAT),
    ("too many sessions, Anthropic's route", "/sess/more/v1/messages", {**JSON, "x-api-key": "the-key"}, CHAT),
    ("a wrong static key", "/sess/more/v1/messages", {**JSON, "x-api-key": "not-the-key"}, CHAT),
]
GUARDED = {"admin_token": ADMIN, "agent_auth": "session-key", "session_key_secret": SECRET}


def _quart_turns(app: Any) -> Any:
    """The app without its lane: each turn route's Quart view runs the lane's handler for it."""
    lane = app.asgi_app
    assert isinstance(lane, TurnLane)

    async def view(**_: Any) -> Response:
        found = lane.match(request.path)
        assert found is not None
        raw = await request.get_data(cache=False, as_text=False)
        assert isinstance(raw, bytes)
        reply = await found.handler(raw, request.headers, found.url_session, found.url_instance,
                                    g.admitted.confined, g.admitted.client, None)
        assert isinstance(reply, bytes)
        return Response(reply, status=200, mimetype="application/json")

    for endpoint, function in list(app.view_functions.items()):
        if function is served_by_the_lane:
            app.view_functions[endpoint] = view
    return lane.app


def _comparable(response: httpx.Response) -> Any:
    """The reply without what differs from one call to the next (its id, its time)."""
    data = response.json()
    if response.status_code == 200 and isinstance(data, dict):
        return {k: v for k, v in data.items() if k not in ("id", "created", "created_at")}
    return data


@attrs.frozen
class Side:
    """One way in: its runtime, its engine and a client for its app."""

    runtime: Runtime
    engine: SimEngine
    http: httpx.AsyncClient


@asynccontextmanager
async def _side(tokenizer: Any, lane: bool, settings: dict[str, Any]) -> AsyncIterator[Side]:
    engine = SimEngine(tokenizer, SimConfig(seed=3, token_interval=0.0005))
    config = ProxyConfig.of(port=0, max_sessions=16, max_sessions_per_client=1, **settings)
    async with open_runtime(config, backend=engine, tokenizer=tokenizer) as runtime:
        app = create_app(runtime)
        async with open_client(app.asgi_app if lane else _quart_turns(app)) as http:
            yield Side(runtime, engine, http)


@asynccontextmanager
async def _both(tokenizer: Any, settings: dict[str, Any]) -> AsyncIterator[tuple[Side, Side]]:
    """The lane and the Quart app, each over a runtime of its own (so that each call is a session's first)."""
    async with _side(tokenizer, True, settings) as lane, _side(tokenizer, False, settings) as quart:
        yield lane, quart


@pytest.fixture
async def both(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[Side, Side]]:
    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", MAX_BODY)
    async with _both(tokenizer, GUARDED) as sides:
        yield sides


async def _compare(lane: Side, quart: Side, table: list[tuple[str, str, dict[str, str], bytes]]) -> list[str]:
    differences = []
    for name, path, headers, body in table:
        answers = [await side.http.post(path, content=body, headers=headers) for side in (lane, quart)]
        seen = [(r.status_code, _comparable(r), r.headers.get("retry-after")) for r in answers]
        if seen[0] != seen[1]:
            differences.append(f"{name}: lane {seen[0]} != quart {seen[1]}")
    return differences


async def test_the_lane_and_the_quart_app_admit_and_refuse_alike(both: tuple[Side, Side]) -> None:
    lane, quart = both
    assert await _compare(lane, quart, TABLE) == []


async def test_the_dressage_dialect_refuses_alike_too(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--api-dialect dressage`` reshapes refusals (here every prompt is past ``--max-prompt-tokens``): on the
    lane and on Quart alike."""
    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", MAX_BODY)
    async with _both(tokenizer, {**GUARDED, "api_dialect": "dressage", "max_prompt_tokens": 4}) as (lane, quart):
        assert await _compare(lane, quart, TABLE) == []
        own = next(row for row in TABLE if row[0] == "the session's own key")
        reshaped = await lane.http.post(own[1], content=own[3], headers=own[2])
        assert reshaped.status_code == 413 and reshaped.json()["error"] == "context_overflow", reshaped.text


async def test_a_client_over_its_sessions_is_refused_alike(tokenizer: Any) -> None:
    """The client (127.0.0.1, a static API key) holds one busy session: a new one is refused on both."""
    async with _both(tokenizer, {"api_key": "the-key"}) as both, AsyncExitStack() as busy:
        for side in both:
            side.engine.script("so " * 4000, routing_key="busy")
            request = ChatRequest(messages=HI, max_tokens=4000, stream=True)
            events = await busy.enter_async_context(
                await side.runtime.start_turn(request, Identity("busy", client="addr:127.0.0.1")))
            assert isinstance(events.first, TurnAccepted)
        assert await _compare(*both, CROWDED) == []
        refused = await both[0].http.post(CROWDED[0][1], content=CROWDED[0][3], headers=CROWDED[0][2])
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "too_many_sessions"


async def test_every_row_is_answered_as_expected_on_the_lane(both: tuple[Side, Side]) -> None:
    """The table's meaning, so that two equally wrong answers cannot pass the comparison."""
    lane = both[0].http
    expected = {
        "no credential": (401, "missing_api_key"), "a wrong key": (401, "invalid_api_key"),
        "the admin token as x-api-key": (401, "invalid_api_key"),
        "another session's key": (401, "wrong_session"), "another session's key, by header": (401, "wrong_session"),
        "another session's key, a bad body": (401, "wrong_session"),
        "another session's key, a prompt group's URL": (401, None),
        "the session's own key": (200, None), "the key names the session": (200, None), "the admin token": (200, None),
        "a lower-case bearer scheme": (200, None), "another content type": (200, None),
        "a form content type": (200, None), "an oversized body": (413, "request_entity_too_large"),
        "an oversized body, no credential": (401, None), "an empty body": (400, "invalid_request"),
        "a session id with a control character": (400, "invalid_request"),
        "no session at all": (400, "missing_session_id"),
        "/generate without the admin token": (401, "admin_token_required"),
        "/generate with the admin token": (200, None),
    }
    for name, path, headers, body in TABLE:
        if name not in expected:
            continue
        response = await lane.post(path, content=body, headers=headers)
        status, code = expected[name]
        assert response.status_code == status, (name, response.text)
        if code is not None and "/v1/messages" not in path:
            assert response.json()["error"]["code"] == code, (name, response.text)
