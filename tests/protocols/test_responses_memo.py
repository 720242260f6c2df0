"""A Responses input is converted once per distinct item, not every turn (issue 12).

``ResponsesFormat.load`` hands out the same converted (frozen) user, system and tool
messages for the same item text every turn, groups the assistant parts per body,
and keeps the converted tools by their text. These tests make sure nothing cached
stands for something that changed, and that every body is decided as the full
conversion decides it: the same call, or the same error word for word.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import orjson
import pytest
from _util import decision, nested, start_reasons

from actorproxy.protocols.responses_api import parse_responses_body
from actorproxy.protocols.responses_format import ResponsesFormat
from actorproxy.protocols.responses_memo import ResponsesBody, ResponsesMemo, load_responses_body
from actorproxy.schema.jsonio import MAX_DEPTH, load_body
from actorproxy.serve import RunningProxy
from actorproxy.tokenization.message_fields import FrozenMessage

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



def test_a_repeated_input_is_the_same_converted_objects_every_turn() -> None:
    fmt = ResponsesFormat()
    first = fmt.parse(fmt.load(_raw(HISTORY))).request
    later = [*HISTORY, {"type": "function_call", "name": "shell", "arguments": "{}", "call_id": "call_2"},
             {"type": "function_call_output", "call_id": "call_2", "output": "ok"}]
    second = fmt.parse(fmt.load(_raw(later))).request
    same = [a is b for a, b in zip(first.messages, second.messages, strict=False)]
    # The instructions' system message is made anew; every other message (assistant turns too) is the memo's.
    assert same == [False] + [True] * (len(first.messages) - 1), same
    assert [type(m) is FrozenMessage for m in second.messages] == [False] + [True] * (len(second.messages) - 1)
    assert second == parse_responses_body(orjson.loads(_raw(later))).request
    assert isinstance(ResponsesFormat().load(_raw(later)), ResponsesBody)


def test_the_fields_around_the_input_are_typed_once_while_they_repeat() -> None:
    fmt = ResponsesFormat()
    first = fmt.load(_raw(HISTORY))
    second = fmt.load(_raw([*HISTORY, {"type": "message", "role": "user", "content": "more"}]))
    assert isinstance(first, ResponsesBody) and isinstance(second, ResponsesBody)
    assert second.fields is first.fields  # the same typed options: not structured again
    assert second.value == {k: v for k, v in orjson.loads(_raw(HISTORY)).items() if k != "input"}
    changed = fmt.load(_raw(HISTORY, temperature=0.5))
    assert isinstance(changed, ResponsesBody) and changed.fields.options.temperature == 0.5


@pytest.mark.parametrize("edit", ["text", "arguments", "output", "reorder", "delete", "tools", "spacing"])
def test_an_old_item_edited_moved_or_deleted_is_never_its_cached_self(edit: str) -> None:
    fmt = ResponsesFormat()
    fmt.parse(fmt.load(_raw(HISTORY)))
    items = json.loads(json.dumps(HISTORY))
    fields: dict[str, Any] = {}
    if edit == "text":
        items[1]["content"][0]["text"] = "List the dirs."
    elif edit == "arguments":
        items[3]["arguments"] = '{"cmd": "ls -a"}'
    elif edit == "output":
        items[4]["output"] = "c.py"
    elif edit == "reorder":
        items[2], items[3] = items[3], items[2]
    elif edit == "delete":
        del items[5]
    elif edit == "tools":
        fields["tools"] = [{**TOOLS[0], "name": "bash"}]
    raw = _raw(items, **fields)
    if edit == "spacing":
        raw = raw.replace(b'"output":"a.py\\nb.py"', b'"output" : "a.py\\nb.py"')
    fast = decision(fmt.load, fmt.parse, raw)
    assert not isinstance(fast, tuple) and fast == decision(load_body, parse_responses_body, raw)


BAD_ITEMS: list[Any] = [
    {"type": "message", "role": "robot", "content": "x"},
    {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]},
    {"type": "message", "role": "user", "content": 7},
    {"type": "message", "role": "user", "content": [{"type": [], "text": "x"}]},  # was a TypeError: a 500
    {"type": "function_call", "arguments": "{}", "call_id": "c"},
    {"type": "function_call", "name": "f", "arguments": {}, "call_id": "c"},
    {"type": "function_call_output", "call_id": 3, "output": "x"},
    {"type": "reasoning", "encrypted_content": "actorproxy-b64:!!!"},
    {"type": "web_search_call"},
    {"content": "no type, no role"},
    "a string",
    None,
]


@pytest.mark.parametrize("bad", BAD_ITEMS, ids=[json.dumps(b)[:40] for b in BAD_ITEMS])
def test_a_bad_new_item_gets_the_full_conversions_error_word_for_word(bad: Any) -> None:
    fmt = ResponsesFormat()
    fmt.parse(fmt.load(_raw(HISTORY)))
    for items in ([*HISTORY, bad], [HISTORY[0], bad, *HISTORY[1:]]):
        raw = _raw(items)
        decided = decision(fmt.load, fmt.parse, raw)
        assert isinstance(decided, tuple) and decided == decision(load_body, parse_responses_body, raw)


@pytest.mark.parametrize("fields", [{"tools": [{"type": "function"}]}, {"tools": {}}, {"tools": [3]},
                                    {"input": []}, {"input": "just text"}, {"instructions": 5, "tools": 7}])
def test_odd_tools_and_inputs_are_decided_as_before(fields: dict[str, Any]) -> None:
    fmt = ResponsesFormat()
    fmt.parse(fmt.load(_raw(HISTORY)))
    raw = _raw(HISTORY, **fields)
    assert decision(fmt.load, fmt.parse, raw) == decision(load_body, parse_responses_body, raw)


@pytest.mark.parametrize("depth", [MAX_DEPTH - 5, MAX_DEPTH - 4, MAX_DEPTH - 3, MAX_DEPTH - 2, MAX_DEPTH - 1])
@pytest.mark.parametrize("where", ["item", "tools", "other"])
def test_the_nesting_bound_is_the_same_with_a_cached_history(depth: int, where: str) -> None:
    fmt = ResponsesFormat()
    fmt.parse(fmt.load(_raw(HISTORY)))
    if where == "item":
        raw = _raw([*HISTORY, {"type": "message", "role": "user", "content": "x", "extra": nested(depth)}])
    elif where == "tools":
        raw = _raw(HISTORY, tools=[{**TOOLS[0], "parameters": nested(depth)}])
    else:
        raw = _raw(HISTORY, metadata=nested(depth))
    assert decision(fmt.load, fmt.parse, raw) == decision(load_body, parse_responses_body, raw)


def test_the_memo_is_bounded() -> None:
    memo = ResponsesMemo(max_bytes=1000, tools_bytes=1000, max_turns=10)
    for i in range(100):
        reply = {"type": "message", "role": "assistant", "content": f"reply {i}"}
        items = [{"type": "message", "role": "user", "content": f"m {i} " + "x" * 40}, reply,
                 {"type": "message", "role": "user", "content": "more"}]
        body = load_responses_body(_raw(items), memo)
        assert isinstance(body, ResponsesBody) and body.messages[1]["content"] == f"reply {i}"
    assert len(memo.items) < 50
    assert len(memo._turns) + len(memo._old_turns) <= 20


# -- over HTTP: a rewritten history still splits the segment ---------------------------------------------


@pytest.mark.parametrize("edit", [None, "text", "our_reply", "delete"])
async def test_an_edited_old_item_is_still_a_history_rewrite(
    http: httpx.AsyncClient, proxy: RunningProxy, edit: str | None
) -> None:
    session = f"responses-edit-{edit}"
    items = json.loads(json.dumps(HISTORY[:2]))
    for turn in range(4):
        if turn == 3 and edit is not None:
            if edit == "text":
                items[1]["content"][0]["text"] = "List the dirs."
            elif edit == "our_reply":
                items[2]["content"][0]["text"] += " (edited)"
            elif edit == "delete":
                del items[2:4]
        body = {"model": "m", "max_output_tokens": 12, "instructions": "You are Codex.", "input": items,
                "store": False}
        response = await http.post("/v1/responses", json=body, headers={"session-id": session})
        assert response.status_code == 200, response.text
        output = [item for item in response.json()["output"] if item["type"] == "message"]
        items.append({"type": "message", "role": "assistant", "content": output[0]["content"]})
        items.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"n{turn}"}]})
    expected = ["session_start"] if edit is None else ["session_start", "history_rewrite"]
    assert await start_reasons(http, session) == expected
