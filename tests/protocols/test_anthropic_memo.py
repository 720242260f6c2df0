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


def test_a_turns_request_holds_its_typed_body_by_reference() -> None:
    """As chat's: the request a turn runs holds the body's converted messages, and the tools and settings its
    fields were converted to once while they repeat (not a copy a turn); it equals the full check's request."""
    fmt = AnthropicFormat()
    fields = {"stop_sequences": ["END"], "temperature": 0.5, "top_p": 0.9, "stream": True,
              "thinking": {"type": "enabled", "budget_tokens": 1024}}
    more = [*HISTORY, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "More."}]
    first, second = fmt.load(_raw(HISTORY, **fields)), fmt.load(_raw(more, **fields))
    assert isinstance(first, MessagesBody) and isinstance(second, MessagesBody)
    one, two = fmt.parse(first), fmt.parse(second)
    assert one.request.messages is first.messages and two.request.messages is second.messages
    assert two.request.tools is one.request.tools and two.request.stop is one.request.stop
    assert two == parse_messages_body(orjson.loads(_raw(more, **fields)))
    assert (two.request.max_tokens, two.request.stop, two.request.enable_thinking, two.thinking_shown) == (
        64, ("END",), True, True)
    changed = fmt.parse(fmt.load(_raw(more, **{**fields, "tool_choice": {"type": "none"}})))
    assert changed.request.tools == [] and changed.request.messages == two.request.messages
