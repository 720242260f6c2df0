"""The history's messages are checked once per distinct message, not every turn (issue 12).

``load_chat_body`` hands out one frozen message per distinct message text, the
same object every turn. What the three memo formats share (reuse, typing again
what changed, the full check's errors, aging, the bound) is tested once for all
of them in ``test_memo_formats.py``; here is what is chat's own: a duplicate
``messages`` key, what the memo weighs, the cut of frozen messages, and the
request holding the typed body.
"""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import orjson
import pytest

from actorproxy.protocols.chat_messages import ChatBody, ChatMemo, _check, load_chat_body
from actorproxy.protocols.memo import MessageMemo
from actorproxy.protocols.openai_chat import parse_chat_body

CALL = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
HISTORY: list[dict[str, Any]] = [
    {"role": "developer", "content": "You are a coding agent."},
    {"role": "user", "content": "Read a.py."},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "print('a')"},
    {"role": "user", "content": "And now?"},
]


def _raw(messages: list[dict[str, Any]], **fields: Any) -> bytes:
    return orjson.dumps({"model": "m", "messages": messages, **fields})


def _loaded(memo: ChatMemo, messages: list[dict[str, Any]], **fields: Any) -> ChatBody:
    body = load_chat_body(_raw(messages, **fields), memo)
    assert isinstance(body, ChatBody)
    return body


def test_a_duplicate_messages_key_reads_the_last_one_as_json_does() -> None:
    memo = ChatMemo()
    _loaded(memo, HISTORY)
    raw = _raw(HISTORY)[:-1] + b',"messages":[{"role":"user","content":"last"}]}'
    body = load_chat_body(raw, memo)
    assert isinstance(body, ChatBody) and body.messages == [{"role": "user", "content": "last"}]


@pytest.mark.parametrize("text_bytes", [20, 2000])
def test_the_memo_weighs_at_most_twice_its_budget_in_memory(text_bytes: int) -> None:
    """The bound is on what the kept entries weigh (text, parsed value, checked object), not on their text alone.

    Short messages weigh several times their text: a bound on text let the memo hold
    gigabytes (issue 33).
    """
    budget = 1 << 18
    memo = MessageMemo(max_bytes=budget)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(10 * budget // (text_bytes + 200)):  # enough to turn the memo over many times
            message = {"role": "user", "content": f"message {i} " + "x" * text_bytes}
            memo.put(json.dumps(message).encode(), _check(orjson.loads(json.dumps(message))), 2)
        kept = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert kept <= 2.2 * budget, f"{kept / budget:.1f}x the budget"


def test_message_cut_trusts_identity_only_for_frozen_messages(tokenizer: Any) -> None:
    cut = tokenizer.message_cut()
    mine = {"role": "user", "content": "hi"}
    history: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, mine]
    first = cut.cut(history)
    mine["content"] = "bye"  # an in-process agent edits its own dict in place, and sends the same object again
    again = cut.cut(history)
    assert again[1] == {"role": "user", "content": "bye"} and first[1]["content"] == "hi"
    frozen = _loaded(ChatMemo(), [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}}])
    once = cut.cut(frozen.messages)
    assert once == [{"role": "user", "content": "hi"}]  # the field no template reads is cut...
    assert cut.cut(list(frozen.messages))[0] is once[0]  # ...once: the same frozen message is not cut again




def test_a_turns_request_holds_its_typed_body_by_reference() -> None:
    """The request a turn runs is no copy: it holds the typed body's messages, and the tools and settings its
    fields were typed to once while they repeat; it equals the request the whole body's full check gives."""
    memo = ChatMemo()
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    fields = {"tools": tools, "max_completion_tokens": 7, "stop": "END", "temperature": 0.5, "top_p": 0.9, "seed": 3,
              "chat_template_kwargs": {"enable_thinking": False}, "stream": True}
    first = _loaded(memo, HISTORY, **fields)
    more = [*HISTORY, {"role": "user", "content": "more"}]
    second = _loaded(memo, more, **fields)
    one, two = parse_chat_body(first).request, parse_chat_body(second).request
    assert one.messages is first.messages and two.messages is second.messages
    assert two.messages[0] == {"role": "system", "content": "You are a coding agent."}  # developer read as system
    assert two.tools is one.tools and two.stop is one.stop
    assert two == parse_chat_body(orjson.loads(_raw(more, **fields))).request
    assert (two.max_tokens, two.stop, two.enable_thinking, two.stream, two.tools) == (7, ("END",), False, True, tools)
