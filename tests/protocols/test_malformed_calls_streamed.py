"""A tool call the model writes malformed, streamed: the client sees what the reply and the record say, so its echo
continues the session's segment.

A policy in training writes broken calls (invalid JSON in its arguments, a block cut by ``max_tokens``). Their
text is content in the reply and in the recorded step (docs/parsers.md, Malformed calls). A streaming client must
not have been shown the call's start before it failed: it would keep that call, run it, and send it back as its
history, which then matches nothing the proxy recorded and opens a new segment (``history_rewrite``).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from _util import WEATHER_TOOL, assemble_chat_stream, chat_chunks, sse_reference, start_reasons

from actorproxy.sim import SimEngine

#: Announced (its name and the start of its arguments are in) before it fails: ``"days": }`` is no JSON.
BROKEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": }}\n</tool_call>'
GOOD = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern", "days": 1}}\n</tool_call>'
QUESTION = "Weather in Zürich?"


def _sse(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    """``(event name, data)`` of each event of a stream, its data decoded (``[DONE]`` left out)."""
    return [(name, json.loads(data)) for name, data in sse_reference(body) if data != b"[DONE]"]


async def test_chat_streams_a_broken_call_as_the_content_it_is_and_its_echo_continues(
    http: httpx.AsyncClient, engine: SimEngine
) -> None:
    session = "broken-chat"
    engine.script("Checking.\n" + BROKEN, "It is sunny.", routing_key=session)
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    body = {"model": "m", "tools": [WEATHER_TOOL], "stream": True}
    answer = await http.post(f"/sess/{session}/v1/chat/completions", json={**body, "messages": messages})
    streamed = assemble_chat_stream(chat_chunks(answer.text))
    # What the client assembled is the reply: the block as text, no call.
    assert streamed["calls"] == [] and streamed["content"] == "Checking.\n" + BROKEN, streamed
    # A client echoes what it assembled (and would answer each call it saw with a tool message).
    echo: dict[str, Any] = {"role": "assistant", "content": streamed["content"]}
    if streamed["calls"]:
        echo["tool_calls"] = streamed["calls"]
    results = [{"role": "tool", "tool_call_id": c["id"], "content": "no such day"} for c in streamed["calls"]]
    messages += [echo, *results, {"role": "user", "content": "Try again."}]
    second = await http.post(f"/sess/{session}/v1/chat/completions", json={**body, "messages": messages})
    assert second.status_code == 200
    assert await start_reasons(http, session) == ["session_start"]


async def test_chat_streams_a_good_call_after_a_broken_one_at_the_index_the_reply_gives_it(
    http: httpx.AsyncClient, engine: SimEngine
) -> None:
    session = "broken-then-good"
    engine.script(BROKEN + "\n" + GOOD, routing_key=session)
    body = {"model": "m", "tools": [WEATHER_TOOL], "messages": [{"role": "user", "content": QUESTION}]}
    streamed = assemble_chat_stream(chat_chunks(
        (await http.post(f"/sess/{session}/v1/chat/completions", json={**body, "stream": True})).text))
    engine.script(BROKEN + "\n" + GOOD, routing_key=session + "-whole")
    whole = (await http.post(f"/sess/{session}-whole/v1/chat/completions", json=body)).json()["choices"][0]["message"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in streamed["calls"]] == [
        ("get_weather", '{"city": "Bern", "days": 1}')]
    # (assemble_chat_stream checks that each call is announced at the next index: the good one is call 0)
    assert len(whole["tool_calls"]) == 1
    assert streamed["content"] == whole["content"] == BROKEN


async def test_responses_streams_only_the_items_of_the_response_and_their_echo_continues(
    http: httpx.AsyncClient, engine: SimEngine
) -> None:
    session = "broken-responses"
    engine.script("Checking.\n" + BROKEN, "It is sunny.", routing_key=session)
    tools = [{"type": "function", **WEATHER_TOOL["function"]}]
    body: dict[str, Any] = {"model": "m", "input": QUESTION, "tools": tools, "stream": True, "store": False}
    events = _sse((await http.post(f"/sess/{session}/v1/responses", json=body)).content)
    # Codex keeps each item as its `output_item.done` tells it: those are the response's own items.
    done = [data["item"] for name, data in events if name == "response.output_item.done"]
    completed = events[-1][1]["response"]
    assert events[-1][0] == "response.completed"
    assert [i["type"] for i in done] == [i["type"] for i in completed["output"]] == ["message"], done
    assert done == completed["output"]
    echo = {**body, "input": [{"role": "user", "content": QUESTION}, *done, {"role": "user", "content": "Again."}]}
    assert (await http.post(f"/sess/{session}/v1/responses", json=echo)).status_code == 200
    assert await start_reasons(http, session) == ["session_start"]


async def test_anthropic_streams_only_the_blocks_of_the_message(http: httpx.AsyncClient, engine: SimEngine) -> None:
    session = "broken-anthropic"
    engine.script("Checking.\n" + BROKEN, routing_key=session)
    function = WEATHER_TOOL["function"]
    tool = {"name": function["name"], "description": function["description"], "input_schema": function["parameters"]}
    body = {"model": "m", "max_tokens": 200, "tools": [tool], "messages": [{"role": "user", "content": QUESTION}]}
    events = _sse((await http.post(f"/sess/{session}/v1/messages", json={**body, "stream": True})).content)
    started = [data["content_block"]["type"] for name, data in events if name == "content_block_start"]
    assert started == ["text"], started
    text = "".join(data["delta"].get("text", "") for name, data in events if name == "content_block_delta")
    assert text == "Checking.\n" + BROKEN
