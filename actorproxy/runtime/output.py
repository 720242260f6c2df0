"""How a turn's sampled ids become the recorded output: formats, tool-call ids, SGLang's parsers, recompute.

The local parse (``core.parser.OutputParser``) runs token by token inside the
turn; this module holds what surrounds it: the output format a proxy was
started with, the deterministic tool-call ids, the optional remote parse by
SGLang (``--parse-backend sglang_api``/``hybrid``) and the engine's prompt
logprobs for rebuilt replies (``--on-history-rewrite recompute``).
"""

from __future__ import annotations

import hashlib
import logging
from array import array
from collections.abc import Callable
from typing import Any

import attrs
import trio

from ..core.parser import OutputParser, ReasoningFormat, ToolCallFormat
from ..core.records import Step
from ..engines.base import Backend, BackendError
from ..engines.sglang.parse import (
    SGLANG_REASONING_PARSERS,
    SGLANG_TOOL_CALL_PARSERS,
    ParseBackend,
    RemoteParse,
    SGLangParseClient,
    choose_output,
    completion_text,
)
from ..tokenization.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)

#: Seconds SGLang's parsers may take before ``hybrid`` falls back to ours (``sglang_api`` fails).
REMOTE_PARSE_TIMEOUT = 10.0


@attrs.define
class OutputFormat:
    """How sampled ids are parsed: the model's formats and who has the last word on the step."""

    tool_call_format: ToolCallFormat = "qwen3"
    reasoning_format: ReasoningFormat = "qwen3"
    parse_backend: ParseBackend = "local"
    #: SGLang's parsers, for ``sglang_api`` and ``hybrid``.
    client: SGLangParseClient | None = None


def tool_call_id(session_id: str, step_index: int, call_index: int) -> str:
    """A tool-call id that is the same on every re-run of the same session and turn."""
    digest = hashlib.blake2b(f"{session_id}\0{step_index}\0{call_index}".encode(), digest_size=12)
    return "call_" + digest.hexdigest()


async def parse_remotely(
    fmt: OutputFormat,
    tokenizer: ChatTokenizer,
    step: Step,
    parser: OutputParser,
    tools: list[dict[str, Any]],
    reasoning_open: bool,
    call_id: Callable[[int], str],
) -> None:
    """Let SGLang's parsers decide the recorded output of a reply that does not stream (``sglang_api``; ``hybrid``
    falls back to ours).

    A streamed reply is not asked about: its agent acts on the local parse it was streamed, which its step keeps
    (``TurnGeneration``). Raises :class:`BackendError` when ``sglang_api``
    cannot parse.
    """
    assert fmt.client is not None
    text = completion_text(tokenizer, step.output_ids, reasoning_open=reasoning_open)
    remote: RemoteParse | BackendError | None
    remote = BackendError(f"SGLang parse: timed out after {REMOTE_PARSE_TIMEOUT:g} s", status=504)
    with trio.move_on_after(REMOTE_PARSE_TIMEOUT):
        try:
            remote = await fmt.client.parse(
                text,
                tools,
                tool_call_parser=SGLANG_TOOL_CALL_PARSERS[fmt.tool_call_format],
                reasoning_parser=SGLANG_REASONING_PARSERS.get(fmt.reasoning_format),
            )
        except BackendError as exc:
            remote = exc
    outcome = choose_output(
        fmt.parse_backend,
        text=text,
        local=parser.output,
        local_error=parser.tool_call_parse_error,
        remote=remote,
        tool_call_id=call_id,
        stopped=parser.stopped,
    )
    if outcome.fallback:
        log.warning("session %s step %d: parsed locally: %s", step.session_id, step.index, outcome.fallback)
    step.output = outcome.output
    step.tool_call_parse_error = outcome.tool_call_parse_error


async def recompute_logprobs(backend: Backend, step: Step, input_ids: array[int]) -> None:
    """Fill the rebuilt replies' logprobs from the engine's prompt logprobs (left 0.0 and flagged if not)."""
    if not step.rebuilt_spans or step.fragment_logprobs is None:
        return
    try:
        values = await backend.prompt_logprobs(input_ids)
    except (BackendError, NotImplementedError) as exc:
        log.warning("session %s step %d: prompt logprobs failed (%s); the rebuilt replies keep 0.0",
                    step.session_id, step.index, exc)
        return
    if len(values) != len(input_ids):
        log.warning("session %s step %d: the engine returned %d prompt logprobs for %d tokens",
                    step.session_id, step.index, len(values), len(input_ids))
        return
    for start, end in step.rebuilt_spans:
        for i in range(start, end):
            value = values[i]
            step.fragment_logprobs[i] = 0.0 if value is None else value
    step.logprobs_recomputed = True
    step.logprobs_invalid = False
