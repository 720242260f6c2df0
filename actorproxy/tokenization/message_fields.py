"""What of a message a chat template can read, and messages cut down to it.

Clients send message fields no template renders (Claude Code's
``cache_control``, SDK bookkeeping, anything at all). A proxy that kept them on
every recorded step would hold memory nobody is charged for: the store counts
tokens, and those fields never become tokens. So a message is cut down, before
it is rendered or recorded, to the fields the template can read plus the ones
echo matching reads — the rendered prompt is the same, and what a session keeps
is bounded by what it was charged.

Which fields a template can read is found in its Jinja syntax tree: every
attribute and subscript name, and every string constant (``message.get('x')``,
``'x' in message``). A template that reads a message *whole* (``message |
tojson``, ``message.items()``, ``{{ message }}``, ``for k in message``) keeps every
field. A template that does not parse keeps every field too.
"""

from __future__ import annotations

import functools
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes

#: Message fields the proxy itself reads (rendering aside): echo matching, sub-agent keys, tool results.
MATCHED_FIELDS = frozenset({"role", "content", "name", "tool_call_id", "tool_calls", "reasoning_content", "reasoning"})
#: What a text content part and a tool call are made of (parts are text-only at the edge).
_PART_FIELDS = frozenset({"type", "text"})
_CALL_FIELDS = frozenset({"id", "type", "function"})
_FUNCTION_FIELDS = frozenset({"name", "arguments"})
#: Names under which templates hold the conversation.
_MESSAGE_LISTS = frozenset({"messages", "loop_messages"})
#: Filters and methods that read a whole mapping.
_WHOLE_FILTERS = frozenset({"tojson", "items", "dictsort", "list", "string", "pprint", "xmlattr"})
_WHOLE_METHODS = frozenset({"items", "keys", "values"})


class _GenerationTag(jinja2.ext.Extension):
    """Parses the ``{% generation %}`` blocks some templates carry (transformers' assistant masks)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


#: Filters that keep a list a list, and ones that take one item of it.
_LIST_FILTERS = frozenset(
    {"reverse", "list", "sort", "unique", "select", "reject", "selectattr", "rejectattr", "batch"}
)
_ITEM_FILTERS = frozenset({"first", "last", "random"})


def _kind(node: nodes.Node, lists: set[str], messages: set[str]) -> str | None:
    """``"list"`` if ``node`` evaluates to a list of messages, ``"message"`` to one message, else ``None``."""
    if isinstance(node, nodes.Name):
        return "list" if node.name in lists else "message" if node.name in messages else None
    if isinstance(node, nodes.Filter) and node.node is not None and _kind(node.node, lists, messages) == "list":
        return "list" if node.name in _LIST_FILTERS else "message" if node.name in _ITEM_FILTERS else None
    if isinstance(node, nodes.Getitem) and _kind(node.node, lists, messages) == "list":
        return "list" if isinstance(node.arg, nodes.Slice) else "message"
    if isinstance(node, nodes.CondExpr):
        return _kind(node.expr1, lists, messages) or (
            _kind(node.expr2, lists, messages) if node.expr2 is not None else None
        )
    return None


@functools.lru_cache(maxsize=16)
def template_message_fields(template: str) -> frozenset[str] | None:
    """The message fields ``template`` can read, or ``None`` when it may read a message whole."""
    env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    try:
        tree = env.parse(template)
    except jinja2.TemplateError:
        return None
    # Variables that hold the message list or one message: loops and sets over it (to a fixed point).
    lists: set[str] = set(_MESSAGE_LISTS)
    messages: set[str] = set()
    for _ in range(8):
        before = (len(lists), len(messages))
        for loop in tree.find_all(nodes.For):
            if _kind(loop.iter, lists, messages) == "list" and isinstance(loop.target, nodes.Name):
                messages.add(loop.target.name)
        for assign in tree.find_all(nodes.Assign):
            kind = _kind(assign.node, lists, messages)
            if kind is not None and isinstance(assign.target, nodes.Name):
                (lists if kind == "list" else messages).add(assign.target.name)
        if (len(lists), len(messages)) == before:
            break

    def whole(node: nodes.Node) -> bool:
        return _kind(node, lists, messages) == "message"

    for flt in tree.find_all(nodes.Filter):
        if flt.name in _WHOLE_FILTERS and flt.node is not None and whole(flt.node):
            return None
    for call in tree.find_all(nodes.Call):
        if isinstance(call.node, nodes.Getattr) and call.node.attr in _WHOLE_METHODS and whole(call.node.node):
            return None
    for output in tree.find_all(nodes.Output):
        if any(whole(child) for child in output.nodes):
            return None
    for loop in tree.find_all(nodes.For):
        if whole(loop.iter):
            return None
    for call in tree.find_all(nodes.Call):  # a message handed whole to a macro may be read whole
        if any(whole(arg) for arg in call.args) or any(whole(kw.value) for kw in call.kwargs):
            return None
    names: set[str] = set()
    for getattr_ in tree.find_all(nodes.Getattr):
        names.add(getattr_.attr)
    for const in tree.find_all(nodes.Const):
        if isinstance(const.value, str):
            names.add(const.value)
    return frozenset(names)


def _cut(value: dict[str, Any], keep: frozenset[str]) -> dict[str, Any]:
    """``value`` without the keys not in ``keep`` (the same object when nothing goes)."""
    if value.keys() <= keep:
        return value
    return {k: v for k, v in value.items() if k in keep}


@functools.lru_cache(maxsize=16)
def _keep_sets(fields: frozenset[str]) -> tuple[frozenset[str], frozenset[str], frozenset[str]]:
    """The keys a message, a tool call and its function keep, for a template reading ``fields``."""
    return fields | MATCHED_FIELDS, fields | _CALL_FIELDS, fields | _FUNCTION_FIELDS


def cut_message(message: dict[str, Any], fields: frozenset[str] | None) -> dict[str, Any]:
    """``message`` with only what a template reading ``fields`` (``None``: anything) and matching use."""
    out = message
    content = out.get("content")
    if isinstance(content, list) and any(isinstance(p, dict) and not p.keys() <= _PART_FIELDS for p in content):
        out = {**out, "content": [_cut(p, _PART_FIELDS) if isinstance(p, dict) else p for p in content]}
    if fields is None:
        return out
    keep, call_keep, function_keep = _keep_sets(fields)
    out = _cut(out, keep)
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        cut_calls = []
        for call in calls:
            if isinstance(call, dict):
                call = _cut(call, call_keep)
                function = call.get("function")
                if isinstance(function, dict):
                    cut_function = _cut(function, function_keep)
                    if cut_function is not function:
                        call = {**call, "function": cut_function}
            cut_calls.append(call)
        if any(a is not b for a, b in zip(cut_calls, calls, strict=True)):
            out = {**out, "tool_calls": cut_calls}
    return out


class FrozenMessage(dict[str, Any]):
    """A message only the proxy holds, which nothing edits: shared between turns (and sessions) as it is.

    The wire layer hands out one per distinct message text of a request body
    (:mod:`actorproxy.protocols.chat_messages`), the same object every turn the history
    repeats it, and :class:`MessageCut` hands out its cut messages as such: so the
    per-turn matching of a repeated history is an identity check.
    """

    __slots__ = ()


def _copy(value: Any) -> Any:
    """A copy of a JSON-like value down to its (immutable) strings and numbers."""
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _frozen_copy(message: dict[str, Any]) -> FrozenMessage:
    """A private copy of ``message`` (down to its strings), marked frozen: whoever holds it never edits it."""
    return FrozenMessage({k: _copy(v) for k, v in message.items()})


def kept(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` as something may keep it: a :class:`FrozenMessage` as it is, anything else copied."""
    return message if type(message) is FrozenMessage else _copy(message)


