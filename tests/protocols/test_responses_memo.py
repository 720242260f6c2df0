"""A Responses input is converted once per distinct item, not every turn (issue 12).

``ResponsesFormat.load`` hands out the same converted (frozen) user, system and tool
messages for the same item text every turn, groups the assistant parts per body,
and keeps the converted tools by their text. What the three memo formats share
(reuse, typing again what changed, the full check's errors, aging, the bound) is
tested once for all of them in ``test_memo_formats.py``; here is what is the
Responses API's own.
"""

from __future__ import annotations

from typing import Any

import orjson

from actorproxy.protocols.responses_format import ResponsesFormat
from actorproxy.protocols.responses_memo import ResponsesBody

TOOLS = [{"type": "function", "name": "shell", "description": "Run a command",
          "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
         {"type": "web_search"}]
HISTORY: list[dict[str, Any]] = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be careful."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
    {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Use ls."}]},
    {"type": "function_call", "name": "shell", "arguments": '{"cmd": "ls"}', "call_id": "call_1"},
    {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Two files."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And now?"}]},
]


def _raw(items: list[dict[str, Any]], **fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "instructions": "You are Codex.", "tools": TOOLS, "input": items,
                         "store": False, **fields})


def test_the_value_is_the_fields_around_the_input_as_sent() -> None:
    """What the response echoes of the request: its fields but ``input`` as orjson parses them, from the typed
    fields the memo shares while they repeat."""
    fmt = ResponsesFormat()
    fmt.load(_raw(HISTORY))
    body = fmt.load(_raw([*HISTORY, {"type": "message", "role": "user", "content": "more"}]))
    assert isinstance(body, ResponsesBody)
    assert body.value == {k: v for k, v in orjson.loads(_raw(HISTORY)).items() if k != "input"}
