"""The Anthropic Messages API end to end: the official `anthropic` SDK over real HTTP."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest
import trio
from _util import WEATHER_CHAT, WEATHER_TOOL, WEATHER_TOOL_ANTHROPIC, WrappingBackend, finalized_at, hang_up_after

from actorproxy import ProxyConfig, open_proxy
from actorproxy.core.messages import AssistantOutput, ToolCall
from actorproxy.core.parser import OutputDelta, ToolCallDelta
from actorproxy.core.turn_events import TurnAccepted, TurnDone
from actorproxy.engines.base import BackendError, GenerateRequest, TokenDelta
from actorproxy.errors import Conflict, EngineError, NotFound, Overloaded
from actorproxy.protocols import anthropic as anthropic_api
from actorproxy.protocols.anthropic_types import AnthropicMessage, AnthropicTool
from actorproxy.schema.converter import structure
from actorproxy.serve import RunningProxy
from actorproxy.sim import SimConfig, SimEngine

anthropic = pytest.importorskip("anthropic")

REPLY, ANSWER, ANSWER_TEXT, SYSTEM, QUESTION = WEATHER_CHAT
TOOL = WEATHER_TOOL_ANTHROPIC
THINKING = {"type": "enabled", "budget_tokens": 1024}  # thinking blocks come back only when it is enabled


async def in_thread(base_url: str, session: str | None, work: Callable[[Any], Any]) -> Any:
    """Run ``work(client)`` with a sync Anthropic client in a worker thread, then close the client."""

    def run() -> Any:
        headers = {"X-Session-Id": session} if session else {}
        client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, default_headers=headers)
        try:
            return work(client)
        finally:
            client.close()

    return await trio.to_thread.run_sync(run)


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """``(event, data)`` pairs of an Anthropic stream; every event has both lines."""
    events = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: "), block
        name, data = lines[0][len("event: ") :], json.loads(lines[1][len("data: ") :])
        assert data["type"] == name
        events.append((name, data))
    return events


def check_block_order(events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Assert the stream's shape; returns the block types in order."""
    names = [name for name, _ in events if name != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    blocks: list[str] = []
    open_index: int | None = None
    for name, data in events:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append(data["content_block"]["type"])
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        elif name in ("message_delta", "message_stop"):
            assert open_index is None
    return blocks


async def test_tool_loop_non_streaming(proxy: RunningProxy, engine: SimEngine) -> None:
    engine.script(REPLY, ANSWER, routing_key="anth-plain")

    def loop(client: Any) -> list[Any]:
        messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
        kwargs = {"model": "claude-x", "max_tokens": 256, "system": SYSTEM, "tools": [TOOL], "thinking": THINKING}
        first = client.messages.create(messages=messages, **kwargs)
        call = first.content[-1]
        messages += [{"role": "assistant", "content": first.content},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                   "content": "18 °C"}]}]
        second = client.messages.create(messages=messages, **kwargs)
        return [first, second]

    first, second = await in_thread(proxy.url, "anth-plain", loop)
    assert first.type == "message" and first.role == "assistant" and first.model == "claude-x"
    assert first.id.startswith("msg_")
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    assert first.content[0].thinking == "The user wants weather."
    assert first.content[0].signature == anthropic_api.thinking_signature("The user wants weather.")
    assert first.content[1].name == "get_weather" and first.content[1].input == {"city": "Zürich", "days": 2}
    assert second.stop_reason == "end_turn"
    assert [b.type for b in second.content] == ["thinking", "text"]
    assert second.content[1].text == ANSWER_TEXT
    (segment,), steps = await finalized_at(proxy.url, "anth-plain")
    assert segment["num_steps"] == 2 and [s["status"] for s in steps] == ["completed", "completed"]
    assert [s["prompt_tokens"] for s in steps] == [first.usage.input_tokens, second.usage.input_tokens]
    assert [s["completion_tokens"] for s in steps] == [first.usage.output_tokens, second.usage.output_tokens]
    assert sum(segment["loss_mask"]) == first.usage.output_tokens + second.usage.output_tokens


