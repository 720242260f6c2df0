"""A Responses body's input items converted once per distinct item, not once per turn (issue 12).

Codex sends its whole conversation (``store: false``: every reasoning item, call and
call output) and its tool schemas every turn. Parsing all of it and converting every
item again took about 3.3 ms per turn at 600 items (194 KB), growing with the history.

The scheme of every agent body (``protocols/memo.py``): msgspec hands out each top-level field's and each
item's raw JSON; an item whose bytes a recent turn sent maps to what it converted to
then — a user, system or tool message (the same :class:`FrozenMessage` every turn) or
a part of an assistant turn (its reasoning, text or tool call). The parts are grouped
into assistant messages per body, as ``convert_input`` groups them (a run of output
items is one turn), and a turn whose items' bytes a recent turn sent is the same
frozen assistant message again. The ``tools`` field is kept by its bytes the same way.

Anything the fast path cannot vouch for — a body msgspec cannot read, a part orjson
refuses, a non-ASCII top-level key, an ``input`` that is not a non-empty array,
nesting past the bound, an item or tool list that does not convert — is loaded and
converted whole the ordinary way (``jsonio.load_body``, ``parse_responses_body``), so
what is accepted is what was accepted before and every error is the one the full
conversion gives, word for word.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..core.requests import ChatRequest, holding
from ..schema.converter import structure
from ..schema.jsonio import MAX_DEPTH
from ..tokenization.message_fields import FrozenMessage
from . import memo as shared
from .memo import MEMO_BYTES, MessageMemo
from .responses_api import (
    assemble_input,
    assistant_part,
    convert_tools,
    echo_parts,
    echoed,
    instructions_message,
    item_kind,
    offers_tools,
    other_message,
    responses_request,
    turn_end,
)
from .responses_types import Item, ResponsesOptions, Tool, check_item

#: Raw JSON bytes of ``tools`` fields kept (they repeat every turn).
TOOLS_MEMO_BYTES = 16 << 20
#: Assistant turns kept (twice that at most while the memo turns over).
MEMO_TURNS = 1 << 16
#: An item as converted: its kind, its message or assistant part, whether it is part of an assistant turn.
_Item = tuple[Any, Any, bool]


@attrs.frozen
class ResponsesFields:
    """A Responses body's fields but ``input`` and ``tools``, typed: what an agent sends the same every turn."""

    options: ResponsesOptions
    #: The fields the response echoes, as sent (``tools``: none). Shared by every turn that sends the same
    #: fields: read, never changed.
    echo: dict[str, Any]
    #: Its JSON members before and after ``tools`` (:func:`~.responses_api.echo_parts`).
    echo_parts: tuple[bytes, bytes]
    #: The request these fields ask for, with no messages and no tools: each turn's request is this one holding
    #: its body's messages and tools (the settings by reference, made once while the fields repeat).
    request: ChatRequest
    #: The system message ``instructions`` make, the first of every turn's messages (none without them).
    instructions: FrozenMessage | None
    #: The prompt lists the body's function tools (its tool choice is not ``"none"``).
    offers_tools: bool


def _fields(value: dict[str, Any]) -> ResponsesFields:
    options = structure(value, ResponsesOptions)
    system = instructions_message(options)
    echo = echoed(value, options)
    return ResponsesFields(options, echo, echo_parts(echo), responses_request(options, [], []),
                           None if system is None else FrozenMessage(system), offers_tools(options))


@attrs.frozen
class ResponsesBody:
    """A Responses body read from bytes whose input items and tools all convert."""

    #: The body's fields but ``input`` and ``tools`` (the memo's shared object while they repeat).
    fields: ResponsesFields
    #: The tools as sent (the response echoes them), when the body has ``tools`` (``has_tools``).
    sent_tools: Any
    #: The ``instructions``' system message, then the input as chat messages (a list of its own; but for
    #: assistant turns first seen, the memo's shared objects).
    messages: list[dict[str, Any]]
    #: The function tools as chat tools: the memo's shared list while the body's ``tools`` repeat (read, never
    #: changed).
    tools: list[dict[str, Any]]
    has_tools: bool = False
    #: The ``tools`` field's JSON text as sent (the memo's key, not a copy), when it has tools.
    sent_tools_json: bytes = b""

    @property
    def request(self) -> ChatRequest:
        """The turn's request: the fields' request holding this body's messages and tools, by reference."""
        fields = self.fields
        return holding(fields.request, self.messages, self.tools if fields.offers_tools else fields.request.tools)

    @property
    def echo(self) -> dict[str, Any]:
        """The fields the response echoes: the fields' own, with the tools as sent when the body has them."""
        if not self.has_tools:
            return self.fields.echo
        return {**self.fields.echo, "tools": self.sent_tools or []}

    @property
    def echo_json(self) -> bytes:
        """The echo's JSON members (:func:`~.responses_api.echo_parts`), the tools as their text was sent."""
        head, tail = self.fields.echo_parts
        return head + (self.sent_tools_json if self.has_tools and self.sent_tools else b"[]") + tail


