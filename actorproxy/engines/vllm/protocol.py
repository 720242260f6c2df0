"""vLLM's token wire formats, shared by the client and the simulated routes.

The request bodies (:class:`GenerateTokensRequest` for ``/inference/v1/generate``,
:class:`CompletionRequest` for ``/v1/completions``, :class:`SamplingFields` in both,
:class:`AbortRequests`): the client builds them with every field explicit, the
simulated server structures any body into them with the wire converter. Routed
experts as ``.npy`` (written by :func:`npy_base64`, read by :func:`npy_to_int32_b64`),
both logprob shapes (:func:`read_logprobs`) and the sans-IO reader of a generate or
completions stream (:class:`VLLMStreamParser`).
"""

from __future__ import annotations

import ast
import base64
import struct
import sys
from array import array
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import attrs
import msgspec

from ...core.turn_events import TopLogprobs
from ...schema.converter import CONVERTER, TokenIds, at_least
from ..base import (
    BackendError,
    FinishReason,
    GenerateFinish,
    GenerationEvent,
    SamplingParams,
    WeightVersionSpan,
)
from ..connection import BodyTemplate
from ..deltas import DEFAULT_VERSION, token_deltas, version_at
from ..errors import error_message, stream_error_status
from ..stream_events import Int64, StreamDecoder, checked_alternatives

if TYPE_CHECKING:
    from ..base import GenerateRequest

Api = Literal["generate", "completions"]
GENERATE_PATH = "/inference/v1/generate"
ABORT_PATHS = ("/inference/v1/abort_requests", "/abort_requests")
#: The server's own route list (FastAPI's; absent with ``--disable-fastapi-docs``).
OPENAPI_PATH = "/openapi.json"
#: The answers of a route the server does not have: vLLM 0.32 answers 403 on the
#: scale-out routes when ``--enable-scale-out`` is off, 404/405 where there is no route.
ROUTE_ABSENT = frozenset({403, 404, 405})
#: Routes only a ``VLLM_SERVER_DEV_MODE=1`` server has (``/abort_requests`` too).
PAUSE_PATH, RESUME_PATH = "/pause", "/resume"
VERSION_PATH, WEIGHT_INFO_PATH = "/update_weight_version", "/weight_info"
_NPY_TYPES = {"u1": "B", "i1": "b", "u2": "H", "i2": "h", "u4": "I", "i4": "i", "u8": "Q", "i8": "q"}


@attrs.frozen(kw_only=True)
class SamplingFields:
    """vLLM's sampling fields: ``sampling_params`` of the generate API, top-level fields of completions.

    Defaults are vLLM's (``max_tokens``: ``None``, the server's own: 16 for completions,
    the room left in the context for generate). :meth:`of` sets every field we rely on.
    """

    __wire_omit_if_default__: ClassVar[tuple[str, ...]] = ("prompt_logprobs",)

    max_tokens: int | None = attrs.field(default=None, validator=at_least(1))  # vLLM refuses 0
    temperature: float = attrs.field(default=1.0, validator=at_least(0.0))
    top_p: float = attrs.field(default=1.0, validator=at_least(0.0))
    top_k: int = 0  # 0 or -1: the whole vocabulary
    min_p: float = attrs.field(default=0.0, validator=at_least(0.0))
    seed: int | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    #: ``0``: the sampled token's logprob only; ``None``: none.
    logprobs: int | None = attrs.field(default=None, validator=at_least(-1))
    prompt_logprobs: int | None = attrs.field(default=None, validator=at_least(-1))
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    ignore_eos: bool | None = None  # None: absent, the server's own setting
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def of(cls, s: SamplingParams, *, logprobs: int | None = 0, prompt_logprobs: int | None = None) -> SamplingFields:
        """Sampled as ``s`` asks, every other field explicit (``max_tokens`` defaults to 16 on the server)."""
        return cls(**_sampling(s, logprobs=logprobs, prompt_logprobs=prompt_logprobs))