class MessageCut:
    """One session's messages cut to ``fields`` (:func:`cut_message`), in time proportional to what is new.

    The history comes back whole every turn. A message equal to the one at its
    position last turn (one dict comparison, at C speed) gets last turn's cut
    message back; so does the very :class:`FrozenMessage` given at that position
    last turn (an identity check: the wire layer hands out the same object for the
    same message text every turn, and nobody edits it). Only the others are cut,
    and copied, so what is handed out is never an object the client (an
    in-process agent) may edit in place later; a :class:`FrozenMessage` with
    nothing to cut is kept as it is (no client holds it). What is handed out is
    itself a :class:`FrozenMessage`, shared between turns: nothing may edit it in
    place, and the append-only match compares it by identity next turn.
    """

    def __init__(self, fields: frozenset[str] | None) -> None:
        self._fields = fields
        #: Last turn's messages as given, and as cut.
        self._last_in: list[dict[str, Any]] = []
        self._last: list[dict[str, Any]] = []

    @property
    def known(self) -> int:
        """How many messages last turn had (the ones this turn may find unchanged)."""
        return len(self._last)

    def cut(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        last_in, last, fields = self._last_in, self._last, self._fields
        reused = len(last)
        out: list[dict[str, Any]] = []
        start = 0
        if len(messages) >= reused and messages[:reused] == last:
            # Last turn's messages unchanged, each the very object handed out then (or equal to it): one C loop.
            out, start = list(last), reused
        for i in range(start, len(messages)):
            message = messages[i]
            if i < reused:
                before = last[i]
                if message is before or (message is last_in[i] and type(message) is FrozenMessage) or (
                    message == before
                ):
                    out.append(before)
                    continue
            cut = cut_message(message, fields)
            out.append(cut if cut is message and type(message) is FrozenMessage else _frozen_copy(cut))
        self._last_in = list(messages)  # the caller's list may change; its frozen messages do not
        self._last = out
        return out
