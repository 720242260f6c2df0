"""Echoes that clients rewrite: schema defaults added, arguments re-ordered or re-typed, are the same call."""

from __future__ import annotations

import json
from typing import Any

import httpx
from _util import finalized_at

from actorproxy import ProxyClient
from actorproxy.core.messages import AssistantOutput, ToolCall, echo_tolerance, with_defaults
from actorproxy.serve import RunningProxy
from actorproxy.sim import SimEngine

#: Claude Code's Edit tool, as it sends it (trimmed descriptions).
EDIT = {
    "name": "Edit",
    "description": "Performs exact string replacements in files.",
    "input_schema": {
        "type": "object",
        "properties": {
            "file_path": {"type": "string"},
            "old_string": {"type": "string"},
            "new_string": {"type": "string"},
            "replace_all": {"type": "boolean", "default": False},
            "options": {"type": "object", "properties": {"retries": {"type": "integer", "default": 1}}},
        },
        "required": ["file_path", "old_string", "new_string"],
    },
}
PROPERTIES = EDIT["input_schema"]["properties"]  # type: ignore[index]
CALL = {"file_path": "notes.txt", "old_string": "wrold", "new_string": "world"}
REPLY = "<think>\nFix the typo.\n</think>\n\n" + (
    "<tool_call>\n" + json.dumps({"name": "Edit", "arguments": CALL}) + "\n</tool_call>")


def _echo(arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "Edit", "arguments": text}}]}


def test_echo_tolerance_under_the_schema() -> None:
    ours = AssistantOutput("", "", (ToolCall("call_1", "Edit", json.dumps(CALL)),), schemas={"Edit": PROPERTIES})
    assert echo_tolerance(_echo(CALL), ours) == ()
    assert echo_tolerance(_echo({"replace_all": False, **CALL}), ours) == ("defaults_added",)
    assert echo_tolerance(_echo(dict(reversed(CALL.items()))), ours) == ("reformatted",)
    nested = AssistantOutput("", "", (ToolCall("call_1", "Edit", json.dumps({**CALL, "options": {}})),),
                             schemas={"Edit": PROPERTIES})
    assert echo_tolerance(_echo({**CALL, "options": {"retries": 1}}), nested) == ("defaults_added",)
    assert echo_tolerance(_echo({**CALL, "options": {"retries": 2}}), nested) is None
    # A value other than the default is a different call; so is a changed argument or a bool for a number.
    assert echo_tolerance(_echo({**CALL, "replace_all": True}), ours) is None
    assert echo_tolerance(_echo({**CALL, "new_string": "word"}), ours) is None
    # Without the schema (a reply from before this change), an added field is not tolerated.
    bare = AssistantOutput("", "", ours.tool_calls)
    assert echo_tolerance(_echo({"replace_all": False, **CALL}), bare) is None
    # 1 and 1.0 are the same number; true is not 1.
    numbers = AssistantOutput("", "", (ToolCall("call_1", "Edit", '{"n": 1}'),))
    assert echo_tolerance(_echo('{"n": 1.0}'), numbers) == ("reformatted",)
    assert echo_tolerance(_echo('{"n": true}'), numbers) is None
    assert with_defaults({"options": {}}, PROPERTIES) == {"options": {"retries": 1}, "replace_all": False}


def test_reasoning_echoed_as_the_text_of_the_turn() -> None:
    """Qwen Code (Responses mode) echoes a reply's reasoning as the assistant message's text."""
    call = (ToolCall("call_1", "Edit", json.dumps(CALL)),)
    thought = AssistantOutput("", "Fix the typo.", call)
    as_text = {**_echo(CALL), "content": "Fix the typo."}
    assert echo_tolerance(as_text, thought) == ("reasoning_as_text",)
    assert echo_tolerance({**as_text, "content": [{"type": "text", "text": "\nFix the typo.\n"}]},
                          thought) == ("reasoning_as_text",)
    # With text of its own after the reasoning, both must be there, in that order.
    both = AssistantOutput("Done.", "Fix the typo.", ())
    assert echo_tolerance({"role": "assistant", "content": "Fix the typo.\n\nDone."}, both) == ("reasoning_as_text",)
    assert echo_tolerance({"role": "assistant", "content": "Done.Fix the typo."}, both) is None
    # Other text, or reasoning that was not sampled, is not the echo.
    assert echo_tolerance({**as_text, "content": "Fix the typos."}, thought) is None
    assert echo_tolerance({**as_text, "content": "Fix the typo."}, AssistantOutput("", "", call)) is None


