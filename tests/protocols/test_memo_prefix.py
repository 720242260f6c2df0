"""A long body that starts with one read before has only its new items read, in every format (issue 32).

Chat, Anthropic and Responses bodies are read through the same helper (``memo.read``): a long
body is kept up to an item it can be continued from (chat: its last message; Anthropic: its
last user message; Responses: its last item that is not part of an assistant turn), and the
next turn's body is read from there. Each body is decided as the memo decides it with nothing
kept, whatever follows the kept part (``test_memo_formats.py``: that is the full check's
decision). Chat's own cases follow: sessions that share their start, a field named twice
(``messages`` included) before or after the kept part.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
import hypothesis.strategies as st
import orjson
import pytest
from _util import broken, decision
from hypothesis import HealthCheck, event, given, settings

from actorproxy.protocols.anthropic import AnthropicFormat, parse_messages_body
from actorproxy.protocols.chat_messages import ChatBody, ChatMemo, load_chat_body
from actorproxy.protocols.format import MemoFormat
from actorproxy.protocols.memo import BODY_PREFIX_BYTES, MessageMemo
from actorproxy.protocols.openai_chat import OpenAIChatFormat, parse_chat_body
from actorproxy.protocols.openai_types import ChatOptions
from actorproxy.protocols.responses_api import parse_responses_body
from actorproxy.protocols.responses_format import ResponsesFormat
from actorproxy.schema.converter import structure
from actorproxy.schema.jsonio import load_body

OUTPUT = "def f(x):\n    return x + 1\n" * 4
CHAT_CALL = {"type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}


def _chat_turn(i: int) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": "", "tool_calls": [{**CHAT_CALL, "id": f"call_{i}"}]},
            {"role": "tool", "tool_call_id": f"call_{i}", "content": f"line {i} " * 60}]


def _anthropic_turn(i: int) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Look.", "signature": "sig"},
                {"type": "tool_use", "id": f"toolu_{i}", "name": "read", "input": {"path": f"m{i}.py"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": OUTPUT + str(i)}]}]


def _responses_turn(i: int) -> list[dict[str, Any]]:
    return [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
            {"type": "function_call", "name": "read", "call_id": f"call_{i}", "arguments": '{"path": "a.py"}'},
            {"type": "function_call_output", "call_id": f"call_{i}", "output": OUTPUT + str(i)}]


@attrs.frozen
class Case:
    format: Callable[[], MemoFormat[Any, Any]]
    parse: Callable[[Any], Any]
    #: The memo of the items a body's prefix is kept with.
    items: Callable[[Any], MessageMemo[Any]]
    field: str
    around: dict[str, Any]
    first: list[dict[str, Any]]
    turn: Callable[[int], list[dict[str, Any]]]
    #: Items a next turn may add (good, bad, ending a body wrongly).
    extra: list[dict[str, Any]]

    def raw(self, items: list[Any], *, indent: int | None = None, ensure_ascii: bool = False, **fields: Any) -> bytes:
        """The body's bytes (a lone surrogate in a string written as it is, or escaped with ``ensure_ascii``)."""
        body = {**self.around, self.field: items, **fields}
        return json.dumps(body, indent=indent, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")

    def history(self, turns: int) -> list[dict[str, Any]]:
        return [*self.first, *(item for i in range(turns) for item in self.turn(i))]


CASES = {
    "chat": Case(
        OpenAIChatFormat, parse_chat_body, lambda memo: memo, "messages",
        {"model": "m", "max_tokens": 64,
         "tools": [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]},
        [{"role": "system", "content": "You are a coding agent."},
         {"role": "user", "content": "Read every module. " + "context " * 600}], _chat_turn,
        [{"role": "user", "content": "more é"}, {"role": "assistant", "content": "ok"}, {"role": "user"},
         {"role": "tool", "content": "x"}, {"role": "developer", "content": "careful"}]),
    "anthropic": Case(
        AnthropicFormat, parse_messages_body, lambda memo: memo.messages, "messages",
        {"model": "m", "max_tokens": 64, "system": "You are a coding agent.",
         "tools": [{"name": "read", "input_schema": {"type": "object"}}]},
        [{"role": "user", "content": "Fix the bug. " + "context " * 500}], _anthropic_turn,
        [{"role": "user", "content": "go on"}, {"role": "assistant", "content": "ok"},
         {"role": "system", "content": "note", "clear_at": "next_user_message"},
         {"role": "user", "content": [{"type": "text"}]}, {"role": "tool", "content": "x"}]),
    "responses": Case(
        ResponsesFormat, parse_responses_body, lambda memo: memo.items, "input",
        {"model": "m", "instructions": "You are Codex.", "store": False,
         "tools": [{"type": "function", "name": "read", "parameters": {"type": "object"}}]},
        [{"type": "message", "role": "user", "content": "Fix the bug. " + "context " * 500}], _responses_turn,
        [{"type": "message", "role": "user", "content": "go on"},
         {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
         {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
         {"type": "function_call", "name": "read", "call_id": "c9", "arguments": "{}"},
         {"type": "function_call_output", "call_id": "c9", "output": "x"},
         {"type": "message", "role": "developer", "content": "careful"},
         {"type": "function_call", "name": "read"}, {"type": "nope"}]),
}


def _count_split(memo: MessageMemo[Any]) -> list[int]:
    """How many item texts each body hands the memo (each one copied to bytes and looked up)."""
    counts: list[int] = []
    find = memo.find

    def counting(keys: list[bytes]) -> list[Any]:
        counts.append(len(keys))
        return find(keys)

    memo.find = counting  # type: ignore[method-assign]
    return counts


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_long_bodys_next_turn_splits_only_its_new_items(name: str) -> None:
    case = CASES[name]
    fmt = case.format()
    memo = case.items(fmt._memo)
    counts = _count_split(memo)
    before: list[Any] = []
    for turn in range(6):
        items = case.history(turn)
        raw = case.raw(items)
        assert len(raw) > BODY_PREFIX_BYTES
        kept = memo.bodies.find(raw)
        body = fmt.load(raw)
        assert fmt.parse(body) == decision(load_body, case.parse, raw)
        if turn:
            assert kept is not None and bytes(kept.prefix) == raw[: len(kept)]  # read from the kept part on
        assert all(a is b for a, b in zip(before, body.messages, strict=False))  # the same objects as last turn
        before = body.messages
    assert fmt.parse(fmt.load(raw)) == decision(load_body, case.parse, raw)  # the same body again (a retry)
    # The first body splits all its items; each next one only its new items; the retry none.
    assert counts == [len(case.first), *[len(case.turn(0))] * 5, 0]
    assert len(memo.bodies) == 1  # each turn's body replaced the one it extended


#: Any JSON value, small: an item or a field no format takes (a lone surrogate included).
_value = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=5) | st.sampled_from(["user", "tool", "\udc80"]),
    lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.sampled_from(["role", "content", "type", "x"]),
                                                                inner, max_size=2),
    max_leaves=4,
)


