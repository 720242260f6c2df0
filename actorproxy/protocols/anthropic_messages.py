"""An Anthropic Messages body's history converted once per distinct message, not once per turn (issue 12).

Claude Code sends its whole conversation, its system prompt and its tools (tens of
KB of schemas) every turn. Parsing all of it, checking every content block and
converting every message to the OpenAI form the template renders took about 7 ms
per turn at 400 messages (215 KB), growing with the history.

The scheme of every agent body (:mod:`.memo`): msgspec hands out the
raw JSON text of each top-level field and of each message; a message whose text a
recent turn sent, byte for byte, maps to what it converted to then — the same
:class:`FrozenMessage` objects every turn, so ``MessageCut`` and the append-only
match are identity checks too. The ``system`` and ``tools`` fields are kept the
same way, by their text. What converts a message depends on nothing but its own
text (its index only names it in errors), except that a ``role: "system"`` message
with ``clear_at: "next_user_message"`` leaves the conversation once a later user
message exists: that is decided per body, from the roles.

Anything the fast path cannot vouch for — a body msgspec cannot read, a part orjson
refuses, a non-ASCII top-level key, nesting past the bound, a message, ``system`` or
``tools`` that does not convert, a last message from the assistant — is loaded and
checked the ordinary way, whole (``jsonio.load_body``, ``parse_messages_body``), so
what is accepted is what was accepted before and every error is the one the full
check gives, word for word.
"""

from __future__ import annotations

from typing import Any

import attrs

from ..core.requests import ChatRequest, holding
from ..schema.converter import structure
from ..schema.jsonio import MAX_DEPTH
from ..tokenization.message_fields import FrozenMessage
from . import memo as shared
from .anthropic_request import (
    clears_at_next_user,
    convert_content,
    convert_tools,
    messages_request,
    offers_tools,
    system_messages,
)
from .anthropic_types import (
    SYSTEM_KINDS,
    SYSTEM_PLACE,
    AnthropicMessage,
    AnthropicTool,
    Block,
    MessagesOptions,
    check_kinds,
)
from .memo import FIELD_MEMO_BYTES, MEMO_BYTES, MessageMemo

#: The fields converted through a memo; the others are parsed as they come.
_CONVERTED = ("messages", "system", "tools")


@attrs.frozen
class Converted:
    """One Anthropic message as converted: its role, its OpenAI messages, and whether a later user turn clears it."""

    role: str
    messages: tuple[FrozenMessage, ...]
    clears: bool = False


@attrs.frozen
class MessagesFields:
    """A Messages body's fields but ``messages``, ``system`` and ``tools``, typed: what an agent sends the same
    every turn."""

    options: MessagesOptions
    #: The request these fields ask for, with no messages and no tools: each turn's request is this one holding
    #: its body's messages and tools (the settings by reference, made once while the fields repeat).
    request: ChatRequest
    #: The prompt lists the body's tools (its tool choice is not ``none``).
    offers_tools: bool


@attrs.frozen
class MessagesBody:
    """A Messages body read from bytes whose messages, system prompt and tools all convert."""

    #: The body's fields but ``messages``, ``system`` and ``tools``, typed (the memo's shared object while they repeat).
    fields: MessagesFields
    #: The conversation as OpenAI messages (``system`` first): the memo's shared :class:`FrozenMessage` objects.
    messages: list[dict[str, Any]]
    #: The tools the prompt lists, as OpenAI function tools: the memo's shared list while the body's ``tools``
    #: repeat (read, never changed), or none (no ``tools``, or a tool choice of ``none``).
    tools: list[dict[str, Any]]

    @property
    def request(self) -> ChatRequest:
        """The turn's request: the fields' request holding this body's messages and tools, by reference."""
        return holding(self.fields.request, self.messages, self.tools)