def _sampling(s: SamplingParams, *, logprobs: int | None, prompt_logprobs: int | None) -> dict[str, Any]:
    return {
        "max_tokens": s.max_new_tokens,
        "temperature": s.temperature,
        "top_p": s.top_p,
        "top_k": s.top_k,
        "min_p": s.min_p,
        "seed": s.seed,
        "stop": [],
        "stop_token_ids": list(s.stop_token_ids),
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "skip_special_tokens": False,
        "ignore_eos": s.ignore_eos,
        "min_tokens": s.min_tokens,
        "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty,
        "repetition_penalty": s.repetition_penalty,
    }


@attrs.frozen
class StreamOptions:
    include_usage: bool = False


@attrs.frozen(kw_only=True)
class GenerateTokensRequest:
    """A ``POST /inference/v1/generate`` body (token ids in, token ids out)."""

    __wire_omit_if_default__ = ("stream_options",)

    token_ids: TokenIds
    request_id: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    sampling_params: SamplingFields | None = None


@attrs.frozen(kw_only=True)
class CompletionRequest(SamplingFields):
    """A ``POST /v1/completions`` body: the sampling fields at the top level, a token-id ``prompt``.

    A text prompt is vLLM's but not ours to send.
    """

    __wire_omit_if_default__ = ("prompt_logprobs", "model", "stream_options", "routed_experts_prompt_start")

    prompt: TokenIds | str
    model: str | None = None
    request_id: str | None = None
    echo: bool = False
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    #: The first prompt position whose routed experts are returned.
    routed_experts_prompt_start: int = attrs.field(default=0, validator=at_least(0))

    @classmethod
    def of_tokens(
        cls,
        input_ids: array[int],
        s: SamplingParams,
        *,
        rid: str,
        model: str | None,
        stream: bool = True,
        prompt_logprobs: int | None = None,
    ) -> CompletionRequest:
        """Our completion of ``input_ids``: token ids back, named by id (``return_tokens_as_token_ids``)."""
        return cls(
            # ``logprobs: k`` lists the sampled token and the k likeliest (k + 1 when it is not among them).
            **_sampling(s, logprobs=None if prompt_logprobs else s.top_logprobs, prompt_logprobs=prompt_logprobs),
            prompt=TokenIds(input_ids),
            model=model,
            request_id=rid,
            return_token_ids=True,
            return_tokens_as_token_ids=True,
            stream=stream,
            stream_options=StreamOptions(include_usage=True) if stream else None,
        )


def generate_tokens_bytes(request: GenerateRequest) -> bytes:
    """The streamed ``/inference/v1/generate`` body of ``request`` as JSON bytes (from its sampling's template)."""
    return _template("generate", request.sampling, None).fill(request.input_ids, request.rid)  # (the body's order)


def completion_bytes(request: GenerateRequest, model: str | None) -> bytes:
    """The streamed ``/v1/completions`` body of ``request`` as JSON bytes (:meth:`CompletionRequest.of_tokens`'s)."""
    return _template("completions", request.sampling, model).fill(request.input_ids, request.rid)


def _template(api: Api, sampling: SamplingParams, model: str | None) -> BodyTemplate:
    """The body template of ``api`` for ``sampling`` (and ``model``), written once."""
    def body() -> Any:
        if api == "generate":
            return CONVERTER.unstructure(GenerateTokensRequest(
                token_ids=TokenIds(array("i")), request_id="", stream=True,
                stream_options=StreamOptions(include_usage=True),
                # The generate route lists the sampled token and the likeliest ``logprobs - 1`` others when it is
                # not among the ``logprobs`` likeliest: one more is asked, so the k likeliest are always there.
                sampling_params=SamplingFields.of(sampling, logprobs=sampling.top_logprobs + 1 if sampling.top_logprobs
                                                  else 0)))
        return CONVERTER.unstructure(CompletionRequest.of_tokens(array("i"), sampling, rid="", model=model))

    holes = ("token_ids" if api == "generate" else "prompt", "request_id")
    return BodyTemplate.kept(_TEMPLATES, (api, sampling, model), body, holes)


