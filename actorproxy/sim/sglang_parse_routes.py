"""SGLang's native parsing endpoints over the simulated server: ``/parse_function_call`` and ``/separate_reasoning``.

The wire shapes are SGLang's (``sglang/srt/entrypoints/http_server.py``, the
``ParseFunctionCallReq`` / ``SeparateReasoningReqInput`` of ``io_struct.py``):

* ``POST /separate_reasoning`` ``{"text", "reasoning_parser"}`` →
  ``{"reasoning_text", "text"}``;
* ``POST /parse_function_call`` ``{"text", "tool_call_parser", "tools"}`` →
  ``{"normal_text", "calls": [{"tool_index", "name", "parameters"}]}``, where
  ``parameters`` is the arguments' JSON text.

The parsing itself is ours, sans-IO and on text (:func:`separate_reasoning`,
:func:`parse_function_call`), following what SGLang's parsers do:

* reasoning (``qwen3``): everything up to ``</think>`` is reasoning, with or
  without a ``<think>`` in front (the prompt may have opened the block); text
  with neither tag is all normal text. Reasoning never closed ends at a
  ``<tool_call>`` (as newer SGLang builds do), else runs to the end of the text.
  ``qwen3-thinking`` and ``deepseek-r1`` treat untagged text as reasoning.
* tool calls (``qwen25``, alias ``qwen``): Hermes ``<tool_call>\\n{...}\\n</tool_call>``
  blocks of JSON (an object, or a list of them); ``tool_index`` is the tool's
  position in ``tools``. ``qwen3_coder``: ``<function=f><parameter=k>v</parameter></function>``
  inside ``<tool_call>`` blocks, each value converted by the tool's JSON schema;
  ``tool_index`` counts the calls.

As SGLang does by default, calls that do not parse, and calls of functions not
in ``tools``, are dropped without a word (a dropped JSON block's text is lost;
an XML function not in ``tools`` stays in the text). Without tools nothing is a
call. ``normal_text`` is the text without its tool-call blocks, stripped (SGLang's
``qwen25`` keeps only the text before the first block; text between or after
blocks is rare, and keeping it is what our own parser does).

Errors have the shape of SGLang's ``ErrorResponse`` (``{"object": "error",
"message", "type", "param", "code"}``): 400 for a malformed request or an
unknown parser name (SGLang's native endpoints let the ``ValueError`` of an
unknown name escape as a bare HTTP 500), 500 for an injected fault
(``faults.fail_next_parses``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from typing import Any, TypeVar

from quart import Blueprint, Response

from ..core.parser import tool_schemas
from ..core.tool_parsers import convert_parameter
from ..engines.sglang.protocol import (
    ParseFunctionCallOutput,
    ParseFunctionCallReq,
    SeparateReasoningOutput,
    SeparateReasoningReqInput,
    ToolCallItem,
)
from ..errors import BadRequest
from ..schema.converter import CONVERTER, structure
from ..tokenization.tokenizer import THINK_END, THINK_START, TOOL_CALL_START
from .state import SimState
from .wire import json_response, read_json

T = TypeVar("T")

#: Reasoning parser name → whether text without think tags is reasoning (SGLang's ``force_reasoning``).
REASONING_PARSERS: Mapping[str, bool] = {"qwen3": False, "qwen3-thinking": True, "deepseek-r1": True}
#: Reasoning parsers for which a ``<tool_call>`` ends reasoning that was never closed (newer SGLang builds).
_TOOL_CALL_ENDS_REASONING = frozenset({"qwen3", "qwen3-thinking"})
JSON_TOOL_CALL_PARSERS = frozenset({"qwen25", "qwen"})
XML_TOOL_CALL_PARSERS = frozenset({"qwen3_coder"})
TOOL_CALL_PARSERS = JSON_TOOL_CALL_PARSERS | XML_TOOL_CALL_PARSERS


class UnknownParser(ValueError):
    """A parser name SGLang would not know."""


def check_reasoning_parser(name: object) -> str:
    if not isinstance(name, str) or name not in REASONING_PARSERS:
        raise UnknownParser(f"Unsupported reasoning parser: {name!r}; known: {sorted(REASONING_PARSERS)}")
    return name


def check_tool_call_parser(name: object) -> str:
    if not isinstance(name, str) or name not in TOOL_CALL_PARSERS:
        raise UnknownParser(f"Unsupported tool_call_parser: {name!r}; known: {sorted(TOOL_CALL_PARSERS)}")
    return name


# -- reasoning (sans-IO) ----------------------------------------------------------------


def separate_reasoning(text: str, parser: str) -> tuple[str, str]:
    """``(reasoning_text, text)`` as SGLang's reasoning parser ``parser`` splits ``text``.

    Reasoning is stripped at its start, the text after ``</think>`` at both
    ends; text that is not reasoning at all comes back unchanged.
    """
    if not (REASONING_PARSERS[check_reasoning_parser(parser)] or THINK_START in text or THINK_END in text):
        return "", text
    body = text.replace(THINK_START, "").strip()
    reasoning, found, rest = body.partition(THINK_END)
    if not found:
        call_at = body.find(TOOL_CALL_START) if parser in _TOOL_CALL_ENDS_REASONING else -1
        if call_at >= 0:  # a call without closing </think> (Qwen3.5 does it): the call is not reasoning
            return body[:call_at].strip(), body[call_at:]
        return body, ""  # cut short before </think>: all of it is reasoning
    return reasoning, rest.strip()


# -- tool calls (sans-IO) ---------------------------------------------------------------

# SGLang's qwen25 detector needs the newlines around the JSON.
_JSON_BLOCK = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)
_XML_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_XML_FUNCTION = re.compile(r"<function=(.*?)(?:</function>|\Z)", re.DOTALL)
_XML_PARAMETER = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _tool_names(tools: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Function name → its index in ``tools`` (the last one of a repeated name, as SGLang's dict does)."""
    names: dict[str, int] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        if isinstance(name, str) and name:
            names[name] = i
    return names