async def test_tool_loop_streaming(proxy: RunningProxy, engine: SimEngine) -> None:
    engine.script(REPLY, ANSWER, routing_key="anth-stream")

    # Raw events from the SDK: the first turn (a thinking block, then a tool_use block).
    def first_turn(client: Any) -> list[Any]:
        return list(client.messages.create(
            messages=[{"role": "user", "content": QUESTION}], model="claude-x", max_tokens=256,
            system=SYSTEM, tools=[TOOL], thinking=THINKING, stream=True))

    raw = await in_thread(proxy.url, "anth-stream", first_turn)
    kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in raw]
    assert kinds[0] == ("message_start", None) and raw[0].message.content == []
    assert kinds[1] == ("content_block_start", None) and raw[1].content_block.type == "thinking"
    thinking = [e for e, kind in zip(raw, kinds, strict=True) if kind[1] == "thinking_delta"]
    assert len(thinking) > 1 and "".join(e.delta.thinking for e in thinking) == "The user wants weather."
    signature_at = kinds.index(("content_block_delta", "signature_delta"))
    assert kinds[signature_at + 1] == ("content_block_stop", None) and raw[signature_at + 1].index == 0
    assert raw[signature_at].delta.signature == anthropic_api.thinking_signature("The user wants weather.")
    start = raw[signature_at + 2]
    assert start.type == "content_block_start" and start.index == 1
    assert start.content_block.type == "tool_use" and start.content_block.input == {}
    partial = "".join(e.delta.partial_json for e, kind in zip(raw, kinds, strict=True) if kind[1] == "input_json_delta")
    assert json.loads(partial) == {"city": "Zürich", "days": 2}
    assert kinds[-3:] == [("content_block_stop", None), ("message_delta", None), ("message_stop", None)]
    assert raw[-2].delta.stop_reason == "tool_use" and raw[-2].delta.stop_sequence is None
    assert raw[0].message.usage.input_tokens > 0 and raw[-2].usage.output_tokens > 0
    call_id = start.content_block.id

    # Second turn through the SDK's stream helper, echoing what the first stream assembled.
    def second_turn(client: Any) -> tuple[list[str], Any]:
        echo = [{"type": "thinking", "thinking": "The user wants weather.",
                 "signature": raw[signature_at].delta.signature},
                {"type": "tool_use", "id": call_id, "name": "get_weather", "input": json.loads(partial)}]
        messages = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": echo},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                                  "content": [{"type": "text", "text": "18 °C"}]}]}]
        with client.messages.stream(messages=messages, model="claude-x", max_tokens=256, system=SYSTEM,
                                    tools=[TOOL], thinking=THINKING) as stream:
            texts = list(stream.text_stream)
            return texts, stream.get_final_message()

    texts, final = await in_thread(proxy.url, "anth-stream", second_turn)
    assert len(texts) > 3 and "".join(texts) == ANSWER_TEXT
    assert final.stop_reason == "end_turn" and [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == "Got it." and final.content[1].text == ANSWER_TEXT
    (segment,), steps = await finalized_at(proxy.url, "anth-stream")
    assert segment["num_steps"] == 2 and [s["status"] for s in steps] == ["completed", "completed"]
    assert steps[1]["completion_tokens"] == final.usage.output_tokens


async def test_stream_wire_format(http: httpx.AsyncClient, engine: SimEngine) -> None:
    engine.script(REPLY, routing_key="wire")
    body = {"model": "m", "max_tokens": 100, "tools": [TOOL], "stream": True, "thinking": THINKING,
            "messages": [{"role": "user", "content": QUESTION}]}
    response = await http.post("/v1/messages", json=body, headers={"X-Session-Id": "wire"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in response.text
    events = sse_events(response.text)
    assert check_block_order(events) == ["thinking", "tool_use"]
    delta = [data for name, data in events if name == "message_delta"][0]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(engine.tokenizer.encode(REPLY)) + 1  # + <|im_end|>


async def test_anthropic_and_openai_record_the_same_tokens(proxy: RunningProxy, engine: SimEngine) -> None:
    openai = pytest.importorskip("openai")
    for session in ("eq-anthropic", "eq-openai", "eq-anthropic-stream"):
        engine.script(REPLY, ANSWER, routing_key=session)

    def via_anthropic(stream: bool) -> Callable[[Any], None]:
        def work(client: Any) -> None:
            messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
            kwargs = {"model": "m", "max_tokens": 256, "system": [{"type": "text", "text": SYSTEM}],
                      "tools": [TOOL], "thinking": {"type": "enabled", "budget_tokens": 1024}}
            if stream:
                with client.messages.stream(messages=messages, **kwargs) as s:
                    reply = s.get_final_message()
            else:
                reply = client.messages.create(messages=messages, **kwargs)
            results = [{"type": "tool_result", "tool_use_id": b.id, "content": "18 °C", "is_error": False}
                       for b in reply.content if b.type == "tool_use"]
            messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": results}]
            client.messages.create(messages=messages, **kwargs)
        return work

    def via_openai() -> None:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0,
                               default_headers={"X-Session-Id": "eq-openai"})
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": QUESTION}]
        kwargs: dict[str, Any] = {"model": "m", "tools": [WEATHER_TOOL], "extra_body": {"enable_thinking": True}}
        reply = client.chat.completions.create(messages=messages, **kwargs).choices[0].message
        messages += [reply.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "18 °C"}]
        client.chat.completions.create(messages=messages, **kwargs)
        client.close()

    await in_thread(proxy.url, "eq-anthropic", via_anthropic(False))
    await in_thread(proxy.url, "eq-anthropic-stream", via_anthropic(True))
    await trio.to_thread.run_sync(via_openai)
    segments: dict[str, dict[str, Any]] = {}
    for name in ("eq-anthropic", "eq-anthropic-stream", "eq-openai"):
        (segments[name],), _ = await finalized_at(proxy.url, name)
    reference = segments["eq-openai"]
    assert reference["num_steps"] == 2 and reference["start_reason"] == "session_start"
    for name in ("eq-anthropic", "eq-anthropic-stream"):
        assert segments[name]["num_steps"] == 2
        assert segments[name]["token_ids"] == reference["token_ids"], name
        assert segments[name]["loss_mask"] == reference["loss_mask"], name


async def test_stop_reasons(http: httpx.AsyncClient, engine: SimEngine) -> None:
    text = "Thought: look around.\nAction: ls\nObservation: files"
    for session in ("stop-plain", "stop-stream"):
        engine.script(text, "word " * 50, routing_key=session)
    body = {"model": "m", "max_tokens": 100, "stop_sequences": ["Observation:"],
            "messages": [{"role": "user", "content": "go"}]}
    plain = (await http.post("/v1/messages", json=body, headers={"X-Session-Id": "stop-plain"})).json()
    assert plain["stop_reason"] == "stop_sequence" and plain["stop_sequence"] == "Observation:"
    assert plain["content"] == [{"type": "text", "text": "Thought: look around.\nAction: ls\n"}]
    events = sse_events((await http.post("/v1/messages", json={**body, "stream": True},
                                         headers={"X-Session-Id": "stop-stream"})).text)
    assert check_block_order(events) == ["text"]
    assert "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta") == plain["content"][0]["text"]
    assert [d["delta"] for n, d in events if n == "message_delta"] == [
        {"stop_reason": "stop_sequence", "stop_sequence": "Observation:"}]
    # The length limit is max_tokens.
    follow = {"model": "m", "max_tokens": 5, "messages": [
        {"role": "user", "content": "go"}, {"role": "assistant", "content": plain["content"]},
        {"role": "user", "content": "Observation: a.txt"}]}
    limited = (await http.post("/v1/messages", json=follow, headers={"X-Session-Id": "stop-plain"})).json()
    assert limited["stop_reason"] == "max_tokens" and limited["usage"]["output_tokens"] == 5