class ResponsesMemo:
    """What recent turns' input items and tool lists converted to, by their JSON text."""

    def __init__(self, max_bytes: int = MEMO_BYTES, tools_bytes: int = TOOLS_MEMO_BYTES,
                 max_turns: int = MEMO_TURNS) -> None:
        self.items: MessageMemo[_Item] = MessageMemo(max_bytes)
        self.tools: MessageMemo[tuple[Any, list[dict[str, Any]]]] = MessageMemo(tools_bytes)
        self.options: MessageMemo[ResponsesFields] = MessageMemo(tools_bytes)
        #: Assistant turns by the bytes of their items (two generations of ``max_turns`` at most).
        self._turns: dict[tuple[bytes, ...], FrozenMessage] = {}
        self._old_turns: dict[tuple[bytes, ...], FrozenMessage] = {}
        self._max_turns = max_turns

    def age(self) -> None:
        """Drop what no turn used since the last drain (:meth:`MessageMemo.age`)."""
        for memo in (self.items, self.tools, self.options):
            memo.age()
        self._old_turns, self._turns = self._turns, {}

    def turn(self, key: tuple[bytes, ...], parts: list[_Item]) -> FrozenMessage:
        """The assistant message of ``parts`` (one turn's items, ``key`` their bytes): the memo's when known."""
        message = self._turns.get(key)
        if message is None:
            message = self._old_turns.pop(key, None)
            if message is None:
                (assembled,) = assemble_input(parts)
                message = FrozenMessage(assembled)
            if len(self._turns) >= self._max_turns:
                self._old_turns, self._turns = self._turns, {}
            self._turns[key] = message
        return message


def load_responses_body(raw: bytes, memo: ResponsesMemo) -> Any:
    """A request body: a :class:`ResponsesBody` when everything in it converts, else its JSON value.

    Raises what :func:`~actorproxy.schema.jsonio.load_body` raises, with the same words
    (:func:`actorproxy.protocols.memo.load`).
    """
    return shared.load(raw, lambda raw: _from_memo(raw, memo))


def _from_memo(raw: bytes, memo: ResponsesMemo) -> ResponsesBody | None:
    """The body from the memo, or ``None`` where the ordinary way must decide.

    A long body is read from the end of the kept one it starts with (:func:`.memo.read`): only its
    new items are split, copied and converted. It is kept up to its last item that is not part of an
    assistant turn (a user, system or tool message): an assistant turn groups a run of items into one
    message, so a kept part must not end inside one; after such an item, what the items up to it come
    to is what they come to whatever follows.
    """
    read = shared.read(raw, "input", memo.items.bodies)  # a string input is cheap anyway
    if read is None:
        return None
    top = read.fields
    typed, depth = shared.options(memo.options, [item for item in top.items() if item[0] != "tools"], _fields)
    tools: list[dict[str, Any]] = _NO_TOOLS
    sent_tools, tools_json = None, b""
    if "tools" in top:
        tools_json = top["tools"]
        (sent_tools, tools), tools_depth = shared.field(memo.tools, tools_json, _tools)
        depth = max(depth, 1 + tools_depth)
    keys = list(map(bytes, read.texts))
    parts, items_depth = shared.items(memo.items, keys, _convert)
    seen = read.seen
    kept: list[dict[str, Any]] = [] if seen is None else seen.items
    items_depth = max(items_depth, 0 if seen is None else seen.depth)
    if max(depth, 2 + items_depth) > MAX_DEPTH:
        return None
    settled = len(parts)
    while settled and parts[settled - 1][2]:
        settled -= 1
    if settled:
        kept = _assemble(parts[:settled], keys[:settled], memo, list(kept))
        read.keep(memo.items.bodies, settled, kept, items_depth)
    messages: list[dict[str, Any]] = [] if typed.instructions is None else [typed.instructions]
    messages += kept
    return ResponsesBody(typed, sent_tools, _assemble(parts[settled:], keys[settled:], memo, messages), tools,
                         "tools" in top, tools_json)


#: The tools of a body without ``tools`` (read, never changed).
_NO_TOOLS: list[dict[str, Any]] = []


def _tools(tools: Any) -> tuple[Any, list[dict[str, Any]]]:
    """The tools as sent (the response echoes them) and as chat tools."""
    return tools, convert_tools(tools, structure(tools, list[Tool], where="tools"))[0]


def _assemble(parts: list[_Item], keys: list[bytes], memo: ResponsesMemo,
              messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` then ``assemble_input(parts)``, each assistant turn from the memo when its items were seen
    together."""
    at = 0
    while at < len(parts):
        if not parts[at][2]:
            messages.append(parts[at][1])
            at += 1
            continue
        end = turn_end(parts, at)
        messages.append(memo.turn(tuple(keys[at:end]), parts[at:end]))
        at = end
    return messages


def _convert(item: Any) -> _Item:
    """One input item typed and converted (raises where the full conversion refuses it: that one says what)."""
    typed = structure(item, Item, where="input")
    check_item(typed, "input")
    kind, assistant = item_kind(typed)
    if assistant:
        return kind, assistant_part(typed, "input"), True
    return kind, FrozenMessage(other_message(typed)), False
