"""Parsing by SGLang's own parsers, and the choice between that parse and ours.

SGLang serves the reasoning and tool-call parsers of its OpenAI API as two
native one-shot endpoints (``sglang/srt/entrypoints/http_server.py``):

* ``POST /separate_reasoning`` ``{"text", "reasoning_parser"}`` →
  ``{"reasoning_text", "text"}``.
* ``POST /parse_function_call`` ``{"text", "tool_call_parser", "tools"}`` →
  ``{"normal_text", "calls": [{"tool_index", "name", "parameters"}]}``, where
  ``parameters`` is the arguments' JSON text. Without tools it finds no calls.

:class:`SGLangParseClient` calls them; :func:`choose_output` (sans-IO) decides,
for the ``local | sglang_api | hybrid`` parse backends, which parse becomes a
step's output. Both endpoints parse finished text only: streamed deltas always
come from the local parser.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import attrs
import orjson

from ...core.messages import AssistantOutput, ToolCall
from ...core.tool_parsers import ToolCallFormat
from ...errors import BadRequest
from ...schema.converter import CONVERTER, structure
from ...tokenization.tokenizer import THINK_START, TOOL_CALL_START
from ..base import BackendError
from ..connection import EngineOptions, make_streams, request_json
from .protocol import (
    Function,
    ParseFunctionCallOutput,
    ParseFunctionCallReq,
    SeparateReasoningOutput,
    SeparateReasoningReqInput,
    Tool,
)

if TYPE_CHECKING:
    from ...tokenization.tokenizer import ChatTokenizer

T = TypeVar("T")
ParseBackend = Literal["local", "sglang_api", "hybrid"]
PARSE_BACKENDS: tuple[ParseBackend, ...] = ("local", "sglang_api", "hybrid")

#: SGLang's name for the parser of each of our tool-call formats (``qwen25`` is
#: the Hermes/Qwen JSON detector; newer builds also call it ``qwen``).
SGLANG_TOOL_CALL_PARSERS: Mapping[ToolCallFormat, str] = {
    "qwen3": "qwen25", "qwen3_coder": "qwen3_coder", "glm45": "glm45", "deepseek_v31": "deepseekv31",
    "kimi_k2": "kimi_k2", "llama3": "llama3", "gpt_oss": "gpt-oss",
}  # fmt: skip
SGLANG_REASONING_PARSER = "qwen3"
#: Our ``--model-reasoning-type`` -> SGLang's ``--reasoning-parser`` (``none``: not separated).
SGLANG_REASONING_PARSERS: Mapping[str, str] = {
    "qwen3": "qwen3", "glm45": "glm45", "deepseek_v31": "deepseek-v3", "kimi_k2": "kimi", "deepseek_r1": "deepseek-r1",
    "gpt_oss": "gpt-oss",
}  # fmt: skip


@attrs.frozen
class RemoteParse:
    """What SGLang's parsers made of a generation."""

    reasoning: str
    content: str
    #: ``(name, arguments JSON text)`` per call, in order.
    calls: tuple[tuple[str, str], ...]


@attrs.frozen
class ParseOutcome:
    output: AssistantOutput
    tool_call_parse_error: bool
    source: Literal["local", "sglang"]
    #: Why a ``hybrid`` parse fell back to the local one.
    fallback: str | None = None


def completion_text(tokenizer: ChatTokenizer, output_ids: Sequence[int], *, reasoning_open: bool = False) -> str:
    """A generation's text as SGLang's parsers expect it.

    Special tokens (``<|im_end|>``) are dropped as ``skip_special_tokens`` does;
    ``<think>`` is put back in front when the prompt opened the block, since
    SGLang's ``qwen3`` reasoning parser only sees reasoning after that tag.
    """
    text = tokenizer.decode([t for t in output_ids if t not in tokenizer.special_ids])
    return THINK_START + text if reasoning_open and tokenizer.think_start_id is not None else text


def _sglang_tool(tool: Mapping[str, Any]) -> Tool:
    # Only the fields SGLang's Tool/Function models know; some builds reject others.
    function = tool.get("function", tool)
    return Tool(Function(function.get("name"), function.get("description"), function.get("parameters")))


def _answer(answer: object, cls: type[T], what: str) -> T:
    """An endpoint's answer as ``cls``; a :class:`BackendError` if it is not one."""
    try:
        return structure(answer, cls)
    except BadRequest as exc:
        kind = "call" if (exc.param or "").startswith("calls[") else "response"
        raise BackendError(f"{what}: unexpected {kind} ({exc.message}): {str(answer)[:200]}") from None


