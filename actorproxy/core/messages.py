"""Chat messages as the proxy compares them: by meaning, not by bytes.

Agents echo the assistant turns we returned, but rarely byte for byte: tool
arguments come back re-serialised or with the tool schema's defaults filled in,
``reasoning_content`` is dropped, ``content: null`` becomes ``""``. The
append-only check therefore compares
messages through :func:`message_key` (context messages) and
:func:`echo_matches` (an assistant turn we generated).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import orjson


@attrs.frozen
class ToolCall:
    """A parsed tool call: ``arguments`` is the JSON text, ``parsed`` its value."""

    id: str
    name: str
    arguments: str
    parsed: Any = attrs.field(eq=False, default=None)

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@attrs.frozen
class AssistantOutput:
    """What a generation meant: the parsed reply we returned to the agent."""

    content: str
    reasoning: str
    tool_calls: tuple[ToolCall, ...]
    #: Tool name -> the JSON schemas of its parameters (``parameters.properties``) in the request
    #: that produced this reply: an echoed call is compared under them (see :func:`echo_matches`).
    schemas: Mapping[str, Mapping[str, Any]] = attrs.field(factory=dict, eq=False, repr=False)


def content_text(content: Any) -> str:
    """The text of an OpenAI ``content`` field: a string, ``None`` or a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        # Joined as the chat template joins them, so a key matches what is rendered.
        return "\n".join(
            part.get("text", "") for part in content if isinstance(part, Mapping) and part.get("type") == "text"
        )
    return ""


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, TypeError, RecursionError):  # not JSON, or nested past the parser's recursion
        return text.strip()


#: Nesting past which a value is keyed as never equal to another (no real message nests this deep).
_KEY_DEPTH = 100


class _TooDeep(Exception):
    pass


def _frozen(value: Any, depth: int = 0) -> Any:
    """``value`` (a JSON value, or whatever a client sent) as a hashable value that compares as it did.

    Objects become frozensets of their items, arrays tuples: equal exactly when the
    values were (``==``), and usable in a conversation's key (a dict key, a set).
    """
    if isinstance(value, dict):
        if depth >= _KEY_DEPTH:
            raise _TooDeep
        return frozenset((_frozen(k, depth + 1), _frozen(v, depth + 1)) for k, v in value.items())
    if isinstance(value, list | tuple):
        if depth >= _KEY_DEPTH:
            raise _TooDeep
        return tuple(_frozen(v, depth + 1) for v in value)
    try:
        hash(value)
    except TypeError:  # no JSON value, but never a reason to fail a session: equal only to itself
        return object()
    return value


def _key_value(value: Any) -> Any:
    """A message field's value in a key: hashable; nested past :data:`_KEY_DEPTH`, equal to nothing else."""
    try:
        return _frozen(value)
    except _TooDeep:
        return object()


def _arguments_key(raw: Any) -> Any:
    """A call's arguments in a key: their JSON value, whether sent as JSON text or as an object."""
    text = _tool_call_arguments(raw)
    try:
        return _frozen(_json_value(text))
    except _TooDeep:
        return ("text", text.strip())  # nested deeper than any real call: compared as text


def _split_inline_reasoning(content: str) -> tuple[str, str]:
    """Split ``<think>r</think>c`` echoed inside content into ``(r, c)``."""
    if "</think>" not in content:
        return "", content
    head, _, tail = content.partition("</think>")
    return head.split("<think>")[-1], tail


