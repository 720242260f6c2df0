"""Streaming parser from sampled token ids to reasoning, content and tool calls.

It works on token ids, not text: ``<think>``, ``</think>``, ``<tool_call>`` and
``</tool_call>`` are single tokens in the Qwen vocabulary, so those tags can
never be split across stream chunks. Text between them is decoded incrementally
(exact across multi-byte characters); inside a ``<tool_call>`` block it goes to
a format-specific block parser (:mod:`.tool_parsers`), which reads each call as it
grows. A block's calls are streamed once the block closed and parsed, each as one
piece (its id, name and ``arguments`` JSON text): a call is never shown before it is
known to be one.

Feeding a generation in any chunking and then calling :meth:`OutputParser.finish`
gives the same result as feeding it at once, and the deltas concatenate to that
result: that is what makes streamed and non-streamed replies identical.

Whitespace rule (as the reference parsers do): reasoning and content are
stripped at both ends, except that content cut by a ``stop`` sequence keeps the
whitespace before it, as OpenAI returns it. While streaming, trailing whitespace
is held back until more text follows, so the concatenated deltas equal the final strings.

A tool call that does not parse is never dropped: the raw text of its block goes
back as content and :attr:`OutputParser.tool_call_parse_error` is set, streamed and
not alike; no piece of it was streamed as a call (see docs/parsers.md). Otherwise a
streaming agent would keep, run and echo back a call that the reply and the recorded
step do not have, and its next turn would match nothing recorded.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import attrs

from ..tokenization.detokenize import IncrementalDetokenizer
from ..tokenization.tokenizer import ChatTokenizer
from .messages import AssistantOutput, ToolCall
from .output_formats import REASONING_FORMATS, ReasoningFormat, default_tool_call_format, tool_schemas
from .text_streams import StopMatcher, StrippedText
from .tool_parsers import BlockParser, CallPiece, ToolCallFormat, format_spec, token_id
from .tool_parsers.harmony import Header, JsonArgumentsParser, harmony_ids, read_header

__all__ = [
    "NOTHING",
    "OutputDelta",
    "OutputParser",
    "ReasoningFormat",
    "StopMatcher",
    "ToolCallDelta",
    "ToolCallFormat",
    "default_tool_call_format",
    "tool_schemas",
]


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


class OutputDelta(NamedTuple):
    """What a piece of the output adds: reasoning text, content text, pieces of tool calls.

    A named tuple (one is made per streamed token: built by ``tuple.__new__``, without the
    attribute writes of a frozen attrs class).
    """

    reasoning: str = ""
    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)



class _Everything:
    """The set of all ids (harmony: every token is read on its own)."""

    def __contains__(self, item: object) -> bool:
        return True


#: The delta that says nothing: every empty delta :meth:`OutputParser.feed` and ``finish`` return is this one.
NOTHING = OutputDelta()

#: ``OutputDelta``'s own ``tuple.__new__``, given every field: a streamed token's delta made without the named
#: tuple's Python-level ``__new__`` (a call and its defaults, ~40% of making one).
_made = tuple.__new__


class _Out:
    """What one call of feed/finish produces."""

    def __init__(self) -> None:
        self.reasoning: list[str] = []
        self.content: list[str] = []
        self.calls: list[ToolCallDelta] = []

    def delta(self) -> OutputDelta:
        reasoning, content = "".join(self.reasoning), "".join(self.content)
        if reasoning or content or self.calls:
            return OutputDelta(reasoning, content, tuple(self.calls))
        return NOTHING


class OutputParser:
    """Parse one generation's token ids as they arrive, in the configured formats.

    ``tools`` are the request's tools: XML formats convert each parameter value
    by its JSON schema type. ``reasoning_format="none"`` treats think tags as
    plain content. ``tool_call_id(i)`` names the ``i``-th call announced in this
    generation (unless the model wrote its own id: Kimi-K2). ``stop_ids`` are the call's own stop
    ids (vLLM's ``stop_token_ids``): like the tokenizer's end ids, they end the reply unshown, unless
    ``include_stop`` (vLLM's ``include_stop_str_in_output``), which also keeps a ``stop`` sequence in the
    content. No ``stop`` sequence ends in the text of the first ``min_tokens`` tokens (as vLLM matches them).
    """

    def __init__(
        self,
        tokenizer: ChatTokenizer,
        *,
        tool_call_id: Callable[[int], str],
        reasoning_open: bool = False,
        stop: tuple[str, ...] = (),
        stop_ids: Collection[int] = (),
        include_stop: bool = False,
        min_tokens: int = 0,
        tools: Sequence[Mapping[str, Any]] = (),
        tool_call_format: ToolCallFormat = "qwen3",
        reasoning_format: ReasoningFormat = "qwen3",
    ) -> None:
        if reasoning_format not in REASONING_FORMATS:
            raise ValueError(f"unknown reasoning_format {reasoning_format!r}")
        self._spec = format_spec(tool_call_format)
        self._tok = tokenizer
        self._tool_call_id = tool_call_id
        self._schemas = tool_schemas(tools)
        self._harmony = harmony_ids(tokenizer) if "gpt_oss" in (tool_call_format, reasoning_format) else None
        thinking = reasoning_format not in ("none", "gpt_oss")
        self._think_start = tokenizer.think_start_id if thinking else None
        self._think_end = tokenizer.think_end_id if thinking else None
        opened = reasoning_open or reasoning_format == "deepseek_r1"
        self._mode = "reasoning" if opened and self._think_end is not None else "content"
        spec = self._spec
        self._block_start = token_id(tokenizer, spec.start) if spec is not None else None
        self._block_end = token_id(tokenizer, spec.end) if spec is not None and spec.end else None
        self._keep_special = spec is None or spec.keep_special
        self._ends = frozenset((*tokenizer.stop_token_ids, *tokenizer.turn_end_ids, *stop_ids))
        self._bare_open = spec is not None and spec.bare_start is not None  # the reply may still open with a call
        self._detok = IncrementalDetokenizer(tokenizer)
        self._reasoning = StrippedText()
        self._content = StrippedText()
        self._raw: list[str] = []  # the open block's text, for when it does not parse
        self._frame = ("", "")  # what surrounds the raw text of the open block
        self._block: BlockParser | None = None
        self._held: list[CallPiece] = []  # the open block's pieces: streamed once it closed and parsed
        self._slots: dict[int, int] = {}  # call of the closing block -> its index in the reply
        self._ids: dict[int, str] = {}  # index in the reply -> its id
        self._announced = 0  # calls streamed so far (their indexes and ids are taken)
        self._calls: list[ToolCall] = []
        self.tool_call_parse_error = False
        # The call's own stop ids end the reply unseen, as the tokenizer's end ids do (vLLM shows neither).
        self._skip = tokenizer.special_ids.union(stop_ids) if stop_ids and not include_stop else tokenizer.special_ids
        self._stop = StopMatcher(stop, include=include_stop) if stop else None
        #: Tokens still to come whose text no stop sequence may end in (the reply's first ``min_tokens``).
        self._quiet = min_tokens if stop else 0
        #: A ``stop`` sequence appeared in the content: the caller should end the generation.
        self.stopped = False
        self._header: str | None = ""  # harmony: the header being read (None: in a body or between messages)
        #: Ids that may change the mode or be dropped; any other id is plain text in every mode. Harmony reads
        #: every token on its own (its headers are text).
        markers = (self._think_start, self._think_end, self._block_start, self._block_end)
        self._specials: frozenset[int] | _Everything = _Everything() if self._harmony is not None else frozenset(
            {*(m for m in markers if m is not None), *self._skip})

    @property
    def stop_sequence(self) -> str | None:
        """The ``stop`` sequence that ended the reply, if one did."""
        return self._stop.matched if self._stop is not None else None

    def _push_content(self, text: str) -> str:
        # Stop sequences match the raw text. A reply cut by one keeps the whitespace before it
        # (OpenAI returns the text up to the stop sequence as it was sampled); only its start is stripped.
        if self._stop is None:
            return self._content.push(text)
        emitted = self._content.push(self._stop.push(text))
        if self._stop.hit:
            self.stopped = True
            return emitted + self._content.release()
        return emitted

    # -- feeding ------------------------------------------------------------

    def feed(self, token_ids: Sequence[int]) -> OutputDelta:
        if len(token_ids) == 1 and token_ids[0] not in self._specials:
            # A streamed token alone, plain text in reasoning or content without stop sequences or a call
            # that may still open (the case of nearly every token): what the loop below makes of it, directly.
            mode = self._mode
            if self._stop is None and not self._bare_open and (mode == "content" or mode == "reasoning"):
                text = self._detok.feed(token_ids)
                if text:
                    if mode == "content":
                        if text := self._content.push(text):
                            return _made(OutputDelta, ("", text, ()))
                    elif text := self._reasoning.push(text):
                        return _made(OutputDelta, (text, "", ()))
                return NOTHING
        if self._quiet:
            return self._feed_quietly(token_ids)
        return self._feed(token_ids)

    def _feed_quietly(self, token_ids: Sequence[int]) -> OutputDelta:
        """Tokens of which the first ones are still within ``min_tokens``: those are read unmatched by the stop
        sequences, then the matcher is armed for the rest."""
        stop, quiet = self._stop, self._quiet
        assert stop is not None
        stop.armed = False
        first = self._feed(token_ids[:quiet])
        self._quiet = max(0, quiet - len(token_ids))
        if self._quiet:
            return first
        stop.armed = True
        if len(token_ids) <= quiet:
            return first
        rest = self._feed(token_ids[quiet:])
        if first is NOTHING:
            return rest
        if rest is NOTHING:
            return first
        return OutputDelta(first.reasoning + rest.reasoning, first.content + rest.content,
                           first.tool_calls + rest.tool_calls)

    def _feed(self, token_ids: Sequence[int]) -> OutputDelta:
        out = _Out()
        specials = self._specials
        run: list[int] = []  # ordinary tokens in a row: detokenized and routed together (same text, fewer calls)
        for tid in token_ids:
            if tid not in specials:
                run.append(tid)
                continue
            if run:
                self._plain(run, out)
                run = []
            if self.stopped:
                break  # a stop sequence ended the reply: later tokens are not shown
            if self._harmony is not None:
                self._harmony_token(tid, out)
            elif tid == self._think_start and self._mode != "tool":
                self._flush_into(out)
                self._mode = "reasoning"
            elif tid == self._think_end and self._mode == "reasoning":
                self._flush_into(out)
                self._mode = "content"
            elif tid == self._block_start and self._mode != "tool":
                # Also from reasoning: Qwen3.5 sometimes calls without closing </think>
                # (SGLang's qwen3 reasoning parser treats it the same way).
                assert self._spec is not None
                self._open_block(out, self._spec.make(self._schemas), (self._spec.start, self._spec.end or ""))
            elif tid == self._block_end and self._mode == "tool":
                self._flush_into(out)
                self._close_block(out)
            elif tid in self._skip and not (self._mode == "tool" and self._keep_special and tid not in self._ends):
                continue
            else:
                self._plain((tid,), out)
        if run:
            self._plain(run, out)
        return out.delta()

    def _plain(self, token_ids: Sequence[int], out: _Out) -> None:
        """Tokens that are none of the markers or special ids: their text goes where the mode says.

        Reasoning and plain content take the run's text at once. A tool block's parser (which
        may end the block, and Llama 3's opening ``{`` may start one) reads it token by token.
        """
        if self._mode != "tool" and not self._bare_open:
            if not self.stopped:  # a stop sequence ended the reply: later tokens are not shown
                text = self._detok.feed(token_ids)
                if text:
                    self._route(text, out)
            return
        for tid in token_ids:
            if self.stopped:
                return
            text = self._detok.feed((tid,))
            if text:
                self._route(text, out)

    def finish(self) -> OutputDelta:
        """Flush what is held back; an unclosed tool call becomes content (flagged)."""
        out = _Out()
        text = self._detok.flush()
        if self._mode == "tool" and self._spec is not None and self._spec.end is None and self._harmony is None:
            self._route(text, out)  # a block that runs to the end of the generation (Llama 3)
            self._close_block(out)
        elif self._mode == "tool":
            # Cut off (max_tokens): the call can never complete; nothing of it was streamed.
            self._raw.append(text)
            self._held = []
            self.tool_call_parse_error = True
            out.content.append(self._push_content(self._frame[0] + "".join(self._raw)))
            self._mode, self._block = "content", None
        elif text and (self._harmony is None or (self._header is None and self._mode != "between")):
            self._route(text, out)
        if self._stop is not None:
            out.content.append(self._content.push(self._stop.flush()))
            self.stopped = self._stop.hit
        return out.delta()

    # -- results ------------------------------------------------------------

    @property
    def output(self) -> AssistantOutput:
        return AssistantOutput(self._content.text, self._reasoning.text, tuple(self._calls), schemas=self._schemas)

    # -- internals ----------------------------------------------------------

    def _route(self, text: str, out: _Out) -> None:
        if self._mode == "reasoning":
            out.reasoning.append(self._reasoning.push(text))
        elif self._mode == "tool":
            assert self._block is not None
            self._raw.append(text)
            self._held.extend(self._block.feed(text))
        elif self._bare_open:
            # Llama 3: a reply that opens with "{" is a call (held until its first non-space character).
            head = text.lstrip()
            if head:
                self._bare_open = False
                assert self._spec is not None and self._spec.bare_start is not None
                if head.startswith(self._spec.bare_start):
                    self._open_block(out, self._spec.make(self._schemas), ("", ""))
                self._route(head, out)
        else:
            out.content.append(self._push_content(text))

    def _flush_into(self, out: _Out) -> None:
        text = self._detok.flush()
        if text:
            self._route(text, out)

    def _open_block(self, out: _Out, block: BlockParser, frame: tuple[str, str]) -> None:
        self._flush_into(out)
        self._mode, self._block, self._frame = "tool", block, frame
        self._raw = []
        self._held = []
        self._slots = {}
        self._bare_open = False

    def _stream(self, pieces: Iterable[CallPiece], out: _Out) -> None:
        """A closed block's calls as deltas, one a call: each takes the next index, its pieces' arguments joined once
        (a call of thousands of pieces is not rebuilt piece by piece)."""
        calls: dict[int, tuple[str, list[str]]] = {}  # index: (name, argument pieces), in the calls' order
        for piece in pieces:
            if piece.name is not None:
                index = self._slots[piece.call] = self._announced
                self._announced += 1
                self._ids[index] = piece.id or self._tool_call_id(index)
                calls[index] = (piece.name, [piece.arguments])
            else:
                calls[self._slots[piece.call]][1].append(piece.arguments)
        out.calls.extend(ToolCallDelta(index, self._ids[index], name, "".join(arguments))
                         for index, (name, arguments) in calls.items())

    def _close_block(self, out: _Out) -> None:
        assert self._block is not None
        result = self._block.close()
        self._block, self._mode = None, "content"
        held, self._held = self._held, []
        if result is None:
            self.tool_call_parse_error = True
            out.content.append(self._push_content(self._frame[0] + "".join(self._raw) + self._frame[1]))
            return
        self._stream((*held, *result.pieces), out)
        for call in result.calls:
            index = self._slots[call.call]
            self._calls.append(ToolCall(self._ids[index], call.name, call.arguments, call.parsed))

    # -- GPT-OSS harmony ----------------------------------------------------

    def _harmony_token(self, tid: int, out: _Out) -> None:
        ids = self._harmony
        assert ids is not None
        if tid == ids.start:
            self._end_message(out)
            self._header = ""
        elif self._header is not None:  # reading a header
            if tid == ids.message:
                header, self._header = self._header + self._detok.flush(), None
                self._begin_message(read_header(header), out)
            elif tid not in self._skip or tid in (ids.channel, ids.constrain):
                self._header += self._detok.feed((tid,))
        elif tid in ids.body_ends:
            self._end_message(out)
            self._mode = "between"
        elif self._mode != "between" and tid not in self._skip:
            text = self._detok.feed((tid,))
            if text:
                self._route(text, out)

    def _begin_message(self, header: Header, out: _Out) -> None:
        if header.kind == "tool":
            self._open_block(out, JsonArgumentsParser(header.name), ("", ""))
        else:
            self._mode = header.kind

    def _end_message(self, out: _Out) -> None:
        if self._header is None and self._mode != "between":
            self._flush_into(out)
            if self._mode == "tool":
                self._close_block(out)
