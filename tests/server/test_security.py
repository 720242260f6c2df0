"""Access control: the admin token, per-session agent keys, a static API key, safe binding."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actorproxy import ProxyConfig, open_proxy
from actorproxy.cli import main
from actorproxy.runtime.runtime import open_runtime
from actorproxy.serve import RunningProxy
from actorproxy.server.app import create_app
from actorproxy.server.auth import AccessPolicy, exposure_problem, route_kind
from actorproxy.sim import SimConfig, SimEngine

ADMIN = "s3cret-admin"
CHAT = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
BEARER = {"Authorization": f"Bearer {ADMIN}"}


@pytest.fixture
async def engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=5, token_interval=0.0005))


async def _serve(engine: SimEngine, tokenizer: Any, **settings: Any) -> AsyncIterator[RunningProxy]:
    async with open_proxy(ProxyConfig.of(port=0, **settings), backend=engine, tokenizer=tokenizer) as running:
        yield running


@pytest.fixture
async def guarded(engine: SimEngine, tokenizer: Any) -> AsyncIterator[RunningProxy]:
    async for running in _serve(engine, tokenizer, admin_token=ADMIN, agent_auth="session-key"):
        yield running


@pytest.fixture
async def http(guarded: RunningProxy) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=guarded.url, timeout=30) as client:
        yield client


async def _open(http: httpx.AsyncClient, session_id: str) -> dict[str, Any]:
    response = await http.post("/session/open", json={"session_id": session_id}, headers=BEARER)
    assert response.status_code == 200, response.text
    opened: dict[str, Any] = response.json()
    return opened


ADMIN_CALLS = [
    ("POST", "/v1/rollout/pause", {"mode": "abort"}),
    ("POST", "/v1/rollout/resume", {"weight_version": "forged"}),
    ("GET", "/v1/rollout/pause_state", None),
    ("POST", "/trajectory/read", {"drain": True}),
    ("POST", "/trajectory/read", {"drain": True, "lease": 60}),
    ("POST", "/trajectory/ack", {"lease": "someone-elses"}),
    ("GET", "/trajectory/stats", None),
    ("POST", "/session/finalize", {"session_id": "victim"}),
    ("GET", "/session/victim", None),
    ("POST", "/session/open", {}),
    # Every other route that finalizes, grades, submits steps or hands a trajectory to training.
    ("POST", "/session/finalize", {"session_id": "agent-a", "reward": 1.0}),
    ("POST", "/complete_trajectory/agent-a", {"reward": 1.0}),
    ("POST", "/submit_steps", {"steps": [{"trajectory_uid": "agent-a", "prompt_uid": "p", "prompt_ids": [1],
                                          "response_ids": [2], "step_index": 0, "reward": 1.0, "is_last": True}]}),
    ("POST", "/compute_reward", {"trajectory_uid": "agent-a", "messages": []}),
    ("POST", "/trajectory/fetch_batch", {"groups": 1, "rollouts_per_group": 1, "timeout_s": 0}),
    ("POST", "/init_trajectory", {}),
    ("POST", "/generate", {"trajectory_uid": "agent-a", "prompt_uid": "p", "messages": []}),
    ("POST", "/agent-a/p/v1/register_trajectory", {"channel": "train"}),
    ("POST", "/sess/agent-a/v1/register_trajectory", {"channel": "train"}),
]


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
async def test_admin_routes_need_the_admin_token(
    http: httpx.AsyncClient, method: str, path: str, body: dict[str, Any] | None
) -> None:
    key = (await _open(http, "agent-a"))["api_key"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {key}"}, {"x-api-key": ADMIN}):
        response = await http.request(method, path, json=body, headers=headers)
        assert response.status_code == 401, (path, headers, response.text)
        error = response.json()["error"]
        assert error["type"] == "authentication_error"
        assert error["code"] == "admin_token_required"
    # The same call with the token is not refused for want of it.
    response = await http.request(method, path, json=body, headers=BEARER)
    assert response.status_code != 401, response.text


async def test_health_shows_details_only_to_the_admin(http: httpx.AsyncClient) -> None:
    anyone = await http.get("/health")
    assert anyone.status_code == 200
    assert anyone.json() == {"status": "ok"}
    admin = await http.get("/health", headers=BEARER)
    assert admin.json()["status"] == "ok"
    assert "config" in admin.json() and "store" in admin.json()
    assert "admin_token" not in admin.json()["config"]["security"]
    assert ADMIN not in admin.text


async def test_a_session_key_is_refused_on_every_route_of_another_sessions_url(http: httpx.AsyncClient) -> None:
    mine = await _open(http, "agent-a")
    await _open(http, "agent-b")
    key = {"Authorization": f"Bearer {mine['api_key']}"}
    count = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    calls = [
        ("GET", "/sess/agent-b/v1/models", None),
        ("POST", "/sess/agent-b/v1/messages/count_tokens", count),
        ("POST", "/sess/agent-b/v1/messages", {"not": "a body"}),  # refused for its key before its body is read
        ("POST", "/agent-b/group-1/v1/complete_trajectory", {"not": "a body"}),
    ]
    for method, path, body in calls:
        response = await http.request(method, path, json=body, headers=key)
        assert response.status_code == 401, (path, response.text)
        error = response.json().get("error", {})
        assert error.get("code") == "wrong_session" or "another session" in str(error), (path, response.text)
    # Its own session's routes stay open to it.
    response = await http.get("/sess/agent-a/v1/models", headers=key)
    assert response.status_code == 200, response.text


async def test_a_session_key_opens_its_own_session_only(http: httpx.AsyncClient, guarded: RunningProxy) -> None:
    openai = pytest.importorskip("openai")
    mine = await _open(http, "agent-a")
    other = await _open(http, "agent-b")
    assert mine["base_url"].endswith("/sess/agent-a") and mine["openai_base_url"].endswith("/sess/agent-a/v1")
    async with openai.AsyncOpenAI(base_url=mine["openai_base_url"], api_key=mine["api_key"], max_retries=0) as client:
        reply = await client.chat.completions.create(**CHAT)
    assert reply.choices[0].message is not None

    # The same key on the other session's URL, or naming it by header, is refused.
    async with openai.AsyncOpenAI(base_url=other["openai_base_url"], api_key=mine["api_key"], max_retries=0) as wrong:
        with pytest.raises(openai.AuthenticationError):
            await wrong.chat.completions.create(**CHAT)
    response = await http.post(
        "/v1/chat/completions",
        json=CHAT,
        headers={"Authorization": f"Bearer {mine['api_key']}", "X-Session-Id": "agent-b"},
    )
    assert response.status_code == 401 and response.json()["error"]["code"] == "wrong_session"
    # With no other name, the key names its session.
    own = {"Authorization": f"Bearer {mine['api_key']}"}
    response = await http.post("/v1/chat/completions", json=CHAT, headers=own)
    assert response.status_code == 200, response.text
    # No key, or a forged one, is refused before anything is recorded.
    forged = mine["api_key"][:-1] + ("0" if mine["api_key"][-1] != "0" else "1")
    for headers in ({}, {"Authorization": f"Bearer {forged}"}, {"Authorization": "Bearer ap1.!!.zz"}):
        response = await http.post("/sess/agent-b/v1/chat/completions", json=CHAT, headers=headers)
        assert response.status_code == 401, response.text
    described = await http.get("/session/agent-b", headers=BEARER)
    assert described.status_code == 404  # agent-b never ran a turn

    stats = (await http.get("/session/agent-a", headers=BEARER)).json()
    assert stats["steps"] == 2


async def test_anthropic_clients_send_the_key_as_x_api_key(http: httpx.AsyncClient) -> None:
    anthropic = pytest.importorskip("anthropic")
    mine = await _open(http, "claude-1")
    async with anthropic.AsyncAnthropic(base_url=mine["base_url"], api_key=mine["api_key"], max_retries=0) as client:
        message = await client.messages.create(**MESSAGES)
    assert message.role == "assistant"
    response = await http.post("/sess/claude-2/v1/messages", json=MESSAGES, headers={"x-api-key": mine["api_key"]})
    assert response.status_code == 401
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == "authentication_error"


async def test_the_admin_token_opens_agent_routes_too(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/chat/completions", json=CHAT, headers={**BEARER, "X-Session-Id": "trainer"})
    assert response.status_code == 200, response.text


async def test_a_static_api_key(engine: SimEngine, tokenizer: Any) -> None:
    async for running in _serve(engine, tokenizer, api_key="k-123"):
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            headers = {"X-Session-Id": "s"}
            refused = await http.post("/v1/chat/completions", json=CHAT, headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "missing_api_key"
            wrong = await http.post("/v1/chat/completions", json=CHAT, headers={**headers, "x-api-key": "k-12"})
            assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
            ok = await http.post("/v1/chat/completions", json=CHAT, headers={**headers, "x-api-key": "k-123"})
            assert ok.status_code == 200
            # No admin token: the trainer's routes stay open (loopback only, see test_refuses_*).
            assert (await http.get("/trajectory/stats")).status_code == 200


async def test_without_settings_everything_stays_open(engine: SimEngine, tokenizer: Any) -> None:
    async for running in _serve(engine, tokenizer):
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            ok = await http.post("/v1/chat/completions", json=CHAT, headers={"X-Session-Id": "s"})
            assert ok.status_code == 200
            opened = (await http.post("/session/open", json={})).json()
            assert opened["api_key"] is None and len(opened["session_id"]) == 32
            assert "config" in (await http.get("/health")).json()


def test_route_kinds() -> None:
    assert route_kind("/v1/chat/completions") == "agent"
    assert route_kind("/sess/x/v1/messages") == "agent"
    assert route_kind("/t/p/v1/messages/count_tokens") == "agent"
    assert route_kind("/v1/rollout/pause") == "admin"
    assert route_kind("/trajectory/read") == "admin"
    assert route_kind("/no/such/route") == "admin"
    assert route_kind("/health") == "public"
    assert route_kind("/ui/assets/app.js") == "public"
    assert route_kind("/ui") == "admin" and route_kind("/ui/api/overview") == "admin"


async def test_the_route_table_names_every_agent_route(engine: SimEngine, tokenizer: Any) -> None:
    """Every route is the admin's unless listed here: a new route that settles a trajectory cannot slip out."""
    config = ProxyConfig.of(port=0, admin_token=ADMIN, agent_auth="session-key")
    async with open_runtime(config, backend=engine, tokenizer=tokenizer) as runtime:
        app = create_app(runtime)
        rules = {rule.rule: re.sub(r"<[^>]+>", "x", rule.rule) for rule in app.url_map.iter_rules()}
    agent = sorted(rule for rule, path in rules.items() if route_kind(path) == "agent")
    turns = ["/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/models", "/v1/responses"]
    mounts = ["", "/<url_session>/<url_instance>", "/sess/<url_session>"]
    completion = "/<url_session>/<url_instance>/v1/complete_trajectory"
    assert agent == sorted([m + t for m in mounts for t in turns] + [completion])
    assert route_kind("/sess/x/v1/complete_trajectory") == "agent"  # its rule is the one above (with "sess")
    assert route_kind("/t/p/v1/register_trajectory") == "admin"


