"""The simulated server's shared state and its one way to run a generation.

Every protocol route turns its request into a :class:`~actorproxy.engines.base.GenerateRequest`
and iterates :func:`run_generation`, which waits while generation is paused,
registers the request for aborts, merges the finish into the chunk of the last
token (as real engines report them together) and keeps a :class:`RequestRecord`
of what happened, including client disconnects and injected connection drops.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any, Literal

import attrs
import trio

from ..config.sim_engine import SimConfig
from ..engines.base import BackendError, GenerateFinish, GenerateRequest, TokenDelta
from .engine import SimEngine
from .faults import DropConnection, SimFaults
from .generation import SimGeneration
from .wire import BadField

Protocol = Literal["sglang", "vllm", "llamacpp"]
Status = Literal["waiting", "running", "finished", "aborted", "disconnected", "dropped", "failed"]


def served_engine(**fields: Any) -> SimConfig:
    """The engine config ``actorproxy sim`` serves by default: :class:`SimConfig`'s defaults, ``fields`` set.

    One default differs, as SGLang's does: the initial ``weight_version`` is ``"default"``.
    """
    return SimConfig(**({"weight_version": "default"} | fields))


@attrs.frozen
class SimServerSettings:
    """Settings of ``actorproxy sim``: the served engine and the server flags it imitates."""

    host: str = "127.0.0.1"
    port: int = 30000
    #: The engine the server builds (``--token-interval``, ``--prefill-latency``, ``--seed``,
    #: ``--reply-tokens``, ``--stream-interval``, ``--decode-steps``, ``--weight-version``,
    #: ``--max-model-len`` set its fields of those names); its ``model_id`` is :attr:`model_path`.
    #: An engine passed in explicitly keeps its own config.
    engine: SimConfig = attrs.field(factory=served_engine)
    #: SGLang ``--incremental-streaming-output``: stream deltas instead of cumulative outputs.
    incremental_streaming_output: bool = False
    #: SGLang / vLLM ``--enable-return-routed-experts``.
    enable_return_routed_experts: bool = False
    #: Reported by ``/get_model_info`` and ``/v1/models``, and the built engine's ``model_id``.
    model_path: str = "actorproxy-sim"
    #: Reported as ``tokenizer_path``; ``None``: the tokenizer's name.
    tokenizer_path: str | None = None
    #: ``False`` imitates a vLLM 0.32 without ``--enable-scale-out``: ``/inference/v1/generate``
    #: and ``/inference/v1/abort_requests`` answer 403 and ``/openapi.json`` does not list them.
    vllm_generate_endpoint: bool = True
    #: ``False`` imitates a vLLM without ``VLLM_SERVER_DEV_MODE=1``: no ``/pause``, ``/resume``,
    #: ``/is_paused``, ``/abort_requests``, ``/weight_info`` or ``/update_weight_version``.
    vllm_dev_mode: bool = True
    #: Requests remembered for ``GET /sim/requests``.
    record_capacity: int = 1000
    #: Seconds shutdown waits for responses in flight (generations are aborted first).
    shutdown_grace: float = 2.0

    def __attrs_post_init__(self) -> None:
        if self.engine.model_id not in (attrs.fields(SimConfig).model_id.default, self.model_path):
            raise ValueError("SimServerSettings: set the model name with model_path, not engine.model_id")

    def engine_config(self) -> SimConfig:
        """The config of the engine the server builds: :attr:`engine` with ``model_path`` as its model id."""
        return attrs.evolve(self.engine, model_id=self.model_path)


@attrs.define
class RequestRecord:
    """What the server did with one generate request (see ``GET /sim/requests``)."""

    rid: str
    protocol: Protocol
    stream: bool
    prompt_tokens: int
    status: Status = "waiting"
    finish_reason: str | None = None
    #: Tokens sent to the client (the engine's own view: ``engine.stats(rid)``).
    sent_tokens: int = 0
    message: str = ""

    def to_json(self, engine: SimEngine) -> dict[str, Any]:
        data = attrs.asdict(self)
        try:
            stats = engine.stats(self.rid)
        except KeyError:
            return data | {"output_ids": [], "engine_finish_reason": None, "aborted": False, "cancelled": False}
        return data | {
            "output_ids": list(stats.token_ids),
            "engine_finish_reason": stats.finish_reason,
            "aborted": stats.aborted,
            "cancelled": stats.cancelled,
        }


@attrs.frozen
class Chunk:
    """Tokens produced since the previous chunk, with the finish when it came with them."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    versions: tuple[str, ...]
    finish: GenerateFinish | None = None