class SGLangParseClient:
    """Client of SGLang's ``/separate_reasoning`` and ``/parse_function_call``.

    Every failure (transport, HTTP status, unexpected body) is a :class:`BackendError`.
    """

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.http = make_streams(self.base_url, EngineOptions(read_timeout=60.0))

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> SGLangParseClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def separate_reasoning(self, text: str, parser_name: str) -> tuple[str, str]:
        """``(reasoning, content)`` of ``text`` by SGLang's reasoning parser ``parser_name``."""
        what = "SGLang /separate_reasoning"
        body = CONVERTER.unstructure(SeparateReasoningReqInput(text, parser_name))
        answer = await request_json(self.http, "POST", self.base_url + "/separate_reasoning", what, body=body)
        output = _answer(answer, SeparateReasoningOutput, what)
        return output.reasoning_text or "", output.text or ""

    async def parse_tool_calls(
        self, text: str, tools: Sequence[Mapping[str, Any]], parser_name: str
    ) -> tuple[str, list[tuple[str, str]]]:
        """``(normal_text, [(name, arguments JSON text), ...])`` by SGLang's tool-call parser."""
        what = "SGLang /parse_function_call"
        request = ParseFunctionCallReq(text, parser_name, [_sglang_tool(t) for t in tools])
        body = CONVERTER.unstructure(request)
        answer = await request_json(self.http, "POST", self.base_url + "/parse_function_call", what, body=body)
        output = _answer(answer, ParseFunctionCallOutput, what)
        calls = []
        for call in output.calls:
            if not call.name:
                raise BackendError(f"{what}: unexpected call {call!r:.200}")
            params = call.parameters
            calls.append((call.name, params if isinstance(params, str) else json.dumps(params, ensure_ascii=False)))
        return output.normal_text, calls

    async def parse(
        self,
        text: str,
        tools: Sequence[Mapping[str, Any]],
        *,
        tool_call_parser: str,
        reasoning_parser: str | None = SGLANG_REASONING_PARSER,
    ) -> RemoteParse:
        """Reasoning first, then tool calls in what follows it (as SGLang's chat API does)."""
        # Without think tags there is no reasoning to separate; some SGLang builds would
        # otherwise take untagged text for reasoning (their chat API guards this, the endpoint does not).
        reasoning, rest = "", text
        if reasoning_parser and ("<think>" in text or "</think>" in text):
            reasoning, rest = await self.separate_reasoning(text, reasoning_parser)
        if not tools:  # SGLang finds no calls without tools: spare the round trip
            return RemoteParse(reasoning, rest, ())
        content, calls = await self.parse_tool_calls(rest, tools, tool_call_parser)
        return RemoteParse(reasoning, content, tuple(calls))


def choose_output(
    mode: ParseBackend,
    *,
    text: str,
    local: AssistantOutput,
    local_error: bool,
    remote: RemoteParse | BackendError | None,
    tool_call_id: Callable[[int], str],
    stopped: bool = False,
) -> ParseOutcome:
    """The output a non-streamed reply returns and its step records (a streamed one keeps the local parse).

    ``local``: the local parse. ``sglang_api``: SGLang's parse (``remote``); its
    failure is raised. ``hybrid``: SGLang's parse, the local one if it failed.
    A reply cut by a ``stop`` sequence always takes the local parse (SGLang's
    parsers know nothing of it). When SGLang found the same calls as we did
    (names and parsed arguments), our calls are kept, with their ids and the
    raw arguments the model wrote. ``text`` is :func:`completion_text`.
    """
    if mode == "local" or stopped:
        return ParseOutcome(local, local_error, "local")
    if isinstance(remote, RemoteParse):
        try:
            return _from_remote(text, local, remote, tool_call_id)
        except BackendError as exc:
            remote = exc
    problem = remote if remote is not None else BackendError("SGLang parse: no result")
    if mode == "hybrid":
        return ParseOutcome(local, local_error, "local", fallback=str(problem))
    raise problem


def _from_remote(
    text: str, local: AssistantOutput, remote: RemoteParse, tool_call_id: Callable[[int], str]
) -> ParseOutcome:
    found = []
    for name, arguments in remote.calls:
        try:
            parsed = orjson.loads(arguments)
        except ValueError:
            parsed = None
        if not isinstance(parsed, dict):
            raise BackendError(f"SGLang parse: arguments of {name!r} are not a JSON object: {arguments[:200]!r}")
        found.append((name, arguments, parsed))
    if [(c.name, c.parsed) for c in local.tool_calls] == [(name, parsed) for name, _, parsed in found]:
        calls = local.tool_calls
    else:
        calls = tuple(ToolCall(tool_call_id(i), name, args, parsed) for i, (name, args, parsed) in enumerate(found))
    # SGLang drops calls it cannot parse without saying so: more blocks than calls is the sign.
    blocks = text.count(TOOL_CALL_START) - remote.reasoning.count(TOOL_CALL_START)
    output = AssistantOutput(remote.content.strip(), remote.reasoning.strip(), calls, schemas=local.schemas)
    return ParseOutcome(output, blocks > len(calls), "sglang")
