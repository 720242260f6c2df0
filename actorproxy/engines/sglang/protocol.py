"""SGLang's native ``/generate`` wire format, shared by the client and the simulated routes.

The request bodies (:class:`GenerateReqInput` with its :class:`SGLangSamplingParams`,
:class:`AbortReq`, :class:`PauseGenerationReq`, and the parsing endpoints' requests
and outputs; :class:`ModelInfoOutput`): the clients build them with every
field explicit, the simulated server structures any body into them with the wire
converter. The finish reason as SGLang writes it (:func:`finish_reason_json`) and the
sans-IO reader of a ``/generate`` stream (:class:`SGLangStreamParser`: cumulative or
incremental events).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import attrs
import msgspec
import orjson

from ...core.turn_events import TopLogprobs
from ...same_named import build_from
from ...schema.converter import CONVERTER, TokenIds, at_least
from ..base import (
    BackendError,
    FinishReason,
    GenerateFinish,
    GenerateRequest,
    GenerationEvent,
    SamplingParams,
    WeightVersionSpan,
)
from ..connection import BodyTemplate
from ..deltas import DEFAULT_VERSION, token_deltas, version_at
from ..errors import http_status, stream_error_status
from ..stream_events import Int64, StreamDecoder, checked_alternatives, loads_span
from .cumulative import PrefixCutter, look

GENERATE_PATH = "/generate"
ABORT_PATH = "/abort_request"
#: The model info (SGLang 0.5.23); builds before it serve only the legacy path, which 0.5.23 keeps deprecated.
MODEL_INFO_PATH = "/model_info"
LEGACY_MODEL_INFO_PATH = "/get_model_info"


@attrs.frozen(kw_only=True)
class SGLangSamplingParams:
    """SGLang's ``sampling_params``, with SGLang's defaults (``max_new_tokens``: 128) when absent.

    :meth:`of` sets every field we rely on. ``sampling_seed`` is sent only when asked:
    only newer builds know it.
    """

    __wire_omit_if_default__ = ("sampling_seed",)

    max_new_tokens: int = attrs.field(default=128, validator=at_least(0))
    temperature: float = attrs.field(default=1.0, validator=at_least(0.0))
    top_p: float = attrs.field(default=1.0, validator=at_least(0.0))
    top_k: int = -1
    min_p: float = attrs.field(default=0.0, validator=at_least(0.0))
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    ignore_eos: bool | None = None  # None: absent, the server's own setting
    sampling_seed: int | None = None

    @classmethod
    def of(cls, s: SamplingParams) -> SGLangSamplingParams:
        """``s``'s same-named settings; no stop strings, special tokens and stop tokens kept."""
        return build_from(cls, s, stop=[], stop_token_ids=list(s.stop_token_ids), skip_special_tokens=False,
                          no_stop_trim=True, sampling_seed=s.seed, min_new_tokens=s.min_tokens)


@attrs.frozen(kw_only=True)
class GenerateReqInput:
    """A ``POST /generate`` body (SGLang's ``GenerateReqInput``, the fields we use).

    We send ``input_ids`` (token in, token out), never ``text``; ``logprob_start_len``
    ``-1`` asks for output logprobs only, ``0`` for the prompt's too.
    """

    __wire_omit_if_default__ = ("text", "return_routed_experts")

    input_ids: TokenIds = attrs.field(factory=lambda: TokenIds(array("i")))
    text: str | list[str] | None = None
    rid: str | None = None
    stream: bool = False
    sampling_params: SGLangSamplingParams | None = None
    return_logprob: bool = False
    logprob_start_len: int = attrs.field(default=-1, validator=at_least(-1))
    top_logprobs_num: int = attrs.field(default=0, validator=at_least(0))
    return_routed_experts: bool = False


def generate_bytes(request: GenerateRequest, routed_experts: bool) -> bytes:
    """The streamed ``/generate`` body of ``request`` as JSON bytes: what the converter writes for its
    :class:`GenerateReqInput`, from the template written once for its sampling settings.

    A session's turns sample alike: only the ids and the rid differ (:class:`BodyTemplate`).
    """
    def body() -> Any:
        return CONVERTER.unstructure(GenerateReqInput(
            rid="",
            stream=True,
            sampling_params=SGLangSamplingParams.of(request.sampling),
            return_logprob=True,
            logprob_start_len=-1,
            top_logprobs_num=request.sampling.top_logprobs,
            return_routed_experts=routed_experts,
        ))

    template = BodyTemplate.kept(_TEMPLATES, (request.sampling, routed_experts), body, ("input_ids", "rid"))
    return template.fill(request.input_ids, request.rid)  # (GenerateReqInput's order)


