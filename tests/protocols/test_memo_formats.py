"""The memo fast path of every agent body (``protocols/memo.py``, ``format.MemoFormat``), one set of properties
for the three formats read through it: chat, Anthropic Messages, Responses (issue 12).

- a body is decided as the full check decides it: the same call, or the same error
  word for word (message, ``param`` and ``code``), whatever is in it;
- a turn that repeats the history gets the memo's objects again (the same typed
  messages and options), an item or field that changed is typed again, never its
  cached self;
- a bad item, a bad field or a body nested too deep gets the full check's error;
- aging drops what no turn used since the last age, and the memo is bounded;
- over HTTP, an old item edited, moved or deleted still splits the segment.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
import httpx
import hypothesis.strategies as st
import orjson
import pytest
from _util import broken, decision, nested, start_reasons
from hypothesis import HealthCheck, event, given, settings
from test_anthropic_memo import HISTORY as ANTHROPIC_HISTORY
from test_anthropic_memo import SYSTEM as ANTHROPIC_SYSTEM
from test_anthropic_memo import TOOLS as ANTHROPIC_TOOLS
from test_history_memo import CALL as CHAT_CALL
from test_history_memo import HISTORY as CHAT_HISTORY
from test_responses_memo import HISTORY as RESPONSES_HISTORY
from test_responses_memo import TOOLS as RESPONSES_TOOLS

from actorproxy.errors import BadRequest
from actorproxy.protocols.anthropic import AnthropicFormat, parse_messages_body
from actorproxy.protocols.anthropic_messages import AnthropicMemo, MessagesBody, load_messages_body
from actorproxy.protocols.chat_messages import ChatBody, ChatMemo, load_chat_body
from actorproxy.protocols.format import MemoFormat
from actorproxy.protocols.openai_chat import OpenAIChatFormat, parse_chat_body
from actorproxy.protocols.responses_api import parse_responses_body
from actorproxy.protocols.responses_format import ResponsesFormat
from actorproxy.protocols.responses_memo import ResponsesBody, ResponsesMemo, load_responses_body
from actorproxy.schema.jsonio import MAX_DEPTH, load_body
from actorproxy.serve import RunningProxy
from actorproxy.tokenization.message_fields import FrozenMessage


def _copy(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _no_more(draw: st.DrawFn, items: list[Any]) -> None:
    pass


def _clear_at(draw: st.DrawFn, messages: list[Any]) -> None:
    """Maybe a system message that a later user message clears, anywhere."""
    if draw(st.booleans()):
        messages.insert(draw(st.integers(0, len(messages))),
                        {"role": "system", "content": "note", "clear_at": "next_user_message"})


def _chat_message(role: str, text: str) -> dict[str, Any]:
    return {"role": role, "content": text}


def _responses_message(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "role": role, "content": text}


#: Where a value ``depth`` objects deep goes in a body (its fields, its items), for the nesting bound.
Deep = Callable[[dict[str, Any], list[Any], int], None]


def _in_field(name: str, make: Callable[[Any], Any]) -> Deep:
    def put(around: dict[str, Any], items: list[Any], depth: int) -> None:
        around[name] = make(nested(depth))
    return put


def _in_new_item(item: dict[str, Any]) -> Deep:
    def put(around: dict[str, Any], items: list[Any], depth: int) -> None:
        items.append({**item, "extra": nested(depth)})
    return put


def _in_last_item(around: dict[str, Any], items: list[Any], depth: int) -> None:
    items[-1] = {**items[-1], "extra": nested(depth)}


#: A change an agent makes to its conversation (its items, the fields around them) before it sends it again.
Rewrite = Callable[[list[Any], dict[str, Any]], None]


def _edited(*path: Any) -> Rewrite:
    def rewrite(items: list[Any], around: dict[str, Any]) -> None:
        assert _edit(items, path, 0)
    return rewrite


def _swapped(i: int, j: int) -> Rewrite:
    def rewrite(items: list[Any], around: dict[str, Any]) -> None:
        items[i], items[j] = items[j], items[i]
    return rewrite


def _deleted(start: int, stop: int) -> Rewrite:
    def rewrite(items: list[Any], around: dict[str, Any]) -> None:
        del items[start:stop]
    return rewrite


def _set(field: str, value: Any) -> Rewrite:
    def rewrite(items: list[Any], around: dict[str, Any]) -> None:
        around[field] = value
    return rewrite


@attrs.frozen
class Http:
    """A format's route, for an agent's turns over HTTP."""

    path: str
    #: The header the session is named by.
    header: str
    #: The fields around the items, and the items of the first turn.
    around: dict[str, Any]
    start: list[dict[str, Any]]
    #: The item an agent sends back of the reply's JSON.
    reply: Callable[[Any], dict[str, Any]]
    #: Rewrites of the history at the fourth turn, and why the segment after it starts.
    rewrites: dict[str, tuple[Rewrite, str]]


@attrs.frozen
class Case:
    """A format read through the memo: its full check, and the bodies it is tried on."""

    format: Callable[[], MemoFormat[Any, Any]]
    parse: Callable[[Any], Any]
    #: What the fast path hands out for a body it takes whole.
    fast: type
    #: The body's other fields.
    around: dict[str, Any]
    #: The field holding the items the memo keeps, and the history in it.
    items: str
    history: list[dict[str, Any]]
    #: What a turn adds to the history.
    new: list[dict[str, Any]]
    #: Field names a changed value is set under.
    fields: list[str]
    #: Strings a changed value is drawn from besides random text (roles, types).
    words: list[str]
    #: An item of the format: a message of a role with a text.
    message: Callable[[str, str], dict[str, Any]]
    #: The typed object of the fields around the items in what the fast path hands out, and the fields it
    #: is not typed from (the items, and fields the format keeps apart).
    typed: Callable[[Any], Any]
    apart: frozenset[str]
    #: The converted tools in what the fast path hands out, where they are kept apart from the options: the
    #: memo's shared objects while the ``tools`` field repeats.
    tools: Callable[[Any], list[Any]] | None
    #: Paths to strings in the history's items that an agent might edit (a text, tool arguments, an id).
    edits: list[tuple[Any, ...]]
    #: Other values of the fields around the items that a body may be sent with (a new system prompt, tools).
    changes: list[tuple[str, Any]]
    #: Items the full check refuses, and fields it refuses.
    bad: list[Any]
    bad_fields: list[dict[str, Any]]
    #: Fields the full check may take or refuse.
    odd_fields: list[dict[str, Any]]
    #: Where a deep value may go: how to put it there, and how deep in the body that is beyond its own depth.
    deep: dict[str, tuple[Deep, int]]
    #: A memo of a few KB, how its format loads a body through it, and what each of its parts holds with the
    #: bound each must stay under.
    small_memo: Callable[[], Any]
    load: Callable[[bytes, Any], Any]
    sizes: Callable[[Any], tuple[int, ...]]
    bounds: tuple[int, ...]
    #: The format over HTTP.
    http: Http
    #: How many of the messages a body comes to lead it and are made anew every turn.
    fresh: int = 0
    #: Anything else a body may have in its items.
    more: Callable[[st.DrawFn, list[Any]], None] = _no_more

    def body(self, new: list[dict[str, Any]]) -> dict[str, Any]:
        return {**_copy(self.around), self.items: _copy([*self.history, *new])}


#: Bad chat messages, each sent after a history the memo already holds: the error must be the full check's.
CHAT_BAD: list[Any] = [
    {"role": "user", "content": None},
    {"role": "user"},
    {"role": "user", "content": "x", "tool_calls": [CHAT_CALL]},
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
ANTHROPIC_BAD: list[Any] = [
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
RESPONSES_BAD: list[Any] = [
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
CHAT_TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]

CASES = {
    "chat": Case(
        OpenAIChatFormat, parse_chat_body, ChatBody, {"model": "m"}, "messages", CHAT_HISTORY,
        [{"role": "user", "content": "n"}],
        ["role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content", "reasoning", "type", "text",
         "function", "arguments", "id", "messages", "model", "max_tokens", "tools", "stop", "extra"],
        ["system", "user", "assistant", "tool", "developer", "text"],
        message=_chat_message, typed=lambda body: body.fields, apart=frozenset({"messages"}), tools=None,
        edits=[(1, "content"), (2, "tool_calls", 0, "function", "arguments"), (3, "tool_call_id")],
        changes=[("temperature", 0.5), ("temperature", 0.25), ("tools", CHAT_TOOLS)],
        bad=CHAT_BAD, bad_fields=[{"tools": {}}, {"tools": [{"type": "function"}]}],
        odd_fields=[{"tools": [3]}, {"messages": []}, {"stop": 7}],
        deep={"message": (_in_new_item({"role": "user", "content": "x"}), 3),
              "tools": (_in_field("tools", lambda deep: [{"type": "function", "function": {
                  "name": "f", "parameters": deep}}]), 4),
              "other": (_in_field("metadata", lambda deep: deep), 1)},
        small_memo=lambda: ChatMemo(max_bytes=1000), load=load_chat_body,
        sizes=lambda memo: (len(memo), len(memo.options)), bounds=(50, 50),
        http=Http("/v1/chat/completions", "X-Session-Id", {"model": "m", "max_tokens": 12}, CHAT_HISTORY,
                  lambda reply: {"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""},
                  {"content": (_edited(1, "content"), "history_rewrite"),
                   "tool_call": (_edited(2, "tool_calls", 0, "function", "arguments"), "history_rewrite"),
                   "our_reply": (_edited(5, "content"), "history_rewrite"),
                   "reorder": (_swapped(1, 3), "history_rewrite"), "delete": (_deleted(4, 5), "history_rewrite")})),
    "anthropic": Case(
        AnthropicFormat, parse_messages_body, MessagesBody,
        {"model": "m", "max_tokens": 64, "system": ANTHROPIC_SYSTEM, "tools": ANTHROPIC_TOOLS},
        "messages", ANTHROPIC_HISTORY, [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "n"}],
        ["role", "content", "type", "text", "thinking", "signature", "id", "name", "input", "tool_use_id",
         "is_error", "clear_at", "system", "messages", "model", "max_tokens", "tools", "input_schema",
         "description", "stream", "temperature", "extra"],
        ["user", "assistant", "system", "text", "tool_use", "tool_result", "thinking", "next_user_message"],
        message=_chat_message, typed=lambda body: body.fields, apart=frozenset({"messages", "system", "tools"}),
        tools=lambda body: body.tools,
        edits=[(0, "content", 0, "text"), (1, "content", 2, "input", "path"),
               (2, "content", 0, "content", 0, "text")],
        changes=[("temperature", 0.5), ("system", "Another system prompt."),
                 ("tools", [{**ANTHROPIC_TOOLS[0], "name": "write_file"}])],
        bad=ANTHROPIC_BAD,
        bad_fields=[{"system": 7}, {"system": [{"type": "image"}]}, {"tools": [{"name": "f"}]},
                    {"tools": [{"type": "web_search", "name": "w"}]}, {"tools": {}}, {"model": None, "tools": 3}],
        odd_fields=[{"messages": []}],
        deep={"message": (_in_last_item, 3),
              "tools": (_in_field("tools", lambda deep: [{**ANTHROPIC_TOOLS[0], "input_schema": deep}]), 3),
              "system": (_in_field("system", lambda deep: [{**ANTHROPIC_SYSTEM[0], "cache_control": deep}]), 3),
              "other": (_in_field("metadata", lambda deep: deep), 1)},
        small_memo=lambda: AnthropicMemo(max_bytes=1000, field_bytes=1000), load=load_messages_body,
        sizes=lambda memo: (len(memo.messages), len(memo.system), len(memo.tools), len(memo.options)),
        bounds=(50, 50, 50, 50), more=_clear_at,
        http=Http("/v1/messages", "X-Session-Id",
                  {"model": "m", "max_tokens": 12, "system": ANTHROPIC_SYSTEM, "tools": ANTHROPIC_TOOLS},
                  ANTHROPIC_HISTORY,
                  lambda reply: {"role": "assistant", "content": [{"type": "text", "text": "".join(
                      block["text"] for block in reply["content"] if block["type"] == "text")}]},
                  {"text": (_edited(0, "content", 0, "text"), "history_rewrite"),
                   "tool_input": (_edited(1, "content", 2, "input", "path"), "history_rewrite"),
                   "our_reply": (_edited(3, "content", 0, "text"), "history_rewrite"),
                   "system": (_set("system", "Another system prompt."), "system_changed"),
                   "delete": (_deleted(2, 4), "history_rewrite")})),
    "responses": Case(
        ResponsesFormat, parse_responses_body, ResponsesBody,
        {"model": "m", "instructions": "You are Codex.", "tools": RESPONSES_TOOLS, "store": False},
        "input", RESPONSES_HISTORY, [{"type": "message", "role": "user", "content": "n"}],
        ["type", "role", "content", "text", "name", "arguments", "call_id", "output", "summary", "input", "tools",
         "instructions", "model", "store", "stream", "parameters", "encrypted_content", "extra"],
        ["user", "assistant", "developer", "message", "reasoning", "function_call", "function_call_output",
         "input_text"],
        message=_responses_message, typed=lambda body: body.fields, apart=frozenset({"input", "tools"}),
        tools=lambda body: body.tools,
        edits=[(1, "content", 0, "text"), (3, "arguments"), (4, "output")],
        changes=[("temperature", 0.5), ("tools", [{**RESPONSES_TOOLS[0], "name": "bash"}])],
        bad=RESPONSES_BAD, bad_fields=[{"instructions": 5, "tools": 7}, {"tools": {}}, {"tools": [3]}],
        odd_fields=[{"tools": [{"type": "function"}]}, {"input": []}, {"input": "just text"}],
        deep={"item": (_in_new_item({"type": "message", "role": "user", "content": "x"}), 3),
              "tools": (_in_field("tools", lambda deep: [{**RESPONSES_TOOLS[0], "parameters": deep}]), 3),
              "other": (_in_field("metadata", lambda deep: deep), 1)},
        small_memo=lambda: ResponsesMemo(max_bytes=1000, tools_bytes=1000, max_turns=10), load=load_responses_body,
        sizes=lambda memo: (len(memo.items), len(memo.tools), len(memo.options),
                            len(memo._turns) + len(memo._old_turns)),
        bounds=(50, 50, 50, 21),
        http=Http("/v1/responses", "session-id",
                  {"model": "m", "max_output_tokens": 12, "instructions": "You are Codex.", "store": False},
                  RESPONSES_HISTORY[:2],
                  lambda reply: {"type": "message", "role": "assistant", "content": next(
                      item for item in reply["output"] if item["type"] == "message")["content"]},
                  {"text": (_edited(1, "content", 0, "text"), "history_rewrite"),
                   "our_reply": (_edited(2, "content", 0, "text"), "history_rewrite"),
                   "delete": (_deleted(2, 4), "history_rewrite")})),
}


@st.composite
def _bodies(draw: st.DrawFn, case: Case) -> bytes:
    """A body with the cached history and a new item, one thing in it changed, then maybe its bytes."""
    values = st.recursive(
        st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=8) | st.sampled_from([*case.words, "\udc80"]),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(case.fields), inner, max_size=3),
        max_leaves=6,
    )
    body = case.body(case.new)
    case.more(draw, body[case.items])
    tools = body.get("tools")
    target: Any = draw(st.sampled_from([body, body, *(tools[:1] if isinstance(tools, list) else []),
                                        *body[case.items]]))
    content, calls = target.get("content"), target.get("tool_calls") or []
    inner = [part for part in content if isinstance(part, dict)] if isinstance(content, list) else []
    inner += [call["function"] for call in calls]  # a content part, or a tool call's function
    if draw(st.booleans()) and inner:
        target = draw(st.sampled_from(inner))
    action = draw(st.sampled_from(["set", "set", "delete", "none"]))
    if action == "delete" and target:
        target.pop(draw(st.sampled_from(sorted(target))))
    elif action == "set":
        target[draw(st.sampled_from(case.fields))] = draw(values)
    text = json.dumps(body, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 1])))
    return broken(draw, text.encode("utf-8", "surrogatepass"))  # a lone surrogate raw or escaped: refused


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_body_is_decided_as_the_full_check_decides_it(name: str, data: st.DataObject) -> None:
    case = CASES[name]
    raw = data.draw(_bodies(case))
    fmt = case.format()
    fmt.parse(fmt.load(json.dumps(case.body([])).encode()))  # the history is in the memo
    fast = decision(fmt.load, fmt.parse, raw)
    assert fast == decision(load_body, case.parse, raw)
    try:
        event("refused" if isinstance(fast, tuple) else "fast path" if isinstance(fmt.load(raw), case.fast)
              else "full")
    except BadRequest:
        event("refused on load")


@attrs.define
class Conversation:
    """An agent's conversation as it sends it: the fields around its items, and each item's value and text."""

    case: Case
    around: dict[str, Any]
    items: list[tuple[Any, bytes]]

    def raw(self, around: dict[str, Any] | None = None, items: list[bytes] | None = None) -> bytes:
        fields = around if around is not None else self.around
        texts = items if items is not None else [text for _, text in self.items]
        parts = [orjson.dumps(name) + b":" + orjson.dumps(value) for name, value in fields.items()]
        return b"{" + b",".join([*parts, orjson.dumps(self.case.items) + b":[" + b",".join(texts) + b"]"]) + b"}"

    def typed_text(self, around: dict[str, Any]) -> bytes:
        """The text of the fields the typed options come from."""
        return self.raw({k: v for k, v in around.items() if k not in self.case.apart}, [])


@attrs.define
class Seen:
    """The last body the fast path took whole, and what the memo still holds of it."""

    body: Any
    messages: list[Any]
    around: dict[str, Any]
    texts: list[bytes]
    #: "kept": found again; "old": found again (in the old generation since an age); "old, used": an age and a
    #: turn since, that may have used part of it; "gone": two ages with no turn between; "mixed": part of it gone.
    state: str = "kept"


def _edit(value: Any, path: tuple[Any, ...], n: int) -> bool:
    """Sets the string at ``path`` in ``value`` to another one of its kind (JSON stays JSON); ``False`` if none."""
    try:
        *inner, last = path
        for step in inner:
            value = value[step]
        old = value[last]
    except (KeyError, IndexError, TypeError):
        return False
    if not isinstance(old, str):
        return False
    try:
        json.loads(old)
        value[last] = json.dumps({"edited": n})
    except ValueError:
        value[last] = f"{old} (edit {n})"
    return True


#: What a turn does to the conversation (each a body the memo reads, but ``age``).
_TURNS = ["grow", "edit", "respell", "reorder", "delete", "change"]
#: Bodies sent once beside the conversation: every one of the kind, each a check of its own.
_ONCE = ["bad", "bad field", "odd field", "prefill", "deep"]
_ACTIONS = [*_TURNS, "grow", "grow", "age", "age", "age", *_ONCE]


def _once(case: Case, talk: Conversation, kind: str) -> list[tuple[dict[str, Any], list[bytes], bytes, Any]]:
    """Bodies of ``kind`` sent beside the conversation: their fields, their items, their bytes, and what the
    full check must say (``"error"``, whether they are too deep, or ``None``: whatever it says)."""
    texts = [text for _, text in talk.items]
    bodies: list[tuple[dict[str, Any], list[bytes], Any]] = []
    if kind == "bad":
        for bad in map(orjson.dumps, case.bad):  # at the end, second, before a message
            after = orjson.dumps(case.message("user", "."))
            for items in ([*texts, bad], [texts[0], bad, *texts[1:]], [*texts, bad, after]):
                bodies.append((talk.around, items, "error"))
    elif kind in ("bad field", "odd field"):
        for fields in case.bad_fields if kind == "bad field" else case.odd_fields:
            bodies.append(({**talk.around, **fields}, texts, "error" if kind == "bad field" else None))
    elif kind == "prefill":  # the agent's own start of our reply
        bodies.append((talk.around, [*texts, orjson.dumps(case.message("assistant", "prefill"))], None))
    else:
        for put, beyond in case.deep.values():
            for depth in range(MAX_DEPTH - 5, MAX_DEPTH + 1):
                around, values = _copy(talk.around), [orjson.loads(text) for text in texts]
                put(around, values, depth)
                bodies.append((around, list(map(orjson.dumps, values)), depth + beyond > MAX_DEPTH))
    out = []
    for around, items, expect in bodies:
        if case.items in around:  # a body with other items of its own, as the agent sends them
            out.append((around, [], orjson.dumps(around), expect))
        else:
            out.append((around, items, talk.raw(around, items), expect))
    return out


@pytest.mark.parametrize("name", sorted(CASES))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_turns_through_the_memo_reuse_what_repeats_and_type_again_what_changed(name: str, data: st.DataObject) -> None:
    """An agent's turns, as they come: new items, an old one edited, respelled, moved or deleted, a field
    changed, the memo aged between them; and beside them bodies with a bad item or field, or nested deep."""
    case = CASES[name]
    fmt = case.format()
    talk = Conversation(case, _copy(case.around), [(item, orjson.dumps(item)) for item in _copy(case.history)])
    seen: Seen | None = None
    ages = 0  # ages in a row, no body loaded since the first
    for n in range(data.draw(st.integers(1, 8), label="turns")):
        action = "grow" if n == 0 else data.draw(st.sampled_from(_ACTIONS), label="action")
        event(action)
        if action == "age":
            fmt.age()
            ages += 1
            if ages == 2:  # nothing used since the age before: nothing is kept
                assert not any(case.sizes(fmt._memo))
                event("aged twice")
            if seen is not None:
                seen.state = {"kept": "old", "old": "gone", "old, used": "mixed"}.get(seen.state, seen.state)
            continue
        ages = 0
        changed = False  # an item's text changed (still in the body)
        if action in _TURNS:
            older = len(talk.items) - 1  # the items before the last one (the history ends with the agent's turn)
            if action == "grow":
                talk.items += [(item, orjson.dumps(item)) for item in
                               (case.message("assistant", f"reply {n}"), case.message("user", f"next {n}"))]
            elif action == "edit":
                index, *path = data.draw(st.sampled_from(case.edits), label="edit")
                if index >= len(talk.items) or not _edit(talk.items[index][0], tuple(path), n):
                    continue
                talk.items[index] = (talk.items[index][0], orjson.dumps(talk.items[index][0]))
                changed = True
            elif action == "respell":  # the same item written otherwise: typed again, equal
                index = data.draw(st.integers(0, max(older - 1, 0)), label="respelled")
                value, text = talk.items[index]
                talk.items[index] = (value, json.dumps(value, separators=(", ", " : ")).encode())
                changed = talk.items[index][1] != text
            elif action == "reorder" and older >= 2:
                i, j = data.draw(st.lists(st.integers(0, older - 1), min_size=2, max_size=2, unique=True),
                                 label="swapped")
                talk.items[i], talk.items[j] = talk.items[j], talk.items[i]
            elif action == "delete" and older >= 1:
                del talk.items[data.draw(st.integers(0, older - 1), label="deleted")]
            elif action == "change":
                field, value = data.draw(st.sampled_from(case.changes), label="change")
                talk.around[field] = _copy(value)
            around, items = _copy(talk.around), [text for _, text in talk.items]
            bodies = [(around, items, talk.raw(around, items), None)]
        else:
            bodies = _once(case, talk, action)
        for around, items, raw, expect in bodies:
            # -- the same call, or the same error word for word ----------------------------------------------
            fast = decision(fmt.load, fmt.parse, raw)
            assert fast == decision(load_body, case.parse, raw)
            if expect is not None:
                assert isinstance(fast, tuple) == (expect in ("error", True)), raw
            try:
                body = fmt.load(raw)
            except BadRequest:
                body = None
            if n == 0:  # the history, new to the memo, is read through it all the same
                assert isinstance(body, case.fast)
            if not isinstance(body, case.fast):
                if seen is not None and seen.state == "old":
                    seen.state = "old, used"
                continue
            # -- what repeats is the memo's, what changed is typed again ------------------------------------
            messages = fmt.parse(body).request.messages  # what the turn runs
            assert all(type(m) is FrozenMessage for m in messages[case.fresh:])
            if seen is not None:
                event(f"after a body {seen.state}")
                before = {id(m) for m in seen.messages}
                assert not any(id(m) in before for m in messages[: case.fresh])  # made anew every turn
                if seen.state in ("kept", "old", "old, used"):
                    if items[: len(seen.texts)] == seen.texts and around == seen.around:  # the history repeated
                        assert all(a is b for a, b in zip(messages[case.fresh : len(seen.messages)],
                                                          seen.messages[case.fresh:], strict=True))
                    if changed:  # an item written otherwise is typed again, never its cached self
                        assert not all(id(m) in before for m in messages[case.fresh:])
                    same = talk.typed_text(around) == talk.typed_text(seen.around)
                    assert (case.typed(body) is case.typed(seen.body)) == same
                    if case.tools is not None and around.get("tools") == seen.around.get("tools"):
                        assert all(a is b for a, b in zip(case.tools(body), case.tools(seen.body), strict=True))
                elif seen.state == "gone":  # aged out: typed again
                    assert not any(id(m) in before for m in messages)
                    assert case.typed(body) is not case.typed(seen.body)
            if action not in _TURNS:
                if seen is not None and seen.state == "old":
                    seen.state = "old, used"
                continue
            if seen is not None and seen.state == "old":
                # One age, then this turn: what the next age keeps is what this turn used, as a new memo would.
                fmt.age()
                ages = 1
                new = case.format()
                new.load(raw)
                assert case.sizes(fmt._memo) == case.sizes(new._memo)
                event("aged after one turn")
            seen = Seen(body, messages, around, items, "old" if ages == 1 else "kept")


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_memo_is_bounded(name: str) -> None:
    case = CASES[name]
    memo = case.small_memo()
    for i in range(100):
        items = [case.message("user", f"message {i} " + "x" * 40), case.message("assistant", f"reply {i}"),
                 case.message("user", "more")]
        raw = orjson.dumps({**case.around, case.items: items})
        body = case.load(raw, memo)
        assert isinstance(body, case.fast)
        assert case.format().parse(body).request == case.parse(orjson.loads(raw)).request
    assert all(size < bound for size, bound in zip(case.sizes(memo), case.bounds, strict=True)), case.sizes(memo)
    raw = orjson.dumps({**case.around, case.items: [case.message("user", "message 0 " + "x" * 40)]})
    again = case.load(raw, memo)  # evicted: typed again
    assert case.format().parse(again).request == case.parse(orjson.loads(raw)).request


# -- over HTTP: a rewritten history still splits the segment ---------------------------------------------


@pytest.mark.parametrize(("name", "rewrite"), [(name, rewrite) for name, case in sorted(CASES.items())
                                               for rewrite in [None, *case.http.rewrites]])
async def test_an_edited_old_item_is_still_a_history_rewrite(
    http: httpx.AsyncClient, proxy: RunningProxy, name: str, rewrite: str | None
) -> None:
    route = CASES[name].http
    session = f"{name}-edit-{rewrite}"
    around, items = _copy(route.around), _copy(route.start)
    for turn in range(4):
        if turn == 3 and rewrite is not None:
            route.rewrites[rewrite][0](items, around)
        response = await http.post(route.path, json={**around, CASES[name].items: items},
                                   headers={route.header: session})
        assert response.status_code == 200, response.text
        items += [route.reply(response.json()), CASES[name].message("user", f"next {turn}")]
    expected = ["session_start"] if rewrite is None else ["session_start", route.rewrites[rewrite][1]]
    assert await start_reasons(http, session) == expected
