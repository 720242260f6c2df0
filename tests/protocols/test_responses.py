"""The OpenAI Responses API end to end: the official `openai` SDK (create and stream) over real HTTP."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from _util import WEATHER_CHAT, WEATHER_TOOL, finalized_at

from actorproxy.core.messages import AssistantOutput, ToolCall
from actorproxy.core.parser import OutputDelta, ToolCallDelta
from actorproxy.core.turn_events import TurnDone
from actorproxy.errors import EngineError
from actorproxy.protocols.responses_api import convert_input, parse_responses_body
from actorproxy.protocols.responses_events import ResponseEventWriter
from actorproxy.protocols.responses_types import Item
from actorproxy.schema.converter import structure
from actorproxy.serve import RunningProxy
from actorproxy.sim import SimEngine

openai = pytest.importorskip("openai")

REPLY, ANSWER, ANSWER_TEXT, SYSTEM, QUESTION = WEATHER_CHAT
FUNCTION = WEATHER_TOOL["function"]
TOOLS: list[dict[str, Any]] = [{"type": "function", **FUNCTION},  # type: ignore[dict-item]
                               {"type": "web_search"}, {"type": "namespace", "name": "ns", "tools": []}]


def client_for(url: str, session: str) -> Any:
    """A sync client; use it in a ``with`` block (an open keep-alive connection delays the proxy's shutdown)."""
    return openai.OpenAI(base_url=f"{url}/sess/{session}/v1", api_key="unused", max_retries=0)


def sse(text: str) -> list[dict[str, Any]]:
    """The data of each event; every event has an ``event:`` line naming its type."""
    events = []
    for block in text.strip().split("\n\n"):
        if block.startswith(":"):
            continue
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        events.append(json.loads(data[len("data: "):]))
        assert events[-1]["type"] == name[len("event: "):]
    return events


async def test_responses_and_chat_record_the_same_tokens(proxy: RunningProxy, engine: SimEngine) -> None:
    sessions = ("eq-chat", "eq-create", "eq-stream", "eq-previous")
    for session in sessions:
        engine.script(REPLY, ANSWER, routing_key=session)

    def via_chat() -> None:
        with client_for(proxy.url, "eq-chat") as client:
            chat(client)

    def chat(client: Any) -> None:
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
        kwargs: dict[str, Any] = {"model": "m", "tools": [WEATHER_TOOL], "extra_body": {"enable_thinking": True}}
        reply = client.chat.completions.create(messages=messages, **kwargs).choices[0].message
        messages += [reply.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "18 °C"}]
        client.chat.completions.create(messages=messages, **kwargs)

    def via_responses(session: str, *, stream: bool, previous: bool) -> list[Any]:
        with client_for(proxy.url, session) as client:
            return responses(client, stream=stream, previous=previous)

    def responses(client: Any, *, stream: bool, previous: bool) -> list[Any]:
        kwargs: dict[str, Any] = {"model": "m", "instructions": SYSTEM, "tools": TOOLS,
                                  "reasoning": {"effort": "medium"}}
        items: list[Any] = [{"role": "user", "content": QUESTION}]

        def call(**more: Any) -> Any:
            if not stream:
                return client.responses.create(**kwargs, **more)
            with client.responses.stream(**kwargs, **more) as events:
                return events.get_final_response()

        first = call(input=items)
        outputs = [{"type": "function_call_output", "call_id": item.call_id, "output": "18 °C"}
                   for item in first.output if item.type == "function_call"]
        if previous:
            second = call(input=outputs, previous_response_id=first.id)
        else:
            second = call(input=[*items, *(item.model_dump(exclude_none=True) for item in first.output), *outputs])
        return [first, second]

    await trio.to_thread.run_sync(via_chat)
    first, second = await trio.to_thread.run_sync(lambda: via_responses("eq-create", stream=False, previous=False))
    streamed = await trio.to_thread.run_sync(lambda: via_responses("eq-stream", stream=True, previous=False))
    await trio.to_thread.run_sync(lambda: via_responses("eq-previous", stream=False, previous=True))
    assert [item.type for item in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == "The user wants weather."
    assert json.loads(first.output[1].arguments) == {"city": "Zürich", "days": 2}
    assert second.output_text == ANSWER_TEXT and second.status == "completed"
    assert second.usage.input_tokens > first.usage.input_tokens > 0
    for got, want in zip(streamed, (first, second), strict=True):
        assert [(i.type, getattr(i, "arguments", None)) for i in got.output] == [
            (i.type, getattr(i, "arguments", None)) for i in want.output]
        assert got.output_text == want.output_text and got.usage.output_tokens == want.usage.output_tokens
    segments = {s: (await finalized_at(proxy.url, s))[0] for s in sessions}
    reference = segments["eq-chat"]
    assert len(reference) == 1 and reference[0]["num_steps"] == 2
    for session in sessions[1:]:
        assert len(segments[session]) == 1, session
        assert segments[session][0]["token_ids"] == reference[0]["token_ids"], session
        assert segments[session][0]["loss_mask"] == reference[0]["loss_mask"], session


async def test_stream_event_sequence(http: httpx.AsyncClient, engine: SimEngine) -> None:
    engine.script(REPLY, routing_key="seq")
    body = {"model": "m", "input": QUESTION, "tools": TOOLS, "stream": True, "store": False,
            "include": ["reasoning.encrypted_content"]}
    response = await http.post("/v1/responses", json=body, headers={"session-id": "seq"})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse(response.text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    deltas = {"response.reasoning_text.delta", "response.function_call_arguments.delta"}
    compact = [k for i, k in enumerate(kinds) if not (k in deltas and kinds[i - 1] == k)]
    assert compact == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["usage"]["output_tokens"] > 0 and done["store"] is False
    reasoning, call = done["output"]
    assert reasoning["encrypted_content"].startswith("actorproxy-b64:")
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    assert call["arguments"] == arguments and json.loads(arguments) == {"city": "Zürich", "days": 2}
    # The session came from the `session-id` header (Codex sends it); the encrypted reasoning, echoed
    # without its text, restores it: the echo extends the segment.
    engine.script(ANSWER, routing_key="seq")
    reasoning.pop("content")
    echo = {**body, "stream": False, "input": [
        {"role": "user", "content": QUESTION}, reasoning, call,
        {"type": "function_call_output", "call_id": call["call_id"], "output": "18 °C"}]}
    second = (await http.post("/v1/responses", json=echo, headers={"thread-id": "seq"})).json()
    assert second["output"][-1]["content"][0]["text"] == ANSWER_TEXT
    segments, steps = await finalized_at(str(http.base_url), "seq")
    assert len(segments) == 1 and len(steps) == 2


async def test_length_limit_is_incomplete(http: httpx.AsyncClient, engine: SimEngine) -> None:
    engine.script("word " * 50, "word " * 50, routing_key="short")
    body = {"model": "m", "input": "go", "max_output_tokens": 5}
    plain = (await http.post("/sess/short/v1/responses", json=body)).json()
    assert plain["status"] == "incomplete" and plain["incomplete_details"] == {"reason": "max_output_tokens"}
    assert plain["usage"]["output_tokens"] == 5 and plain["max_output_tokens"] == 5
    events = sse((await http.post("/sess/short/v1/responses", json={**body, "stream": True})).text)
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"


BAD: list[tuple[dict[str, Any], str]] = [
    ({"input": []}, "'input'"),
    ({"input": 5}, "'input'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input_image"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "'x' is not known"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": {}, "call_id": "c"}]}, "arguments"),
    ({"input": [{"type": "function_call_output", "call_id": 5, "output": "x"}]}, "call_id"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0]"),
    ({"input": "hi", "tools": {}}, "'tools'"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "reasoning": "high"}, "reasoning"),
    ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous response"),
    ({"input": [{"type": "reasoning", "encrypted_content": "actorproxy-b64:!!"}, {"role": "user", "content": "x"}]},
     "encrypted_content"),
]


async def test_bad_input_is_a_clear_400(http: httpx.AsyncClient, proxy: RunningProxy) -> None:
    headers = {"X-Session-Id": "bad"}
    assert (await http.post("/v1/responses", json={"input": "hi"}, headers=headers)).status_code == 200
    for body, hint in BAD:
        response = await http.post("/v1/responses", json={"model": "m", **body}, headers=headers)
        assert response.status_code == 400, (body, response.text)
        assert hint in response.json()["error"]["message"], (hint, response.json())
    assert (await http.post("/v1/responses", json={"input": "hi"})).status_code == 400  # no session

    def sdk() -> Any:
        with pytest.raises(openai.BadRequestError) as caught, client_for(proxy.url, "bad") as client:
            client.responses.create(model="m", input="x", previous_response_id="resp_nope")
        return caught.value

    error = await trio.to_thread.run_sync(sdk)
    assert error.code == "previous_response_not_found"
    # A response id is resolved within its session only.
    first = (await http.post("/v1/responses", json={"input": "hi"}, headers=headers)).json()
    other = await http.post("/v1/responses", json={"input": "x", "previous_response_id": first["id"]},
                            headers={"X-Session-Id": "other"})
    assert other.status_code == 400
    _, steps = await finalized_at(proxy.url, "bad")
    assert len(steps) == 2


def test_input_conversion() -> None:
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "not the reasoning"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "one"}]},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        # Codex injects outputs that answer no call.
        {"type": "function_call_output", "name": "goal_objective", "namespace": "agent", "output": "goal"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        # Text after a call is a new assistant turn (not our output's order).
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
        {"type": "message", "role": "assistant", "content": "more"},
    ]
    assert convert_input(structure(items, list[Item])) == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "tool", "content": "goal"},
        {"role": "assistant", "content": "done", "reasoning_content": "think", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "assistant", "content": "more"},
    ]
    call = parse_responses_body({"input": "hi", "instructions": "be brief", "tools": TOOLS})
    assert call.request.messages[0] == {"role": "system", "content": "be brief"} and call.own_messages() == [
        {"role": "user", "content": "hi"}]
    assert call.request.tools == [WEATHER_TOOL]  # web_search and namespace are not offered
    assert call.request.enable_thinking is None
    assert parse_responses_body({"input": "x", "reasoning": {"effort": "none"}}).request.enable_thinking is False