class AnthropicMemo:
    """What recent turns' messages, system prompts and tool lists converted to, by their JSON text."""

    def __init__(self, max_bytes: int = MEMO_BYTES, field_bytes: int = FIELD_MEMO_BYTES) -> None:
        #: The messages by their text; its ``bodies``: long bodies up to their last user message, with the
        #: OpenAI messages they come to (the system prompt's not among them).
        self.messages: MessageMemo[Converted] = MessageMemo(max_bytes)
        self.system: MessageMemo[tuple[FrozenMessage, ...]] = MessageMemo(field_bytes)
        self.tools: MessageMemo[list[dict[str, Any]]] = MessageMemo(field_bytes)
        self.options: MessageMemo[MessagesFields] = MessageMemo(field_bytes)

    def age(self) -> None:
        """Drop what no turn used since the last drain (:meth:`MessageMemo.age`)."""
        for memo in (self.messages, self.system, self.tools, self.options):
            memo.age()


def load_messages_body(raw: bytes, memo: AnthropicMemo) -> Any:
    """A request body: a :class:`MessagesBody` when everything in it converts, else its JSON value.

    Raises what :func:`~actorproxy.schema.jsonio.load_body` raises (empty, not JSON,
    too deep), with the same words (:func:`actorproxy.protocols.memo.load`).
    """
    return shared.load(raw, lambda raw: _from_memo(raw, memo))


def _from_memo(raw: bytes, memo: AnthropicMemo) -> MessagesBody | None:
    """The body from the memo, or ``None`` where the ordinary way must decide.

    A long body is read from the end of the kept one it starts with (:func:`.memo.read`): only its
    new messages are split, copied and converted. It is kept up to its last user message: whether
    a ``clear_at`` system message stays is settled for every message before it (a user message
    follows), so what the messages up to there come to is what they come to whatever follows.
    """
    read = shared.read(raw, "messages", memo.messages.bodies)
    if read is None:
        return None
    top = read.fields
    options, depth = shared.options(memo.options, [item for item in top.items() if item[0] not in _CONVERTED],
                                    _options)
    system: tuple[FrozenMessage, ...] = ()
    if "system" in top:
        system, system_depth = shared.field(memo.system, top["system"], _system)
        depth = max(depth, 1 + system_depth)
    tools: list[dict[str, Any]] = _NO_TOOLS
    if "tools" in top:
        tools, tools_depth = shared.field(memo.tools, top["tools"], _tools)
        depth = max(depth, 1 + tools_depth)
    entries, messages_depth = shared.items(memo.messages, list(map(bytes, read.texts)), _convert)
    seen = read.seen
    kept: list[FrozenMessage] = [] if seen is None else seen.items
    messages_depth = max(messages_depth, 0 if seen is None else seen.depth)
    if max(depth, 2 + messages_depth) > MAX_DEPTH:
        return None
    if entries and entries[-1].role == "assistant":
        return None  # prefill: the full check names it (a kept part ends on a user message)
    users = [i for i, entry in enumerate(entries) if entry.role == "user"]
    settled = users[-1] + 1 if users else 0  # the messages up to the last user message, a later user for each
    if settled:
        kept = kept + [m for entry in entries[:settled] if not entry.clears for m in entry.messages]
        read.keep(memo.messages.bodies, settled, kept, messages_depth)
    rest = [m for entry in entries[settled:] for m in entry.messages]  # no user message after any of them
    return MessagesBody(options, [*system, *kept, *rest], tools if options.offers_tools else options.request.tools)


#: The tools of a body without ``tools`` (read, never changed).
_NO_TOOLS: list[dict[str, Any]] = []


def _options(value: dict[str, Any]) -> MessagesFields:
    options = structure(value, MessagesOptions)
    return MessagesFields(options, messages_request(options, [], []), offers_tools(options))


def _system(system: Any) -> tuple[FrozenMessage, ...]:
    typed = structure(system, str | list[Block] | None, where="system")  # type: ignore[arg-type]
    check_kinds(typed, SYSTEM_KINDS, SYSTEM_PLACE, "system")
    return tuple(FrozenMessage(m) for m in system_messages(typed))


def _tools(tools: Any) -> list[dict[str, Any]]:
    return convert_tools(structure(tools, list[AnthropicTool], where="tools"))


def _convert(message: Any) -> Converted:
    """One message typed and converted (raises where the full check refuses it: that check says what)."""
    typed = structure(message, AnthropicMessage, where="messages")
    clears = typed.role == "system" and clears_at_next_user(typed)
    return Converted(typed.role, tuple(FrozenMessage(m) for m in convert_content(typed)), clears)
