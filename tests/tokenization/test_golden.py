"""The wire output of one fixed recorded conversation, compared byte for byte with ``tests/golden/``.

Two agents talk to one proxy over real HTTP: an OpenAI chat agent (tools, a
non-streamed tool call, streamed text, a streamed tool call with usage, a
stop sequence) and an Anthropic agent (thinking, tool use, a streamed reply,
a sub-agent's turn routed to a child session). Both sessions are finalized
and read back with their steps. Every response (status, content type, body
bytes: JSON or SSE frames) and the finalized segments and steps are written
into one transcript, which must equal ``tests/golden/conversation.txt``
exactly. Only what is random or a clock reading is normalised: 32-hex-digit
ids (completion and message ids, engine rids) become ``<id-N>`` in order of
first appearance, and timestamps become ``<time>``.

Any change to what the proxy sends shows up here as a diff. When a change is
intended, regenerate with ``ACTORPROXY_UPDATE_GOLDEN=1 pytest tests/tokenization/test_golden.py``
and review the diff of the golden file like code.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from pathlib import Path
from typing import Any

import httpx
from _util import WEATHER_TOOL

from actorproxy import ProxyConfig, open_proxy
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.tokenization.tokenizer import ChatTokenizer

GOLDEN = Path(__file__).parents[1] / "golden" / "conversation.txt"

OPENAI = "golden-openai"
ANTHROPIC = "golden-anthropic"

_SYSTEM = "You are a careful assistant. Use tools when they help."
_CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
_CALL_LYON = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>'
_SIGNATURE = "actorproxy-sha256-b146af6cda9cf08cf6984873a103eeae540f72ccc1bb6f15b74ddc26460c29e9"
_ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "Current weather of a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


def _openai_turns() -> list[tuple[str, dict[str, Any]]]:
    """(engine output, request body) per OpenAI turn; later turns echo the earlier replies."""
    user = {"role": "user", "content": "What is the weather in Paris for two days?"}
    call = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "call_c544a4b9ed810dcd383a9e13", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}],
    }
    result = {"role": "tool", "tool_call_id": "call_c544a4b9ed810dcd383a9e13", "content": "Sunny, 24 C."}
    history = [{"role": "system", "content": _SYSTEM}, user]
    answer = {"role": "assistant", "content": "Sunny in Paris, 24 C."}
    lyon = {
        "role": "assistant",
        "content": "Let me check Lyon too.",
        "tool_calls": [{"id": "call_82ce9fb494d8c25cbff69787", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}],
    }
    return [
        (
            "<think>\nI should call the weather tool.\n</think>\n\n" + _CALL_PARIS,
            {"model": "qwen3", "messages": history, "tools": [WEATHER_TOOL], "max_tokens": 200},
        ),
        (
            "<think>\nThe tool answered.\n</think>\n\nSunny in Paris, 24 C.",
            {"model": "qwen3", "messages": [*history, call, result], "tools": [WEATHER_TOOL], "stream": True},
        ),
        (
            "Let me check Lyon too.\n" + _CALL_LYON,
            {
                "model": "qwen3",
                "messages": [*history, call, result, answer, {"role": "user", "content": "And Lyon?"}],
                "tools": [WEATHER_TOOL],
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
        (
            "Lyon is cloudy. END of report, nothing more.",
            {
                "model": "qwen3",
                "messages": [*history, call, result, answer, {"role": "user", "content": "And Lyon?"}, lyon,
                             {"role": "tool", "tool_call_id": "call_82ce9fb494d8c25cbff69787", "content": "Cloudy."}],
                "tools": [WEATHER_TOOL],
                "stop": ["END"],
            },
        ),
    ]


def _anthropic_turns() -> list[tuple[str, str, dict[str, Any]]]:
    """(engine session, engine output, request body) per Anthropic turn."""
    user = {"role": "user", "content": "Is it raining in Oslo?"}
    use = {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "Check the weather.", "signature": _SIGNATURE},
            {"type": "tool_use", "id": "call_40ce81ead57aca7068fbc265", "name": "get_weather",
             "input": {"city": "Oslo"}},
        ],
    }
    result = {
        "role": "user",
        "content": [{"type": "tool_result", "tool_use_id": "call_40ce81ead57aca7068fbc265", "content": "Light rain."}],
    }
    base = {"model": "claude-golden", "max_tokens": 300, "system": _SYSTEM, "tools": [_ANTHROPIC_TOOL],
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    return [
        (
            ANTHROPIC,
            '<think>\nCheck the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Oslo"}}\n</tool_call>',
            {**base, "messages": [user]},
        ),
        (
            ANTHROPIC,
            "<think>\nIt rains.\n</think>\n\nYes, light rain in Oslo.",
            {**base, "messages": [user, use, result], "stream": True},
        ),
        (
            f"{ANTHROPIC}/sub-1",
            "Searched: three files mention Oslo.",
            {
                "model": "claude-golden",
                "max_tokens": 100,
                "system": "You are a search sub-agent. Report briefly.",
                "messages": [{"role": "user", "content": "Find files about Oslo."}],
                "stream": True,
            },
        ),
    ]


# -- normalising what is random or a clock reading -----------------------------------

_HEX_ID = re.compile(r"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")
_TIMESTAMP = re.compile(r'("(?:created|created_at|finished_at|first_token_at|written_at|started_at)": ?)[0-9.e+-]+')


class Normaliser:
    def __init__(self) -> None:
        self._ids: dict[str, str] = {}

    def __call__(self, text: str) -> str:
        def rename(match: re.Match[str]) -> str:
            return self._ids.setdefault(match.group(0), f"<id-{len(self._ids) + 1}>")

        return _TIMESTAMP.sub(r"\1<time>", _HEX_ID.sub(rename, text))


async def _record(tokenizer: ChatTokenizer) -> str:
    engine = SimEngine(tokenizer, SimConfig(seed=7, token_interval=0.0))
    config = ProxyConfig.of(port=0, heartbeat_interval=3600.0)
    out: list[str] = []
    norm = Normaliser()

    async def exchange(path: str, body: dict[str, Any] | None, headers: dict[str, str], http: httpx.AsyncClient) -> Any:
        out.append(f">>> {'GET' if body is None else 'POST'} {path} {json.dumps(headers, sort_keys=True)}")
        if body is None:
            response = await http.get(path, headers=headers)
        else:
            out.append(json.dumps(body, ensure_ascii=False, sort_keys=True))
            response = await http.post(path, content=json.dumps(body, ensure_ascii=False).encode(),
                                       headers={"content-type": "application/json", **headers})
        out.append(f"<<< {response.status_code} {response.headers.get('content-type')}")
        out.append(norm(response.content.decode("utf-8")))
        out.append("")
        return response

    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running, httpx.AsyncClient(
        base_url=running.url, timeout=60
    ) as http:
        for output, body in _openai_turns():
            engine.script(output, routing_key=OPENAI)
            await exchange("/v1/chat/completions", body, {"X-Session-Id": OPENAI}, http)
        for key, output, body in _anthropic_turns():
            engine.script(output, routing_key=key)
            await exchange("/v1/messages", body, {"X-Session-Id": ANTHROPIC}, http)
        await exchange(f"/session/{ANTHROPIC}", None, {}, http)
        await exchange("/session/finalize", {"session_id": OPENAI, "reward": 1.0}, {}, http)
        await exchange("/session/finalize", {"session_id": ANTHROPIC, "reward": 0.5, "instance_id": "golden"}, {},
                       http)
        for session in (OPENAI, ANTHROPIC, f"{ANTHROPIC}/sub-1"):
            response = await exchange("/trajectory/read", {"session_id": session, "include_steps": True}, {}, http)
            assert response.status_code == 200, response.text
        await exchange("/trajectory/stats", None, {}, http)
    return "\n".join(out)


async def test_wire_output_of_a_recorded_conversation_is_unchanged(tokenizer: ChatTokenizer) -> None:
    transcript = await _record(tokenizer)
    if os.environ.get("ACTORPROXY_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(transcript, encoding="utf-8")
    golden = GOLDEN.read_text(encoding="utf-8")
    if transcript != golden:
        diff = difflib.unified_diff(golden.splitlines(), transcript.splitlines(), "golden", "now", lineterm="", n=1)
        raise AssertionError("the wire output changed:\n" + "\n".join(list(diff)[:80]))