@st.composite
def _next_bodies(draw: st.DrawFn, case: Case) -> tuple[bytes, bytes]:
    """A long body (maybe ending in extra items), then the next turn's: more items and fields, maybe broken bytes;
    both written with or without indents and escapes."""
    style = {"indent": draw(st.sampled_from([None, 1])), "ensure_ascii": draw(st.booleans())}
    items = case.history(draw(st.integers(0, 3)))
    items += draw(st.lists(st.sampled_from(case.extra), max_size=2))
    first = case.raw(items, **style)
    more = draw(st.lists(st.sampled_from(case.extra) | st.sampled_from(case.turn(7)) | _value, max_size=4))
    fields: dict[str, Any] = {}
    if draw(st.booleans()):
        fields[draw(st.sampled_from(["model", "tools", "stream", "temperature", "n", case.field]))] = draw(_value)
    raw = case.raw([*items, *more], **style, **fields)
    if draw(st.booleans()):  # a field named twice, after the array
        raw = raw[: raw.rindex(b"}")] + b',"' + draw(st.sampled_from([case.field.encode(), b"model", b"x"])) + b'":1}'
    return first, broken(draw, raw, max(0, len(first) - 300))


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_body_after_a_kept_one_is_decided_as_the_full_check_decides_it(name: str, data: st.DataObject) -> None:
    case = CASES[name]
    first, raw = data.draw(_next_bodies(case))
    fmt = case.format()
    decision(fmt.load, fmt.parse, first)
    event("kept part found" if case.items(fmt._memo).bodies.find(raw) is not None else "read whole")
    fresh = case.format()  # nothing kept: the memo's own path, decided as the full check decides
    expected = decision(fresh.load, fresh.parse, raw)
    assert decision(fmt.load, fmt.parse, raw) == expected


# -- chat's own cases -----------------------------------------------------------------------------------------

CHAT = CASES["chat"]


def test_chat_sessions_that_share_their_start_and_a_retry() -> None:
    memo = ChatMemo()
    common = CHAT.history(3)
    sessions = [[*common, {"role": "user", "content": f"sample {i}"}] for i in range(4)]
    for _ in range(3):
        for i, messages in enumerate(sessions):
            for _retry in range(2):  # the same body twice (a retry): read from itself
                raw = CHAT.raw(messages)
                body = load_chat_body(raw, memo)
                assert isinstance(body, ChatBody)
                assert parse_chat_body(body) == parse_chat_body(orjson.loads(raw))
                assert body.fields.tools == tuple(orjson.loads(raw)["tools"])  # as sent
            messages += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": "go on"}]
    assert len(memo.bodies) == 4


@pytest.mark.parametrize(
    "case", ["field_twice", "messages_after", "messages_before", "field_before_and_after", "field_after_then_not"]
)
def test_a_chat_name_given_twice_reads_as_json_does(case: str) -> None:
    fmt = OpenAIChatFormat()
    messages = CHAT.history(4)
    first = CHAT.raw(messages)
    if case == "messages_before":
        first = first.replace(b'"messages": [', b'"messages": [{"role": "user", "content": "first"}], "messages": [', 1)
    if case in ("field_before_and_after", "field_after_then_not"):
        first = first[:-1] + b', "model": "m2"}'
    decision(fmt.load, fmt.parse, first)
    nxt = CHAT.raw([*messages, {"role": "user", "content": "next"}])
    if case == "field_twice":
        nxt = nxt[:-1] + b', "model": "other"}'
    elif case == "messages_after":
        nxt = nxt[:-1] + b', "messages": [{"role": "user", "content": "last"}]}'
    elif case == "messages_before":
        nxt = nxt.replace(b'"messages": [', b'"messages": [{"role": "user", "content": "first"}], "messages": [', 1)
    elif case == "field_before_and_after":
        nxt = nxt[:-1] + b', "model": "m2"}'
    assert decision(fmt.load, fmt.parse, nxt) == decision(load_body, parse_chat_body, nxt)
    loaded = fmt.load(nxt)
    assert isinstance(loaded, ChatBody)
    others = {k: v for k, v in orjson.loads(nxt).items() if k != "messages"}
    assert loaded.fields.options == structure(others, ChatOptions)
