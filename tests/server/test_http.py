"""End to end over real HTTP: hypercorn on a loopback port, httpx and the official openai SDK."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from _util import WEATHER_TOOL, assemble_chat_stream, chat_chunks, finalized_at, hang_up_after

from actorproxy.serve import RunningProxy
from actorproxy.sim import SimEngine

REPLY = (
    '<think>\nThe user wants weather.\n</think>\n\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>'
)
ANSWER = "<think>\nGot it.\n</think>\n\nIt is 18 °C and sunny in Zürich — enjoy! 🌞"


def _body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": messages, "tools": [WEATHER_TOOL], **extra}


async def test_streaming_and_non_streaming_agree(http: httpx.AsyncClient, engine: SimEngine) -> None:
    engine.script(REPLY, ANSWER, routing_key="plain")
    engine.script(REPLY, ANSWER, routing_key="streamed")
    messages = [{"role": "user", "content": "Weather in Zürich?"}]
    plain = (await http.post("/v1/chat/completions", json=_body(messages), headers={"X-Session-Id": "plain"})).json()
    response = await http.post(
        "/v1/chat/completions",
        json=_body(messages, stream=True, stream_options={"include_usage": True}),
        headers={"X-Session-Id": "streamed"},
    )
    assert response.headers["content-type"].startswith("text/event-stream")
    chunks = chat_chunks(response.text)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    streamed = assemble_chat_stream(chunks)
    message = plain["choices"][0]["message"]
    assert plain["choices"][0]["finish_reason"] == streamed["finish"] == "tool_calls"
    assert message["reasoning_content"] == streamed["reasoning"] == "The user wants weather."
    assert (message["content"] or "") == streamed["content"] == ""
    assert [c["function"] for c in message["tool_calls"]] == [c["function"] for c in streamed["calls"]]
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Zürich", "days": 2}
    assert streamed["usage"] == plain["usage"]
    # Second turn, with the text answer streamed token by token.
    streamed_reply = {"role": "assistant", "content": None, "tool_calls": streamed["calls"]}
    assert streamed["calls"][0]["id"] != message["tool_calls"][0]["id"]  # ids are per session
    for session, reply in (("plain", message), ("streamed", streamed_reply)):
        call = reply["tool_calls"][0]
        follow = messages + [reply, {"role": "tool", "tool_call_id": call["id"], "content": "18 °C"}]
        if session == "plain":
            second = (await http.post("/v1/chat/completions", json=_body(follow),
                                      headers={"X-Session-Id": session})).json()
            plain_text = second["choices"][0]["message"]["content"]
        else:
            response = await http.post("/v1/chat/completions", json=_body(follow, stream=True),
                                       headers={"X-Session-Id": session})
            chunks = chat_chunks(response.text)
            assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) > 3
            streamed_text = assemble_chat_stream(chunks)["content"]
    assert plain_text == streamed_text == "It is 18 °C and sunny in Zürich — enjoy! 🌞"
    # Both sessions recorded the same tokens.
    for session in ("plain", "streamed"):
        assert (await http.post("/session/finalize", json={"session_id": session})).status_code == 200
    segments = {}
    for session in ("plain", "streamed"):
        data = (await http.post("/trajectory/read", json={"session_id": session, "drain": True})).json()["data"]
        assert len(data) == 1
        segments[session] = data[0]
    assert segments["plain"]["token_ids"] == segments["streamed"]["token_ids"]
    assert segments["plain"]["loss_mask"] == segments["streamed"]["loss_mask"]
    assert segments["plain"]["num_steps"] == 2


async def test_openai_sdk_both_ways(proxy: RunningProxy, engine: SimEngine) -> None:
    openai = pytest.importorskip("openai")
    engine.script(REPLY, ANSWER, REPLY, ANSWER)

    def conversation(stream: bool) -> tuple[str, str]:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused",
                               default_headers={"X-Session-Id": f"sdk-{stream}"})
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Zürich?"}]
        kwargs: dict[str, Any] = {"model": "policy", "tools": [WEATHER_TOOL]}
        if stream:
            calls: dict[int, dict[str, Any]] = {}
            for chunk in client.chat.completions.create(messages=messages, stream=True, **kwargs):
                for tc in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                    call = calls.setdefault(tc.index, {"id": tc.id, "type": "function",
                                                       "function": {"name": None, "arguments": ""}})
                    call["function"]["name"] = call["function"]["name"] or tc.function.name
                    call["function"]["arguments"] += tc.function.arguments or ""
            reply = {"role": "assistant", "content": None, "tool_calls": list(calls.values())}
        else:
            completion = client.chat.completions.create(messages=messages, **kwargs)
            reply = completion.choices[0].message.model_dump(exclude_none=True)
        call_id = reply["tool_calls"][0]["id"]
        messages += [reply, {"role": "tool", "tool_call_id": call_id, "content": "18 °C"}]
        if stream:
            text = "".join(
                chunk.choices[0].delta.content or ""
                for chunk in client.chat.completions.create(messages=messages, stream=True, **kwargs)
                if chunk.choices
            )
        else:
            text = client.chat.completions.create(messages=messages, **kwargs).choices[0].message.content or ""
        models = client.models.list()
        client.close()
        return text, models.data[0].id

    for stream in (False, True):
        text, model_id = await trio.to_thread.run_sync(conversation, stream)
        assert text == "It is 18 °C and sunny in Zürich — enjoy! 🌞"
        assert model_id == "actorproxy"
    for stream in (False, True):
        segments, steps = await finalized_at(proxy.url, f"sdk-{stream}")
        assert [s["num_steps"] for s in segments] == [2]
        assert [s["status"] for s in steps] == ["completed", "completed"]


BAD_BODIES: list[tuple[Any, str | None]] = [
    (b"{not json", None),
    (b"", None),
    ([1, 2], None),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 3}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0].function"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 17}, "stop"),
    ({"messages": [{"role": "assistant", "content": "x", "tool_calls": [{"function": {}}]}]},
     "messages[0].tool_calls[0].function.name"),
    # Typed message fields (issue 11 finding 1) and text-only content (issue 19 §5).
    ({"messages": [{"role": "user", "content": "x", "name": {}}]}, "messages[0].name"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": [1]}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
]


async def test_bad_input_gets_openai_errors_and_loses_nothing(http: httpx.AsyncClient) -> None:
    headers = {"X-Session-Id": "keep"}
    messages = [{"role": "user", "content": "hello"}]
    first = await http.post("/v1/chat/completions", json={"messages": messages}, headers=headers)
    assert first.status_code == 200
    before = (await http.get("/session/keep")).json()
    for body, param in BAD_BODIES:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = await http.post("/v1/chat/completions", content=content,
                                   headers={**headers, "content-type": "application/json"})
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"]
        assert error["param"] == param, (body, error)
    # No session id at all.
    response = await http.post("/v1/chat/completions", json={"messages": messages})
    assert response.status_code == 400 and response.json()["error"]["code"] == "missing_session_id"
    after = (await http.get("/session/keep")).json()
    assert after == before
    # Unknown sessions and routes: 404 in the same format; bad fields: 400.
    for path, body in (("/session/finalize", {"session_id": "nope"}),
                       ("/trajectory/read", {"session_id": "nope"})):
        response = await http.post(path, json=body)
        assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"
    assert (await http.post("/session/finalize", json={})).status_code == 400
    assert (await http.post("/session/finalize", json={"session_id": "keep", "reward": "high"})).status_code == 400
    assert (await http.post("/trajectory/read", json={"drain": "yes"})).status_code == 400
    typo = await http.post("/session/finalize", json={"session_id": "keep", "rewrad": 1.0})
    assert typo.status_code == 400 and typo.json()["error"]["param"] == "rewrad"
    nan = await http.post("/session/finalize", content=b'{"session_id": "keep", "reward": NaN}')
    # NaN is not JSON: refused by the parser, before any field is looked at.
    assert nan.status_code == 400 and nan.json()["error"]["code"] == "invalid_json"
    response = await http.get("/no/such/route")
    assert response.status_code == 404 and "error" in response.json()
    response = await http.get("/v1/chat/completions")
    assert response.status_code == 405 and "error" in response.json()
    # The session still finalizes with its one good step.
    await http.post("/session/finalize", json={"session_id": "keep"})
    data = (await http.post("/trajectory/read", json={"session_id": "keep", "include_steps": True})).json()
    assert [s["status"] for s in data["steps"]] == ["completed"]
    assert data["data"][0]["num_steps"] == 1


async def test_stream_disconnect_stops_generation(http: httpx.AsyncClient, engine: SimEngine) -> None:
    engine.script("word " * 400, routing_key="gone")
    body = {"messages": [{"role": "user", "content": "talk"}], "stream": True, "max_tokens": 500}
    await hang_up_after(http, "/v1/chat/completions", body, "gone")
    # The session notices at its next token, records the step and stops the engine.
    # No polling: the session's mailbox is serial, so describe is answered once the turn has ended.
    with trio.fail_after(10):
        described = (await http.get("/session/gone")).json()
    step = described["recent_steps"][-1]
    assert step["status"] == "client_disconnected" and step["in_segment"] is False
    stats = engine.stats(step["rid"])
    assert stats.aborted and stats.finish_reason == "abort"
    assert 0 < step["completion_tokens"] == len(stats.token_ids) < 400


async def test_health_models_stats(http: httpx.AsyncClient) -> None:
    health = (await http.get("/health")).json()
    assert health["status"] == "ok" and health["active_sessions"] == 0
    assert health["backend"] == "sim" and health["tokenizer"] == "qwen3"
    assert health["config"]["limits"]["max_steps_per_session"] == 400
    models = (await http.get("/v1/models")).json()
    assert models["data"][0]["id"] == "actorproxy"
    stats = (await http.get("/trajectory/stats")).json()
    assert stats["segments"] == 0 and stats["max_tokens"] > 0


async def test_stop_sequences_streamed_and_not(http: httpx.AsyncClient, engine: SimEngine) -> None:
    text = "Thought: look around.\nAction: ls\nObservation: files"
    for session in ("stop-a", "stop-b"):
        engine.script(text, "Done.", routing_key=session)
    messages = [{"role": "user", "content": "go"}]
    body = {"messages": messages, "stop": ["Observation:"]}
    plain = (await http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "stop-a"})).json()
    streamed = assemble_chat_stream(chat_chunks((await http.post(
        "/v1/chat/completions", json={**body, "stream": True}, headers={"X-Session-Id": "stop-b"})).text))
    assert plain["choices"][0]["message"]["content"] == streamed["content"] == "Thought: look around.\nAction: ls\n"
    assert plain["choices"][0]["finish_reason"] == streamed["finish"] == "stop"
    # The agent echoes the truncated reply; the session continues the same segment.
    follow = messages + [{"role": "assistant", "content": "Thought: look around.\nAction: ls"},
                         {"role": "user", "content": "Observation: a.txt"}]
    second = await http.post("/v1/chat/completions", json={"messages": follow}, headers={"X-Session-Id": "stop-a"})
    assert second.json()["choices"][0]["message"]["content"] == "Done."
    await http.post("/session/finalize", json={"session_id": "stop-a"})
    data = (await http.post("/trajectory/read", json={"session_id": "stop-a", "include_steps": True})).json()
    assert [s["num_steps"] for s in data["data"]] == [1 + 1]
    first_step = data["steps"][0]
    # Every sampled token up to the one completing the stop sequence is recorded; none after.
    sampled = first_step["output_ids"]
    assert "Observation:" in "".join(engine.tokenizer.decode(sampled))
    assert engine.tokenizer.eot_token_id not in sampled
