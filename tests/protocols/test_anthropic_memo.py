"""An Anthropic Messages history is converted once per distinct message, not every turn (issue 12).

``AnthropicFormat.load`` hands out the same converted (frozen) messages for the
same message text every turn, and the same converted tools for the same tools
text. What the three memo formats share (reuse, typing again what changed, the
full check's errors, aging, the bound) is tested once for all of them in
``test_memo_formats.py``; here is what is Anthropic's own: a ``clear_at`` system
message is cleared by the body it is in, and an edited old message is a history
rewrite over HTTP exactly as before.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson
import pytest
from _util import decision, start_reasons

from actorproxy.protocols.anthropic import AnthropicFormat, parse_messages_body
from actorproxy.protocols.anthropic_messages import MessagesBody
from actorproxy.schema.jsonio import load_body
from actorproxy.serve import RunningProxy

TOOLS = [{"name": "read_file", "description": "Read a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]
SYSTEM = [{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}]
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": [{"type": "text", "text": "Read a.py."}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Read it.", "signature": "sig"},
        {"type": "text", "text": "Reading."},
        {"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.py"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "print('a')"}]},
        {"type": "text", "text": "And now?"}]},
]


def _raw(messages: list[dict[str, Any]], **fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "max_tokens": 64, "system": SYSTEM, "tools": TOOLS, "messages": messages,
                         **fields})


def test_a_cleared_system_message_is_decided_by_the_body_it_is_in() -> None:
    fmt = AnthropicFormat()
    reminder = {"role": "system", "content": "Remember the tests.", "clear_at": "next_user_message"}
    go_on = {"role": "user", "content": "Go on."}
    bodies = {
        "cleared": [*HISTORY, reminder, go_on],
        "kept": [*HISTORY, reminder],  # no user message after it (yet)
        "cleared later": [*HISTORY, reminder, {"role": "assistant", "content": "Ok."}, go_on],
    }
    for name, messages in bodies.items():  # the same cached reminder in each
        raw = _raw(messages)
        assert isinstance(fmt.load(raw), MessagesBody)
        call = decision(fmt.load, fmt.parse, raw)
        assert call == decision(load_body, parse_messages_body, raw)
        assert ({"role": "system", "content": "Remember the tests."} in call.request.messages) == (name == "kept")


# -- over HTTP: a rewritten history still splits the segment ---------------------------------------------


@pytest.mark.parametrize("edit", [None, "text", "tool_input", "our_reply", "system", "delete"])
async def test_an_edited_old_message_is_still_a_history_rewrite(
    http: httpx.AsyncClient, proxy: RunningProxy, edit: str | None
) -> None:
    session = f"anthropic-edit-{edit}"
    messages = json.loads(json.dumps(HISTORY))
    system: Any = SYSTEM
    for turn in range(4):
        if turn == 3 and edit is not None:
            if edit == "text":
                messages[0]["content"][0]["text"] = "Read b.py."
            elif edit == "tool_input":
                messages[1]["content"][2]["input"] = {"path": "b.py"}
            elif edit == "our_reply":
                messages[3]["content"][0]["text"] += " (edited)"
            elif edit == "system":
                system = "Another system prompt."
            elif edit == "delete":
                del messages[2:4]
        body = {"model": "m", "max_tokens": 12, "system": system, "tools": TOOLS, "messages": messages}
        response = await http.post("/v1/messages", json=body, headers={"X-Session-Id": session})
        assert response.status_code == 200, response.text
        text = "".join(block["text"] for block in response.json()["content"] if block["type"] == "text")
        messages.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
        messages.append({"role": "user", "content": f"next {turn}"})
    expected = {None: ["session_start"], "system": ["session_start", "system_changed"]}.get(
        edit, ["session_start", "history_rewrite"])
    assert await start_reasons(http, session) == expected
