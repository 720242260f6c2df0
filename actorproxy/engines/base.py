"""The interface every inference engine client implements.

A backend turns a :class:`GenerateRequest` (token ids in) into a stream of
:class:`TokenDelta` events (token ids, logprobs and weight version out) that
ends with exactly one :class:`GenerateFinish`.  The simulated engine, the
SGLang client and the vLLM client all implement :class:`Backend`, so the
session actors never know which engine they talk to.

Cancellation is structured: a caller that stops early simply leaves the
``async with backend.open_generation(...)`` block (or has its cancel scope
cancelled); the backend then closes its stream and tells the engine to stop.
:meth:`Generation.abort` is the *acknowledged* form: the engine is asked to stop
at the next token boundary and the stream goes on to a final
``GenerateFinish(reason="abort")``, so every token the engine produced is
delivered before the stream ends.
"""

from __future__ import annotations

from array import array
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Literal, Protocol

import attrs

from ..core.ids import uuid4_hex
from ..http.sockets import WakeLater

FinishReason = Literal["stop", "length", "abort"]

#: The header that keeps a session on one engine worker behind sgl-model-gateway.
ROUTING_HEADER = "X-SMG-Routing-Key"


def new_rid() -> str:
    """A fresh request id: 32 hex digits, so no id is a prefix of another.

    SGLang aborts by rid *prefix*; fixed-length random ids keep that safe.
    """
    return uuid4_hex()


@attrs.frozen(cache_hash=True)
class SamplingParams:
    """Sampling settings sent to the engine explicitly (never a server default).

    A runtime makes one per setting its turns ask for (``runtime/generate.py: Samplings``), and
    each engine keys its body's template on it: its hash is computed once.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: No stop id (``stop_token_ids``, or the model's end of text) is sampled before this many tokens.
    min_tokens: int = 0
    #: The engine does not stop on the model's end-of-text ids (then ``stop_token_ids`` holds only the call's own).
    ignore_eos: bool = False
    #: How many of each sampled token's most likely alternatives to report (OpenAI's ``top_logprobs``):
    #: the generation's ``top_logprobs`` (see :class:`Generation`). 0: none asked, none read.
    top_logprobs: int = 0


@attrs.frozen
class GenerateRequest:
    """One generation: the exact prompt token ids and how to sample."""

    input_ids: array[int]  # array('i'): the prompt, exactly as the engine must see it
    sampling: SamplingParams
    rid: str = attrs.field(factory=new_rid)
    #: Keeps a session on one engine worker (sent as ``X-SMG-Routing-Key``).
    routing_key: str | None = None
    #: Ask the engine for the MoE experts each token was routed to (R3).
    return_routed_experts: bool = False


@attrs.frozen
class TokenDelta:
    """Tokens the engine sampled since the previous event, in order."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    #: The weight version that sampled these tokens, as the engine names it.
    weight_version: str


@attrs.frozen
class WeightVersionSpan:
    """Output tokens ``[start, end)`` (indexes into the generation) sampled by ``version``."""

    version: str
    start: int
    end: int


@attrs.frozen
class GenerateFinish:
    """The last event of every generation stream."""

    reason: FinishReason
    #: The stop token id that ended the generation (it is also the last
    #: sampled token), when ``reason == "stop"``.
    matched_stop: int | None = None
    weight_version: str = "0"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    message: str = ""
    #: Base64 of little-endian int32 ``[prompt + completion - 1, layers, topk]``
    #: when ``return_routed_experts`` was asked and the engine supports it.
    routed_experts: str | None = None
    #: The engine's authoritative per-token versions, when it reports spans. vLLM
    #: sends them only at the end, so its TokenDelta stamps are a best guess and
    #: these spans win; empty when the engine reports none.
    weight_versions: tuple[WeightVersionSpan, ...] = ()


GenerationEvent = TokenDelta | GenerateFinish


@attrs.frozen
class ModelInfo:
    model_id: str
    max_model_len: int | None
    weight_version: str


