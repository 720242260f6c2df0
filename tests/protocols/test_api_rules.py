"""Each agent API's own rules for tools and reasoning, the same on every route.

``tool_choice`` "none" offers the model no tools on chat, Responses and Messages alike (the
prompt is the one without tools). Reasoning is returned when the API returns it: Anthropic's
Messages only when the request enables ``thinking``; chat's ``reasoning_effort: "none"`` and
Responses' ``reasoning.effort: "none"`` both turn thinking off.
"""

from __future__ import annotations

from typing import Any

import httpx
from _util import WEATHER_TOOL
from test_anthropic import sse_events

from actorproxy.sim import SimEngine

HELLO = [{"role": "user", "content": "hi"}]
FUNCTION = WEATHER_TOOL["function"]
THOUGHT = "<think>\nThe user says hi.\n</think>\n\nHello!"


async def _prompt_tokens(http: httpx.AsyncClient, path: str, session: str, body: dict[str, Any]) -> int:
    response = await http.post(path, json=body, headers={"X-Session-Id": session})
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return int(usage.get("prompt_tokens") or usage.get("input_tokens"))


async def test_tool_choice_none_offers_no_tools_on_every_route(http: httpx.AsyncClient) -> None:
    chat_tool = {"type": "function", "function": FUNCTION}
    flat_tool = {"type": "function", **FUNCTION}
    messages_tool = {"name": FUNCTION["name"], "description": FUNCTION.get("description", ""),
                     "input_schema": FUNCTION["parameters"]}
    routes: list[tuple[str, dict[str, Any], dict[str, Any], Any]] = [
        ("/v1/chat/completions", {"messages": HELLO}, {"tools": [chat_tool]}, "none"),
        ("/v1/responses", {"input": "hi"}, {"tools": [flat_tool]}, "none"),
        ("/v1/messages", {"model": "m", "max_tokens": 16, "messages": HELLO}, {"tools": [messages_tool]},
         {"type": "none"}),
    ]
    for n, (path, base, tools, none) in enumerate(routes):
        without = await _prompt_tokens(http, path, f"w{n}", base)
        refused = await _prompt_tokens(http, path, f"n{n}", {**base, **tools, "tool_choice": none})
        offered = await _prompt_tokens(http, path, f"o{n}", {**base, **tools})
        assert without == refused < offered, path


async def test_messages_return_thinking_only_when_the_request_enables_it(
    http: httpx.AsyncClient, engine: SimEngine
) -> None:
    for session in ("plain", "plain-stream", "think", "think-stream"):
        engine.script(THOUGHT, routing_key=session)
    body = {"model": "m", "max_tokens": 64, "messages": HELLO}
    plain = (await http.post("/v1/messages", json=body, headers={"X-Session-Id": "plain"})).json()
    assert plain["content"] == [{"type": "text", "text": "Hello!"}]
    streamed = sse_events((await http.post("/v1/messages", json={**body, "stream": True},
                                           headers={"X-Session-Id": "plain-stream"})).text)
    starts = [d["content_block"]["type"] for n, d in streamed if n == "content_block_start"]
    assert starts == ["text"] and [d["index"] for n, d in streamed if n == "content_block_start"] == [0]
    thinking = {**body, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    shown = (await http.post("/v1/messages", json=thinking, headers={"X-Session-Id": "think"})).json()
    assert [b["type"] for b in shown["content"]] == ["thinking", "text"]
    assert shown["content"][0]["thinking"] == "The user says hi."
    streamed = sse_events((await http.post("/v1/messages", json={**thinking, "stream": True},
                                           headers={"X-Session-Id": "think-stream"})).text)
    assert [d["content_block"]["type"] for n, d in streamed if n == "content_block_start"] == ["thinking", "text"]
    # The sampled tokens are the same either way: the reply hides the thinking, the record keeps it.
    for session in ("plain", "think"):
        await http.post("/session/finalize", json={"session_id": session})
    steps = [(await http.post("/trajectory/read", json={"session_id": s, "include_steps": True})).json()["steps"][0]
             for s in ("plain", "think")]
    assert steps[0]["output_ids"] == steps[1]["output_ids"]
    assert steps[0]["output"]["reasoning_content"] == "The user says hi."


async def test_reasoning_effort_none_turns_thinking_off_on_chat_as_on_responses(http: httpx.AsyncClient) -> None:
    chat = "/v1/chat/completions"
    default = await _prompt_tokens(http, chat, "d", {"messages": HELLO})
    off = await _prompt_tokens(http, chat, "k", {"messages": HELLO, "chat_template_kwargs": {"enable_thinking": False}})
    assert off != default
    assert await _prompt_tokens(http, chat, "e", {"messages": HELLO, "reasoning_effort": "none"}) == off
    assert await _prompt_tokens(http, chat, "h", {"messages": HELLO, "reasoning_effort": "high"}) == default
    # An explicit chat_template_kwargs wins over the effort.
    assert await _prompt_tokens(http, chat, "x", {"messages": HELLO, "reasoning_effort": "none",
                                                  "chat_template_kwargs": {"enable_thinking": True}}) == default
    responses = "/v1/responses"
    assert await _prompt_tokens(http, responses, "r", {"input": "hi", "reasoning": {"effort": "none"}}) == off