def test_error_types() -> None:
    assert anthropic_api.proxy_error_json(NotFound("x"))["error"]["type"] == "not_found_error"
    assert anthropic_api.proxy_error_json(Conflict("x"))["error"]["type"] == "invalid_request_error"
    assert anthropic_api.proxy_error_json(Overloaded("x"))["error"]["type"] == "overloaded_error"
    assert anthropic_api.proxy_error_json(EngineError("x")) == {
        "type": "error", "error": {"type": "api_error", "message": "x"}}
    assert anthropic_api.error_type(429) == "rate_limit_error"
    assert anthropic_api.error_type(400) == "invalid_request_error"
    assert anthropic_api.error_type(500) == "api_error"


GOOD = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hello"}]}

BAD_BODIES: list[tuple[Any, str]] = [
    (b"{not json", "not valid JSON"),
    (b"", "empty"),
    ([1], "JSON object"),
    ({k: v for k, v in GOOD.items() if k != "max_tokens"}, "max_tokens"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "max_tokens": True}, "max_tokens"),
    ({k: v for k, v in GOOD.items() if k != "model"}, "model"),
    ({**GOOD, "messages": []}, "messages"),
    ({**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({**GOOD, "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({**GOOD, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "image blocks are not supported"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]}]}, "image blocks"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content[0]"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]},
     "'tool_use'"),
    ({**GOOD, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "a", "name": "f", "input": "{}"}]}, {"role": "user", "content": "b"}]},
     "messages[1].content[0].input"),
    ({**GOOD, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "The answer is"}]},
     "prefill"),
    ({**GOOD, "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({**GOOD, "tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({**GOOD, "system": 5}, "system"),
    ({**GOOD, "temperature": 1.5}, "temperature"),
    ({**GOOD, "stream": "yes"}, "stream"),
    ({**GOOD, "thinking": "on"}, "thinking"),
    ({**GOOD, "stop_sequences": "END"}, "stop_sequences"),
    ({**GOOD, "tool_choice": "auto"}, "tool_choice"),
]


async def test_bad_input_gets_anthropic_errors_and_loses_nothing(http: httpx.AsyncClient, proxy: RunningProxy) -> None:
    headers = {"X-Session-Id": "keep"}
    assert (await http.post("/v1/messages", json=GOOD, headers=headers)).status_code == 200
    before = (await http.get("/session/keep")).json()
    for path in ("/v1/messages", "/v1/messages/count_tokens", "/sess/keep/v1/messages"):
        for body, hint in BAD_BODIES:
            if path.endswith("count_tokens") and hint == "max_tokens":
                continue  # count_tokens needs no max_tokens (but still checks one that is sent)
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            response = await http.post(path, content=content, headers={**headers, "content-type": "application/json"})
            assert response.status_code == 400, (path, body, response.text)
            error = response.json()
            assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
            assert hint in error["error"]["message"], (hint, error)
    # No session id, wrong method, unknown route: Anthropic's format too.
    response = await http.post("/v1/messages", json=GOOD)
    assert response.status_code == 400 and "no session id" in response.json()["error"]["message"]
    for response, status, kind in (
        (await http.get("/v1/messages"), 405, "invalid_request_error"),
        (await http.post("/v1/messages/batches", json=GOOD), 404, "not_found_error"),
    ):
        assert response.status_code == status and response.json()["error"]["type"] == kind
    assert (await http.get("/session/keep")).json() == before
    # The SDK maps the 400 to its own exception.

    def sdk_error(client: Any) -> Any:
        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model="m", max_tokens=10, messages=[{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])
        return caught.value

    error = await in_thread(proxy.url, "keep", sdk_error)
    assert error.status_code == 400 and error.body["error"]["type"] == "invalid_request_error"
    (segment,), steps = await finalized_at(proxy.url, "keep")
    assert [s["status"] for s in steps] == ["completed"] and segment["num_steps"] == 1


async def test_unknown_fields_ignored_and_beta_query(proxy: RunningProxy, engine: SimEngine,
                                                     http: httpx.AsyncClient) -> None:
    engine.script("Hello!", "Hello again!", "And again!", routing_key="extra")
    body = {
        **GOOD, "metadata": {"user_id": "user_abc_account_x_session_y"},
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
        "top_k": 5, "service_tier": "auto", "output_config": {"effort": "high"}, "future_field": [1, 2],
        "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "thinking": {"type": "adaptive"},
        "tools": [{**TOOL, "cache_control": {"type": "ephemeral"}, "type": "custom", "strict": True}],
    }
    response = await http.post("/v1/messages?beta=true", json=body, headers={"X-Session-Id": "extra"})
    assert response.status_code == 200, response.text
    assert response.json()["content"] == [{"type": "text", "text": "Hello!"}]

    def beta(client: Any) -> tuple[Any, Any]:
        message = client.beta.messages.create(
            model="m", max_tokens=50, betas=["interleaved-thinking-2025-05-14"],
            messages=[{"role": "user", "content": "hello"}], metadata={"user_id": "u"})
        count = client.beta.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hello"}])
        return message, count

    message, count = await in_thread(proxy.url, "extra", beta)
    assert message.content[0].text == "Hello again!" and count.input_tokens > 0
    # metadata.user_id does not name a session.
    response = await http.post("/v1/messages", json=body)
    assert response.status_code == 400 and "no session id" in response.json()["error"]["message"]


async def test_count_tokens_matches_the_next_turn(proxy: RunningProxy, engine: SimEngine) -> None:
    engine.script(REPLY, routing_key="count")

    def work(client: Any) -> tuple[int, int]:
        kwargs: dict[str, Any] = {"model": "m", "system": SYSTEM, "tools": [TOOL],
                                  "messages": [{"role": "user", "content": QUESTION}]}
        counted = client.messages.count_tokens(**kwargs).input_tokens
        reply = client.messages.create(max_tokens=100, **kwargs)
        return counted, reply.usage.input_tokens

    counted, used = await in_thread(proxy.url, "count", work)
    assert counted == used > 0
    # Counting is not a turn: the session holds one step.
    (_,), steps = await finalized_at(proxy.url, "count")
    assert len(steps) == 1


async def test_ping_heartbeat_in_a_slow_stream(tokenizer: Any) -> None:
    slow = SimEngine(tokenizer, SimConfig(seed=5, token_interval=0.25))
    slow.script("Hello there friend.", routing_key="slow")
    async with open_proxy(ProxyConfig.of(port=0, heartbeat_interval=0.05), backend=slow,
                          tokenizer=tokenizer) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            body = {**GOOD, "stream": True}
            response = await http.post("/v1/messages", json=body, headers={"X-Session-Id": "slow"})
    events = sse_events(response.text)
    assert check_block_order(events) == ["text"]
    names = [name for name, _ in events]
    first_delta = names.index("content_block_delta")
    assert "ping" in names[first_delta:names.index("message_delta")], names  # between two tokens
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == "Hello there friend."


@attrs.define
class _Failing:
    """A generation that fails after ``after`` token events."""

    inner: Any
    after: int

    @property
    def rid(self) -> str:
        return str(self.inner.rid)

    async def __aiter__(self) -> AsyncIterator[Any]:
        seen = 0
        async for event in self.inner:
            if isinstance(event, TokenDelta):
                seen += 1
                if seen > self.after:
                    raise BackendError("engine fell over")
            yield event

    async def abort(self) -> None:
        await self.inner.abort()

    def abort_soon(self, batch: Any = None) -> Any:
        return self.inner.abort_soon(batch)


@attrs.define
class FailingBackend(WrappingBackend):

    @asynccontextmanager
    async def open_generation(self, request: GenerateRequest) -> AsyncIterator[_Failing]:
        async with self.inner.open_generation(request) as generation:
            yield _Failing(generation, 4)



async def test_mid_stream_failure_is_an_error_event(tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="actorproxy.access")
    engine = SimEngine(tokenizer, SimConfig(seed=5, token_interval=0.0005))
    engine.script("word " * 30, "word " * 30)
    async with open_proxy(ProxyConfig.of(port=0), backend=FailingBackend(engine), tokenizer=tokenizer) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            response = await http.post("/v1/messages", json={**GOOD, "stream": True},
                                       headers={"X-Session-Id": "fails"})
            plain = await http.post("/v1/messages", json=GOOD, headers={"X-Session-Id": "fails-plain"})
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[0][0] == "message_start" and events[-1][0] == "error"
    assert "message_stop" not in [name for name, _ in events]
    assert events[-1][1]["error"] == {"type": "api_error", "message": events[-1][1]["error"]["message"]}
    assert "engine fell over" in events[-1][1]["error"]["message"]
    assert plain.status_code == 502 and plain.json()["error"]["type"] == "api_error"
    # Counted and logged as the failure it ended with, as the plain call is, not as the 200 of its head.
    lines = {r.fields["session"]: r.fields for r in caplog.records  # type: ignore[attr-defined]
             if r.name == "actorproxy.access" and r.fields["path"] == "/v1/messages"}
    assert (lines["fails"]["status"], lines["fails"]["error"]) == (502, "engine_error"), lines
    assert lines["fails-plain"]["status"] == 502


def test_conversion_of_blocks() -> None:
    body = {
        "model": "m", "max_tokens": 10,
        "system": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": [
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "thinking", "thinking": "hmm", "signature": "sig"},
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Zürich"}},
                {"type": "tool_use", "id": "call_2", "name": "get_weather", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "is_error": True,
                 "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]},
                {"type": "tool_result", "tool_use_id": "call_2"},
                {"type": "text", "text": "<system-reminder>be brief</system-reminder>"},
            ]},
        ],
    }
    call = anthropic_api.parse_messages_body(body)
    assert call.request.messages == [
        {"role": "system", "content": "one\ntwo"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "hmm", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "x\ny"},
        {"role": "tool", "tool_call_id": "call_2", "content": ""},
        {"role": "user", "content": "<system-reminder>be brief</system-reminder>"},
    ]
    assert call.request.max_tokens == 10 and call.request.enable_thinking is None and not call.stream
    only_calls = anthropic_api.convert_messages(None, structure([
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c", "name": "f", "input": {"k": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c", "content": "r"}]},
    ], list[AnthropicMessage]))
    assert only_calls[1]["content"] is None and only_calls[-1] == {"role": "tool", "tool_call_id": "c", "content": "r"}
    tools = anthropic_api.convert_tools(
        structure([TOOL, {"name": "bare", "input_schema": {"type": "object"}}], list[AnthropicTool]))
    assert tools == [WEATHER_TOOL, {"type": "function", "function": {"name": "bare", "parameters": {"type": "object"}}}]
    disabled = anthropic_api.parse_messages_body({**GOOD, "thinking": {"type": "disabled"}})
    assert disabled.request.enable_thinking is False


