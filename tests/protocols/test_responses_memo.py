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


def test_the_echo_is_the_fields_around_the_input_as_sent() -> None:
    """What the response echoes of the request: its fields but ``input`` as orjson parses them, from the typed
    fields the memo shares while they repeat (the same dict every turn without ``tools``)."""
    fmt = ResponsesFormat()
    fmt.load(_raw(HISTORY))
    more = [*HISTORY, {"type": "message", "role": "user", "content": "more"}]
    body = fmt.load(_raw(more))
    assert isinstance(body, ResponsesBody)
    sent = orjson.loads(_raw(HISTORY))
    assert body.echo["tools"] == TOOLS and body.echo["instructions"] == sent["instructions"]
    assert body.echo == fmt.parse(orjson.loads(_raw(more))).echo
    bare = [orjson.dumps({"model": "m", "input": items, "store": False}) for items in (HISTORY, more)]
    one, two = (fmt.load(raw) for raw in bare)
    assert isinstance(one, ResponsesBody) and isinstance(two, ResponsesBody) and one.echo is two.echo


def test_a_turns_request_holds_its_typed_body_by_reference() -> None:
    """As chat's: the request a turn runs holds the input's converted messages after the ``instructions``'
    system message, and the tools and settings its fields were converted to once while they repeat (not a copy
    a turn); the call equals the full conversion's, the echoed fields included."""
    fmt = ResponsesFormat()
    fields = {"temperature": 0.5, "top_p": 0.9, "max_output_tokens": 64, "reasoning": {"effort": "low"},
              "stream": True, "metadata": {"k": "v"}}
    more = [*HISTORY, {"type": "message", "role": "user", "content": "more"}]
    first, second = fmt.load(_raw(HISTORY, **fields)), fmt.load(_raw(more, **fields))
    assert isinstance(first, ResponsesBody) and isinstance(second, ResponsesBody)
    one, two = fmt.parse(first), fmt.parse(second)
    assert two.request.tools is one.request.tools and two.request.messages[0] is one.request.messages[0]
    assert two.request.messages[0] == {"role": "system", "content": "You are Codex."} and two.has_instructions
    assert two == fmt.parse(orjson.loads(_raw(more, **fields)))
    assert (two.request.max_tokens, two.request.temperature, two.request.enable_thinking) == (64, 0.5, True)
    none = fmt.parse(fmt.load(_raw(more, **fields, tool_choice="none")))
    assert none.request.tools == [] and none.echo["tools"] == TOOLS and none.echo["tool_choice"] == "none"
    bare = fmt.parse(fmt.load(orjson.dumps({"model": "m", "input": more, "store": False})))
    assert bare == fmt.parse({"model": "m", "input": more, "store": False}) and not bare.has_instructions