_TEMPLATES: dict[tuple[SamplingParams, bool], BodyTemplate] = {}


@attrs.frozen
class AbortReq:
    """``POST /abort_request``: stop the requests whose rid starts with ``rid`` (every one with ``abort_all``)."""

    rid: str = ""
    abort_all: bool = False


@attrs.frozen(kw_only=True)
class ModelInfoOutput:
    """``GET /model_info`` (``/get_model_info``); the length fields: some builds and gateways add them."""

    __wire_omit_if_default__ = ("served_model_name", "max_model_len", "context_length")

    model_path: str | None = None
    tokenizer_path: str | None = None
    is_generation: bool = True
    preferred_sampling_params: str | dict[str, Any] | None = None
    weight_version: str | int | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    context_length: int | None = None


PauseMode = Literal["abort", "retract", "in_place"]


@attrs.frozen
class PauseGenerationReq:
    """``POST /pause_generation``: drop the running requests (``abort``) or keep them for later."""

    mode: PauseMode = "abort"


# -- the parsing endpoints (``/separate_reasoning``, ``/parse_function_call``) -------------


@attrs.frozen
class SeparateReasoningReqInput:
    text: str
    reasoning_parser: str


@attrs.frozen
class SeparateReasoningOutput:
    reasoning_text: str | None = None
    text: str | None = None


@attrs.frozen
class Function:
    """A tool's function in SGLang's ``Function`` model: only the fields it knows (some builds refuse others)."""

    __wire_omit_if_default__ = ("name", "description", "parameters")

    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None


@attrs.frozen
class Tool:
    function: Function
    type: str = "function"


@attrs.frozen
class ParseFunctionCallReq:
    text: str
    tool_call_parser: str
    tools: list[Tool] | None = None


@attrs.frozen(kw_only=True)
class ToolCallItem:
    """One call found: ``parameters`` is the arguments object as JSON text (some builds send the object)."""

    tool_index: int | None = None
    name: str
    parameters: str | dict[str, Any]


@attrs.frozen
class ParseFunctionCallOutput:
    normal_text: str
    calls: list[ToolCallItem]


