"""The engine pool over in-process engines: routing, stickiness, failover, backpressure."""

from __future__ import annotations

from array import array
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from actorproxy.engines.base import BackendError, GenerateFinish, GenerateRequest, ModelInfo, SamplingParams
from actorproxy.engines.pool import EnginePool
from actorproxy.sim import SimConfig, SimEngine

INTERVAL = 0.01


@attrs.define
class Flaky:
    """A sim engine that fails its next ``fail_open`` opens, or ``fail_first`` streams before any token."""

    inner: SimEngine
    fail_open: int = 0
    fail_first: int = 0
    kind: str = "sim"
    opened: int = 0
    up: bool = True
    error: BackendError | None = None

    @asynccontextmanager
    async def open_generation(self, request: GenerateRequest) -> AsyncIterator[Any]:
        self.opened += 1
        if self.fail_open > 0:
            self.fail_open -= 1
            raise self.error or BackendError("connection refused", unreachable=True)
        if self.fail_first > 0:
            self.fail_first -= 1
            yield _Broken()
            return
        async with self.inner.open_generation(request) as generation:
            yield generation

    async def model_info(self) -> ModelInfo:
        return await self.inner.model_info()

    async def prompt_logprobs(self, input_ids: array[int]) -> list[float | None]:
        return await self.inner.prompt_logprobs(input_ids)  # type: ignore[attr-defined, no-any-return]

    async def health(self) -> bool:
        return self.up

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Broken:
    rid = "broken"

    def __aiter__(self) -> _Broken:
        return self

    async def __anext__(self) -> Any:
        raise BackendError("stream dropped before the first token", unreachable=True)

    async def abort(self) -> None:
        pass

    def abort_soon(self, batch: Any = None) -> None:
        pass


def _request(tokenizer: Any, key: str | None) -> GenerateRequest:
    return GenerateRequest(tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"),
                           SamplingParams(max_new_tokens=5), routing_key=key)


async def _drain(pool: EnginePool, request: GenerateRequest) -> GenerateFinish:
    async with pool.open_generation(request) as generation:
        async for event in generation:
            if isinstance(event, GenerateFinish):
                return event
    raise AssertionError("no finish")


def _engines(tokenizer: Any, n: int) -> list[Flaky]:
    return [Flaky(SimEngine(tokenizer, SimConfig(seed=i, token_interval=INTERVAL))) for i in range(n)]


async def test_round_robin_and_sticky_sessions(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    engines = _engines(tokenizer, 3)
    pool = EnginePool(list(engines), names=["a", "b", "c"])
    for i in range(6):
        await _drain(pool, _request(tokenizer, f"s{i}"))
    assert [e.opened for e in engines] == [2, 2, 2]
    pinned = {f"s{i}": pool.engine_for(f"s{i}") for i in range(6)}
    for i in range(6):
        await _drain(pool, _request(tokenizer, f"s{i}"))
        assert pool.engine_for(f"s{i}") == pinned[f"s{i}"]
    assert [e.opened for e in engines] == [4, 4, 4]


async def test_failover_before_first_token(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    engines = _engines(tokenizer, 3)
    pool = EnginePool(list(engines), names=["a", "b", "c"])
    await _drain(pool, _request(tokenizer, "s"))
    home = pool.engine_for("s")
    index = "abc".index(home or "")
    engines[index].fail_first = 1
    finish = await _drain(pool, _request(tokenizer, "s"))
    assert finish.reason == "length"
    assert pool.engine_for("s") != home and pool.retries == 1
    stats = pool.statistics()["engines"]
    assert stats[index]["healthy"] is False and stats[index]["failures"] == 1
    # Connection refused on open: also retried elsewhere.
    other = "abc".index(pool.engine_for("s") or "")
    engines[other].fail_open = 1
    await _drain(pool, _request(tokenizer, "s"))
    assert pool.retries == 2
    # Health checks bring the engines back.
    await pool.check_health()
    assert all(e["healthy"] for e in pool.statistics()["engines"])


async def test_all_engines_down(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    engines = _engines(tokenizer, 2)
    for engine in engines:
        engine.up = False
    pool = EnginePool(list(engines))
    await pool.check_health()
    with pytest.raises(BackendError, match="no healthy"):
        await _drain(pool, _request(tokenizer, "s"))


async def test_an_engine_error_is_retried_but_does_not_mark_it_down(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    engines = _engines(tokenizer, 2)
    pool = EnginePool(list(engines), names=["a", "b"])
    engines[0].fail_open = 1
    engines[1].fail_open = 1
    failing = BackendError("HTTP 500 from the engine")
    for engine in engines:
        engine.error = failing
    with pytest.raises(BackendError, match="500"):
        await _drain(pool, _request(tokenizer, "s"))  # both answered 500: the error reaches the turn
    assert all(e["healthy"] for e in pool.statistics()["engines"])
    assert pool.retries == 1
    await _drain(pool, _request(tokenizer, "s"))  # and the next turn works


async def test_errors_after_first_token_are_not_retried(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    engines = _engines(tokenizer, 2)
    pool = EnginePool(list(engines))
    request = _request(tokenizer, "s")
    got = []
    async with pool.open_generation(request) as generation:
        async for event in generation:
            got.append(event)
            break
    assert pool.retries == 0 and len(got) == 1


async def test_backpressure_at_the_concurrency_limit(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    engines = _engines(tokenizer, 1)
    pool = EnginePool(list(engines), max_concurrency=2)
    finished: list[float] = []

    async def one(i: int) -> None:
        await _drain(pool, _request(tokenizer, f"s{i}"))
        finished.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        for i in range(5):
            nursery.start_soon(one, i)
        await trio.testing.wait_all_tasks_blocked()
        snapshot = pool.statistics()["engines"][0]
        assert (snapshot["in_flight"], snapshot["queued"]) == (2, 3)
    # Five 5-token generations, two at a time: done at 5, 5, 10, 10, 15 intervals.
    assert finished == pytest.approx([5 * INTERVAL, 5 * INTERVAL, 10 * INTERVAL, 10 * INTERVAL, 15 * INTERVAL])


@attrs.define
class _Hanging(Flaky):
    """An engine whose generations never open (a connect that hangs)."""

    @asynccontextmanager
    async def open_generation(self, request: GenerateRequest) -> AsyncIterator[Any]:
        self.opened += 1
        await trio.sleep_forever()
        yield  # pragma: no cover


async def test_a_turn_cancelled_while_its_generation_opens_frees_its_slot(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    """The agent left while the engine connection was being made: the engine's concurrency slot comes back."""
    pool = EnginePool([_Hanging(SimEngine(tokenizer, SimConfig()))], max_concurrency=1)
    with trio.move_on_after(1):
        await _drain(pool, _request(tokenizer, "s"))
    snapshot = pool.statistics()["engines"][0]
    assert (snapshot["in_flight"], snapshot["queued"]) == (0, 0)
    engine = pool._engines[0]
    assert engine.limiter.borrowed_tokens == 0  # the next turn is not refused a slot forever
    engine.backend = Flaky(SimEngine(tokenizer, SimConfig(token_interval=INTERVAL)))
    with trio.fail_after(1):
        assert (await _drain(pool, _request(tokenizer, "s"))).reason == "length"
