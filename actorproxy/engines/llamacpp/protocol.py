"""llama.cpp's ``/completion`` wire format, shared by the client and the simulated routes.

The request (:class:`CompletionRequest`: the client builds it with every sampler set,
the simulated server structures it with the wire converter), the final event of a
completion (:class:`CompletionResult`), the ``stop_type`` of each finish
(:data:`STOP_TYPES`) and the sans-IO reader of a ``/completion`` stream
(:class:`LlamaCppStreamParser`), which also enforces stop ids and the token limit.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from ...core.turn_events import TopLogprobs
from ...schema.converter import CONVERTER, TokenIds, at_least
from ..base import BackendError, FinishReason, GenerateFinish, GenerationEvent, SamplingParams
from ..connection import BodyTemplate
from ..errors import error_message, stream_error_status
from ..stream_events import StreamDecoder, checked_alternatives

if TYPE_CHECKING:
    from ..base import GenerateRequest

COMPLETION_PATH = "/completion"
#: Our finish reason -> llama.cpp's ``stop_type`` (read back by :class:`LlamaCppStreamParser`).
STOP_TYPES = {"stop": "eos", "length": "limit", "abort": "none"}


@attrs.frozen
class CompletionRequest:
    """A ``POST /completion`` body: the fields we send, with llama.cpp's defaults when absent.

    :meth:`of` is the client's request (every sampler set, neutral unless asked: the
    server's defaults are not); the simulated server reads any body into this class.
    Unknown fields are tolerated (llama.cpp has many more). ``prompt`` is token ids
    (a text prompt is llama.cpp's, but not ours to send).
    """

    prompt: TokenIds | str
    n_predict: int = attrs.field(default=-1, validator=at_least(-1))  # -1: until the context is full
    temperature: float = attrs.field(default=0.8, validator=at_least(0.0))
    top_k: int = 40
    top_p: float = attrs.field(default=0.95, validator=at_least(0.0))
    min_p: float = attrs.field(default=0.05, validator=at_least(0.0))
    typical_p: float = 1.0
    dynatemp_range: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.0
    xtc_probability: float = 0.0
    mirostat: int = 0
    min_keep: int = 0
    seed: int = -1  # -1: random
    ignore_eos: bool | None = None  # None: absent, the server's own setting
    stop: list[str] = attrs.field(factory=list)
    n_probs: int = attrs.field(default=0, validator=at_least(0))
    post_sampling_probs: bool = False
    return_tokens: bool = False
    stream: bool = False
    cache_prompt: bool = True

    @classmethod
    def of(cls, input_ids: array[int], s: SamplingParams) -> CompletionRequest:
        """Our streamed request for ``input_ids``: sampled as ``s`` asks, every other sampler off."""
        return cls(
            prompt=TokenIds(input_ids),
            n_predict=s.max_new_tokens,
            temperature=s.temperature,
            top_k=s.top_k if s.top_k > 0 else 0,  # 0: the whole vocabulary
            top_p=s.top_p,
            min_p=s.min_p,
            # The penalties' window (llama.cpp's penalties sampler uses it for all three): off unless one is asked.
            repeat_last_n=-1 if (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) != (0.0, 0.0, 1.0)
            else 0,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            repeat_penalty=s.repetition_penalty,
            seed=s.seed if s.seed is not None else -1,
            ignore_eos=s.ignore_eos,
            n_probs=max(s.top_logprobs, 1),  # (1: the sampled token's logprob alone)
            return_tokens=True,
            stream=True,
        )


@attrs.frozen
class CompletionTimings:
    prompt_n: int
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float
    #: Prompt tokens taken from the cache (read by :class:`LlamaCppStreamParser`).
    cache_n: int = 0


@attrs.frozen(kw_only=True)
class CompletionResult:
    """A whole completion, or the final event of a stream (``stop: true``), in llama.cpp's key order.

    :class:`LlamaCppStreamParser` reads ``tokens``, ``stop``, ``stop_type`` and
    ``timings.cache_n`` of it. ``completion_probabilities`` (present with ``n_probs``
    on a whole completion) stays plain JSON, as the entries of the per-token events do.
    """

    __wire_omit_if_default__ = ("completion_probabilities",)

    index: int = 0
    content: str
    tokens: list[int]
    id_slot: int = 0
    stop: bool = True
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: dict[str, Any]
    prompt: str
    has_new_line: bool
    truncated: bool = False
    stop_type: str
    stopping_word: str = ""
    tokens_cached: int = 0
    timings: CompletionTimings
    completion_probabilities: list[dict[str, Any]] | None = None


def completion_bytes(request: GenerateRequest) -> bytes:
    """The streamed ``/completion`` body of ``request`` as JSON bytes (:meth:`CompletionRequest.of`'s, from the
    template written once for its sampling settings)."""
    sampling = request.sampling
    template = BodyTemplate.kept(
        _TEMPLATES, sampling, lambda: CONVERTER.unstructure(CompletionRequest.of(array("i"), sampling)), ("prompt",))
    return template.fill(request.input_ids)


_TEMPLATES: dict[SamplingParams, BodyTemplate] = {}


def _entry_logprob(entry: object, token: int) -> float:
    if not isinstance(entry, Mapping):
        raise BackendError(f"llama.cpp: malformed completion_probabilities entry {entry!r:.200}")
    if isinstance(entry.get("id"), int) and entry["id"] != token:
        raise BackendError(f"llama.cpp: probability entry for {entry['id']} does not match token {token}")
    if isinstance(entry.get("logprob"), int | float):
        return float(entry["logprob"])
    if isinstance(entry.get("prob"), int | float):  # post_sampling_probs
        return math.log(entry["prob"]) if entry["prob"] > 0 else -math.inf
    for candidate in entry.get("probs") or ():  # older builds: top-n probabilities
        if isinstance(candidate, Mapping) and (
            candidate.get("id") == token or candidate.get("tok_str", object()) == entry.get("content")
        ):
            prob = float(candidate.get("prob", 0.0))
            return math.log(prob) if prob > 0 else -math.inf
    return math.nan  # the sampled token is not among the reported ones


def _alternatives(entry: Mapping[str, Any]) -> TopLogprobs:
    """A probability entry's ``top_logprobs`` (asked with ``n_probs``): its ``id``/``logprob`` pairs."""
    top = entry.get("top_logprobs")
    if type(top) is not list:
        raise BackendError(f"llama.cpp: a probability entry without top_logprobs: {entry!r:.200}")
    pairs = [(a.get("id"), a.get("logprob")) if type(a) is dict else (None, None) for a in top]
    return checked_alternatives(pairs, "llama.cpp", top)


class LlamaCppStreamParser(StreamDecoder):
    """Sans-IO reader of one ``/completion`` stream, enforcing stop ids and the limit."""

    what = "llama.cpp"

    def __init__(self, *, stop_token_ids: tuple[int, ...], max_new_tokens: int, prompt_len: int, version: str) -> None:
        super().__init__()
        self.ids: list[int] = []
        self.version = version
        self._stops = frozenset(stop_token_ids)
        self._limit = max_new_tokens
        self._prompt_len = prompt_len

    def feed(self, payload: Mapping[str, Any]) -> list[GenerationEvent]:
        if "error" in payload:
            message = error_message(payload)
            raise BackendError(f"llama.cpp: {message}", status=stream_error_status(payload["error"], message))
        tokens = payload.get("tokens") or []
        final = payload.get("stop") is True
        if (not final and type(tokens) is list and len(tokens) == 1 and type(token := tokens[0]) is int
                and type(probs := payload.get("completion_probabilities")) is list and len(probs) == 1
                and type(entry := probs[0]) is dict and type(value := entry.get("logprob")) is float
                and ((named := entry.get("id")) is None or (type(named) is int and named == token))
                and len(self.ids) + 1 < self._limit and token not in self._stops):
            # A streamed event's one token, its entry plain and naming it, neither the limit nor a stop id:
            # what the loop below makes of it, read directly (no generator, zip or ABC checks).
            self.ids.append(token)
            if self.top is not None:
                self.top.append(_alternatives(entry))
            return self.tokens(tokens, [value])
        if final and tokens == self.ids:
            tokens = []  # a final event repeating the whole output, not new tokens
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise BackendError(f"llama.cpp: malformed tokens {tokens!r:.200}")
        probs = payload.get("completion_probabilities") or []
        if tokens and (not isinstance(probs, list) or len(probs) != len(tokens)):
            raise BackendError(f"llama.cpp: {len(tokens)} tokens but probabilities {probs!r:.200} (n_probs ignored?)")
        ids: list[int] = []
        logprobs: list[float] = []
        for token, entry in zip(tokens, probs, strict=False):
            ids.append(token)
            logprobs.append(_entry_logprob(entry, token))
            if self.top is not None:
                self.top.append(_alternatives(entry))
            ended = self._client_stop(len(self.ids) + len(ids), token)
            if ended is not None:
                return self._out(ids, logprobs) + [ended]
        events = self._out(ids, logprobs)
        if final:
            events.append(self._finish(payload))
        return events

    def _client_stop(self, count: int, token: int) -> GenerateFinish | None:
        # The limit wins over a stop id on the same token, as in SGLang and the sim.
        if count >= self._limit:
            return self.finish_event("length")
        if token in self._stops:
            return self.finish_event("stop", token)
        return None

    def _out(self, ids: list[int], logprobs: list[float]) -> list[GenerationEvent]:
        self.ids.extend(ids)
        return self.tokens(ids, logprobs)

    def _finish(self, payload: Mapping[str, Any]) -> GenerateFinish:
        kind = payload.get("stop_type")
        if kind is None:  # older builds: one boolean per cause
            kind = "eos" if payload.get("stopped_eos") else "limit" if payload.get("stopped_limit") else None
            kind = kind or ("word" if payload.get("stopped_word") else "none")
        timings = payload.get("timings")
        cached = timings.get("cache_n") if isinstance(timings, Mapping) else None
        if kind == "eos":
            return self.finish_event("stop", self.ids[-1] if self.ids else None, cached)
        if kind == "limit":
            return self.finish_event("length", cached=cached)
        if kind == "word":
            return self.finish_event("stop", cached=cached)
        return self.finish_event("abort", cached=cached, message=f"llama.cpp stop_type {kind}")

    def finish_event(
        self, reason: FinishReason, matched: int | None = None, cached: object = None, message: str = ""
    ) -> GenerateFinish:
        """The generation's finish event (also the client's own, when it stops reading first)."""
        return GenerateFinish(
            reason=reason,
            matched_stop=matched,
            weight_version=self.version,
            prompt_tokens=self._prompt_len,
            cached_tokens=cached if isinstance(cached, int) else 0,
            message=message,
        )

    def end(self, done: bool) -> list[GenerationEvent]:
        return []  # no final event: the generation reports the missing finish