def test_writer_mid_stream_error_and_order() -> None:
    call = parse_responses_body({"input": "x"})
    writer = ResponseEventWriter(call, response_id="resp_1", model="m")
    frames = writer.start() + writer.delta(OutputDelta(content="Hi"))
    frames += writer.delta(OutputDelta(tool_calls=(ToolCallDelta(0, "call_1", "f", "{\"a\""),)))
    frames += writer.delta(OutputDelta(tool_calls=(ToolCallDelta(0, None, None, ": 1}"),)))
    output = AssistantOutput("Hi", "", (ToolCall("call_1", "f", "{\"a\": 1}"),))
    frames += writer.finish(TurnDone(0, output, "tool_calls", 3, 4, False))
    events = sse(frames.decode())
    final = events[-1]["response"]["output"]
    assert [(i["type"], i["id"]) for i in final] == [("message", "msg_1_0"), ("function_call", "fc_1_1")]
    assert final[1]["arguments"] == "{\"a\": 1}" and final[1]["call_id"] == "call_1"
    failing = ResponseEventWriter(call, response_id="resp_2", model="m")
    failing.start()
    failing.delta(OutputDelta(content="Hi"))
    events = sse(failing.error(EngineError("engine died")).decode())
    assert [e["type"] for e in events] == ["error", "response.failed"]
    assert events[1]["response"]["error"] == {"code": "engine_error", "message": "engine died"}