class AbortBatch:
    """The aborts one pause asks for: while it asks (:attr:`open`), an engine may send them as one call,
    or hold them back to write them together when the pause has asked them all (:meth:`close`)."""

    def __init__(self) -> None:
        #: The pause is asking (one synchronous pass): every abort asked meanwhile is in the batch.
        self.open = True
        #: Per engine client, what it keeps of the batch (its one call and who joined it).
        self.shared: dict[object, Any] = {}
        #: What is left of the batch's calls (reading their answers): awaited by the pause while it waits for
        #: its generations, a task a connection, not one a generation (cancelled once they all ended).
        self.rest: list[Callable[[], Awaitable[None]]] = []
        self._on_close: list[Callable[[], None]] = []

    def on_close(self, send: Callable[[], None]) -> None:
        """Call ``send`` (an engine's aborts held back while the pause asks) when the batch closes."""
        self._on_close.append(send)

    def close(self) -> None:
        """The pause has asked every generation: what the engines held back goes out now."""
        self.open = False
        sends, self._on_close = self._on_close, []
        for send in sends:
            send()


#: Takes tokens relayed straight from the engine's read (``Generation.relay``): their ids, logprobs and
#: the weight version that sampled them all. It answers whether to go on, or an awaitable of that to
#: await before anything more is read (the agent reads slowly: back-pressure).
TokenSink = Callable[[Sequence[int], Sequence[float], str], bool | Awaitable[bool]]
#: Told an aborted generation's finish as the relay reads it, every token before it taken: ``False`` to
#: wake the relaying task now, or where its wake-up waits (see ``Generation.relay``).
FinishSink = Callable[[GenerateFinish], bool | WakeLater]


class Generation(Protocol):
    """A running generation: iterate it for events, abort it for a clean stop.

    A generation over a stream may also offer ``relay(take: TokenSink) -> Awaitable[None] | None``:
    while only plain tokens come (one weight version, nothing else pending), each read's tokens
    go to ``take`` directly, without a :class:`TokenDelta` or an iteration each; the awaitable
    returns when anything else comes (iterate on for it), or when ``take`` answered ``False``.
    ``None``: nothing to relay now (iterate). It may take ``ended`` too (a :data:`FinishSink`): once
    an abort was asked, the read that brings the finish has its tokens taken by ``take`` in the read's
    task, and then ``ended`` is told the finish there, before the relaying task wakes (it still iterates
    the finish). A pause's thousand streams end in the relay hub's task, their tasks' own work after
    the pause's answer.

    A generation whose request asked for ``sampling.top_logprobs`` also offers ``top_logprobs``: a list of
    :data:`~actorproxy.core.turn_events.TopLogprobs`, one for each token handed out so far, in their order
    (read once the stream ended).
    """

    rid: str

    def __aiter__(self) -> AsyncIterator[GenerationEvent]: ...

    async def abort(self) -> None:
        """Ask the engine to stop at the next token boundary.

        The iterator then yields the remaining tokens and a final
        ``GenerateFinish(reason="abort")``. Safe to call more than once and
        after the stream ended.
        """
        ...

    def abort_soon(self, batch: AbortBatch | None = None) -> Callable[[], Awaitable[None]] | None:
        """:meth:`abort`, begun before this returns: what is left of it, to await in a task, or ``None``.

        Where the engine allows, the abort call is sent now, without a scheduling round
        (a pause asks a thousand generations at once, and the engine streams on until
        each call arrives); what is returned then only reads the answer. Aborts asked
        with the same ``batch`` (one pause) may go to the engine as one call: only one
        of them is then left something to await.
        """
        ...


class Backend(Protocol):
    """An inference engine as the session actors see it."""

    #: Short kind name: ``"sim"``, ``"sglang"``, ``"vllm"``.
    kind: str

    def open_generation(self, request: GenerateRequest) -> AbstractAsyncContextManager[Generation]:
        """Start a generation. Leaving the block stops it (and tells the engine)."""
        ...

    async def model_info(self) -> ModelInfo: ...

    async def prompt_logprobs(self, input_ids: array[int]) -> list[float | None]:
        """The engine's logprob of every prompt token given the ones before it.

        The first entry is ``None`` (nothing precedes it). Used to recompute
        real logprobs for a rebuilt prefix.
        """
        ...

    async def aclose(self) -> None: ...


class BackendError(Exception):
    """The engine failed (connection refused, HTTP error, malformed stream)."""

    def __init__(self, message: str, *, status: int = 502, unreachable: bool = False) -> None:
        super().__init__(message)
        self.status = status
        #: The engine could not be reached at all (connection refused, reset, dropped):
        #: the pool marks it down, rather than blaming one request.
        self.unreachable = unreachable
