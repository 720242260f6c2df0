"""The Anthropic Messages request body, typed (others' protocol: unknown fields tolerated).

The one converter structures a body into these classes, so a bad value is a 400 naming
its path (``messages[1].content[0].input``) in Anthropic's error shape. A content block
is structured by its ``type`` (:class:`Block` names its kinds); a block of a kind we do
not read stays a bare :class:`Block`, and the rules between fields are validators: which
kinds a role may send (a user's ``tool_use`` is refused, an image anywhere: this proxy
serves a text-only model), the last message not the assistant's (prefill). What the
classes hold is converted to the OpenAI messages the template renders by
:mod:`.anthropic_request`.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from ..schema.converter import FieldError, at_least, between, named
from .openai_types import MAX_STOP_SEQUENCES

Role = Literal["user", "assistant", "system"]


@attrs.frozen
class Block:
    """A content block: its ``type``; a block of a type not named in ``__wire_tags__`` is a bare ``Block``."""

    type: str


@attrs.frozen
class TextBlock(Block):
    text: str


@attrs.frozen
class ThinkingBlock(Block):
    thinking: str


@attrs.frozen
class ToolUseBlock(Block):
    id: str = attrs.field(validator=named)
    name: str = attrs.field(validator=named)
    input: dict[str, Any]


@attrs.frozen
class ToolReferenceBlock(Block):
    """Claude Code's ToolSearch answer (a deferred tool it loads), inside a tool result: the tool's name."""

    tool_name: str = attrs.field(validator=named)


def unsupported(block: Block, place: str) -> FieldError:
    """The refusal of a block of a kind ``place`` does not take (the index is the caller's to name)."""
    if block.type in ("image", "document"):
        return FieldError(f"is a {block.type} block: {block.type} blocks are not supported "
                          "(this proxy serves a text-only model)")
    return FieldError(f"is a content block of type {block.type!r}, which is not supported in {place}")


def check_kinds(value: Any, kinds: frozenset[type[Block]], place: str, field: str) -> None:
    """A string, ``None``, or blocks of the classes in ``kinds`` only (else a :class:`FieldError` naming one)."""
    if isinstance(value, list):
        for j, block in enumerate(value):
            if type(block) not in kinds:
                error = unsupported(block, place)
                error.field = f"{field}[{j}]"
                raise error


def only(kinds: frozenset[type[Block]], place: str) -> Any:
    """An attrs validator: :func:`check_kinds`."""

    def check(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
        check_kinds(value, kinds, place, attribute.name)

    return check


@attrs.frozen
class ToolResultBlock(Block):
    tool_use_id: str = attrs.field(validator=named)
    #: ``is_error`` is not read: Qwen's format has no place for it, and agents say so in the result's text.
    content: str | list[Block] | None = attrs.field(
        default=None, validator=only(frozenset({TextBlock, ToolReferenceBlock}), "a tool result")
    )


Block.__wire_tags__ = {  # type: ignore[attr-defined]
    "text": TextBlock,
    "thinking": ThinkingBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "tool_reference": ToolReferenceBlock,
}

#: Blocks of a ``role: "system"`` message that change the offered tools (the
#: ``mid-conversation-tool-changes`` beta). Not rendered: the prompt lists the request's ``tools``.
TOOL_CHANGE_BLOCKS = frozenset({"request_tool_addition", "request_tool_removal"})

#: What each role's content may hold (``redacted_thinking``, opaque by design, is a bare :class:`Block`).
_ROLE_KINDS: dict[str, tuple[frozenset[type[Block]], frozenset[str], str]] = {
    "user": (frozenset({TextBlock, ToolResultBlock}), frozenset(), "a user message"),
    "assistant": (frozenset({TextBlock, ThinkingBlock, ToolUseBlock}), frozenset({"redacted_thinking"}),
                  "an assistant message"),
    "system": (frozenset({TextBlock}), TOOL_CHANGE_BLOCKS, "a system message"),
}


def _role_content(instance: Any, attribute: attrs.Attribute[Any], value: str | list[Block]) -> None:
    if isinstance(value, str):
        return
    kinds, bare, place = _ROLE_KINDS[instance.role]
    for j, block in enumerate(value):
        if type(block) not in kinds and not (type(block) is Block and block.type in bare):
            error = unsupported(block, place)
            error.field = f"{attribute.name}[{j}]"
            raise error


@attrs.frozen
class AnthropicMessage:
    role: Role
    content: str | list[Block] = attrs.field(validator=_role_content)
    #: ``"next_user_message"``: the message leaves the conversation once a later user message exists.
    clear_at: Any = None


def _custom(value: Any, _: Any) -> str | None:
    """A tool's ``type``: absent or ``custom`` (checked before the tool's other fields: its words say why)."""
    if value in (None, "custom"):
        return None if value is None else "custom"
    raise FieldError(f"is {value!r}: an Anthropic-defined or server tool, which this proxy cannot run; "
                     "define it as a custom tool (name, description, input_schema)")


@attrs.frozen(kw_only=True)
class AnthropicTool:
    __wire_hooks__ = {"type": _custom}

    type: str | None = None
    input_schema: dict[str, Any]
    name: str = attrs.field(validator=named)
    description: str | None = None


@attrs.frozen
class ToolChoice:
    #: ``"none"`` offers the model no tools.
    type: str


@attrs.frozen
class ThinkingConfig:
    #: ``"enabled"``, ``"adaptive"`` and later modes let the model think; ``"disabled"`` does not.
    type: str


def _stop_sequences(instance: object, attribute: attrs.Attribute[Any], value: list[str] | None) -> None:
    if value is not None and (len(value) > MAX_STOP_SEQUENCES or not all(0 < len(s) <= 256 for s in value)):
        raise FieldError(f"must be an array of at most {MAX_STOP_SEQUENCES} non-empty strings", field=attribute.name)


@attrs.frozen
class MessagesOptions:
    """``POST /v1/messages`` but its conversation and tools: the fields we read (others are ignored).

    ``max_tokens`` is required on ``/v1/messages`` only (``count_tokens`` takes none): that rule is the route's.
    """

    model: str = attrs.field(validator=named)
    max_tokens: int | None = attrs.field(default=None, validator=at_least(1))
    stream: bool | None = None
    tool_choice: ToolChoice | None = None
    session_id: str | None = None
    instance_id: str | None = None
    turn_id: str | None = None
    thinking: ThinkingConfig | None = None
    temperature: float | None = attrs.field(default=None, validator=between(0.0, 1.0))
    top_p: float | None = attrs.field(default=None, validator=between(0.0, 1.0))
    top_k: int | None = attrs.field(default=None, validator=at_least(0))
    stop_sequences: list[str] | None = attrs.field(default=None, validator=_stop_sequences)


#: What the top-level ``system`` may hold: text blocks.
SYSTEM_KINDS: frozenset[type[Block]] = frozenset({TextBlock})
SYSTEM_PLACE = "the system prompt"


def _conversation(instance: object, attribute: attrs.Attribute[Any], value: list[AnthropicMessage]) -> None:
    if not value:
        raise FieldError("must be a non-empty array", field=attribute.name)
    if value[-1].role == "assistant":
        raise FieldError("is an assistant message: the last message must not be one (prefill is not supported)",
                         field=f"{attribute.name}[{len(value) - 1}]")


@attrs.frozen
class MessagesRequest(MessagesOptions):
    """``POST /v1/messages``: the fields we read (others are ignored)."""

    tools: list[AnthropicTool] | None = attrs.field(default=None, kw_only=True)
    system: str | list[Block] | None = attrs.field(
        default=None, kw_only=True, validator=only(SYSTEM_KINDS, SYSTEM_PLACE)
    )
    messages: list[AnthropicMessage] = attrs.field(kw_only=True, validator=_conversation)
