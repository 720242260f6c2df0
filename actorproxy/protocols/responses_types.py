"""The OpenAI Responses request body, typed (others' protocol: unknown fields tolerated).

The one converter structures a body into these classes, so a bad value is a 400 naming
its path (``input[3].call_id``). An input item, a content part and a tool are structured
by their ``type`` (an item without one is a message); an item or part of a kind we do not
convert stays a bare :class:`Item` or :class:`Part`, refused by the validator of the field
holding it, and a tool of another kind is a bare :class:`Tool`, not offered to the model.
What the classes hold is converted to chat messages by :mod:`.responses_api`.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

from ..schema.converter import FieldError, at_least, between, named
from .openai_types import MAX_TOP_LOGPROBS


@attrs.frozen
class Part:
    """A content part: its ``type``; a part of a type not named in ``__wire_tags__`` is a bare ``Part``."""

    type: str


@attrs.frozen
class TextPart(Part):
    text: str


@attrs.frozen
class RefusalPart(Part):
    refusal: str


TEXT_PARTS = frozenset({"input_text", "output_text", "text", "summary_text", "reasoning_text"})
MEDIA_PARTS = frozenset({"input_image", "input_file", "input_audio"})
Part.__wire_tags__ = {**dict.fromkeys(TEXT_PARTS, TextPart), "refusal": RefusalPart}  # type: ignore[attr-defined]


def check_parts(value: Any, field: str) -> None:
    """A string, ``None``, or text and refusal parts only (else a :class:`FieldError` naming the part)."""
    if isinstance(value, list):
        for j, part in enumerate(value):
            if type(part) is Part:
                if part.type in MEDIA_PARTS:
                    error = FieldError(f"is an {part.type} part: {part.type} parts are not supported "
                                       "(this proxy serves a text-only model)")
                else:
                    error = FieldError(f"is a part of type {part.type!r}: it must be a text part "
                                       "(input_text, output_text)")
                error.field = f"{field}[{j}]"
                raise error


def _text_parts(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    check_parts(value, attribute.name)


@attrs.frozen
class Item:
    """An input item: its ``type``; an item of a type not named in ``__wire_tags__`` is a bare ``Item``."""

    type: str


@attrs.frozen(kw_only=True)
class MessageItem(Item):
    #: An item without a ``type`` is a message.
    type: str = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part] = attrs.field(validator=_text_parts)


@attrs.frozen(kw_only=True)
class ReasoningItem(Item):
    #: The reasoning text; else ``encrypted_content`` (ours: the text, base64); a summary is not read.
    content: str | list[Part] | None = attrs.field(default=None, validator=_text_parts)
    encrypted_content: Any = None


@attrs.frozen(kw_only=True)
class FunctionCallItem(Item):
    name: str = attrs.field(validator=named)
    #: A JSON string.
    arguments: str
    call_id: str = attrs.field(validator=named)


@attrs.frozen(kw_only=True)
class FunctionCallOutputItem(Item):
    output: str | list[Part] = attrs.field(validator=_text_parts)
    #: Codex also sends outputs that answer no call (no ``call_id``): tool results all the same.
    call_id: str | None = None


Item.__wire_tags__ = {  # type: ignore[attr-defined]
    "message": MessageItem,
    "reasoning": ReasoningItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
}
Item.__wire_untagged__ = "message"  # type: ignore[attr-defined]


def check_item(item: Item, where: str) -> None:
    """An item of a kind we convert (else a :class:`FieldError` naming its ``type``)."""
    if type(item) is Item:
        raise FieldError(f"is {item.type!r}: input items of that type are not supported "
                         "(use message, function_call, function_call_output, reasoning)", field=f"{where}.type")


def _input(instance: object, attribute: attrs.Attribute[Any], value: str | list[Item]) -> None:
    if isinstance(value, str):
        return
    if not value:
        raise FieldError("must be a string or a non-empty array of items", field=attribute.name)
    for i, item in enumerate(value):
        check_item(item, f"{attribute.name}[{i}]")


@attrs.frozen
class Tool:
    """A tool: its ``type``; a tool of another kind than ``function`` or ``namespace`` is a bare ``Tool``, not
    offered (a hosted tool, such as ``web_search``, which the model's server would run)."""

    type: str


@attrs.frozen
class ChatFunction:
    """A function tool in the chat shape (``{"type": "function", "function": {...}}``), sent by some clients."""

    name: str = attrs.field(validator=named)
    parameters: dict[str, Any] | None = None


def _flat_name(instance: Any, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if instance.function is None and not value:
        raise FieldError("must be a non-empty string", field=attribute.name)


@attrs.frozen(kw_only=True)
class FunctionTool(Tool):
    """A function tool, flat (``name``, ``parameters`` beside ``type``) or in the chat shape (``function``)."""

    function: ChatFunction | None = None
    name: str | None = attrs.field(default=None, validator=_flat_name)
    parameters: dict[str, Any] | None = None


@attrs.frozen(kw_only=True)
class NamespaceTool(Tool):
    """Tools grouped under a name (Codex's ``multi_agent_v1``: ``spawn_agent``, ``wait_agent``, ...): its function
    tools are offered to the model by their own names, and a call of one goes back with its ``namespace``."""

    name: str = attrs.field(validator=named)
    tools: list[Tool] = attrs.field(factory=list)


Tool.__wire_tags__ = {"function": FunctionTool, "namespace": NamespaceTool}  # type: ignore[attr-defined]


@attrs.frozen
class Reasoning:
    #: ``"none"`` turns thinking off, any other effort on; absent: the template's default.
    effort: str | None = None


@attrs.frozen
class ResponsesOptions:
    """``POST /v1/responses`` but its input and tools: the fields we read (others are ignored)."""

    #: Echoed as sent (not checked: any model name is this proxy's model).
    model: Any = None
    instructions: str | list[Part] | None = attrs.field(default=None, validator=_text_parts)
    tool_choice: Any = None
    max_output_tokens: int | None = attrs.field(default=None, validator=at_least(1))
    stream: bool | None = None
    store: bool | None = None
    include: list[Any] | None = None
    top_logprobs: int | None = attrs.field(default=None, validator=between(0, MAX_TOP_LOGPROBS))
    temperature: float | None = attrs.field(default=None, validator=between(0.0, 2.0))
    top_p: float | None = attrs.field(default=None, validator=between(0.0, 1.0))
    reasoning: Reasoning | None = None
    previous_response_id: str | None = None
    session_id: str | None = None


@attrs.frozen
class ResponsesRequest(ResponsesOptions):
    """``POST /v1/responses``: the fields we read (others are ignored)."""

    tools: list[Tool] | None = attrs.field(default=None, kw_only=True)
    input: str | list[Item] = attrs.field(kw_only=True, validator=_input)