class SGLangStreamParser(StreamDecoder):
    """Sans-IO reader of one SGLang ``/generate`` stream (cumulative or incremental).

    An incremental stream's events of one read are decoded together; a cumulative one's
    each alone, without the prefix the previous event had (:mod:`.cumulative`), and one
    that the next event read with it repeats is not decoded at all (:meth:`take_spans`).
    """

    what = "SGLang"
    reads_lying = True

    def __init__(self, *, stop_token_ids: Sequence[int] = (), version: str = DEFAULT_VERSION) -> None:
        super().__init__()
        self.ids: list[int] = []  # every output token delivered so far
        self.version = version  # the last version seen
        self._stops = frozenset(stop_token_ids)
        self._incremental: bool | None = None
        self.batched = False  # a cumulative event is cut alone; incremental events are batched once the shape is known
        self._cutter = PrefixCutter()
        self._cut = 0  # tokens cut from the event being decoded

    def read_common(self, raw: bytearray, start: int, stop: int, out: list[GenerationEvent]) -> bool:
        """An incremental stream's event of one new token, its entry naming it, nothing else (no finish, no spans,
        no field but SGLang's): decoded into :class:`_TokenEvent`, whose types msgspec checks as it decodes (the
        checks :meth:`feed` makes in Python of orjson's dicts), then read as :meth:`feed` reads it.

        Any other event (several tokens, a repeat, a finish, a field of another type or name, a
        malformed one) fails the decode or the checks after it, before anything changed: it is
        read as JSON (its errors named as before). A stream known to be incremental only (from its
        second event): a cumulative stream's events are cut first.
        """
        if not self._incremental or self._cut or self.top is not None:  # (the typed event has no alternatives)
            return False
        try:
            event = _TOKEN_EVENT.decode(raw[start:stop])
        except msgspec.MsgspecError:  # (not this kind of event, or malformed: decoded again as JSON, to say which)
            return False
        ids, meta = event.output_ids, event.meta_info
        entries = meta.output_token_logprobs
        if (len(ids) != 1 or len(entries) != 1 or (entry := entries[0])[1] != (token := ids[0])
                or meta.completion_tokens <= len(self.ids)):
            return False
        if meta.weight_version is not None:
            self.version = meta.weight_version
        self.payloads += 1
        self.ids.append(token)
        if events := self.tokens(ids, [entry[0]]):
            self._hand_out(events, out)
        return True

    @property
    def cumulative(self) -> bool:
        """Whether the stream is known to be in SGLang's cumulative shape (from its second event on)."""
        return self._incremental is False

    def feed(self, payload: Mapping[str, Any]) -> list[GenerationEvent]:
        if "error" in payload:
            error = payload["error"]
            message = str(error.get("message", error)) if isinstance(error, Mapping) else str(error)
            raise BackendError(f"SGLang: {message}", status=stream_error_status(error, message))
        meta = payload.get("meta_info")
        if type(meta) is not dict:
            meta = meta if isinstance(meta, Mapping) else {}
        entries = meta.get("output_token_logprobs")
        ids = payload.get("output_ids")
        completion = meta.get("completion_tokens")
        cut = self._cut
        if (type(ids) is list and len(ids) == 1 and type(token := ids[0]) is int
                and (cut == len(self.ids) if cut else self._incremental and (
                    completion is None or (type(completion) is int and completion > len(self.ids))))
                and type(entries) is list and len(entries) == 1 and type(entry := entries[0]) is list
                and len(entry) >= 2 and entry[1] == token and type(value := entry[0]) is float):
            # An event of one new token, its entry plain and naming it: what _new_tokens makes of it, read
            # directly (no slices, repeat checks, zip). An incremental stream's (nothing is cut from its events:
            # its _cut is 0), or a cumulative one's cut after exactly the tokens delivered (nothing repeats).
            if cut:
                self._cut, self._cutter.tokens = 0, cut + 1
            new_ids, logprobs = ids, [value]
            skipped = 0
        else:
            new_ids, logprobs, skipped = self._new_tokens(ids, entries, completion)
        if self.top is not None and new_ids:
            self.top += _alternatives(meta.get("output_top_logprobs"), skipped, len(new_ids))
        spans = self.read_versions(meta)
        if spans:
            events = self._deltas(new_ids, logprobs, spans)
        else:  # every token stamped with the event's version: one delta (or none)
            self.ids += new_ids
            events = self.tokens(new_ids, logprobs)
        finish = meta.get("finish_reason")
        if finish is not None:
            events.append(self._finish(finish, meta, spans, events))
        return events

    def end(self, done: bool) -> list[GenerationEvent]:
        raise BackendError("SGLang: the stream ended without a finish_reason")

    def _new_tokens(self, ids: object, entries: object, completion: object) -> tuple[list[int], list[float], int]:
        """The event's new token ids and their logprobs (``ids``: its ``output_ids``, ``entries``: its
        ``output_token_logprobs``), without what it repeats (:meth:`_skip`, :meth:`_drop_repeat`), checked; and
        how many of its entries come before them (those it repeats)."""
        if ids is None:  # older builds: the ids only inside the logprob entries
            ids = [entry[1] for entry in entries] if isinstance(entries, list) else []
        if not isinstance(ids, list):
            raise BackendError(f"SGLang: output_ids is not a list: {ids!r}")
        cut, self._cut = self._cut, 0
        self._cutter.tokens = cut + len(ids)
        if self._incremental and not cut:  # the common event: new tokens only, unless it repeats (see _skip)
            sent = len(self.ids)
            skip = len(ids) if isinstance(completion, int) and completion == sent and len(ids) <= sent else 0
        else:
            skip = self._skip(ids, cut, completion)
        new_ids = ids[skip:] if skip else ids
        new_entries = entries[skip:] if skip and isinstance(entries, list) else entries
        if self._incremental is not False and type(completion) is int and completion < len(self.ids) + len(new_ids):
            new_ids, new_entries = self._drop_repeat(new_ids, new_entries, completion)
        return new_ids, self._logprobs(new_ids, new_entries), skip

    def take_events(self, datas: list[tuple[str, bytes]], out: list[GenerationEvent]) -> None:
        """Events given one by one (another SSE shape): one the next repeats is not decoded (:meth:`_read_all`)."""
        self._read_all(len(datas), lambda i: look(datas[i][1]) if datas[i][0] == "message" else (False, None),
                       lambda i: datas[i][0] == "message" and datas[i][1].strip() != b"[DONE]",
                       lambda i: self.take_one(*datas[i], out))

    def take_spans(self, spans: list[tuple[int, int]], out: list[GenerationEvent]) -> None:
        """A read's events, each decoded where it lies: one the next repeats is not decoded (:meth:`_read_all`)."""
        if len(spans) < 3:  # (the common read: one event)
            for start, stop in spans:
                self.take_span(start, stop, out)
            return
        buf = self.buffer
        self._read_all(len(spans), lambda i: self._cutter.look(buf, *spans[i]), lambda i: True,
                       lambda i: self.take_span(*spans[i], out))

    def _read_all(self, n: int, looked: Callable[[int], tuple[bool, bytes | None]], readable: Callable[[int], bool],
                  take: Callable[[int], None]) -> None:
        """``take`` each of ``n`` events read together but a cumulative one the next repeats (``cumulative.look``).

        A proxy reads several events at once when it is behind its engine (a pause's
        backlog, a busy loop) or the engine is fast (a short reply arrives whole): each
        would cost a decode for tokens the next one repeats (with the same version: a run
        of such events is read as its last). Only once the stream is known to be cumulative
        (from its second event); the last event (``readable``: an event, not ``[DONE]``) is
        always read. When the event after a skipped one fails, the skipped one is read after
        all, then it again (:meth:`_undo`): what is handed out before the error, or read when
        the event did not repeat it (the queued abort's last token alone), is what an event a
        read gives.
        """
        last = n - 1
        while last > 0 and not readable(last):
            last -= 1
        if last < 2 or self._incremental:  # (an incremental stream repeats nothing: no event looked at)
            for i in range(n):
                take(i)
            return
        ordinary, version = looked(0)
        skipped = False
        for i in range(n):
            if i < last and not self.finished:
                skip = ordinary and self.cumulative
                ordinary, next_version = looked(i + 1)
                skip = skip and version is not None and version == next_version
                version = next_version
                if skip:
                    skipped = True
                    continue
            if not skipped:
                take(i)
                continue
            skipped = False
            delivered, run, ran = len(self.ids), self.run_version, len(self.run_ids)
            try:
                take(i)  # (the event before it skipped: it was to repeat it)
            except BackendError:
                # It failed (malformed, a check, or it does not repeat the one before: SGLang's abort of a
                # queued request carries the last token alone): undone, and read as an event a read reads it.
                self._undo(delivered, run, ran)
                take(i - 1)  # (its tokens handed out)
                take(i)  # (its error, if it fails again)

    def _undo(self, delivered: int, run: str | None, ran: int) -> None:
        """Undo what a failed event did before failing: the tokens past ``delivered`` and the run past its
        ``ran`` tokens of version ``run`` dropped, the cutter's memory of it too (the next is decoded whole)."""
        del self.ids[delivered:]
        if self.top is not None:
            del self.top[delivered:]
        self._failing = []
        if run is None:
            self.run_version = None
        elif self.run_version is not None:
            del self.run_ids[ran:], self.run_logprobs[ran:]
        self._cut = 0
        self._cutter = PrefixCutter()

    def decode(self, raw: bytes) -> Any:
        """One event's JSON (see :meth:`decode_span`)."""
        return self.decode_span(raw, 0, len(raw))

    def line_break(self, raw: bytearray, start: int, stop: int) -> int:
        """The event's first line break, not searched for in what it repeats (``PrefixCutter.line_break``)."""
        if self._incremental is False:
            return self._cutter.line_break(raw, start, stop)
        return raw.find(b"\n", start, stop)

    def decode_span(self, raw: bytes | bytearray, start: int, stop: int) -> Any:
        """The JSON of event ``raw[start:stop]``; a cumulative event's without the tokens already read
        (:mod:`.cumulative`)."""
        # An incremental stream has nothing repeated to cut (known from its second event).
        if not self._incremental:
            cut, self._cut = self._cutter.cut(raw, start, stop, use=self._incremental is False,
                                              top=self.top is not None)
            if cut is not None:
                return orjson.loads(cut)
        return loads_span(raw, start, stop)

    def _skip(self, ids: list[int], cut: int, completion: object) -> int:
        """How many of the event's ``ids`` were delivered before (O(1): only the boundary is checked)."""
        sent = len(self.ids)
        if cut:  # the event's first ``cut`` tokens were cut from its bytes
            skip = sent - cut
        elif isinstance(completion, int) and completion == sent and len(ids) <= sent:
            # Nothing new: an event without tokens, or SGLang's abort of a queued
            # request, which repeats only the last token (in either stream shape).
            return len(ids)
        elif self._is_incremental(ids, completion):
            return 0
        else:
            skip = sent  # the event repeats every earlier token
        if not 0 <= skip <= len(ids) or (skip and ids[skip - 1] != self.ids[-1]):
            if cut and skip > len(ids) and type(completion) is int and completion == sent:
                return len(ids)  # nothing new (as above), cut after the queued abort's repeat of the last token
            raise BackendError("SGLang: a cumulative event does not extend the tokens already sent")
        return skip

    def _drop_repeat(self, ids: list[int], entries: object, completion: int) -> tuple[list[int], object]:
        """An incremental event with more tokens than ``completion_tokens`` counts: the tokens past the count repeat.

        SGLang's abort of a request in its waiting queue (one retracted there) repeats the
        last token, with every logprob entry so far; coalesced with deltas the client had
        not read yet, it comes after them. The first ``completion - delivered`` tokens (and
        entries) are the new ones; the rest must repeat the last tokens delivered.
        """
        keep = completion - len(self.ids)
        delivered = self.ids + ids[: max(keep, 0)]
        extra = ids[max(keep, 0) :]
        if keep < 0 or extra != delivered[len(delivered) - len(extra) :]:
            raise BackendError(f"SGLang: an event carries {len(ids)} tokens, but completion_tokens {completion} "
                               f"counts {keep} new after {len(self.ids)}, and the rest repeat nothing delivered")
        return ids[:keep], entries[:keep] if isinstance(entries, list) else entries

    def _is_incremental(self, ids: list[int], completion: object) -> bool:
        if self._incremental is not None:
            return self._incremental
        sent = len(self.ids)
        if sent == 0:
            return True  # the first event reads the same either way
        if isinstance(completion, int) and completion == sent + len(ids):
            self._incremental = True  # completion_tokens counts all tokens so far
        elif isinstance(completion, int) and completion == len(ids):
            self._incremental = False
        elif len(ids) < sent or ids[:sent] != self.ids:
            self._incremental = True
        else:
            # No count to go by and the event starts with all earlier tokens: the
            # server default (cumulative), decided again at the next event.
            return False
        self.batched = self._incremental
        return self._incremental

    @staticmethod
    def _logprobs(ids: list[int], entries: object) -> list[float]:
        if not ids:
            return []
        if not isinstance(entries, list) or len(entries) != len(ids):
            got = len(entries) if isinstance(entries, list) else entries
            raise BackendError(f"SGLang: {len(ids)} new tokens but logprob entries {got!r}")
        logprobs: list[float] = []
        for token, entry in zip(ids, entries, strict=True):
            if type(entry) is list and len(entry) >= 2 and entry[1] == token and (value := entry[0]) is not None:
                logprobs.append(float(value))  # the common entry, [logprob, id, text], checked once
            elif not isinstance(entry, list | tuple) or len(entry) < 2 or entry[1] != token or entry[0] is None:
                raise BackendError(f"SGLang: logprob entry {entry!r} does not match token {token}")
            else:
                logprobs.append(float(entry[0]))
        return logprobs

    def _deltas(
        self, ids: list[int], logprobs: list[float], spans: tuple[WeightVersionSpan, ...]
    ) -> list[GenerationEvent]:
        """One :class:`TokenDelta` per run of tokens the event's spans stamp alike."""
        stamps = [version_at(spans, len(self.ids) + i) or self.version for i in range(len(ids))]
        self.ids.extend(ids)
        return token_deltas(ids, logprobs, stamps)

    def _finish(self, raw: object, meta: Mapping[str, Any], spans: tuple[WeightVersionSpan, ...],
                events: list[GenerationEvent]) -> GenerateFinish:
        """The event's finish; an error when it is the engine's failure (``events``, its tokens, handed out first)."""
        info: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {"type": str(raw)}
        kind = info.get("type")
        message = str(info.get("message") or "")
        matched: int | None = None
        reason: FinishReason = "length"
        if kind == "stop":
            reason = "stop"
            m = info.get("matched")
            if isinstance(m, int) and not isinstance(m, bool):
                matched = m
            elif self.ids and self.ids[-1] in self._stops:
                matched = self.ids[-1]
        elif kind == "abort":
            reason = "abort"
            status = info.get("status_code")
            # An abort carrying an error status is the engine refusing or failing the
            # request (400: prompt too long, bad params), not a stop we asked for. The tokens the event brings
            # were sampled and sent: handed out before the error.
            if isinstance(status, int) and status >= 400 and (status < 500 or not self.abort_requested):
                self.fail(BackendError(f"SGLang: {message or 'request aborted'}", status=http_status(status, message)),
                          events)
        elif kind != "length":
            self.fail(BackendError(f"SGLang: unknown finish_reason {raw!r}"), events)
        experts = meta.get("routed_experts")
        return GenerateFinish(
            reason=reason,
            matched_stop=matched,
            weight_version=self.version,
            prompt_tokens=_int(meta.get("prompt_tokens")),
            cached_tokens=_int(meta.get("cached_tokens")),
            message=message if reason == "abort" else "",
            routed_experts=experts if isinstance(experts, str) else None,
            weight_versions=spans,
        )