def _json_calls(text: str, tools: Sequence[Mapping[str, Any]]) -> tuple[str, list[ToolCallItem]]:
    indexes = _tool_names(tools)
    calls: list[ToolCallItem] = []
    for block in _JSON_BLOCK.finditer(text):
        try:
            value = json.loads(block.group(1).strip())
        except ValueError:
            continue  # SGLang logs it and drops the call
        for action in value if isinstance(value, list) else [value]:
            name = action.get("name") if isinstance(action, dict) else None
            if not isinstance(name, str) or name not in indexes:
                continue  # not a call, or a function the request does not offer
            arguments = action.get("parameters") or action.get("arguments", {})
            calls.append(
                ToolCallItem(tool_index=indexes[name], name=name, parameters=json.dumps(arguments, ensure_ascii=False))
            )
    return _JSON_BLOCK.sub("", text).strip(), calls


def _xml_function(body: str, schemas: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """``(name, arguments)`` of one ``<function=...>`` body, ``None`` if it is not a call of ``tools``."""
    name, found, params = body.partition(">")
    if not found or name not in schemas:
        return None
    arguments: dict[str, Any] = {}
    for match in _XML_PARAMETER.finditer(params):
        key, found, value = match.group(1).partition(">")
        if not found:
            continue
        value = value.removeprefix("\n").removesuffix("\n")
        arguments[key] = convert_parameter(value, schemas[name].get(key))
    return name, arguments


def _xml_calls(text: str, tools: Sequence[Mapping[str, Any]]) -> tuple[str, list[ToolCallItem]]:
    schemas = tool_schemas(tools)
    calls: list[ToolCallItem] = []
    kept: list[str] = []  # the normal text, piece by piece
    end = 0
    for block in _XML_BLOCK.finditer(text):
        kept.append(text[end : block.start()])
        end = block.end()
        content = block.group(1)
        functions = list(_XML_FUNCTION.finditer(content))
        accepted = []
        for function in functions:
            call = _xml_function(function.group(1), schemas)
            if call is not None:
                name, arguments = call
                parameters = json.dumps(arguments, ensure_ascii=False)
                calls.append(ToolCallItem(tool_index=len(calls), name=name, parameters=parameters))
                accepted.append(function)
        if not accepted or len(accepted) < len(functions):
            # A function not offered is prose, not a call: the block stays, minus the calls taken from it.
            literal = block.group(0)
            offset = len("<tool_call>")
            for function in reversed(accepted):
                literal = literal[: offset + function.start()] + literal[offset + function.end() :]
            kept.append(literal)
    kept.append(text[end:])
    return "".join(kept).strip(), calls


def parse_function_call(text: str, tools: Sequence[Mapping[str, Any]], parser: str) -> tuple[str, list[ToolCallItem]]:
    """``(normal_text, calls)`` as SGLang's tool-call parser ``parser`` reads ``text``."""
    check_tool_call_parser(parser)
    if not tools:
        return text, []
    if parser in XML_TOOL_CALL_PARSERS:
        return _xml_calls(text, tools)
    return _json_calls(text, tools)


# -- the routes --------------------------------------------------------------------------


def _error(message: str, status: HTTPStatus, param: str | None = None) -> Response:
    body = {"object": "error", "message": message, "type": status.phrase, "param": param, "code": status.value}
    return json_response(body, status.value)


def parse_blueprint(state: SimState) -> Blueprint:
    """SGLang's ``/parse_function_call`` and ``/separate_reasoning``."""
    bp = Blueprint("sglang_parse", __name__)

    @bp.errorhandler(BadRequest)
    async def _bad(error: BadRequest) -> Response:
        return _error(error.message, HTTPStatus(error.status), error.param)

    @bp.errorhandler(UnknownParser)
    async def _unknown(error: UnknownParser) -> Response:
        return _error(str(error), HTTPStatus.BAD_REQUEST)

    def _failed() -> Response | None:
        if state.faults.take_parse_failure():
            return _error("simulated parse failure (injected fault)", HTTPStatus.INTERNAL_SERVER_ERROR)
        return None

    async def _read(path: str, kind: type[T]) -> T:
        """The request body, kept in ``state.parse_requests`` (tests read what was asked), structured."""
        raw = await read_json()
        state.parse_requests.append((path, raw))
        return structure(raw, kind)

    def post(path: str, kind: type[T], answer: Callable[[T], object]) -> None:
        """A parse route: its body structured as ``kind``, answered with ``answer(body)`` unless a failure is
        injected (a bad parser name is a 400 first: ``answer`` raises it and leaves the fault armed)."""

        async def route() -> Response:
            output = answer(await _read(path, kind))
            if (failure := _failed()) is not None:
                return failure
            return json_response(CONVERTER.unstructure(output))

        bp.add_url_rule(path, path.strip("/"), route, methods=["POST"])

    def function_calls(body: ParseFunctionCallReq) -> ParseFunctionCallOutput:
        parser = check_tool_call_parser(body.tool_call_parser)
        tools = [CONVERTER.unstructure(tool) for tool in body.tools or ()]
        return ParseFunctionCallOutput(*parse_function_call(body.text, tools, parser))

    def reasoning(body: SeparateReasoningReqInput) -> SeparateReasoningOutput:
        return SeparateReasoningOutput(*separate_reasoning(body.text, check_reasoning_parser(body.reasoning_parser)))

    post("/parse_function_call", ParseFunctionCallReq, function_calls)
    post("/separate_reasoning", SeparateReasoningReqInput, reasoning)
    return bp
