"""Streaming parser from sampled token ids to reasoning, content and tool calls.

It works on token ids, not text: ``<think>``, ``</think>``, ``<tool_call>`` and
``</tool_call>`` are single tokens in the Qwen vocabulary, so a tag can never
be split across stream chunks. Text between them is decoded incrementally
(exact across multi-byte characters). Feeding a generation in any chunking and
then calling :meth:`OutputParser.finish` gives the same result as feeding it at
once: that is what makes streamed and non-streamed replies identical.

Whitespace rule (as the reference parsers do): reasoning and content are
stripped at both ends. While streaming, trailing whitespace is held back until
more text follows, so the concatenated deltas equal the final strings.

A tool call that does not parse is never dropped: its raw text goes back as
content and :attr:`OutputParser.tool_call_parse_error` is set.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

import attrs

from ..tokenization.detokenize import IncrementalDetokenizer
from ..tokenization.tokenizer import TOOL_CALL_END, TOOL_CALL_START, ChatTokenizer
from .messages import AssistantOutput, ToolCall


@attrs.frozen
class ToolCallDelta:
    """A piece of a streamed tool call.

    The first piece of call ``index`` carries its ``id`` and ``name``; the
    ``arguments`` fragments of all pieces of a call concatenate to the final
    call's ``arguments`` exactly.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@attrs.frozen
class OutputDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class _Stripped:
    """Accumulates text, emitting it stripped at both ends (trailing space held back)."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self._pending = ""
        self._started = False

    def push(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            if not text:
                return ""
            self._started = True
        combined = self._pending + text
        emitted = combined.rstrip()
        self._pending = combined[len(emitted) :]
        if emitted:
            self.parts.append(emitted)
        return emitted

    @property
    def text(self) -> str:
        return "".join(self.parts)


class OutputParser:
    """Parse one generation's token ids as they arrive (Qwen3 / Hermes formats)."""

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        tool_call_id: Callable[[int], str],
        reasoning_open: bool = False,
        stop: tuple[str, ...] = (),
    ) -> None:
        self._tok = tokenizer
        self._tool_call_id = tool_call_id
        self._mode = "reasoning" if reasoning_open and tokenizer.think_end_id is not None else "content"
        self._detok = IncrementalDetokenizer(tokenizer)
        self._reasoning = _Stripped()
        self._content = _Stripped()
        self._call_body: list[str] = []
        self._calls: list[ToolCall] = []
        self.tool_call_parse_error = False
        self._skip = tokenizer.special_ids
        self._stop = StopMatcher(stop) if stop else None

    @property
    def stop_sequence(self) -> str | None:
        """The ``stop`` sequence that ended the reply, if one did."""
        return self._stop.matched if self._stop is not None else None

    @property
    def stopped(self) -> bool:
        """A ``stop`` sequence appeared in the content: the caller should end the generation."""
        return self._stop is not None and self._stop.hit

    def _push_content(self, text: str) -> str:
        # Stop sequences match the raw text; stripping comes after, so a reply cut
        # by a stop sequence is trimmed like any other.
        if self._stop is not None:
            text = self._stop.push(text)
        return self._content.push(text)

    # -- feeding ------------------------------------------------------------

    def feed(self, token_ids: Iterable[int]) -> OutputDelta:
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ToolCallDelta] = []
        tok = self._tok
        for tid in token_ids:
            if self.stopped:
                break  # a stop sequence ended the reply: later tokens are not shown
            if tid == tok.think_start_id and self._mode != "tool":
                self._flush_into(reasoning, content)
                self._mode = "reasoning"
            elif tid == tok.think_end_id and self._mode == "reasoning":
                self._flush_into(reasoning, content)
                self._mode = "content"
            elif tid == tok.tool_call_start_id and self._mode != "tool":
                self._flush_into(reasoning, content)
                self._mode = "tool"
                self._call_body = []
            elif tid == tok.tool_call_end_id and self._mode == "tool":
                self._call_body.append(self._detok.flush())
                self._mode = "content"
                call = self._close_call()
                if call is not None:
                    calls.append(ToolCallDelta(len(self._calls) - 1, call.id, call.name, call.arguments))
                else:
                    content.append(self._push_content(self._raw_call_text()))
            elif tid in self._skip:
                continue
            else:
                text = self._detok.feed((tid,))
                if text:
                    self._route(text, reasoning, content)
        return OutputDelta("".join(reasoning), "".join(content), tuple(calls))

    def finish(self) -> OutputDelta:
        """Flush what is held back; an unclosed tool call becomes content (flagged)."""
        reasoning: list[str] = []
        content: list[str] = []
        self._flush_into(reasoning, content)
        if self._mode == "tool":
            self.tool_call_parse_error = True
            content.append(self._push_content(self._raw_call_text(closed=False)))
            self._mode = "content"
        if self._stop is not None:
            content.append(self._content.push(self._stop.flush()))
        return OutputDelta("".join(reasoning), "".join(content), ())

    # -- results ------------------------------------------------------------

    @property
    def output(self) -> AssistantOutput:
        return AssistantOutput(self._content.text, self._reasoning.text, tuple(self._calls))

    # -- internals ----------------------------------------------------------

    def _route(self, text: str, reasoning: list[str], content: list[str]) -> None:
        if self._mode == "reasoning":
            reasoning.append(self._reasoning.push(text))
        elif self._mode == "tool":
            self._call_body.append(text)
        else:
            content.append(self._push_content(text))

    def _flush_into(self, reasoning: list[str], content: list[str]) -> None:
        text = self._detok.flush()
        if text:
            self._route(text, reasoning, content)

    def _raw_call_text(self, *, closed: bool = True) -> str:
        return TOOL_CALL_START + "".join(self._call_body) + (TOOL_CALL_END if closed else "")

    def _close_call(self) -> ToolCall | None:
        body = "".join(self._call_body).strip()
        try:
            value = json.loads(body)
        except ValueError:
            value = None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            self.tool_call_parse_error = True
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                self.tool_call_parse_error = True
                return None
        if not isinstance(arguments, dict):
            self.tool_call_parse_error = True
            return None
        call = ToolCall(
            id=self._tool_call_id(len(self._calls)),
            name=value["name"],
            arguments=json.dumps(arguments, ensure_ascii=False),
            parsed=arguments,
        )
        self._calls.append(call)
        return call


class StopMatcher:
    """Applies OpenAI ``stop`` sequences to streamed content.

    Content passes through with the last ``len(longest stop) - 1`` characters
    held back, so a stop sequence split across chunks is still caught and never
    half-sent. After a match, :attr:`hit` is set and nothing more passes.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._buffer = ""
        self.hit = False
        #: The stop sequence that matched (Anthropic reports it as ``stop_sequence``).
        self.matched: str | None = None

    def push(self, text: str) -> str:
        if self.hit or not text:
            return ""
        buffer = self._buffer + text
        found = [(at, stop) for stop in self._stops if (at := buffer.find(stop)) >= 0]
        if found:
            at, self.matched = min(found)
            emitted = buffer[:at]
            self.hit = True
            self._buffer = ""
        else:
            cut = max(0, len(buffer) - self._hold)
            emitted, self._buffer = buffer[:cut], buffer[cut:]
        return emitted

    def flush(self) -> str:
        emitted, self._buffer = self._buffer, ""
        return emitted
