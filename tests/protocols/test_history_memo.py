"""The history's messages are checked once per distinct message, not every turn (issue 12).

``load_chat_body`` hands out one frozen message per distinct message text, the
same object every turn; these tests make sure no cached message ever stands for
one that changed: an old message edited (its text, a tool call), moved or
deleted is checked again and is a history rewrite exactly as before, and a bad
new message gets the full check's error word for word.
"""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import httpx
import orjson
import pytest
from _util import nested, start_reasons

from actorproxy.errors import BadRequest
from actorproxy.protocols.chat_messages import ChatBody, ChatMemo, _check, load_chat_body
from actorproxy.protocols.memo import MessageMemo
from actorproxy.protocols.openai_chat import OpenAIChatFormat, parse_chat_body
from actorproxy.schema.jsonio import MAX_DEPTH, load_body
from actorproxy.serve import RunningProxy
from actorproxy.tokenization.message_fields import FrozenMessage

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


def test_a_repeated_message_is_the_same_checked_object_every_turn() -> None:
    memo = ChatMemo()
    first = _loaded(memo, HISTORY)
    second = _loaded(memo, [*HISTORY, {"role": "user", "content": "more"}])
    assert all(a is b for a, b in zip(first.messages, second.messages, strict=False))
    assert all(type(m) is FrozenMessage for m in second.messages)
    assert second.messages[0] == {"role": "system", "content": "You are a coding agent."}  # developer read as system
    assert second.messages[-1] == {"role": "user", "content": "more"}
    plain = parse_chat_body(orjson.loads(_raw([*HISTORY, {"role": "user", "content": "more"}])))
    assert parse_chat_body(second).request == plain.request


def test_the_fields_around_the_messages_are_typed_once_while_they_repeat() -> None:
    memo = ChatMemo()
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    first = load_chat_body(_raw(HISTORY, tools=tools, temperature=0.5), memo)
    second = load_chat_body(_raw([*HISTORY, {"role": "user", "content": "more"}], tools=tools, temperature=0.5), memo)
    assert isinstance(first, ChatBody) and isinstance(second, ChatBody)
    assert second.fields is first.fields  # the same typed options: not structured again
    assert second.fields.options.temperature == 0.5 and second.fields.tools == tuple(tools)
    other = load_chat_body(_raw(HISTORY, tools=tools, temperature=0.25), memo)
    assert isinstance(other, ChatBody) and other.fields.options.temperature == 0.25


@pytest.mark.parametrize("edit", ["content", "tool_call", "tool_call_id", "reorder", "delete", "spacing"])
def test_an_old_message_edited_moved_or_deleted_is_never_its_cached_self(edit: str) -> None:
    memo = ChatMemo()
    before = _loaded(memo, HISTORY).messages
    messages = json.loads(json.dumps(HISTORY))
    if edit == "content":
        messages[1]["content"] = "Read b.py."
    elif edit == "tool_call":
        messages[2]["tool_calls"][0]["function"]["arguments"] = '{"path": "b.py"}'
    elif edit == "tool_call_id":
        messages[3]["tool_call_id"] = "call_2"
    elif edit == "reorder":
        messages[1], messages[4] = messages[4], messages[1]
    elif edit == "delete":
        del messages[3]
    raw = _raw(messages)
    if edit == "spacing":  # the same message written otherwise: parsed again, equal
        raw = raw.replace(b'"content":"Read a.py."', b'"content" : "Read a.py."')
    after = load_chat_body(raw, memo)
    assert isinstance(after, ChatBody)
    expected = parse_chat_body(orjson.loads(raw)).request.messages
    assert after.messages == expected  # what the full check gives, never a stale cached message
    if edit == "content":
        assert after.messages[1]["content"] == "Read b.py." and after.messages[1] is not before[1]
    if edit == "spacing":
        assert after.messages[1] == before[1] and after.messages[1] is not before[1]