def test_event_writer_block_order() -> None:
    writer = anthropic_api.EventWriter(message_id="msg_1", model="m")
    frames = [writer.start(TurnAccepted(step_index=0, prompt_tokens=7))]
    for delta in (
        OutputDelta(reasoning="Think"), OutputDelta(reasoning=" more", content="Text"),
        OutputDelta(tool_calls=(ToolCallDelta(0, "call_a", "f", '{"k": '),)),
        OutputDelta(tool_calls=(ToolCallDelta(0, None, None, "1}"),)),
        OutputDelta(content=" after", tool_calls=(ToolCallDelta(1, "call_b", "g", "{}"),)),
        OutputDelta(),
    ):
        frames.append(writer.delta(delta))
    output = AssistantOutput("Text after", "Think more", (ToolCall("call_a", "f", '{"k": 1}'),
                                                         ToolCall("call_b", "g", "{}")))
    frames.append(writer.finish(TurnDone(0, output, "tool_calls", 7, 30, False)))
    events = sse_events(b"".join(frames).decode())
    assert check_block_order(events) == ["thinking", "text", "tool_use", "text", "tool_use"]
    deltas = [(d["index"], d["delta"]) for n, d in events if n == "content_block_delta"]
    assert deltas == [
        (0, {"type": "thinking_delta", "thinking": "Think"}),
        (0, {"type": "thinking_delta", "thinking": " more"}),
        (0, {"type": "signature_delta", "signature": anthropic_api.thinking_signature("Think more")}),
        (1, {"type": "text_delta", "text": "Text"}),
        (2, {"type": "input_json_delta", "partial_json": '{"k": '}),
        (2, {"type": "input_json_delta", "partial_json": "1}"}),
        (3, {"type": "text_delta", "text": " after"}),
        (4, {"type": "input_json_delta", "partial_json": "{}"}),
    ]
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                             "usage": {"input_tokens": 7, "output_tokens": 30}}


async def test_stream_disconnect_stops_generation(http: httpx.AsyncClient, engine: SimEngine) -> None:
    engine.script("word " * 400, routing_key="gone")
    body = {**GOOD, "max_tokens": 500, "stream": True}
    await hang_up_after(http, "/v1/messages", body, "gone", marker="event: content_block_delta")
    # No polling: the session's mailbox is serial, so describe is answered once the turn has ended.
    with trio.fail_after(10):
        described = (await http.get("/session/gone")).json()
    step = described["recent_steps"][-1]
    assert step["status"] == "client_disconnected" and step["in_segment"] is False
    stats = engine.stats(step["rid"])
    assert stats.aborted and 0 < step["completion_tokens"] == len(stats.token_ids) < 400