_TEMPLATES: dict[tuple[Api, SamplingParams, str | None], BodyTemplate] = {}


@attrs.frozen
class ServerRoutes:
    """The routes a vLLM server lists in its ``/openapi.json`` (``paths``).

    A route vLLM registers only to refuse it (the scale-out routes without
    ``--enable-scale-out`` answer 403) is not listed there.
    """

    paths: frozenset[str]

    @classmethod
    def of(cls, openapi: object) -> ServerRoutes | None:
        """The routes of an ``/openapi.json`` document; ``None`` when it is not one."""
        paths = openapi.get("paths") if isinstance(openapi, Mapping) else None
        if not isinstance(paths, Mapping):
            return None
        return cls(frozenset(p for p in paths if isinstance(p, str)))

    @property
    def generate(self) -> bool:
        return GENERATE_PATH in self.paths

    @property
    def abort_paths(self) -> tuple[str, ...]:
        return tuple(p for p in ABORT_PATHS if p in self.paths)

    def has(self, path: str) -> bool:
        return path in self.paths


@attrs.frozen
class AbortRequests:
    """``POST /inference/v1/abort_requests`` (and the RL ``/abort_requests``): engine request ids."""

    request_ids: list[str] | None = None


def npy_to_int32_b64(text: str) -> str:
    """Base64 of an ``.npy`` integer array as base64 of raw little-endian int32."""
    raw = base64.b64decode(text)
    if not raw.startswith(b"\x93NUMPY"):
        raise BackendError("vLLM: routed_experts is not an .npy payload")
    size, start = (2, 8) if raw[6] == 1 else (4, 8)
    header_len = int.from_bytes(raw[start : start + size], "little")
    body = start + size + header_len
    header = ast.literal_eval(raw[start + size : body].decode("latin1"))
    descr, shape = str(header.get("descr", "")), header.get("shape", ())
    code = _NPY_TYPES.get(descr[1:])
    if code is None or header.get("fortran_order") or descr[:1] not in "<>|=":
        raise BackendError(f"vLLM: unsupported routed_experts array {header!r}")
    count = 1
    for dim in shape:
        count *= int(dim)
    values = array(code)
    values.frombytes(raw[body : body + count * values.itemsize])
    if (descr[0] == ">") != (sys.byteorder == "big"):
        values.byteswap()
    out = array("i", values)
    if sys.byteorder == "big":
        out.byteswap()
    return base64.b64encode(out.tobytes()).decode("ascii")


def _token_id(entry: Mapping[str, Any]) -> int | None:
    tid = entry.get("token_id")
    if isinstance(tid, int):
        return tid
    token = entry.get("token")
    if isinstance(token, str) and token.startswith("token_id:") and token[9:].isdigit():
        return int(token[9:])
    return None


def read_logprobs(raw: object) -> tuple[list[float | None], list[int | None]]:
    """Logprobs and the token ids they name, from either vLLM logprob shape."""
    if not isinstance(raw, Mapping):
        return [], []
    content = raw.get("content")
    if isinstance(content, list):  # generate / chat shape
        entries = [e for e in content if isinstance(e, Mapping)]
        return [e.get("logprob") for e in entries], [_token_id(e) for e in entries]
    values = raw.get("token_logprobs")
    if isinstance(values, list):  # completions shape
        tokens = raw.get("tokens") or []
        ids = [_token_id({"token": t}) for t in tokens] if isinstance(tokens, list) else []
        return list(values), ids + [None] * (len(values) - len(ids))
    return [], []