#: Bad messages, each sent after a history the memo already holds: the error must be the full check's.
BAD_MESSAGES: list[Any] = [
    {"role": "user", "content": None},
    {"role": "user"},
    {"role": "user", "content": "x", "tool_calls": [CALL]},
    {"role": "user", "content": "x", "name": 3},
    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
    {"role": "user", "content": [{"type": "text"}]},
    {"role": "user", "content": 5},
    {"role": "robot", "content": "x"},
    {"content": "x"},
    {"role": 1, "content": "x"},
    {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
    {"role": "assistant", "tool_calls": {"function": {"name": "f"}}},
    {"role": "assistant", "tool_calls": [{"type": None, "function": {"name": "f"}}]},
    {"role": "tool", "content": "x", "tool_call_id": 7},
    {"role": "assistant", "content": "x", "reasoning_content": ["no"]},
    "a string",
    None,
    [],
]


def _error(call: Any) -> tuple[str, str | None, str | None]:
    with pytest.raises(BadRequest) as info:
        call()
    return (str(info.value), info.value.param, info.value.code)


@pytest.mark.parametrize("bad", BAD_MESSAGES, ids=[json.dumps(b)[:40] for b in BAD_MESSAGES])
def test_a_bad_new_message_gets_the_full_checks_error_word_for_word(bad: Any) -> None:
    fmt = OpenAIChatFormat()
    fmt.parse(fmt.load(_raw(HISTORY)))  # the history is in the memo
    for messages in ([*HISTORY, bad], [HISTORY[0], bad, *HISTORY[1:]]):
        raw = _raw(messages)
        assert _error(lambda raw=raw: fmt.parse(fmt.load(raw))) == _error(
            lambda raw=raw: parse_chat_body(load_body(raw))
        )


@pytest.mark.parametrize("depth", [MAX_DEPTH - 4, MAX_DEPTH - 3, MAX_DEPTH - 2, MAX_DEPTH - 1, MAX_DEPTH])
@pytest.mark.parametrize("where", ["message", "tools"])
def test_the_nesting_bound_is_the_same_with_a_cached_history(depth: int, where: str) -> None:
    fmt = OpenAIChatFormat()
    fmt.parse(fmt.load(_raw(HISTORY)))
    if where == "message":
        raw = _raw([*HISTORY, {"role": "user", "content": "x", "extra": nested(depth)}])
    else:
        raw = _raw(HISTORY, tools=[{"type": "function", "function": {"name": "f", "parameters": nested(depth)}}])

    def outcome(load: Any, parse: Any) -> Any:
        try:
            return parse(load(raw)).request
        except BadRequest as exc:
            return (str(exc), exc.param, exc.code)

    fast = outcome(fmt.load, fmt.parse)
    assert fast == outcome(load_body, parse_chat_body)
    assert isinstance(fast, tuple) == (depth + (3 if where == "message" else 4) > MAX_DEPTH)


def test_a_duplicate_messages_key_reads_the_last_one_as_json_does() -> None:
    memo = ChatMemo()
    _loaded(memo, HISTORY)
    raw = _raw(HISTORY)[:-1] + b',"messages":[{"role":"user","content":"last"}]}'
    body = load_chat_body(raw, memo)
    assert isinstance(body, ChatBody) and body.messages == [{"role": "user", "content": "last"}]


def test_the_memo_is_bounded() -> None:
    memo = ChatMemo(max_bytes=1000)
    for i in range(100):
        _loaded(memo, [{"role": "user", "content": f"message {i} " + "x" * 40}])
    assert len(memo) < 50
    again = _loaded(memo, [{"role": "user", "content": "message 0 " + "x" * 40}])  # evicted: checked again
    assert again.messages == [{"role": "user", "content": "message 0 " + "x" * 40}]


def test_aging_drops_what_no_lookup_used_since_the_last_age() -> None:
    """Issue 33: the memo kept every finalized session's messages until it reached its bound (64 MiB): RSS
    grew with each drain (memory_drains.py: one entry a session, ~1 MiB of pinned allocator arenas a drain).
    Aged at each drain, it keeps what the turns since the last drain used, and nothing older."""
    memo = ChatMemo()
    done = {"role": "user", "content": "the first message of a session finalized and drained"}
    live = {"role": "user", "content": "the first message of a session still running"}
    _loaded(memo, [done])
    _loaded(memo, [live], tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    memo.age()
    again = _loaded(memo, [live])  # a turn of the live session after the drain: it stays
    memo.age()
    assert len(memo) == 1 and len(memo.options) == 1  # the drained session's message and the old tools are gone
    assert _loaded(memo, [live]).messages[0] is again.messages[0]


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


# -- over HTTP: a rewritten history still splits the segment ---------------------------------------------


async def _turn(http: httpx.AsyncClient, session: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    response = await http.post("/v1/chat/completions", json={"model": "m", "messages": messages, "max_tokens": 12},
                               headers={"X-Session-Id": session})
    assert response.status_code == 200, response.text
    message = response.json()["choices"][0]["message"]
    return {"role": "assistant", "content": message["content"] or ""}


@pytest.mark.parametrize("edit", [None, "content", "tool_call", "our_reply", "reorder", "delete"])
async def test_an_edited_old_message_is_still_a_history_rewrite(
    http: httpx.AsyncClient, proxy: RunningProxy, edit: str | None
) -> None:
    session = f"edit-{edit}"
    messages = json.loads(json.dumps(HISTORY))
    for turn in range(4):
        if turn == 3 and edit is not None:
            if edit == "content":
                messages[1]["content"] = "Read b.py."
            elif edit == "tool_call":
                messages[2]["tool_calls"][0]["function"]["arguments"] = '{"path": "b.py"}'
            elif edit == "our_reply":
                messages[5]["content"] += " (edited)"
            elif edit == "reorder":
                messages[1], messages[3] = messages[3], messages[1]
            elif edit == "delete":
                del messages[4]
        messages.append(await _turn(http, session, messages))
        messages.append({"role": "user", "content": f"next {turn}"})
    expected = ["session_start"] if edit is None else ["session_start", "history_rewrite"]
    assert await start_reasons(http, session) == expected


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
    assert two.tools is one.tools and two.stop is one.stop
    assert two == parse_chat_body(orjson.loads(_raw(more, **fields))).request
    assert (two.max_tokens, two.stop, two.enable_thinking, two.stream, two.tools) == (7, ("END",), False, True, tools)
