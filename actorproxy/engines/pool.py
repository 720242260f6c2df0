"""The engine pool: several engines behind the one :class:`Backend` interface.

* New sessions go to the healthy engine with the fewest generations in flight
  (ties broken round-robin); a session's later turns stick to the engine that
  served it before, so its prefix stays in that engine's cache.
* Each engine has a concurrency limit; turns beyond it queue (backpressure)
  and the queue length is visible in ``statistics()``.
* A turn whose engine fails before the first token is retried on another
  healthy engine (not when the engine called the request invalid). Only an
  engine that could not be reached at all is marked down; one that answered
  with an error stays up. After the first token an error is the turn's error.
* :meth:`EnginePool.run` checks every engine's health on an interval and
  brings engines back up. An engine that answers "not healthy" is marked down;
  a check that gets no answer (it timed out, or its connection failed) marks it
  down only if nothing came from the engine since the previous round: an engine
  streaming tokens to us is alive, however busy it is to answer its probe.
"""

from __future__ import annotations

import itertools
import logging
from array import array
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import attrs
import trio

from ..core.turn_events import TopLogprobs
from .base import (
    AbortBatch,
    Backend,
    BackendError,
    FinishSink,
    GenerateRequest,
    Generation,
    GenerationEvent,
    ModelInfo,
    TokenDelta,
    TokenSink,
)

log = logging.getLogger(__name__)

#: Sessions whose engine the pool remembers (least recently used forgotten first).
STICKY_CAPACITY = 100_000


@attrs.define(eq=False)
class _Engine:
    backend: Backend
    name: str
    limiter: trio.CapacityLimiter
    healthy: bool = True
    in_flight: int = 0
    queued: int = 0
    requests: int = 0
    failures: int = 0
    #: An event of a generation came from the engine since the health round began (live traffic).
    served: bool = False

    def snapshot(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.backend.kind,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "queued": self.queued,
            "limit": int(self.limiter.total_tokens),
            "requests": self.requests,
            "failures": self.failures,
        }


async def _check(backend: Backend) -> bool | None:
    """The engine's answer to its health check: up or not; ``None`` when no answer came (a transport failure)."""
    health = getattr(backend, "health", None)
    if health is None:
        return True
    try:
        return bool(await health())
    except (BackendError, OSError):
        return None


class EnginePool:
    """Routes generations over several engines (see module docstring)."""

    def __init__(
        self,
        backends: list[Backend],
        *,
        names: list[str] | None = None,
        max_concurrency: int = 256,
        health_interval: float = 5.0,
    ) -> None:
        if not backends:
            raise ValueError("an engine pool needs at least one engine")
        self.kind = backends[0].kind
        names = names or [f"{b.kind}-{i}" for i, b in enumerate(backends)]
        self._engines = [
            _Engine(b, n, trio.CapacityLimiter(max_concurrency)) for b, n in zip(backends, names, strict=True)
        ]
        self._health_interval = health_interval
        self._sticky: OrderedDict[str, _Engine] = OrderedDict()
        self._turn = itertools.count()
        self.retries = 0

    # -- routing ------------------------------------------------------------

    def _choose(self, routing_key: str | None, exclude: set[int]) -> _Engine:
        if routing_key is not None:
            engine = self._sticky.get(routing_key)
            if engine is not None and engine.healthy and id(engine) not in exclude:
                self._sticky.move_to_end(routing_key)
                return engine
        candidates = [e for e in self._engines if e.healthy and id(e) not in exclude]
        if not candidates:
            raise BackendError("no healthy inference engine", status=503)
        start = next(self._turn) % len(self._engines)
        order = self._engines[start:] + self._engines[:start]
        engine = min((e for e in order if e in candidates), key=lambda e: e.in_flight + e.queued)
        if routing_key is not None:
            self._sticky[routing_key] = engine
            self._sticky.move_to_end(routing_key)
            while len(self._sticky) > STICKY_CAPACITY:
                self._sticky.popitem(last=False)
        return engine

    def engines(self) -> list[Backend]:
        """The engines behind the pool (for engine-control calls such as pause)."""
        return [e.backend for e in self._engines]

    def engine_for(self, routing_key: str) -> str | None:
        """The engine a session is pinned to, if any."""
        engine = self._sticky.get(routing_key)
        return None if engine is None else engine.name

    def open_generation(self, request: GenerateRequest) -> AbstractAsyncContextManager[Generation]:
        return _PoolGeneration(self, request)

    def _failed(self, engine: _Engine, error: BackendError, tried: set[int]) -> bool:
        """Account a failure before the first token; whether to retry on another engine.

        An unreachable engine is marked down until a health check brings it
        back; an engine that answered with an error stays up (the error may be
        this request's). A request the engine called invalid is not retried.
        """
        engine.failures += 1
        if error.unreachable and engine.healthy:
            log.warning("engine %s marked down: %s", engine.name, error)
            engine.healthy = False
        if error.status == 400:
            return False
        retry = any(e.healthy and id(e) not in tried for e in self._engines)
        if retry:
            self.retries += 1
        return retry

    # -- health -------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Check every engine's health forever (start it in a nursery)."""
        task_status.started()
        while True:
            await self.check_health()
            await trio.sleep(self._health_interval)

    async def check_health(self) -> None:
        """One round: ask every engine at once (see the module docstring for what an answer does)."""

        async def one(engine: _Engine) -> None:
            live, engine.served = engine.served, False
            answer: bool | None = None
            with trio.move_on_after(max(2.0, self._health_interval)):
                answer = await _check(engine.backend)
            if answer is None:
                if live or engine.served:
                    return  # no answer, but its generations are answered: busy, not down
                why = "its health check got no answer, and nothing else came from it since the last check"
            else:
                why = "its health check answered that it is not healthy"
            healthy = bool(answer)
            if healthy != engine.healthy:
                if healthy:
                    log.warning("engine %s is up again: its health check answered", engine.name)
                else:
                    log.warning("engine %s is down: %s; it gets no turns until a check finds it up", engine.name, why)
            engine.healthy = healthy

        async with trio.open_nursery() as nursery:
            for engine in self._engines:
                nursery.start_soon(one, engine)

    def statistics(self) -> dict[str, Any]:
        return {
            "engines": [e.snapshot() for e in self._engines],
            "sticky_sessions": len(self._sticky),
            "retries": self.retries,
        }

    # -- the rest of Backend ------------------------------------------------

    async def model_info(self) -> ModelInfo:
        errors = []
        for engine in self._engines:
            try:
                return await engine.backend.model_info()
            except BackendError as exc:
                errors.append(exc)
        raise BackendError(f"no engine answered model info: {errors[-1]}")

    async def prompt_logprobs(self, input_ids: array[int]) -> list[float | None]:
        engine = self._choose(None, set())
        async with engine.limiter:
            return await engine.backend.prompt_logprobs(input_ids)

    async def health(self) -> bool:
        return any(e.healthy for e in self._engines)

    async def aclose(self) -> None:
        for engine in self._engines:
            await engine.backend.aclose()


