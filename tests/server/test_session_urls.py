"""Per-session URLs: a black-box agent names its session with nothing but a base URL."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
from _util import WEATHER_TOOL, WEATHER_TOOL_ANTHROPIC, finalized_at

from actorproxy import ProxyClient
from actorproxy.client import ProxyError as ClientError
from actorproxy.errors import BadRequest
from actorproxy.serve import RunningProxy
from actorproxy.server.identity import resolve_identity
from actorproxy.sim import SimConfig, SimEngine

REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
ANSWER = "It is 4 °C in Oslo."
TOOL = WEATHER_TOOL_ANTHROPIC
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
MESSAGES = {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
async def engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=3, token_interval=0.0005))


async def test_openai_sdk_with_a_session_base_url(proxy: RunningProxy, engine: SimEngine) -> None:
    openai = pytest.importorskip("openai")
    engine.script(REPLY, ANSWER, routing_key="oai-url")

    def agent() -> tuple[str, str]:
        # A header naming another session loses to the URL.
        client = openai.OpenAI(base_url=f"{proxy.url}/sess/oai-url/v1", api_key="unused", max_retries=0,
                               default_headers={"X-Session-Id": "header-loses"})
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
        reply = client.chat.completions.create(model="m", messages=messages, tools=[WEATHER_TOOL]).choices[0]
        call = reply.message.tool_calls[0]
        messages += [reply.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "4 °C"}]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="m", messages=messages, tools=[WEATHER_TOOL], stream=True) if chunk.choices)
        model = client.models.list().data[0].id
        client.close()
        return text, model

    text, model = await trio.to_thread.run_sync(agent)
    assert text == ANSWER and model == "actorproxy"
    (segment,), _ = await finalized_at(proxy.url, "oai-url")
    assert segment["num_steps"] == 2 and segment["trajectory_id"] == "oai-url#0"
    async with ProxyClient(proxy.url) as client:
        with pytest.raises(ClientError) as caught:
            await client.finalize_session("header-loses")
    assert caught.value.status == 404


async def test_anthropic_sdk_with_a_session_base_url(proxy: RunningProxy, engine: SimEngine) -> None:
    anthropic = pytest.importorskip("anthropic")
    engine.script(REPLY, ANSWER, routing_key="anth-url")

    def agent() -> tuple[str, int]:
        # Claude Code sends its own session header on every call: the URL still wins.
        client = anthropic.Anthropic(base_url=f"{proxy.url}/sess/anth-url", api_key="unused", max_retries=0,
                                     default_headers={"X-Claude-Code-Session-Id": "cc-loses"})
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
        counted = client.messages.count_tokens(model="m", messages=messages, tools=[TOOL]).input_tokens
        first = client.messages.create(model="m", max_tokens=100, messages=messages, tools=[TOOL])
        assert first.usage.input_tokens == counted
        call = first.content[-1]
        messages += [{"role": "assistant", "content": first.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "4 °C"}]}]
        with client.messages.stream(model="m", max_tokens=100, messages=messages, tools=[TOOL]) as stream:
            final = stream.get_final_message()
        client.close()
        return final.content[0].text, counted

    text, counted = await trio.to_thread.run_sync(agent)
    assert text == ANSWER and counted > 0
    (segment,), _ = await finalized_at(proxy.url, "anth-url")
    assert segment["num_steps"] == 2 and segment["trajectory_id"] == "anth-url#0"


async def test_claw_style_url_names_session_and_instance(http: httpx.AsyncClient, proxy: RunningProxy) -> None:
    headers = {"X-Session-Id": "loses", "X-Instance-Id": "loses-too"}
    response = await http.post("/traj-1/prompt-a/v1/chat/completions", json=CHAT, headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["actorproxy"]["session_id"] == "traj-1"
    response = await http.post("/traj-2/prompt-b/v1/messages?beta=true", json=MESSAGES)
    assert response.status_code == 200 and response.json()["actorproxy"]["session_id"] == "traj-2"
    count = await http.post("/traj-2/prompt-b/v1/messages/count_tokens", json=MESSAGES)
    assert count.status_code == 200 and count.json()["input_tokens"] > 0
    models = await http.get("/traj-2/prompt-b/v1/models")
    assert models.json()["data"][0]["id"] == "actorproxy"
    for session, instance in (("traj-1", "prompt-a"), ("traj-2", "prompt-b")):
        (segment,), _ = await finalized_at(proxy.url, session)
        assert segment["instance_id"] == instance and segment["num_steps"] == 1
    assert (await http.get("/session/loses")).status_code == 404


async def test_session_routes_do_not_shadow_the_others(http: httpx.AsyncClient) -> None:
    # /sess/<id>/... is the per-session route, not a Claw URL with trajectory "sess".
    response = await http.post("/sess/s1/v1/chat/completions", json=CHAT)
    assert response.json()["actorproxy"]["session_id"] == "s1"
    models = await http.get("/sess/s1/v1/models")
    assert models.status_code == 200 and models.json()["object"] == "list"
    # /session/<path> still describes a session, whatever its id looks like.
    described = await http.get("/session/s1")
    assert described.status_code == 200 and described.json()["session_id"] == "s1"
    shadow = await http.get("/session/s1/v1/models")
    assert shadow.status_code == 404 and "no live session 's1/v1/models'" in shadow.json()["error"]["message"]
    assert (await http.get("/health")).json()["status"] == "ok"
    assert (await http.get("/v1/models")).status_code == 200
    assert (await http.get("/trajectory/stats")).status_code == 200
    assert (await http.post("/session/finalize", json={"session_id": "s1"})).json()["steps"] == 1
    read = await http.post("/trajectory/read", json={"session_id": "s1"})
    assert read.status_code == 200 and read.json()["data"][0]["trajectory_id"] == "s1#0"
    # The plain routes still want a session.
    plain = await http.post("/v1/chat/completions", json=CHAT)
    assert plain.status_code == 400 and plain.json()["error"]["code"] == "missing_session_id"
    # An unknown route under a session URL is a 404 in the caller's format.
    missing = await http.post("/sess/s1/v1/completions", json=CHAT)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_identity_precedence() -> None:
    every = {"X-Session-Id": "header", "X-Claude-Code-Session-Id": "claude", "X-SMG-Routing-Key": "smg"}

    def session(headers: dict[str, str], url: str | None = None) -> str:
        return resolve_identity(headers, "body", url_session=url).session_id

    assert session(every, "url") == "url"
    assert session(every) == "header"
    assert session({k: v for k, v in every.items() if k != "X-Session-Id"}) == "claude"
    assert session({"X-SMG-Routing-Key": "smg"}) == "smg"
    assert session({}) == "body"
    assert session({"X-Session-Id": "  "}) == "body"  # blank counts as absent
    identity = resolve_identity({"X-Instance-Id": "header"}, None, "body", url_session="t", url_instance="p")
    assert (identity.session_id, identity.instance_id) == ("t", "p")
    assert resolve_identity({"X-Instance-Id": "header"}, "s", "body").instance_id == "header"
    with pytest.raises(BadRequest, match="X-Claude-Code-Session-Id"):
        resolve_identity({"X-Claude-Code-Session-Id": "x" * 300})
    with pytest.raises(BadRequest, match="no session id"):
        resolve_identity({})
    for control in ("a\x00b", "a\tb", "a\x1fb", "a\x7fb"):  # control characters are refused, anywhere inside
        with pytest.raises(BadRequest, match="printable"):
            resolve_identity({"X-Session-Id": control})
    assert resolve_identity({"X-Session-Id": "sé-\x80~"}).session_id == "sé-\x80~"  # the rest is kept


async def test_claude_code_session_header(http: httpx.AsyncClient) -> None:
    headers = {"X-Claude-Code-Session-Id": "cc-1", "X-SMG-Routing-Key": "router"}
    response = await http.post("/v1/messages", json=MESSAGES, headers=headers)
    assert response.status_code == 200 and response.json()["actorproxy"]["session_id"] == "cc-1"
