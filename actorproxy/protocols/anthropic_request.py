"""The Anthropic Messages request, typed by the one converter (:mod:`.anthropic_types`), as a :class:`ChatRequest`."""

from __future__ import annotations

import json
from typing import Any

import attrs

from ..core.requests import ChatRequest, offered_tools, sampling_extras
from ..errors import BadRequest
from ..schema.converter import structure
from .anthropic_types import (
    AnthropicMessage,
    AnthropicTool,
    Block,
    MessagesOptions,
    MessagesRequest,
    TextBlock,
    ThinkingBlock,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
)


@attrs.frozen
class AnthropicCall:
    """A validated ``/v1/messages`` (or ``/v1/messages/count_tokens``) body."""

    request: ChatRequest
    model: str
    stream: bool
    #: Identity fields a client may put in the body instead of headers.
    session_id: str | None
    instance_id: str | None
    turn_id: str | None
    #: The request enables ``thinking``: only then does the reply carry thinking blocks (Anthropic's
    #: rule). The sampled reasoning is recorded either way.
    thinking_shown: bool = False


# -- request --------------------------------------------------------------------


def _text(blocks: list[Block]) -> list[str]:
    """The texts of blocks already checked to be text (or tool references: a deferred tool's name)."""
    return [b.text if isinstance(b, TextBlock) else b.tool_name
            for b in blocks if isinstance(b, TextBlock | ToolReferenceBlock)]


def _user(content: str | list[Block]) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    tool_messages: list[dict[str, Any]] = []
    texts: list[str] = []
    for block in content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            result = block.content
            text = result if isinstance(result, str) else "\n".join(_text(result or []))
            tool_messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
    if texts or not tool_messages:
        return [*tool_messages, {"role": "user", "content": "\n".join(texts)}]
    return tool_messages


def _assistant(content: str | list[Block]) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            function = {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}
            calls.append({"id": block.id, "type": "function", "function": function})
        # redacted_thinking: opaque by design, nothing to render
    # Joined with "" so a reply we streamed as several blocks echoes back as the
    # content we produced (the parser's pieces concatenate to it).
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def convert_messages(system: str | list[Block] | None, messages: list[AnthropicMessage]) -> list[dict[str, Any]]:
    """Anthropic ``system`` + ``messages`` (typed) as the OpenAI messages the chat template renders."""
    converted = system_messages(system)
    user_later = False
    kept: list[list[dict[str, Any]]] = []
    for message in reversed(messages):  # backwards: whether a later user message clears a system one
        if not (message.role == "system" and clears_at_next_user(message) and user_later):
            kept.append(convert_content(message))
        user_later = user_later or message.role == "user"
    for part in reversed(kept):
        converted.extend(part)
    return converted


def system_messages(system: str | list[Block] | None) -> list[dict[str, Any]]:
    """The top-level ``system`` (typed) as the leading system message (none when it is absent or empty)."""
    text = system if isinstance(system, str) else "\n".join(_text(system or []))
    return [{"role": "system", "content": text}] if text else []


def convert_content(message: AnthropicMessage) -> list[dict[str, Any]]:
    """One message as OpenAI messages (a ``system`` one whether or not a later user message clears it)."""
    if message.role == "user":
        return _user(message.content)
    if message.role == "assistant":
        return [_assistant(message.content)]
    content = message.content  # a role "system" message: its text blocks (tool changes are not rendered)
    return [{"role": "system", "content": content if isinstance(content, str) else "\n".join(_text(content))}]


def clears_at_next_user(message: AnthropicMessage) -> bool:
    """Whether a ``role: "system"`` message leaves the conversation once a later user message exists."""
    return bool(message.clear_at == "next_user_message")


def convert_tools(tools: list[AnthropicTool] | None) -> list[dict[str, Any]]:
    """Custom tools (typed) as OpenAI function tools."""
    converted = []
    for tool in tools or []:
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.input_schema
        converted.append({"type": "function", "function": function})
    return converted


def offers_tools(options: MessagesOptions) -> bool:
    """Whether the prompt lists the body's tools: not when its tool choice is ``{"type": "none"}``."""
    return options.tool_choice is None or options.tool_choice.type != "none"


def messages_request(
    options: MessagesOptions, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> ChatRequest:
    """The request a Messages body's typed fields ask for, with these messages and (converted) tools."""
    return ChatRequest(
        messages=messages,
        tools=offered_tools(tools, not offers_tools(options)),
        max_tokens=options.max_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        enable_thinking=None if options.thinking is None else options.thinking.type != "disabled",
        stop=tuple(options.stop_sequences or ()),
        stream=bool(options.stream),
        extras=sampling_extras(top_k=options.top_k),
    )


def parse_messages_body(body: Any, *, count_only: bool = False, made: ChatRequest | None = None) -> AnthropicCall:
    """Validate a Messages body; raise :class:`BadRequest` naming the bad field.

    The body is structured by the one converter into :class:`MessagesRequest`;
    ``count_only`` is for ``/v1/messages/count_tokens``, where ``max_tokens``
    is not sent. Unknown fields are ignored. ``made``, when given, is the
    request the body asks for, made already from what its parts were converted
    to (``anthropic_messages``): the body is then its other fields, typed
    already (:class:`MessagesOptions`).
    """
    options: MessagesOptions
    if made is None:
        typed = structure(body, MessagesRequest)
        options = typed
        made = messages_request(typed, convert_messages(typed.system, typed.messages), convert_tools(typed.tools))
    else:
        options = body
    if not count_only and options.max_tokens is None:
        raise BadRequest("'max_tokens' is required: an integer of at least 1", param="max_tokens")
    return AnthropicCall(request=made, model=options.model, stream=made.stream,
                         thinking_shown=bool(made.enable_thinking), session_id=options.session_id,
                         instance_id=options.instance_id, turn_id=options.turn_id)