class _PoolGeneration:
    """A generation that may move to another engine until its first token arrives.

    Its own context manager: entering it takes a concurrency slot of an engine (at
    once, without a scheduling round, when one is free) and opens the engine's
    generation; leaving it leaves that generation, then frees the slot.
    """

    def __init__(self, pool: EnginePool, request: GenerateRequest) -> None:
        self._pool = pool
        self._request = request
        self._opened: AbstractAsyncContextManager[Generation] | None = None  # the engine's, entered
        self._generation: Generation | None = None
        self._iterator: AsyncIterator[GenerationEvent] | None = None
        self._engine: _Engine | None = None
        self._started = False
        self._tried: set[int] = set()
        self.rid = request.rid

    async def __aenter__(self) -> _PoolGeneration:
        await self.connect(set())
        return self

    @property
    def top_logprobs(self) -> list[TopLogprobs] | None:
        """The engine's generation's alternatives of its tokens, when asked for (``Generation``)."""
        return getattr(self._generation, "top_logprobs", None)

    async def __aexit__(self, *exc_info: object) -> None:
        await self._leave()

    async def connect(self, tried: set[int]) -> None:
        while True:
            engine = self._pool._choose(self._request.routing_key, tried)
            tried.add(id(engine))
            limiter = engine.limiter
            try:
                limiter.acquire_nowait()  # a free slot: no scheduling round (the engine call yields anyway)
            except trio.WouldBlock:
                engine.queued += 1
                try:
                    await limiter.acquire()
                finally:
                    engine.queued -= 1
            engine.in_flight += 1
            engine.requests += 1
            opened = engine.backend.open_generation(self._request)
            try:
                generation = await opened.__aenter__()
            except BaseException as exc:
                self._release(engine)
                if isinstance(exc, BackendError) and self._pool._failed(engine, exc, tried):
                    continue
                raise
            self._opened, self._engine, self._generation = opened, engine, generation
            self._iterator = generation.__aiter__()
            self._tried = tried
            return

    async def _leave(self) -> None:
        """Leave the engine's generation (as after a clean exit: it sends its own abort if it must), free the slot."""
        opened, engine = self._opened, self._engine
        self._opened = None
        if opened is None or engine is None:
            return
        try:
            await opened.__aexit__(None, None, None)
        finally:
            self._release(engine)

    @staticmethod
    def _release(engine: _Engine) -> None:
        engine.in_flight -= 1
        engine.limiter.release()

    def __aiter__(self) -> _PoolGeneration:
        return self

    def __anext__(self) -> Awaitable[GenerationEvent]:
        """Once a token came, the engine's own next event: no frame of this wrapper's per streamed token."""
        if self._started:
            assert self._iterator is not None
            return self._iterator.__anext__()
        return self._next_before_a_token()

    def relay(self, take: TokenSink, ended: FinishSink | None = None) -> Awaitable[None] | None:
        """Once a token came (the generation stays on its engine), the engine's own relay, if it has one."""
        if not self._started:
            return None
        relay = getattr(self._generation, "relay", None)
        return relay(take, ended) if relay is not None else None

    async def _next_before_a_token(self) -> GenerationEvent:
        while True:
            assert self._iterator is not None and self._engine is not None
            try:
                event = await self._iterator.__anext__()
                self._engine.served = True
            except BackendError as exc:
                # Nothing was generated yet: the turn can move to another engine.
                await self._leave()
                if not self._pool._failed(self._engine, exc, self._tried):
                    raise
                await self.connect(self._tried)
                continue
            if isinstance(event, TokenDelta):
                self._started = True
            return event

    def abort_soon(self, batch: AbortBatch | None = None) -> Callable[[], Awaitable[None]] | None:
        if self._generation is not None:
            return self._generation.abort_soon(batch)
        return self.abort

    async def abort(self) -> None:
        if self._generation is not None:
            await self._generation.abort()