async def test_claude_code_edit_echo_keeps_one_segment(proxy: RunningProxy, engine: SimEngine) -> None:
    """Claude Code echoes its Edit call with ``"replace_all": false`` added first: still one segment."""
    engine.script(REPLY, "Fixed.", routing_key="edit")
    body: dict[str, Any] = {"model": "claude-opus-5-5", "max_tokens": 1024, "system": "You are Claude Code.",
                            "tools": [EDIT], "messages": [{"role": "user", "content": "Fix the typo in notes.txt"}]}
    async with httpx.AsyncClient(base_url=f"{proxy.url}/sess/edit", timeout=30) as http:
        first = (await http.post("/v1/messages?beta=true", json=body)).json()
        use = next(b for b in first["content"] if b["type"] == "tool_use")
        assert use["input"] == CALL
        echoed = [{**b, "input": {"replace_all": False, **b["input"]}} if b["type"] == "tool_use" else b
                  for b in first["content"]]
        body["messages"] += [
            {"role": "assistant", "content": echoed},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "Done."}]}]
        second = await http.post("/v1/messages?beta=true", json=body)
        assert second.status_code == 200, second.text
    segments, _ = await finalized_at(proxy.url, "edit")
    assert [(s["num_steps"], s["start_reason"]) for s in segments] == [(2, "session_start")]
    # What was tolerated is counted: on the segment, in /trajectory/stats and /metrics.
    assert segments[0]["metadata"]["echo_tolerated"] == {"defaults_added": 1}
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        stats = (await http.get("/trajectory/stats")).json()
        metrics = (await http.get("/metrics")).text
    assert stats["echo_tolerated"] == {"defaults_added": 1}
    assert 'actorproxy_echoes_tolerated_total{rewrite="defaults_added"} 1.0' in metrics


async def test_reordered_and_retyped_chat_echoes_are_counted(proxy: RunningProxy, engine: SimEngine) -> None:
    """A chat client echoing its calls re-serialised (keys re-ordered, 2 as 2.0): one segment, counted once each."""
    call = {"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}
    engine.script(f"<tool_call>\n{json.dumps(call)}\n</tool_call>", f"<tool_call>\n{json.dumps(call)}\n</tool_call>",
                  "Sunny.", routing_key="chat-echo")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "number"}}}}}
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    async with httpx.AsyncClient(base_url=f"{proxy.url}/sess/chat-echo/v1", timeout=30) as http:
        for rewrite in ('{"days": 2.0, "city": "Oslo"}', '{"days":2,"city":"Oslo"}', None):
            reply = await http.post("/chat/completions", json={"messages": messages, "tools": [tool]})
            assert reply.status_code == 200, reply.text
            if rewrite is None:
                break
            message = reply.json()["choices"][0]["message"]
            message["tool_calls"][0]["function"]["arguments"] = rewrite
            messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "sun"}]
    async with ProxyClient(proxy.url) as client:
        await client.finalize_session("chat-echo")
        segments = (await client.read_trajectory(session_id="chat-echo"))["data"]
        stats = await client.stats()
    assert [(s["num_steps"], s["start_reason"]) for s in segments] == [(3, "session_start")]
    assert segments[0]["metadata"]["echo_tolerated"] == {"reformatted": 2}
    assert stats["echo_tolerated"] == {"reformatted": 2}


async def test_qwen_code_responses_echo_of_reasoning_as_text_keeps_one_segment(
    proxy: RunningProxy, engine: SimEngine
) -> None:
    """Qwen Code in Responses mode sends our reasoning item back as an assistant message whose text it is."""
    engine.script(REPLY, "Fixed.", routing_key="qwen")
    tool = {"type": "function", "name": "Edit", "parameters": EDIT["input_schema"]}
    user = {"role": "user", "content": [{"type": "input_text", "text": "Fix the typo in notes.txt"}]}
    async with httpx.AsyncClient(base_url=f"{proxy.url}/sess/qwen", timeout=30) as http:
        first = (await http.post("/v1/responses", json={"model": "m", "input": [user], "tools": [tool]})).json()
        reasoning, call = first["output"]
        echo = [user, {"role": "assistant", "content": [{"type": "output_text",
                                                         "text": reasoning["content"][0]["text"]}]},
                {"type": "function_call", "call_id": call["call_id"], "name": "Edit", "arguments": call["arguments"]},
                {"type": "function_call_output", "call_id": call["call_id"], "output": "Done."}]
        second = await http.post("/v1/responses", json={"model": "m", "input": echo, "tools": [tool]})
        assert second.status_code == 200, second.text
    async with ProxyClient(proxy.url) as client:
        await client.finalize_session("qwen")
        segments = (await client.read_trajectory(session_id="qwen"))["data"]
    assert [(s["num_steps"], s["start_reason"]) for s in segments] == [(2, "session_start")]
    assert segments[0]["metadata"]["echo_tolerated"] == {"reasoning_as_text": 1}