def _one_logprob(raw: dict[str, Any], token: int) -> float | None:
    """The logprob of a chunk's one ``token`` when ``raw`` (its ``logprobs``) holds one plain entry for it, of
    either shape, that names it or no id (what :func:`read_logprobs` and the checks after it pass); else ``None``.

    A streamed token's common case, read directly: no list of entries, comprehension or ``zip``.
    """
    content = raw.get("content")
    if type(content) is list:  # generate / chat shape
        if (len(content) == 1 and type(entry := content[0]) is dict and type(value := entry.get("logprob")) is float
                and type(tid := entry.get("token_id")) is int and tid == token):
            return value
    elif content is None and type(values := raw.get("token_logprobs")) is list and len(values) == 1:  # completions
        tokens = raw.get("tokens")
        if (type(value := values[0]) is float and type(tokens) is list and len(tokens) == 1
                and _token_id({"token": tokens[0]}) in (token, None)):
            return value
    return None


def _alternatives(raw: object, count: int) -> list[TopLogprobs]:
    """The alternatives of a choice's ``count`` tokens (``raw``: its ``logprobs``), either shape: the generate
    route's ``content[i].top_logprobs`` (``{"token_id", "logprob"}`` entries), completions' ``top_logprobs[i]``
    (``{"token_id:N": logprob}``: ``return_tokens_as_token_ids``). The sampled token comes first in both,
    the likeliest after it: the turn keeps the likeliest it asked for."""
    tops: object = None
    if isinstance(raw, Mapping):
        content = raw.get("content")
        if isinstance(content, list):  # generate / chat shape
            tops = [entry.get("top_logprobs") if isinstance(entry, Mapping) else None for entry in content]
        else:  # completions shape
            tops = raw.get("top_logprobs")
    if not isinstance(tops, list) or len(tops) != count:
        raise BackendError(f"vLLM: {count} tokens but top logprobs {tops!r:.200}")
    out: list[TopLogprobs] = []
    for top in tops:
        if isinstance(top, list):
            pairs = [(_token_id(e), e.get("logprob")) if isinstance(e, Mapping) else (None, None) for e in top]
        elif isinstance(top, Mapping):
            pairs = [(_token_id({"token": key}), value) for key, value in top.items()]
        else:
            pairs = [(None, None)]
        out.append(checked_alternatives(pairs, "vLLM", top))
    return out


class _Alternative(msgspec.Struct, forbid_unknown_fields=True):
    """An entry of a token's ``top_logprobs`` in a generate chunk: vLLM 0.32 lists the sampled token there even
    for ``logprobs: 0`` (the reader reads alternatives only when asked: :meth:`VLLMStreamParser.read_common` is
    then not used)."""

    token_id: Int64
    logprob: float | int
    rank: Int64 | None = None
    token: str = ""
    bytes: list[Int64] | None = None


class _TokenEntry(msgspec.Struct, forbid_unknown_fields=True):
    """A logprob entry of a generate chunk (:class:`_TokenChunk`): vLLM 0.32's ``token_id``, ``logprob``,
    ``rank`` and ``top_logprobs``, or an older build's ``token`` and ``bytes``."""

    token_id: Int64
    logprob: float | int
    rank: Int64 | None = None
    token: str = ""
    bytes: list[Int64] | None = None
    top_logprobs: tuple[_Alternative, ...] = ()


class _TokenLogprobs(msgspec.Struct, forbid_unknown_fields=True):
    content: list[_TokenEntry]


class _TokenChoice(msgspec.Struct, forbid_unknown_fields=True):
    """A generate chunk's choice of plain tokens: no finish, stop reason, routed experts, sampling mask or version
    spans (vLLM 0.32 writes each of them, ``null``)."""

    token_ids: list[Int64]
    logprobs: _TokenLogprobs
    index: Int64 = 0
    finish_reason: None = None
    stop_reason: None = None
    routed_experts: None = None
    sampling_mask: None = None
    weight_versions: None = None
    weight_version: str | None = None


