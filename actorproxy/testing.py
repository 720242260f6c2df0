"""Deterministic simulations for testing rollout code against preemption.

Start a proxy with the simulated engine inside a Trio test, script what the
engine samples, and pause or resume generation at exact points. Under
``trio.testing.MockClock(autojump_threshold=0)`` (pytest-trio's
``autojump_clock`` fixture) every token arrives at a known virtual time, so a
test can pause a generation at an exact token index::

    async def test_my_rollout_survives_a_weight_update(autojump_clock):
        async with open_simulated_proxy(partial_rollout=True) as sim:
            sim.engine.script("The answer is 42.", routing_key="s1")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(my_rollout, sim, "s1")
                await sim.wait_for_tokens("s1", 3)
                ack = await sim.pause()          # every generation stopped and recorded
                assert ack["aborted"] == 1
                await sim.resume(weight_version="1")

``sim.chat`` runs one turn through the runtime directly; pass ``serve_http=True``
to also serve the proxy on a loopback port (``sim.url``) for HTTP clients
(then use the real clock: sockets do not mix with MockClock).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import trio

from .config import ProxyConfig
from .core.messages import AssistantOutput, output_as_message
from .core.requests import ChatRequest, Identity
from .core.turn_events import TurnDelta, TurnDone, TurnFailed
from .errors import ProxyError
from .runtime.backends import sim_config as backend_sim_config
from .runtime.controller import PauseMode
from .runtime.runtime import Runtime, open_runtime
from .schema.converter import CONVERTER
from .serve import open_proxy
from .sim import ScriptedOutput, SimConfig, SimEngine
from .tokenization.tokenizer import ChatTokenizer, load_tokenizer

__all__ = ["ScriptedOutput", "SimulatedProxy", "TurnResult", "open_simulated_proxy"]


@attrs.frozen
class TurnResult:
    """The outcome of one turn: ``done`` on success, ``error`` when the proxy refused or failed it."""

    done: TurnDone | None
    error: ProxyError | None
    #: The text and reasoning the agent received, concatenated from the stream.
    streamed_content: str
    streamed_reasoning: str

    @property
    def output(self) -> AssistantOutput:
        if self.done is None:
            raise AssertionError(f"the turn failed: {self.error}")
        return self.done.output

    @property
    def message(self) -> dict[str, Any]:
        """The assistant message to append to the conversation (as an agent would)."""
        return output_as_message(self.output)


@attrs.define(eq=False)
class SimulatedProxy:
    """A running proxy with a simulated engine, and handles to drive it."""

    runtime: Runtime
    engine: SimEngine
    url: str | None = None

    async def chat(
        self,
        session_id: str,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        max_tokens: int | None = None,
        stream: bool = False,
        instance_id: str | None = None,
    ) -> TurnResult:
        """One chat turn through the proxy's runtime (no HTTP)."""
        request = ChatRequest(messages=messages, tools=tools or [], max_tokens=max_tokens, stream=stream)
        content, reasoning = [], []
        async with await self.runtime.start_turn(request, Identity(session_id, instance_id=instance_id)) as events:
            async for event in events:
                match event:
                    case TurnDelta():
                        content.append(event.delta.content)
                        reasoning.append(event.delta.reasoning)
                    case TurnDone():
                        return TurnResult(event, None, "".join(content), "".join(reasoning))
                    case TurnFailed():
                        return TurnResult(None, event.error, "".join(content), "".join(reasoning))
        raise AssertionError("the turn ended without a result")

    # The answers below are the JSON the HTTP routes send (by the wire converter), so a test
    # asserts on what a trainer would see.

    async def pause(self, mode: PauseMode = "abort") -> dict[str, Any]:
        """Pause generation; returns the acknowledgment (``aborted``, ``partial_tokens``)."""
        return _json(await self.runtime.pause(mode))

    async def resume(self, weight_version: str | None = None, *, bump_epoch: bool = False) -> dict[str, Any]:
        """Resume; a new ``weight_version`` is also installed in the simulated engine."""
        return _json(await self.runtime.resume(weight_version=weight_version, bump_epoch=bump_epoch))

    async def pause_state(self) -> dict[str, Any]:
        return _json(await self.runtime.pause_state())

    async def wait_for_tokens(self, session_id: str, count: int) -> None:
        """Return as soon as the session's generation in flight has produced ``count`` tokens.

        It checks four times per token interval of virtual time, so it returns
        before the next token arrives: a pause issued right after stops the
        generation at exactly ``count`` tokens.
        """
        step = self.engine.config.token_interval / 4
        while True:
            tokens = (await self.runtime.pause_state()).in_flight_tokens.get(session_id, 0)
            if tokens >= count:
                return
            await trio.sleep(step)

    async def finalize(self, session_id: str, *, reward: float | None = None) -> dict[str, Any]:
        return _json(await self.runtime.finalize(session_id, reward=reward))

    async def read(self, session_id: str, *, include_steps: bool = True, drain: bool = False) -> dict[str, Any]:
        return _json(await self.runtime.read(session_id=session_id, include_steps=include_steps, drain=drain))


def _json(reply: Any) -> dict[str, Any]:
    data: dict[str, Any] = CONVERTER.unstructure(reply)
    return data


@asynccontextmanager
async def open_simulated_proxy(
    config: ProxyConfig | None = None,
    *,
    sim_config: SimConfig | None = None,
    tokenizer: ChatTokenizer | None = None,
    serve_http: bool = False,
    **config_fields: Any,
) -> AsyncIterator[SimulatedProxy]:
    """A proxy over a fresh :class:`SimEngine`, inside the caller's Trio code.

    ``config_fields`` override :class:`ProxyConfig` fields (for example
    ``partial_rollout=True``); ``sim_config`` configures the engine (token
    interval, seed, weight version...).
    """
    config = (config or ProxyConfig.of(port=0)).evolve(**config_fields)
    tok = tokenizer or load_tokenizer(config.engines.tokenizer_path)
    engine = SimEngine(tok, sim_config or backend_sim_config(config.engines))
    async with AsyncExitStack() as stack:
        if serve_http:
            running = await stack.enter_async_context(open_proxy(config, backend=engine, tokenizer=tok))
            yield SimulatedProxy(running.runtime, engine, running.url)
        else:
            runtime = await stack.enter_async_context(open_runtime(config, backend=engine, tokenizer=tok))
            yield SimulatedProxy(runtime, engine)