@given(st.text(max_size=120))
@settings(derandomize=True, max_examples=400)
def test_any_presented_key_is_refused_without_crashing(text: str) -> None:
    policy = AccessPolicy.build(admin_token=None, agent_auth="session-key", session_key_secret="x")
    assert policy.key_session(text) is None
    assert policy.key_session(policy.session_key(text)) == text


def test_session_keys_survive_a_restart_with_the_same_admin_token() -> None:
    a = AccessPolicy.build(admin_token="t", agent_auth="session-key")
    b = AccessPolicy.build(admin_token="t", agent_auth="session-key")
    c = AccessPolicy.build(admin_token="u", agent_auth="session-key")
    assert b.key_session(a.session_key("s")) == "s"
    assert c.key_session(a.session_key("s")) is None


def test_refuses_a_public_address_without_an_admin_token(capsys: pytest.CaptureFixture[str]) -> None:
    assert exposure_problem("0.0.0.0", admin_token=None, insecure=False) is not None
    assert exposure_problem("::", admin_token=None, insecure=False) is not None
    assert exposure_problem("0.0.0.0", admin_token="t", insecure=False) is None
    assert exposure_problem("0.0.0.0", admin_token=None, insecure=True) is None
    assert exposure_problem("127.0.0.1", admin_token=None, insecure=False) is None
    assert exposure_problem("::1", admin_token=None, insecure=False) is None
    assert exposure_problem("localhost", admin_token=None, insecure=False) is None
    assert main(["run", "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--admin-token" in err and "--insecure" in err


async def test_proxy_client_carries_the_admin_token(guarded: RunningProxy) -> None:
    """The trainer's ProxyClient works against a guarded proxy when given the token, and only then."""
    from actorproxy import ProxyClient
    from actorproxy.client import ProxyError

    async with ProxyClient(guarded.url) as anonymous:
        with pytest.raises(ProxyError) as refused:
            await anonymous.stats()
    assert refused.value.status == 401
    async with ProxyClient(guarded.url, admin_token=ADMIN) as trainer:
        assert isinstance(await trainer.stats(), dict)
        batch = await trainer.fetch_batch(groups=1, rollouts_per_group=1, timeout_s=0)
    assert batch.data == [] and not batch.complete