class PauseGate:
    """Holds new requests while generation is paused (SGLang ``/pause_generation``, vLLM ``/pause``)."""

    def __init__(self) -> None:
        self._open = trio.Event()
        self._open.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def close(self) -> None:
        if self._open.is_set():
            self._open = trio.Event()

    def open(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        await self._open.wait()


class SimState:
    """Everything the routes share: the engine, the settings, faults, the pause gate, records."""

    def __init__(self, engine: SimEngine, settings: SimServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.faults = SimFaults(engine)
        self.gate = PauseGate()
        self.closing = False
        #: Abort calls received (SGLang ``/abort_request``, vLLM's ``abort_requests``).
        self.abort_calls = 0
        self._running: dict[str, tuple[SimGeneration, tuple[str, ...]]] = {}
        self._running_changed = trio.Event()
        self.records: OrderedDict[str, RequestRecord] = OrderedDict()
        #: ``(path, body)`` of the latest requests to the parsing endpoints (``parse_routes``).
        self.parse_requests: deque[tuple[str, dict[str, Any]]] = deque(maxlen=settings.record_capacity)
        #: Routes that only refuse (vLLM's disabled scale-out routes): left out of ``/openapi.json``.
        self.unlisted: set[str] = set()

    @property
    def running(self) -> int:
        """Requests generating (entered the engine, final chunk not yet produced)."""
        return len(self._running)

    async def wait_idle(self) -> None:
        """Return once no request is generating."""
        while self._running:
            await self._running_changed.wait()

    def _unregister(self, rid: str) -> None:
        self._running.pop(rid, None)
        changed, self._running_changed = self._running_changed, trio.Event()
        changed.set()

    @property
    def tokenizer_path(self) -> str:
        return self.settings.tokenizer_path or self.engine.tokenizer.name

    def check_new(self, request: GenerateRequest) -> None:
        """Refuse what the engine would refuse, before a streamed response starts."""
        limit = self.engine.config.max_model_len
        if len(request.input_ids) >= limit:
            raise BackendError(
                f"The input ({len(request.input_ids)} tokens) is longer than the model's context "
                f"length ({limit} tokens).",
                status=400,
            )
        record = self.records.get(request.rid)
        if request.rid in self._running or (record is not None and record.status in ("waiting", "running")):
            raise BackendError(f"Duplicate request id {request.rid!r}: a request with this id is running", status=400)

    # -- aborts -------------------------------------------------------------

    def abort_prefix(self, rid: str, *, abort_all: bool = False) -> int:
        """SGLang's ``/abort_request``: a no-op unless ``rid`` is running (or ``abort_all``);
        then every running request whose rid starts with ``rid`` stops."""
        if abort_all:
            return self.abort_matching(lambda names: True)
        if not rid or rid not in self._running:
            return 0
        return self.abort_matching(lambda names: names[0].startswith(rid))

    def abort_ids(self, ids: list[str]) -> int:
        """vLLM's abort: exact ids, as sent or as the response names them (``cmpl-...``)."""
        wanted = set(ids)
        return self.abort_matching(lambda names: not wanted.isdisjoint(names))

    def abort_matching(self, match: Callable[[tuple[str, ...]], bool]) -> int:
        count = 0
        for gen, names in list(self._running.values()):
            if match(names):
                gen.abort_nowait()  # synchronous: every abort takes effect at the same instant
                count += 1
        return count

    # -- records ------------------------------------------------------------

    def _record(self, record: RequestRecord) -> None:
        self.records[record.rid] = record
        self.records.move_to_end(record.rid)
        while len(self.records) > self.settings.record_capacity:
            self.records.popitem(last=False)

    def fail(self, rid: str, protocol: Protocol, stream: bool, prompt_tokens: int, message: str) -> None:
        self._record(RequestRecord(rid, protocol, stream, prompt_tokens, "failed", message=message))

    def take_failure(self, request: GenerateRequest, protocol: Protocol, *, stream: bool) -> bool:
        """Whether an armed fault fails ``request`` (recorded as failed); the route answers it with a 500."""
        if not self.faults.take_failure():
            return False
        self.fail(request.rid, protocol, stream, len(request.input_ids), "injected failure")
        return True


async def run_generation(
    state: SimState,
    request: GenerateRequest,
    *,
    protocol: Protocol,
    stream: bool,
    names: tuple[str, ...] = (),
    drop_after: int | None = None,
) -> AsyncGenerator[Chunk, None]:
    """Chunks of one generation; the last one carries the ``GenerateFinish``. Iterate it
    inside ``contextlib.aclosing`` so leaving early unregisters it at once.

    Raises :class:`BackendError` for a prompt that does not fit or a duplicate id.
    Waits while generation is paused. ``drop_after``: raise :class:`DropConnection`
    once that many tokens were yielded. Leaving early (a client disconnect cancels
    the handler) aborts the generation at once and records ``"disconnected"``.
    """
    state.check_new(request)  # a duplicate must not overwrite the running request's record
    record = RequestRecord(request.rid, protocol, stream, len(request.input_ids))
    state._record(record)
    done = False
    try:
        await state.gate.wait_open()
        if state.closing:
            raise BackendError("the server is shutting down", status=503)
        record.status = "running"
        async with state.engine.open_generation(request) as gen:
            state._running[request.rid] = (gen, (request.rid, *names))
            try:
                if drop_after == 0:
                    raise DropConnection("fault: connection dropped before the first token")
                every = state.engine.config.stream_interval if stream else 1
                async for event in gen:
                    finish: GenerateFinish | None
                    if isinstance(event, TokenDelta):
                        finish, events = None, [event]
                        # A burst: the next tokens (each on its own schedule) until there are
                        # ``every`` or the generation ends.
                        while len(events) < every and not gen.final_ready:
                            more = await gen.__anext__()
                            if isinstance(more, GenerateFinish):
                                finish = more
                                break
                            events.append(more)
                        if finish is None and gen.final_ready:
                            last = await gen.__anext__()
                            finish = last if isinstance(last, GenerateFinish) else None
                        chunk = _burst(events, finish)
                    else:
                        finish, chunk = event, Chunk((), (), (), event)
                    record.sent_tokens += len(chunk.token_ids)
                    if finish is not None:
                        record.finish_reason = finish.reason
                        record.status = "aborted" if finish.reason == "abort" else "finished"
                        done = True
                    yield chunk
                    if done:
                        return
                    if drop_after is not None and record.sent_tokens >= drop_after:
                        raise DropConnection(f"fault: connection dropped after {drop_after} tokens")
            finally:
                state._unregister(request.rid)
    except DropConnection:
        record.status, done = "dropped", True
        raise
    except BackendError as exc:
        record.status, record.message, done = "failed", str(exc), True
        raise
    finally:
        if not done:
            record.status = "disconnected"


def _burst(events: list[TokenDelta], finish: GenerateFinish | None) -> Chunk:
    if len(events) == 1:
        event = events[0]
        return Chunk(event.token_ids, event.logprobs, (event.weight_version,) * len(event.token_ids), finish)
    ids = tuple(i for e in events for i in e.token_ids)
    lps = tuple(lp for e in events for lp in e.logprobs)
    versions = tuple(e.weight_version for e in events for _ in e.token_ids)
    return Chunk(ids, lps, versions, finish)


async def collect(
    state: SimState, request: GenerateRequest, *, protocol: Protocol
) -> tuple[list[int], list[float], list[str], GenerateFinish]:
    """Run a generation to its end: ids, logprobs, per-token versions and the finish."""
    ids: list[int] = []
    lps: list[float] = []
    versions: list[str] = []
    async with aclosing(run_generation(state, request, protocol=protocol, stream=False)) as chunks:
        async for chunk in chunks:
            ids += chunk.token_ids
            lps += chunk.logprobs
            versions += chunk.versions
            if chunk.finish is not None:
                return ids, lps, versions, chunk.finish
    raise BackendError("the generation ended without a finish", status=500)


def default_max_tokens(state: SimState, prompt_len: int) -> int:
    """Room left in the context window (vLLM's default for the tokens endpoint)."""
    return max(0, state.engine.config.max_model_len - prompt_len)


def check_sampling(stop: str | list[str] | None) -> None:
    """Refuse what the simulator cannot honour rather than silently ignore it."""
    if stop:
        raise BadField("stop strings are not supported by the simulated engine; use stop_token_ids")