def _tool_call_arguments(raw: Any) -> str:
    if isinstance(raw, str):
        return raw
    try:
        return json.dumps(raw, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # not a JSON value (the embedded API checks nothing)
        return f"<{type(raw).__name__}>"


def _call_key(call: Any) -> tuple[str, Any]:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        function = {}
    return (str(function.get("name", "")), _arguments_key(function.get("arguments", "")))


def message_key(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """A comparable summary of a context message (what the template renders).

    Every part is hashable whatever the client sent (a conversation is known by the keys
    of its first messages): tool-call arguments key as their JSON value, the same whether
    sent as JSON text or as an object.
    """
    role = _key_value(message.get("role"))
    if role == "assistant":
        calls = message.get("tool_calls")
        calls = tuple(_call_key(call) for call in calls) if isinstance(calls, list | tuple) else ()
        reasoning, content = _split_inline_reasoning(content_text(message.get("content")))
        return (role, content.strip(), calls)
    return (
        role,
        content_text(message.get("content")),
        _key_value(message.get("tool_call_id")),
        _key_value(message.get("name")),
    )


def with_defaults(value: Any, properties: Mapping[str, Any] | None) -> Any:
    """``value`` (a call's parsed arguments) with the defaults its schema's ``properties`` declare filled in.

    Nested objects (``properties`` of a property) and arrays (``items``) are filled
    too. Agents echo calls that way: Claude Code parses a call's input against the
    tool's schema and sends back ``"replace_all": false`` the model never wrote.
    """
    if not isinstance(value, dict) or not isinstance(properties, Mapping):
        return value
    filled = {}
    for name, item in value.items():
        schema = properties.get(name)
        filled[name] = _fill(item, schema) if isinstance(schema, Mapping) else item
    for name, schema in properties.items():
        if name not in filled and isinstance(schema, Mapping) and "default" in schema:
            filled[name] = _fill(schema["default"], schema)
    return filled


def _fill(value: Any, schema: Mapping[str, Any]) -> Any:
    if isinstance(value, dict):
        return with_defaults(value, schema.get("properties"))
    items = schema.get("items")
    if isinstance(value, list) and isinstance(items, Mapping):
        return [_fill(v, items) for v in value]
    return value


def _same_value(a: Any, b: Any) -> bool:
    """JSON equality where ``1 == 1.0`` but ``true != 1`` (Python's ``==`` conflates bools and numbers)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _reasoning_as_text(text: str, output: AssistantOutput) -> bool:
    """The echo's text is our reasoning written as plain text, then our text (Qwen Code's Responses mode)."""
    reasoning = output.reasoning.strip()
    text = text.strip()
    return bool(reasoning) and text.startswith(reasoning) and text[len(reasoning) :].strip() == output.content.strip()


def echo_tolerance(message: Mapping[str, Any], output: AssistantOutput) -> tuple[str, ...] | None:
    """How ``message`` echoes the assistant turn we produced: ``None`` if it does not.

    Otherwise the rewrites that were tolerated, each at most once:
    ``"reformatted"`` (arguments differ as text but not as JSON values: key order,
    spacing, ``1`` against ``1.0``, escapes), ``"defaults_added"`` (equal only
    once the tool schema's defaults are applied to both sides) and ``"reasoning_as_text"``
    (the reasoning written as the message's text, before our text). Text is compared
    trimmed; reasoning may be dropped (or echoed inline in ``content``); tool calls
    must agree in number, id (when the echo has one), name and arguments.
    """
    if message.get("role") != "assistant":
        return None
    tolerated: set[str] = set()
    inline_reasoning, content = _split_inline_reasoning(content_text(message.get("content")))
    if content.strip() != output.content.strip():
        if not _reasoning_as_text(content, output):
            return None
        tolerated.add("reasoning_as_text")
    reasoning = message.get("reasoning_content") or message.get("reasoning") or inline_reasoning
    if isinstance(reasoning, str) and reasoning.strip() and reasoning.strip() != output.reasoning.strip():
        return None
    echoed = message.get("tool_calls") or []
    if len(echoed) != len(output.tool_calls):
        return None
    for call, ours in zip(echoed, output.tool_calls, strict=True):
        function = call.get("function") or {}
        if call.get("id") and call.get("id") != ours.id:
            return None
        if function.get("name") != ours.name:
            return None
        text = _tool_call_arguments(function.get("arguments", ""))
        if text == ours.arguments:
            continue
        theirs, mine = _json_value(text), _json_value(ours.arguments)
        if _same_value(theirs, mine):
            tolerated.add("reformatted")
            continue
        properties = output.schemas.get(ours.name)
        if properties is None or not _same_value(with_defaults(theirs, properties), with_defaults(mine, properties)):
            return None
        tolerated.add("defaults_added")
    return tuple(sorted(tolerated))


def echo_matches(message: Mapping[str, Any], output: AssistantOutput) -> bool:
    """Whether ``message`` is the agent's echo of the assistant turn we produced (see :func:`echo_tolerance`)."""
    return echo_tolerance(message, output) is not None


def tools_key(tools: Sequence[Mapping[str, Any]] | None) -> str:
    """Canonical JSON of a tool list: equal keys mean the template renders the same tools."""
    if not tools:
        return ""
    try:  # every turn repeats the tools (tens of KB for a coding agent): orjson writes them ~10x faster
        return orjson.dumps(list(tools), option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:  # what orjson cannot write (an integer past 64 bits): keys are only compared with keys
        return json.dumps(list(tools), sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def output_as_message(output: AssistantOutput) -> dict[str, Any]:
    """The OpenAI assistant message for an output; ``content`` is null for a bare tool call."""
    content = output.content if (output.content or not output.tool_calls) else None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if output.reasoning:
        message["reasoning_content"] = output.reasoning
    if output.tool_calls:
        message["tool_calls"] = [call.to_openai() for call in output.tool_calls]
    return message
