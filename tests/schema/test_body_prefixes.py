"""A long body that starts with a body read before has only its new end read, and is decided exactly as whole.

``load_chat_body`` keeps each long body up to the end of its last message
(``MessageMemo.bodies``); the next turn's body, whose bytes start with those,
is read from there on (``memo.read``). These tests make sure that
reading gives what reading the body whole gives: growing sessions, sessions
that share their start, a field named twice, another ``messages`` after the
array. That any body after a kept one (broken bytes anywhere after the kept
part included) is decided as with nothing kept is a property of every format,
tested for all three in ``tests/protocols/test_memo_prefix.py``.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from actorproxy.errors import BadRequest
from actorproxy.protocols.chat_messages import ChatBody, ChatMemo, load_chat_body
from actorproxy.protocols.memo import BODY_PREFIX_BYTES
from actorproxy.protocols.openai_chat import OpenAIChatFormat, parse_chat_body
from actorproxy.protocols.openai_types import ChatOptions
from actorproxy.schema.converter import structure
from actorproxy.schema.jsonio import load_body

CALL = {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}
TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}


def history(turns: int, tag: str = "") -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent." + tag},
                                      {"role": "user", "content": "Read every module. " + "context " * 600}]
    for i in range(turns):
        call = {**CALL, "id": f"call_{i}"}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": f"line {i} " * 60})
    return messages


def raw_of(messages: list[dict[str, Any]], **options: Any) -> bytes:
    return json.dumps({"model": "m", "messages": messages, "tools": [TOOL], "max_tokens": 64}, **options).encode()


def whole(raw: bytes) -> Any:
    try:
        return parse_chat_body(load_body(raw))
    except BadRequest as exc:
        return (str(exc), exc.param, exc.code)


def fast(fmt: OpenAIChatFormat, raw: bytes) -> Any:
    try:
        return fmt.parse(fmt.load(raw))
    except BadRequest as exc:
        return (str(exc), exc.param, exc.code)


def test_a_growing_session_reads_only_its_new_messages() -> None:
    memo = ChatMemo()
    before: list[Any] = []
    for turn in range(30):
        raw = raw_of(history(turn))
        assert len(raw) > BODY_PREFIX_BYTES
        kept = memo.bodies.find(raw)
        body = load_chat_body(raw, memo)
        assert isinstance(body, ChatBody)
        assert parse_chat_body(body) == parse_chat_body(orjson.loads(raw))
        assert body.fields.tools == tuple(orjson.loads(raw)["tools"])  # as sent
        if turn:
            assert kept is not None and bytes(kept.prefix) == raw[: len(kept)]  # read from the kept part on
            assert all(a is b for a, b in zip(before, body.messages, strict=False))  # the same objects as last turn
        before = body.messages
    assert len(memo.bodies) == 1  # each turn's body replaced the one it extended


def test_sessions_that_share_their_start_and_a_retry() -> None:
    memo = ChatMemo()
    common = history(3)
    sessions = [[*common, {"role": "user", "content": f"sample {i}"}] for i in range(4)]
    for _ in range(3):
        for i, messages in enumerate(sessions):
            for _retry in range(2):  # the same body twice (a retry): read from itself
                raw = raw_of(messages)
                body = load_chat_body(raw, memo)
                assert isinstance(body, ChatBody)
                assert parse_chat_body(body) == parse_chat_body(orjson.loads(raw))
            messages += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": "go on"}]
    assert len(memo.bodies) == 4


@pytest.mark.parametrize(
    "case", ["field_twice", "messages_after", "messages_before", "field_before_and_after", "field_after_then_not"]
)
def test_a_name_given_twice_reads_as_json_does(case: str) -> None:
    fmt = OpenAIChatFormat()
    messages = history(4)
    first = raw_of(messages)
    if case == "messages_before":
        first = first.replace(b'"messages": [', b'"messages": [{"role": "user", "content": "first"}], "messages": [', 1)
    if case in ("field_before_and_after", "field_after_then_not"):
        first = first[:-1] + b', "model": "m2"}'
    fast(fmt, first)
    nxt = raw_of([*messages, {"role": "user", "content": "next"}])
    if case == "field_twice":
        nxt = nxt[:-1] + b', "model": "other"}'
    elif case == "messages_after":
        nxt = nxt[:-1] + b', "messages": [{"role": "user", "content": "last"}]}'
    elif case == "messages_before":
        nxt = nxt.replace(b'"messages": [', b'"messages": [{"role": "user", "content": "first"}], "messages": [', 1)
    elif case == "field_before_and_after":
        nxt = nxt[:-1] + b', "model": "m2"}'
    assert fast(fmt, nxt) == whole(nxt)
    loaded = fmt.load(nxt)
    assert isinstance(loaded, ChatBody)
    others = {k: v for k, v in orjson.loads(nxt).items() if k != "messages"}
    assert loaded.fields.options == structure(others, ChatOptions)
