"""An Anthropic Messages history is converted once per distinct message, not every turn (issue 12).

``AnthropicFormat.load`` hands out the same converted (frozen) messages for the
same message text every turn, and the same converted tools for the same tools
text. These tests make sure nothing cached ever stands for something that
changed (an old message edited, moved or deleted converts again and is a history
rewrite exactly as before), that a ``clear_at`` system message is cleared by the
body it is in, and that every body is decided as the full conversion decides it:
the same request, or the same error word for word.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson
import pytest
from _util import decision, nested, start_reasons

from actorproxy.protocols.anthropic import AnthropicFormat, parse_messages_body
from actorproxy.protocols.anthropic_messages import AnthropicMemo, MessagesBody, load_messages_body
from actorproxy.schema.jsonio import MAX_DEPTH, load_body
from actorproxy.serve import RunningProxy
from actorproxy.tokenization.message_fields import FrozenMessage

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


def _loaded(memo: AnthropicMemo, raw: bytes) -> MessagesBody:
    body = load_messages_body(raw, memo)
    assert isinstance(body, MessagesBody)
    return body



def test_a_repeated_history_is_the_same_converted_objects_every_turn() -> None:
    fmt = AnthropicFormat()
    first = fmt.load(_raw(HISTORY))
    later = [*HISTORY, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks."}]
    second = fmt.load(_raw(later))
    assert isinstance(first, MessagesBody) and isinstance(second, MessagesBody)
    assert all(a is b for a, b in zip(first.messages, second.messages, strict=False))
    assert len(second.messages) == len(first.messages) + 2
    assert all(type(m) is FrozenMessage for m in second.messages)
    assert all(a is b for a, b in zip(first.tools, second.tools, strict=True))
    assert second.options is first.options  # the model, max_tokens, ...: typed once while they repeat
    assert fmt.parse(second).request == parse_messages_body(orjson.loads(_raw(later))).request
    changed = fmt.load(_raw(later, temperature=0.5))
    assert isinstance(changed, MessagesBody) and changed.options.temperature == 0.5


@pytest.mark.parametrize("edit", ["text", "tool_input", "tool_result", "reorder", "delete", "system", "tools",
                                  "spacing"])
def test_an_old_message_edited_moved_or_deleted_is_never_its_cached_self(edit: str) -> None:
    fmt = AnthropicFormat()
    fmt.parse(fmt.load(_raw(HISTORY)))
    messages = json.loads(json.dumps(HISTORY))
    fields: dict[str, Any] = {}
    if edit == "text":
        messages[0]["content"][0]["text"] = "Read b.py."
    elif edit == "tool_input":
        messages[1]["content"][2]["input"] = {"path": "b.py"}
    elif edit == "tool_result":
        messages[2]["content"][0]["content"][0]["text"] = "print('b')"
    elif edit == "reorder":
        messages[0], messages[2] = messages[2], messages[0]
    elif edit == "delete":
        del messages[1]
    elif edit == "system":
        fields["system"] = "Another system prompt."
    elif edit == "tools":
        fields["tools"] = [{**TOOLS[0], "name": "write_file"}]
    raw = _raw(messages, **fields)
    if edit == "spacing":  # the same message written otherwise: converted again, equal
        raw = raw.replace(b'"text":"Read a.py."', b'"text" : "Read a.py."')
    assert decision(fmt.load, fmt.parse, raw) == decision(load_body, parse_messages_body, raw)


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


BAD_MESSAGES: list[Any] = [
    {"role": "user", "content": [{"type": "image", "source": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "content": "x"}]},
    {"role": "user", "content": [{"text": "no type"}]},
    {"role": "user", "content": 7},
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "not an object"}]},
    {"role": "assistant", "content": [{"type": "server_tool_use", "id": "t"}]},
    {"role": "robot", "content": "x"},
    {"content": "x"},
    {"role": "system", "content": [{"type": "image"}]},
    {"role": "system", "content": [{"type": "image"}], "clear_at": "next_user_message"},
    "a string",
    None,
    [],
]


@pytest.mark.parametrize("bad", BAD_MESSAGES, ids=[json.dumps(b)[:40] for b in BAD_MESSAGES])
def test_a_bad_new_message_gets_the_full_conversions_error_word_for_word(bad: Any) -> None:
    fmt = AnthropicFormat()
    fmt.parse(fmt.load(_raw(HISTORY)))  # the history is in the memo
    after = {"role": "user", "content": "."}
    for messages in ([*HISTORY, bad], [HISTORY[0], bad, *HISTORY[1:]], [*HISTORY, bad, after],
                     [*HISTORY, {"role": "assistant", "content": "prefill"}]):
        raw = _raw(messages)
        assert decision(fmt.load, fmt.parse, raw) == decision(load_body, parse_messages_body, raw)


@pytest.mark.parametrize("bad", [{"system": 7}, {"system": [{"type": "image"}]}, {"tools": [{"name": "f"}]},
                                 {"tools": [{"type": "web_search", "name": "w"}]}, {"tools": {}},
                                 {"model": None, "tools": 3}])
def test_bad_system_or_tools_get_the_full_conversions_error(bad: dict[str, Any]) -> None:
    fmt = AnthropicFormat()
    fmt.parse(fmt.load(_raw(HISTORY)))
    raw = _raw(HISTORY, **bad)
    decided = decision(fmt.load, fmt.parse, raw)
    assert isinstance(decided, tuple) and decided == decision(load_body, parse_messages_body, raw)


@pytest.mark.parametrize("depth", [MAX_DEPTH - 5, MAX_DEPTH - 4, MAX_DEPTH - 3, MAX_DEPTH - 2, MAX_DEPTH - 1])
@pytest.mark.parametrize("where", ["message", "tools", "system", "other"])
def test_the_nesting_bound_is_the_same_with_a_cached_history(depth: int, where: str) -> None:
    fmt = AnthropicFormat()
    fmt.parse(fmt.load(_raw(HISTORY)))
    if where == "message":
        raw = _raw([*HISTORY[:-1], {**HISTORY[-1], "extra": nested(depth)}])
    elif where == "tools":
        raw = _raw(HISTORY, tools=[{**TOOLS[0], "input_schema": nested(depth)}])
    elif where == "system":
        raw = _raw(HISTORY, system=[{**SYSTEM[0], "cache_control": nested(depth)}])
    else:
        raw = _raw(HISTORY, metadata=nested(depth))
    assert decision(fmt.load, fmt.parse, raw) == decision(load_body, parse_messages_body, raw)


def test_the_memo_is_bounded() -> None:
    memo = AnthropicMemo(max_bytes=1000, field_bytes=1000)
    for i in range(100):
        _loaded(memo, _raw([{"role": "user", "content": f"message {i} " + "x" * 40}]))
    assert len(memo.messages) < 50
    again = _loaded(memo, _raw([{"role": "user", "content": "message 0 " + "x" * 40}]))
    assert again.messages[-1] == {"role": "user", "content": "message 0 " + "x" * 40}


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
