"""An Anthropic Messages history is converted once per distinct message, not every turn (issue 12).

``AnthropicFormat.load`` hands out the same converted (frozen) messages for the
same message text every turn, and the same converted tools for the same tools
text. What the three memo formats share (reuse, typing again what changed, the
full check's errors, aging, the bound) is tested once for all of them in
``test_memo_formats.py``; here is what is Anthropic's own: a ``clear_at`` system
message is cleared by the body it is in.
"""

from __future__ import annotations

from typing import Any

import orjson
from _util import decision

from actorproxy.protocols.anthropic import AnthropicFormat, parse_messages_body
from actorproxy.protocols.anthropic_messages import MessagesBody
from actorproxy.schema.jsonio import load_body

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
