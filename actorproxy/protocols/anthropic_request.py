"""The Anthropic Messages request read and converted to a :class:`ChatRequest` (see :mod:`.anthropic`)."""

from __future__ import annotations

import json
from typing import Any

import attrs

from ..core.messages import validate_tools
from ..core.requests import ChatRequest
from ..errors import BadRequest
from ..schema.converter import number_in_range
from .openai_chat import MAX_STOP_SEQUENCES


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


def _bad(message: str, param: str) -> BadRequest:
    return BadRequest(message, param=param)


def _string(value: Any, where: str, *, empty: bool = True) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise _bad(f"{where} must be a {'' if empty else 'non-empty '}string", where)
    return value


def _block_list(content: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or an array of content blocks", where)
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(f"{where}[{j}] must be an object with a 'type'", f"{where}[{j}]")
    return content


def _unsupported(kind: str, at: str, place: str) -> BadRequest:
    if kind in ("image", "document"):
        return _bad(f"{at}: {kind} blocks are not supported (this proxy serves a text-only model)", at)
    return _bad(f"{at}: content blocks of type {kind!r} are not supported in {place}", at)


def _text_of(content: Any, where: str, place: str, *, references: bool = False) -> str:
    """The text of a string or an array of text blocks (``system``, ``tool_result.content``).

    With ``references`` (a tool result), a ``tool_reference`` block (Claude Code's
    ToolSearch answer: a deferred tool it loads) is the tool's name: the prompt
    lists every tool the request carries, so the reference only needs naming.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(_block_list(content, where)):
        if references and block["type"] == "tool_reference":
            texts.append(_string(block.get("tool_name"), f"{where}[{j}].tool_name", empty=False))
            continue
        if block["type"] != "text":
            raise _unsupported(block["type"], f"{where}[{j}]", place)
        texts.append(_string(block.get("text"), f"{where}[{j}].text"))
    return "\n".join(texts)


def _user(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    tool_messages: list[dict[str, Any]] = []
    texts: list[str] = []
    for j, block in enumerate(_block_list(content, where)):
        at = f"{where}[{j}]"
        if block["type"] == "text":
            texts.append(_string(block.get("text"), f"{at}.text"))
        elif block["type"] == "tool_result":
            # ``is_error`` is not rendered: Qwen's format has no place for it, and
            # agents (Claude Code) already say so in the result text.
            call_id = _string(block.get("tool_use_id"), f"{at}.tool_use_id", empty=False)
            text = _text_of(block.get("content"), f"{at}.content", "a tool result", references=True)
            tool_messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise _unsupported(block["type"], at, "a user message")
    if texts or not tool_messages:
        return [*tool_messages, {"role": "user", "content": "\n".join(texts)}]
    return tool_messages


def _assistant(content: Any, where: str) -> dict[str, Any]:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(_block_list(content, where)):
        at, kind = f"{where}[{j}]", block["type"]
        if kind == "text":
            texts.append(_string(block.get("text"), f"{at}.text"))
        elif kind == "thinking":
            thoughts.append(_string(block.get("thinking"), f"{at}.thinking"))
        elif kind == "redacted_thinking":
            continue  # opaque by design: nothing to render
        elif kind == "tool_use":
            arguments = block.get("input")
            if not isinstance(arguments, dict):
                raise _bad(f"{at}.input must be an object", f"{at}.input")
            function = {"name": _string(block.get("name"), f"{at}.name", empty=False),
                        "arguments": json.dumps(arguments, ensure_ascii=False)}
            calls.append({"id": _string(block.get("id"), f"{at}.id", empty=False), "type": "function",
                          "function": function})
        else:
            raise _unsupported(kind, at, "an assistant message")
    # Joined with "" so a reply we streamed as several blocks echoes back as the
    # content we produced (the parser's pieces concatenate to it).
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def convert_messages(system: Any, messages: Any) -> list[dict[str, Any]]:
    """Anthropic ``system`` + ``messages`` as the OpenAI messages the chat template renders."""
    converted = system_messages(system)
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array", "messages")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role, content = role_and_content(message, where)
        if role != "system" or not _cleared(message, messages[i + 1:]):
            converted.extend(convert_content(role, content, where))
    if messages[-1].get("role") == "assistant":
        where = f"messages[{len(messages) - 1}]"
        raise _bad(f"{where}: the last message must not be an assistant message (prefill is not supported)", where)
    return converted


def system_messages(system: Any) -> list[dict[str, Any]]:
    """The top-level ``system`` as the leading system message (none when it is absent or empty)."""
    if system is None:
        return []
    if not isinstance(system, str | list):
        raise _bad("'system' must be a string or an array of text blocks", "system")
    text = _text_of(system, "system", "the system prompt")
    return [{"role": "system", "content": text}] if text else []


def role_and_content(message: Any, where: str) -> tuple[str, Any]:
    """A message's role and content, checked (``where`` names it in errors)."""
    if not isinstance(message, dict):
        raise _bad(f"{where} must be an object", where)
    role = message.get("role")
    if role not in ("user", "assistant", "system"):
        raise _bad(f"{where}.role must be 'user', 'assistant' or 'system', got {role!r}", f"{where}.role")
    content = message.get("content")
    if not isinstance(content, str | list):
        raise _bad(f"{where}.content must be a string or an array of content blocks", f"{where}.content")
    return str(role), content


def convert_content(role: str, content: Any, where: str) -> list[dict[str, Any]]:
    """One message's content as OpenAI messages (a ``system`` one whether or not a later user message clears it)."""
    if role == "user":
        return _user(content, f"{where}.content")
    if role == "assistant":
        return [_assistant(content, f"{where}.content")]
    return [{"role": "system", "content": _system_text(content, f"{where}.content")}]


#: Blocks of a ``role: "system"`` message that change the offered tools (the
#: ``mid-conversation-tool-changes`` beta). Not rendered: the prompt lists the request's ``tools``.
_TOOL_CHANGE_BLOCKS = frozenset({"request_tool_addition", "request_tool_removal"})


def _system_text(content: Any, where: str) -> str:
    """A ``role: "system"`` message's text: its text blocks joined with ``\n``."""
    if isinstance(content, str):
        return content
    blocks = [b for b in _block_list(content, where) if b["type"] not in _TOOL_CHANGE_BLOCKS]
    return _text_of(blocks, where, "a system message")


def _cleared(message: dict[str, Any], later: list[Any]) -> bool:
    """``clear_at: "next_user_message"``: the model no longer sees it once a later user message exists."""
    if not clears_at_next_user(message):
        return False
    return any(isinstance(m, dict) and m.get("role") == "user" for m in later)


def clears_at_next_user(message: dict[str, Any]) -> bool:
    """Whether a ``role: "system"`` message leaves the conversation once a later user message exists."""
    return bool(message.get("clear_at") == "next_user_message")


def convert_tools(tools: Any) -> list[dict[str, Any]]:
    """Custom tools as OpenAI function tools; Anthropic-defined and server tools are refused."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise _bad("'tools' must be an array", "tools")
    converted = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _bad(f"{where} must be an object", where)
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise _bad(
                f"{where}: tool type {kind!r} is an Anthropic-defined or server tool, which this proxy cannot run; "
                "define it as a custom tool (name, description, input_schema)",
                f"{where}.type",
            )
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise _bad(f"{where}.input_schema must be an object", f"{where}.input_schema")
        function: dict[str, Any] = {"name": _string(tool.get("name"), f"{where}.name", empty=False)}
        if tool.get("description") is not None:
            function["description"] = _string(tool["description"], f"{where}.description")
        function["parameters"] = schema
        converted.append({"type": "function", "function": function})
    return validate_tools(converted)


def _thinking(value: Any) -> bool | None:
    if value is None:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _bad("'thinking' must be an object with a 'type'", "thinking")
    # "enabled", "adaptive" and later modes all mean: let the model think.
    return bool(value["type"] != "disabled")


def _stop_sequences(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if (
        not isinstance(value, list)
        or len(value) > MAX_STOP_SEQUENCES
        or not all(isinstance(s, str) and 0 < len(s) <= 256 for s in value)
    ):
        raise _bad(f"'stop_sequences' must be an array of at most {MAX_STOP_SEQUENCES} non-empty strings",
                   "stop_sequences")
    return tuple(value)


def parse_messages_body(
    body: Any,
    *,
    count_only: bool = False,
    messages: list[Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> AnthropicCall:
    """Validate a Messages body; raise :class:`BadRequest` naming the bad field.

    ``count_only`` is for ``/v1/messages/count_tokens``, where ``max_tokens``
    is not sent. Unknown top-level fields are ignored. ``messages`` and
    ``tools``, when given, are the body's conversation and tools converted
    already (``anthropic_messages``); the body's own are then not read.
    """
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = _string(body.get("model"), "model", empty=False)
    max_tokens = body.get("max_tokens")
    if not count_only or max_tokens is not None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise _bad("'max_tokens' is required: an integer of at least 1", "max_tokens")
    stream = body.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    tool_choice = body.get("tool_choice")
    if tool_choice is not None and not (isinstance(tool_choice, dict) and isinstance(tool_choice.get("type"), str)):
        raise _bad("'tool_choice' must be an object with a 'type'", "tool_choice")
    ids: dict[str, str | None] = {}
    for name in ("session_id", "instance_id", "turn_id"):
        value = body.get(name)
        ids[name] = None if value is None else _string(value, name)
    thinking = _thinking(body.get("thinking"))
    if tools is None:
        tools = convert_tools(body.get("tools"))
    if tool_choice is not None and tool_choice["type"] == "none":
        tools = []  # as on chat: the model is offered no tools (the prompt does not list them)
    request = ChatRequest(
        messages=convert_messages(body.get("system"), body.get("messages")) if messages is None else messages,
        tools=tools,
        max_tokens=max_tokens,
        temperature=number_in_range(body, "temperature", 0.0, 1.0),
        top_p=number_in_range(body, "top_p", 0.0, 1.0),
        enable_thinking=thinking,
        stop=_stop_sequences(body.get("stop_sequences")),
        stream=bool(stream),
    )
    return AnthropicCall(request=request, model=model, stream=bool(stream), thinking_shown=bool(thinking), **ids)
