"""Every agent body's fast path (``protocols/memo.py``) decides a body as the full check decides it (issue 12).

One property for the three formats read through the memo (chat, Anthropic Messages,
Responses): with a history in the memo, a body that repeats it with one thing in it
changed (a field set to any JSON value or deleted, anywhere: the body, an old or a new
item, a tool, a content part), then maybe its bytes broken (a byte changed, one
inserted, the body cut short), gives the same call as the full load and check, or the
same error word for word (message, ``param`` and ``code``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import attrs
import hypothesis.strategies as st
import pytest
from _util import broken, decision
from hypothesis import HealthCheck, event, given, settings
from test_anthropic_memo import HISTORY as ANTHROPIC_HISTORY
from test_anthropic_memo import SYSTEM as ANTHROPIC_SYSTEM
from test_anthropic_memo import TOOLS as ANTHROPIC_TOOLS
from test_history_memo import HISTORY as CHAT_HISTORY
from test_responses_memo import HISTORY as RESPONSES_HISTORY
from test_responses_memo import TOOLS as RESPONSES_TOOLS

from actorproxy.errors import BadRequest
from actorproxy.protocols.anthropic import AnthropicFormat, parse_messages_body
from actorproxy.protocols.anthropic_messages import MessagesBody
from actorproxy.protocols.chat_messages import ChatBody
from actorproxy.protocols.format import TurnFormat
from actorproxy.protocols.openai_chat import OpenAIChatFormat, parse_chat_body
from actorproxy.protocols.responses_api import parse_responses_body
from actorproxy.protocols.responses_format import ResponsesFormat
from actorproxy.protocols.responses_memo import ResponsesBody
from actorproxy.schema.jsonio import load_body


def _copy(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _no_more(draw: st.DrawFn, items: list[Any]) -> None:
    pass


def _clear_at(draw: st.DrawFn, messages: list[Any]) -> None:
    """Maybe a system message that a later user message clears, anywhere."""
    if draw(st.booleans()):
        messages.insert(draw(st.integers(0, len(messages))),
                        {"role": "system", "content": "note", "clear_at": "next_user_message"})


@attrs.frozen
class Case:
    """A format read through the memo: its full check, and the bodies it is tried on."""

    format: Callable[[], TurnFormat[Any]]
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
    #: Anything else a body may have in its items.
    more: Callable[[st.DrawFn, list[Any]], None] = _no_more

    def body(self, new: list[dict[str, Any]]) -> dict[str, Any]:
        return {**_copy(self.around), self.items: _copy([*self.history, *new])}


CASES = {
    "chat": Case(OpenAIChatFormat, parse_chat_body, ChatBody, {"model": "m"}, "messages", CHAT_HISTORY,
                 [{"role": "user", "content": "n"}],
                 ["role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content", "reasoning", "type",
                  "text", "function", "arguments", "id", "messages", "model", "max_tokens", "tools", "stop",
                  "extra"],
                 ["system", "user", "assistant", "tool", "developer", "text"]),
    "anthropic": Case(AnthropicFormat, parse_messages_body, MessagesBody,
                      {"model": "m", "max_tokens": 64, "system": ANTHROPIC_SYSTEM, "tools": ANTHROPIC_TOOLS},
                      "messages", ANTHROPIC_HISTORY,
                      [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "n"}],
                      ["role", "content", "type", "text", "thinking", "signature", "id", "name", "input",
                       "tool_use_id", "is_error", "clear_at", "system", "messages", "model", "max_tokens", "tools",
                       "input_schema", "description", "stream", "temperature", "extra"],
                      ["user", "assistant", "system", "text", "tool_use", "tool_result", "thinking",
                       "next_user_message"], _clear_at),
    "responses": Case(ResponsesFormat, parse_responses_body, ResponsesBody,
                      {"model": "m", "instructions": "You are Codex.", "tools": RESPONSES_TOOLS, "store": False},
                      "input", RESPONSES_HISTORY, [{"type": "message", "role": "user", "content": "n"}],
                      ["type", "role", "content", "text", "name", "arguments", "call_id", "output", "summary",
                       "input", "tools", "instructions", "model", "store", "stream", "parameters",
                       "encrypted_content", "extra"],
                      ["user", "assistant", "developer", "message", "reasoning", "function_call",
                       "function_call_output", "input_text"]),
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