async def test_item_references_resolve_to_the_items_this_proxy_issued(
    http: httpx.AsyncClient, engine: SimEngine
) -> None:
    """The Vercel AI SDK's default (``store: true``) refers to earlier reasoning and text items by id."""
    engine.script(REPLY, ANSWER, "A third reply.", routing_key="refs")
    engine.script(REPLY, ANSWER, routing_key="refs-stream")
    tools = [{"type": "function", **FUNCTION}]
    for session, stream in (("refs", False), ("refs-stream", True)):
        headers = {"X-Session-Id": session}
        body: dict[str, Any] = {"model": "m", "input": [{"role": "user", "content": QUESTION}], "tools": tools,
                                "stream": stream}
        first = await http.post("/v1/responses", json=body, headers=headers)
        output = (sse(first.text)[-1]["response"] if stream else first.json())["output"]
        assert [item["type"] for item in output] == ["reasoning", "function_call"]
        reasoning, call = output
        # As the SDK sends it: the reasoning by reference, the function call in full, then its output.
        second_input = [*body["input"], {"type": "item_reference", "id": reasoning["id"]},
                        {"type": "function_call", "id": call["id"], "call_id": call["call_id"], "name": call["name"],
                         "arguments": call["arguments"]},
                        {"type": "function_call_output", "call_id": call["call_id"], "output": "18 °C"}]
        second = await http.post("/v1/responses", json={**body, "input": second_input, "stream": False},
                                 headers=headers)
        assert second.status_code == 200, second.text
        message = second.json()["output"][-1]
        assert message["type"] == "message" and message["content"][0]["text"] == ANSWER_TEXT
        if not stream:
            # A text item by reference too; an unknown id and another session's item are 400s naming them.
            third_input = [*second_input, {"type": "item_reference", "id": message["id"]},
                           {"role": "user", "content": "Thanks."}]
            third = await http.post("/v1/responses", json={**body, "input": third_input}, headers=headers)
            assert third.status_code == 200, third.text
            unknown = await http.post("/v1/responses", json={**body, "input": [
                *body["input"], {"type": "item_reference", "id": "rs_nope"}]}, headers=headers)
            assert unknown.status_code == 400 and "'rs_nope' is not known" in unknown.json()["error"]["message"]
            assert unknown.json()["error"]["param"] == "input[1].id"
            stolen = await http.post("/v1/responses", json={**body, "input": second_input},
                                     headers={"X-Session-Id": "thief"})
            assert stolen.status_code == 400 and reasoning["id"] in stolen.json()["error"]["message"]
        segments, steps = await finalized_at(str(http.base_url).rstrip("/"), session)
        # One segment: the referenced items are the echo of what was sampled, not a rewrite.
        assert len(segments) == 1 and segments[0]["num_steps"] == len(steps) == (3 if not stream else 2)
        assert all(s["boundary_reason"] in (None, "session_start") for s in steps)
