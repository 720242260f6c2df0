"""Tool-call parsers for the text inside one ``<tool_call>`` block (sans-IO).

:class:`~actorproxy.core.parser.OutputParser` finds the blocks (``<tool_call>``
and ``</tool_call>`` are single tokens); a block parser reads the text between
them as it arrives, in fragments of any size, and reports :class:`CallPiece`\\ s
to stream as soon as they are certain enough to send:

* ``qwen3`` (Hermes JSON; Qwen2.5, Qwen3): ``{"name": "f", "arguments": {...}}``.
  A call is announced once its name is complete and its arguments value has
  begun; an arguments object then streams as the model writes it, and the final
  ``arguments`` is that raw text. Arguments given as a JSON string (double
  encoded) are sent whole at the end, decoded once.
* ``qwen3_coder`` (XML; Qwen3-Coder, Qwen3.5):
  ``<function=f>\\n<parameter=k>\\nv\\n</parameter>\\n</function>``. The call is
  announced at ``<function=f>``; the arguments object is built as JSON text, one
  parameter at a time (a string-typed value streams as it grows), each value
  converted by the type the tool's JSON schema gives it.

A block either parses as a whole (:meth:`BlockParser.close` returns the calls)
or not at all (``None``): the caller then returns its raw text as content.
Pieces of a call that later fails may already have been streamed.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any, Literal, Protocol

import attrs

ToolCallFormat = Literal["qwen3", "qwen3_coder"]
TOOL_CALL_FORMATS: tuple[ToolCallFormat, ...] = ("qwen3", "qwen3_coder")

_NON_WS = re.compile(r"[^ \t\r\n]")
_FAILED = object()  # what _loads gives for text that is not JSON


@attrs.frozen
class CallPiece:
    """What to stream about call ``call`` of a block: its name first, then argument text."""

    call: int
    name: str | None = None
    arguments: str = ""


@attrs.frozen
class ParsedCall:
    call: int
    name: str
    #: The JSON text of the arguments object: the concatenation of the call's pieces.
    arguments: str
    parsed: dict[str, Any]


@attrs.frozen
class BlockResult:
    """A well-formed block: the pieces still to stream, then every call in it."""

    pieces: tuple[CallPiece, ...]
    calls: tuple[ParsedCall, ...]


class BlockParser(Protocol):
    def feed(self, text: str) -> list[CallPiece]: ...

    def close(self) -> BlockResult | None: ...


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return _FAILED


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


# -- Hermes / Qwen3 JSON -------------------------------------------------------

_STRING_SPECIAL = re.compile(r'["\\]')
_NESTED_SPECIAL = re.compile(r'["{}\[\]]')
_LITERAL_END = re.compile(r"[,}\]\s]")
_ARGUMENT_KEYS = ("arguments", "parameters")


class HermesBlockParser:
    """``{"name": ..., "arguments": {...}}`` read by an incremental, string-aware scanner.

    The scanner follows the outer object only far enough to know where each
    value begins and ends (depth, strings, escapes); ``json.loads`` of the whole
    block at :meth:`close` is the judge of validity.
    """

    def __init__(self) -> None:
        self.body = ""
        self._pos = 0  # the next character to scan
        self._state = "start"
        self._escaped = False  # the last character scanned inside a string was a backslash
        self._in_string = False  # inside a string nested in an object or array value
        self._depth = 0
        self._key = ""
        self._start = 0  # where the current key or value began
        self._kind = ""  # of the current value: "string", "nested" or "literal"
        self._name: str | None = None
        self._args_key: str | None = None
        self._args_start = -1
        self._args_end = -1
        self._announced = False
        self._sent = 0  # characters of the arguments text streamed

    def feed(self, text: str) -> list[CallPiece]:
        self.body += text
        self._scan()
        if self._name is None or self._args_key is None or self.body[self._args_start] not in '{"':
            return []  # not yet (or never) a call worth announcing
        pieces = []
        if not self._announced:
            self._announced = True
            pieces.append(CallPiece(0, self._name))
        if self.body[self._args_start] == "{":  # an object streams raw; anything else waits for close
            end = self._args_end if self._args_end >= 0 else len(self.body)
            start = self._args_start + self._sent
            if end > start:
                pieces.append(CallPiece(0, None, self.body[start:end]))
                self._sent = end - self._args_start
        return pieces

    def close(self) -> BlockResult | None:
        value = _loads(self.body)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return None
        name: str = value["name"]
        key = next((k for k in _ARGUMENT_KEYS if k in value), None)
        args = value[key] if key is not None else {}
        if key is None:
            text = "{}"
        elif isinstance(args, str):
            text, args = args, _loads(args)
        else:
            raw = self.body[self._args_start : self._args_end] if key == self._args_key else ""
            # The raw text unless the scanner located another value (duplicate keys).
            text = raw if raw and _loads(raw) == args else _dumps(args)
        if not isinstance(args, dict):
            return None
        sent = self.body[self._args_start : self._args_start + self._sent]
        if self._announced and (name != self._name or not text.startswith(sent)):
            return None  # what was streamed is not this call: never let the two disagree
        piece = CallPiece(0, None, text[len(sent) :]) if self._announced else CallPiece(0, name, text)
        return BlockResult((piece,) if piece.name or piece.arguments else (), (ParsedCall(0, name, text, args),))

    # -- the scanner ----------------------------------------------------------

    def _scan(self) -> None:
        body, n = self.body, len(self.body)
        while self._pos < n and self._state != "error":
            if self._state == "key":
                end = self._string_end()
                if end < 0:
                    return
                key = _loads(body[self._start : end + 1])
                self._key = key if isinstance(key, str) else ""
                self._state = "colon"
            elif self._state == "value":
                end = self._value_end()
                if end < 0:
                    return
                self._value_done(end)
                self._state = "after_value"
            else:
                found = _NON_WS.search(body, self._pos)
                if found is None:
                    self._pos = n
                    return
                self._pos = found.start() + 1
                self._structure(body[found.start()], found.start())

    def _structure(self, char: str, at: int) -> None:
        state = self._state
        if state == "start":
            self._state = "object" if char == "{" else "error"
        elif state in ("object", "next_key") and char == '"':
            self._state, self._start = "key", at
        elif state in ("object", "after_value") and char == "}":
            self._state = "done"
        elif state == "after_value" and char == ",":
            self._state = "next_key"
        elif state == "colon" and char == ":":
            self._state = "value_start"
        elif state == "value_start" and char not in ",}]":
            self._start, self._state = at, "value"
            if char == '"':
                self._kind = "string"
            elif char in "{[":
                self._kind, self._depth, self._in_string = "nested", 1, False
            else:
                self._kind, self._pos = "literal", at
            if self._key in _ARGUMENT_KEYS and self._args_key is None:
                self._args_key, self._args_start = self._key, at
        else:
            self._state = "error"

    def _string_end(self) -> int:
        """Index of the closing quote of the string being scanned, or -1 (all scanned)."""
        body, pos = self.body, self._pos
        if self._escaped:
            if pos >= len(body):
                return -1
            pos, self._escaped = pos + 1, False
        while (found := _STRING_SPECIAL.search(body, pos)) is not None:
            at = found.start()
            if body[at] == '"':
                self._pos = at + 1
                return at
            if at + 1 >= len(body):
                self._escaped = True
                break
            pos = at + 2
        self._pos = len(body)
        return -1

    def _value_end(self) -> int:
        """End (exclusive) of the value being scanned, or -1 while it is still open."""
        if self._kind == "string":
            end = self._string_end()
            return end + 1 if end >= 0 else -1
        if self._kind == "literal":
            found = _LITERAL_END.search(self.body, self._pos)
            self._pos = found.start() if found is not None else len(self.body)
            return found.start() if found is not None else -1
        while True:
            if self._in_string:
                if self._string_end() < 0:
                    return -1
                self._in_string = False
            found = _NESTED_SPECIAL.search(self.body, self._pos)
            if found is None:
                self._pos = len(self.body)
                return -1
            char, self._pos = found.group(), found.start() + 1
            if char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    return self._pos

    def _value_done(self, end: int) -> None:
        if self._key == "name" and self._kind == "string" and self._name is None:
            name = _loads(self.body[self._start : end])
            if isinstance(name, str) and name:
                self._name = name
        if self._start == self._args_start:
            self._args_end = end


# -- Qwen3-Coder XML -----------------------------------------------------------

_FUNCTION = "<function="
_FUNCTION_END = "</function>"
_PARAMETER = "<parameter="
_PARAMETER_END = "</parameter>"
#: A string value streams up to this many characters behind what arrived: the end
#: tag with the newline before it (stripped from the value) is never sent.
_HOLD_BACK = len("\n" + _PARAMETER_END) - 1
_NULL_ENDINGS = ("null" + _PARAMETER_END, "null\n" + _PARAMETER_END)
_TYPE_PREFIXES = (
    ("int", "integer"), ("uint", "integer"), ("long", "integer"), ("num", "number"), ("float", "number"),
    ("double", "number"), ("bool", "boolean"), ("obj", "object"), ("dict", "object"), ("arr", "array"),
    ("list", "array"),
)  # fmt: skip


def _schema_types(schema: object) -> list[str]:
    """The non-null JSON types a parameter schema allows, in its order (``[]``: unknown)."""
    if not isinstance(schema, Mapping):
        return []
    kind = schema.get("type")
    if isinstance(kind, str | list):
        kinds = [kind] if isinstance(kind, str) else [k for k in kind if isinstance(k, str)]
    else:
        options = schema.get("anyOf") or schema.get("oneOf")
        return [k for option in options for k in _schema_types(option)] if isinstance(options, list) else []
    named = [next((t for p, t in _TYPE_PREFIXES if k.lower().startswith(p)), k.lower()) for k in kinds]
    return [k for k in named if k != "null"]


def _is_plain_string(schema: object) -> bool:
    return all(kind == "string" for kind in _schema_types(schema))


def convert_parameter(value: str, schema: object) -> Any:
    """An XML parameter value as the JSON value its schema calls for.

    ``null`` (any case) is ``None``; a value that does not fit any allowed type
    stays the string the model wrote (so nothing it wrote is lost); a parameter
    without a schema or type is a string.
    """
    if value.lower() == "null":
        return None
    for kind in _schema_types(schema) or ["string"]:
        if kind == "string":
            return value
        if kind == "boolean":
            word = value.strip().lower()
            if word in ("true", "false"):
                return word == "true"
            continue
        loaded = _loads(value)
        if kind == "integer" and type(loaded) is int:
            return loaded
        if kind == "number" and type(loaded) in (int, float) and math.isfinite(loaded):
            return loaded
        if (kind == "object" and isinstance(loaded, dict)) or (kind == "array" and isinstance(loaded, list)):
            return loaded
    return value


def _escape(text: str) -> str:
    # JSON escaping maps each character on its own, so escaped fragments concatenate.
    return _dumps(text)[1:-1]


class XmlBlockParser:
    """``<function=f>`` with ``<parameter=k>`` blocks, built into JSON text as it arrives.

    Strict about structure: only whitespace between tags, every parameter closed
    by ``</parameter>``, every function by ``</function>``. Several functions may
    share one block. One leading and one trailing newline of a value are dropped.
    """

    def __init__(self, schemas: Mapping[str, Mapping[str, Any]]) -> None:
        self.body = ""
        self._schemas = schemas
        self._pos = 0
        self._state = "between"  # between functions, in a "function", in a parameter "value", "error"
        self._names: list[str] = []
        self._fragments: list[list[str]] = []  # each call's argument text so far
        # The open parameter.
        self._key = ""
        self._schema: object = None
        self._stream = False  # its value is a plain string: stream it as it grows
        self._value_start = 0
        self._content_start = -1  # after the leading newline; -1 until the first character arrives
        self._streamed = -1  # how far the string value was sent; -1 until its opening is sent

    def feed(self, text: str) -> list[CallPiece]:
        self.body += text
        out: list[CallPiece] = []
        while self._state != "error" and (self._value(out) if self._state == "value" else self._tag(out)):
            pass
        return out

    def close(self) -> BlockResult | None:
        if self._state != "between" or not self._names or self.body[self._pos :].strip():
            return None
        calls = []
        for i, (name, fragments) in enumerate(zip(self._names, self._fragments, strict=True)):
            text = "".join(fragments)
            parsed = _loads(text)
            if not isinstance(parsed, dict):
                return None
            calls.append(ParsedCall(i, name, text, parsed))
        return BlockResult((), tuple(calls))

    def _emit(self, out: list[CallPiece], text: str) -> None:
        self._fragments[-1].append(text)
        out.append(CallPiece(len(self._names) - 1, None, text))

    def _tag(self, out: list[CallPiece]) -> bool:
        """Read the next tag; ``False`` when more text is needed (or on error)."""
        body = self.body
        found = _NON_WS.search(body, self._pos)
        if found is None:
            self._pos = len(body)
            return False
        at = self._pos = found.start()
        tags = (_FUNCTION,) if self._state == "between" else (_PARAMETER, _FUNCTION_END)
        tag = next((t for t in tags if body.startswith(t, at)), None)
        if tag is None:
            if not any(t.startswith(body[at:]) for t in tags):  # not even a tag cut short
                self._state = "error"
            return False
        if tag == _FUNCTION_END:
            self._emit(out, "}" if self._fragments[-1] else "{}")
            self._state, self._pos = "between", at + len(tag)
            return True
        close = body.find(">", at + len(tag))
        if close < 0:
            return False
        label = body[at + len(tag) : close].strip()
        if not label or "<" in label or "\n" in label:
            self._state = "error"
            return False
        self._pos = close + 1
        if tag == _FUNCTION:
            self._names.append(label)
            self._fragments.append([])
            out.append(CallPiece(len(self._names) - 1, label))
            self._state = "function"
        else:
            self._key, self._state = label, "value"
            self._schema = self._schemas.get(self._names[-1], {}).get(label)
            self._stream = _is_plain_string(self._schema)
            self._value_start, self._content_start, self._streamed = close + 1, -1, -1
        return True

    def _prefix(self) -> str:
        return ("{" if not self._fragments[-1] else ", ") + _dumps(self._key) + ": "

    def _value(self, out: list[CallPiece]) -> bool:
        """Read the open parameter's value; ``True`` once it closed."""
        body, n = self.body, len(self.body)
        if self._content_start < 0:
            if n <= self._value_start:
                return False
            self._content_start = self._value_start + (body[self._value_start] == "\n")
        end = body.find(_PARAMETER_END, max(self._content_start, self._pos - len(_PARAMETER_END) + 1))
        if end < 0:
            self._pos = n
            if self._stream:
                self._stream_string(out, n - _HOLD_BACK)
            return False
        stop = end - 1 if end > self._content_start and body[end - 1] == "\n" else end
        if self._streamed >= 0:
            self._emit(out, _escape(body[self._streamed : stop]) + '"')
        else:
            value = convert_parameter(body[self._content_start : stop], self._schema)
            self._emit(out, self._prefix() + _dumps(value))
        self._state, self._pos = "function", end + len(_PARAMETER_END)
        return True

    def _stream_string(self, out: list[CallPiece], safe_end: int) -> None:
        if self._streamed < 0:
            head = self.body[self._content_start :].lower()
            if any(ending.startswith(head) for ending in _NULL_ENDINGS):
                return  # it may still be `null`
            self._emit(out, self._prefix() + '"')
            self._streamed = self._content_start
        if safe_end > self._streamed:
            self._emit(out, _escape(self.body[self._streamed : safe_end]))
            self._streamed = safe_end