def _alternatives(entries: object, skipped: int, count: int) -> list[TopLogprobs]:
    """The alternatives of an event's ``count`` new tokens, after the ``skipped`` it repeats: its
    ``output_top_logprobs``, a list of ``[logprob, id, text]`` per token (``null``: none), the likeliest first."""
    if not isinstance(entries, list) or len(entries) < skipped + count:
        got = len(entries) if isinstance(entries, list) else entries
        raise BackendError(f"SGLang: {count} new tokens but output_top_logprobs {got!r:.200}")
    out: list[TopLogprobs] = []
    for top in entries[skipped : skipped + count]:
        listed = [] if top is None else top if isinstance(top, list) else [None]
        pairs = [(e[1], e[0]) if isinstance(e, list) and len(e) >= 2 else (None, None) for e in listed]
        out.append(checked_alternatives(pairs, "SGLang", top))
    return out


class _TokenMeta(msgspec.Struct, forbid_unknown_fields=True):
    """The ``meta_info`` of an incremental event of plain tokens, without a finish or version spans: SGLang's
    fields, each typed, no other (an event with any other is read as JSON)."""

    output_token_logprobs: list[tuple[float, Int64, str | None]]
    completion_tokens: Int64
    finish_reason: None = None
    weight_version: str | None = None
    id: str = ""
    prompt_tokens: Int64 = 0
    cached_tokens: Int64 = 0
    reasoning_tokens: Int64 = 0
    num_retractions: Int64 = 0
    output_token_logprobs_length: Int64 = 0
    input_token_logprobs: list[tuple[float, Int64, str | None]] = []
    dp_rank: Int64 | None = None  # (with several data-parallel ranks: which one serves the request)
    # SGLang 0.5.23 writes these as well (tokenizer_manager.py): the cache's split on every event (null without a
    # cache hit; "storage" and its backend with HiCache storage), the time the first event was sent on that one,
    # and with --enable-metrics the request's times on every event.
    cached_tokens_details: dict[str, Int64 | str] | None = None
    response_sent_to_client_ts: float | None = None
    queue_time: float | None = None
    forward_entry_time: float | None = None
    prefill_finished_time: float | None = None
    storage_prefetch_wait: float | None = None
    storage_staging_wait: float | None = None


class _TokenEvent(msgspec.Struct, forbid_unknown_fields=True):
    """An incremental ``/generate`` event of plain tokens (:meth:`SGLangStreamParser.read_common`)."""

    output_ids: list[Int64]
    meta_info: _TokenMeta
    text: str = ""


_TOKEN_EVENT = msgspec.json.Decoder(_TokenEvent)


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def finish_reason_json(finish: GenerateFinish, completion_tokens: int) -> dict[str, Any]:
    """``meta_info.finish_reason`` as SGLang writes it (what :class:`SGLangStreamParser` reads)."""
    if finish.reason == "stop":
        return {"type": "stop", "matched": finish.matched_stop}
    if finish.reason == "length":
        return {"type": "length", "length": completion_tokens}
    return {"type": "abort", "message": finish.message or "Abort request"}