class _TokenChunk(msgspec.Struct, forbid_unknown_fields=True):
    """A ``/inference/v1/generate`` chunk of plain tokens, each field typed, none unknown
    (:meth:`VLLMStreamParser.read_common`)."""

    choices: list[_TokenChoice]
    request_id: str | None = None
    usage: None = None
    output_mode: str | None = None


_TOKEN_CHUNK = msgspec.json.Decoder(_TokenChunk)


class VLLMStreamParser(StreamDecoder):
    """Sans-IO reader of one vLLM stream (generate or completions chunks)."""

    what = "vLLM"
    reads_lying = True

    def __init__(self, *, version: str = DEFAULT_VERSION, routed_experts: bool = False) -> None:
        super().__init__()
        self.ids: list[int] = []
        self.version = version
        self.request_id: str | None = None
        self._experts_wanted = routed_experts
        self._reason: str | None = None
        self._stop_reason: object = None
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._experts: str | None = None
        self._spans: tuple[WeightVersionSpan, ...] = ()

    def read_common(self, raw: bytearray, start: int, stop: int, out: list[GenerationEvent]) -> bool:
        """A ``/inference/v1/generate`` chunk of one token, its logprob entry naming it, nothing else (no finish, no
        usage, no spans, no field but vLLM's): decoded into :class:`_TokenChunk`, whose types msgspec checks as it
        decodes (the checks :meth:`feed` makes in Python of orjson's dicts), then read as :meth:`feed` reads it.

        Any other chunk (several tokens, an integer logprob, a finish, a field of another type or
        name, a malformed one) fails the decode or the checks after it, before anything changed:
        it is read as JSON (its errors named as before).
        """
        if self.top is not None:  # (alternatives asked: the typed chunk has none)
            return False
        try:
            chunk = _TOKEN_CHUNK.decode(raw[start:stop])
        except msgspec.MsgspecError:  # (not this kind of chunk, or malformed: decoded again as JSON, to say which)
            return False
        choices = chunk.choices
        if len(choices) != 1:
            return False
        choice = choices[0]
        ids, content = choice.token_ids, choice.logprobs.content
        if (choice.index != 0 or len(ids) != 1 or len(content) != 1 or (entry := content[0]).token_id != ids[0]
                or type(value := entry.logprob) is not float):
            return False
        if chunk.request_id is not None:
            self.request_id = chunk.request_id
        if choice.weight_version is not None:
            self.version = choice.weight_version
        self.payloads += 1
        events = self.tokens(ids, [value])
        self.ids += ids
        if events:
            self._hand_out(events, out)
        return True

    def feed(self, payload: Mapping[str, Any]) -> list[GenerationEvent]:
        if "error" in payload or payload.get("object") == "error":
            error = payload.get("error", payload)
            message = error_message(payload)
            raise BackendError(f"vLLM: {message}", status=stream_error_status(error, message))
        rid = payload.get("request_id", payload.get("id"))
        if isinstance(rid, str):
            self.request_id = rid
        usage = payload.get("usage")
        if usage is not None:  # (a streamed chunk's: none, or null)
            self._read_usage(usage)
        events: list[GenerationEvent] = []
        for choice in payload.get("choices") or ():
            if (type(choice) is dict or isinstance(choice, Mapping)) and choice.get("index", 0) == 0:
                events += self._choice(choice)
        return events

    def _read_usage(self, usage: object) -> None:
        if not isinstance(usage, Mapping):
            return
        if isinstance(usage.get("prompt_tokens"), int):
            self._prompt_tokens = usage["prompt_tokens"]
        details = usage.get("prompt_tokens_details")
        if isinstance(details, Mapping) and isinstance(details.get("cached_tokens"), int):
            self._cached_tokens = details["cached_tokens"]

    def _choice(self, choice: Mapping[str, Any]) -> list[GenerationEvent]:
        raw, ids = choice.get("logprobs"), choice.get("token_ids")
        if (type(ids) is list and len(ids) == 1 and type(token := ids[0]) is int and type(raw) is dict
                and (value := _one_logprob(raw, token)) is not None):
            ints, floats = ids, [value]  # a streamed chunk's one token (what _tokens would make of it)
        else:
            ints, floats = self._tokens(raw, ids)
        if self.top is not None and ints:
            self.top += _alternatives(raw, len(ints))
        experts = choice.get("routed_experts")
        if isinstance(experts, str) and self._experts_wanted:
            self._experts = npy_to_int32_b64(experts)  # (a malformed one fails the chunk before its tokens count)
        spans = self.read_versions(choice)
        if spans:
            self._spans = spans
            self.version = spans[-1].version
            stamps = [version_at(spans, len(self.ids) + i) or self.version for i in range(len(ints))]
            events = token_deltas(ints, floats, stamps)
        else:  # every token of the event sampled by its version (a streamed chunk): one delta, or none
            events = self.tokens(ints, floats)
        self.ids += ints
        reason = choice.get("finish_reason")
        if reason == "error":  # (the tokens the chunk brings were sampled and sent: handed out before the error)
            self.fail(BackendError("vLLM: the engine failed the request (finish_reason error)"), events)
        if isinstance(reason, str):
            self._reason, self._stop_reason = reason, choice.get("stop_reason")
        return events

    @staticmethod
    def _tokens(raw: object, ids: object) -> tuple[list[int], list[float]]:
        """A choice's token ids and their logprobs, checked against each other (``raw``: its ``logprobs``)."""
        logprobs, named = read_logprobs(raw)
        if ids is None:  # no return_token_ids: the ids named by the logprob entries
            if any(t is None for t in named):
                raise BackendError("vLLM: a chunk carries neither token_ids nor token-id logprobs")
            ids = named
        if not isinstance(ids, list):
            raise BackendError(f"vLLM: token_ids is not a list: {ids!r}")
        if len(logprobs) != len(ids) or None in logprobs:
            raise BackendError(f"vLLM: {len(ids)} tokens but logprobs {logprobs!r:.200}")
        for token, tid in zip(ids, named, strict=False):
            if tid is not None and tid != token:
                raise BackendError(f"vLLM: logprob entry for {tid} does not match token {token}")
        return [int(t) for t in ids], [float(v) for v in logprobs if v is not None]  # (none is None: checked above)

    def end(self, done: bool) -> list[GenerationEvent]:
        """The finish (held until ``[DONE]`` so the usage chunk is in it)."""
        message = ""
        reason: FinishReason
        matched: int | None = None
        if self._reason is None:
            if not done:
                return []  # cut off: the generation reports the missing finish
            reason, message = "abort", "the stream ended without a finish reason"
        elif self._reason == "stop":
            reason = "stop"
            stop = self._stop_reason
            if isinstance(stop, int) and not isinstance(stop, bool):
                matched = stop
            elif stop is None and self.ids:  # EOS: the last token is the stop token
                matched = self.ids[-1]
        elif self._reason == "length":
            reason = "length"
        else:
            reason = "abort"
            message = "aborted" if self._reason == "abort" else f"finish_reason {self._reason}"
        return [
            GenerateFinish(
                reason=reason,
                matched_stop=matched,
                weight_version=self.version,
                prompt_tokens=self._prompt_tokens,
                cached_tokens=self._cached_tokens,
                message=message,
                routed_experts=self._experts,
                weight_versions=self._spans,
            )
        ]


def npy_base64(raw_le_int32: bytes, shape: tuple[int, ...]) -> str:
    """Base64 of a ``.npy`` file holding little-endian int32 data of ``shape`` (vLLM's format)."""
    dims = ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "")
    header = f"{{'descr': '<i4', 'fortran_order': False, 'shape': ({dims}), }}"
    pad = 64 - (10 + len(header) + 1) % 64
    header += " " * (pad % 64) + "\n"
    blob = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1") + raw_le_int32
    return base64.b64encode(blob).decode("ascii")
