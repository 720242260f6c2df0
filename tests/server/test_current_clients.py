"""What current clients send is accepted (issue 19 §1, §5): Claude Code's Messages body, chat-completions fields."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from actorproxy.sim import SimConfig, SimEngine

TOOL = {"name": "Edit", "description": "Edit a file", "defer_loading": True, "cache_control": {"type": "ephemeral"},
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"},
                                                           "replace_all": {"type": "boolean", "default": False}}}}


@pytest.fixture
async def engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=4, token_interval=0.0))


def claude_code_body(**extra: Any) -> dict[str, Any]:
    """A Messages body shaped as Claude Code 2.1.330 sends it on its default model (protocols.md §8)."""
    return {
        "model": "claude-sonnet-4-6", "max_tokens": 128000, "stream": False,
        "system": [{"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Fix the bug.",
                                          "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "<system-reminder>The user opened main.py.</system-reminder>"},
            {"role": "system", "content": [{"type": "text", "text": "Only until the next user turn."}],
             "clear_at": "next_user_message"},
            {"role": "user", "content": "Go on."},
        ],
        "tools": [TOOL],
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
        "metadata": {"user_id": "user_abc_account_def_session_ghi"},
        **extra,
    }


async def test_claude_code_messages_body_is_served_with_system_entries_in_place(
    http: httpx.AsyncClient, engine: SimEngine
) -> None:
    engine.script("Done.", routing_key="cc")
    headers = {"X-Claude-Code-Session-Id": "cc", "anthropic-version": "2023-06-01", "x-app": "cli",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
                                 "mid-conversation-tool-changes-2026-07-01"}
    response = await http.post("/v1/messages?beta=true", json=claude_code_body(), headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["content"][-1] == {"type": "text", "text": "Done."}
    await http.post("/session/finalize", json={"session_id": "cc"})
    step = (await http.post("/trajectory/read", json={"session_id": "cc", "include_steps": True})).json()["steps"][0]
    roles = [(m["role"], m["content"]) for m in step["new_messages"]]
    assert roles == [
        ("system", "You are Claude Code."),
        ("user", "Fix the bug."),
        ("system", "<system-reminder>The user opened main.py.</system-reminder>"),
        # clear_at next_user_message: a later user message exists, so the model no longer sees it.
        ("user", "Go on."),
    ]


async def test_a_trailing_system_entry_is_kept_and_prefill_still_refused(http: httpx.AsyncClient) -> None:
    body = claude_code_body()
    body["messages"] = [*body["messages"], {"role": "system", "content": "Shown now.", "clear_at": "next_user_message"}]
    response = await http.post("/v1/messages", json=body, headers={"X-Session-Id": "tail"})
    assert response.status_code == 200, response.text
    body["messages"] = [*body["messages"], {"role": "assistant", "content": "Sure"}]
    refused = await http.post("/v1/messages", json=body, headers={"X-Session-Id": "tail"})
    assert refused.status_code == 400 and refused.json()["type"] == "error"
    assert "prefill" in refused.json()["error"]["message"]


async def test_tool_search_results_with_tool_references_are_served(http: httpx.AsyncClient, engine: SimEngine) -> None:
    """Claude Code's ToolSearch answers with ``tool_reference`` blocks (the deferred tools it loads): not a 400."""
    engine.script("Loaded.", routing_key="ts")
    body = claude_code_body()
    body["messages"] = [
        {"role": "user", "content": "Watch the build."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ToolSearch",
                                           "input": {"query": "select:Monitor"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "tool_reference", "tool_name": "Monitor"}, {"type": "tool_reference", "tool_name": "Cron"}]},
            {"type": "text", "text": "Tool loaded.", "cache_control": {"type": "ephemeral"}}]},
    ]
    response = await http.post("/v1/messages?beta=true", json=body, headers={"X-Session-Id": "ts"})
    assert response.status_code == 200, response.text
    await http.post("/session/finalize", json={"session_id": "ts"})
    step = (await http.post("/trajectory/read", json={"session_id": "ts", "include_steps": True})).json()["steps"][0]
    assert [m["content"] for m in step["new_messages"] if m["role"] == "tool"] == ["Monitor\nCron"]
    bad = {**body, "messages": [*body["messages"][:2], {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "tool_reference"}]}]}]}
    refused = await http.post("/v1/messages", json=bad, headers={"X-Session-Id": "ts2"})
    assert refused.status_code == 400 and "tool_name" in refused.json()["error"]["message"], refused.text


async def test_count_tokens_takes_the_same_body(http: httpx.AsyncClient) -> None:
    body = claude_code_body()
    body.pop("max_tokens")
    response = await http.post("/v1/messages/count_tokens?beta=true", json=body, headers={"X-Session-Id": "count"})
    assert response.status_code == 200 and response.json()["input_tokens"] > 0


async def test_chat_completions_fields_current_clients_send(http: httpx.AsyncClient, engine: SimEngine) -> None:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    hello = [{"role": "user", "content": "hi"}]
    # tool_choice "none": no tools in the prompt, so the prompt is the one without tools.
    without = await http.post("/v1/chat/completions", json={"messages": hello}, headers={"X-Session-Id": "a"})
    none = await http.post("/v1/chat/completions", json={"messages": hello, "tools": [tool], "tool_choice": "none"},
                           headers={"X-Session-Id": "b"})
    offered = await http.post("/v1/chat/completions", json={"messages": hello, "tools": [tool]},
                              headers={"X-Session-Id": "c"})
    prompt = [r.json()["usage"]["prompt_tokens"] for r in (without, none, offered)]
    assert prompt[0] == prompt[1] < prompt[2]
    # response_format is accepted and not enforced (documented); n > 1 and images are clear 400s.
    ok = await http.post("/v1/chat/completions", json={"messages": hello, "response_format": {"type": "json_object"}},
                         headers={"X-Session-Id": "d"})
    assert ok.status_code == 200
    n = await http.post("/v1/chat/completions", json={"messages": hello, "n": 2}, headers={"X-Session-Id": "e"})
    assert n.status_code == 400 and n.json()["error"]["param"] == "n"
    image = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]
    refused = await http.post("/v1/chat/completions", json={"messages": image}, headers={"X-Session-Id": "f"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages[0].content[1]"
    assert "image_url" in refused.json()["error"]["message"]
