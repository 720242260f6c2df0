"""The running proxy without HTTP: actors started in one nursery, and a facade to reach them.

:func:`open_runtime` starts the store and the session registry (each with
``nursery.start``), and on exit finalizes every open session into the store
(bounded by ``shutdown_grace``) before cancelling. The ingress, the tests and
``actorproxy.testing`` all drive the proxy through :class:`Runtime`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from ..backends.base import Backend
from ..config import ProxyConfig
from ..errors import NotFound, Overloaded
from ..tokenization.tokenizer import ChatTokenizer, load_tokenizer
from . import registry as reg
from . import store as st
from .actor import ActorGone, ask
from .messages import ChatRequest, DescribeSession, FinalizeSession, Identity, RunTurn, TurnEvent
from .session import SessionActor, SessionCounters

#: Events a turn may queue before the session waits for the ingress (backpressure).
_TURN_EVENT_BUFFER = 16


@attrs.define(eq=False)
class Runtime:
    """Handles to the live actors; every method is a message to one of them."""

    config: ProxyConfig
    tokenizer: ChatTokenizer
    backend: Backend
    context_window: int
    store: trio.MemorySendChannel[Any]
    registry: trio.MemorySendChannel[Any]

    async def start_turn(
        self, request: ChatRequest, identity: Identity
    ) -> trio.MemoryReceiveChannel[TurnEvent]:
        """Queue a turn on its session; read the returned channel for its events.

        Close the channel (``async with``) when done: a closed channel tells the
        session the agent went away, and the generation stops.
        """
        send, recv = trio.open_memory_channel[TurnEvent](_TURN_EVENT_BUFFER)
        for _ in range(3):
            mailbox = await ask(self.registry, lambda r: reg.Lookup(identity.session_id, True, r))
            try:
                await mailbox.send(RunTurn(request, identity, send))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                continue  # the session retired between lookup and send: ask again
            return recv
        send.close()
        recv.close()
        raise Overloaded(f"session {identity.session_id!r} is restarting; retry")

    async def finalize(self, session_id: str, *, reward: float | None = None) -> dict[str, Any]:
        """Close the session's open segment into the store."""
        mailbox = await ask(self.registry, lambda r: reg.Lookup(session_id, False, r))
        if mailbox is not None:
            try:
                return dict(
                    await ask(mailbox, lambda r: FinalizeSession(reward=reward, reason="finalize", reply=r))
                )
            except ActorGone:
                pass  # retired meanwhile: its data is in the store
        if await ask(self.store, lambda r: st.Knows(session_id, r)):
            return {"session_id": session_id, "segments": 0, "steps": 0}
        raise NotFound(f"unknown session {session_id!r}", param="session_id")

    async def describe_session(self, session_id: str) -> dict[str, Any]:
        mailbox = await ask(self.registry, lambda r: reg.Lookup(session_id, False, r))
        if mailbox is None:
            raise NotFound(f"no live session {session_id!r}", param="session_id")
        try:
            return dict(await ask(mailbox, lambda r: DescribeSession(r)))
        except ActorGone:
            raise NotFound(f"no live session {session_id!r}", param="session_id") from None

    async def read(
        self,
        *,
        session_id: str | None = None,
        trajectory_id: str | None = None,
        drain: bool = False,
        include_steps: bool = False,
    ) -> dict[str, Any]:
        result = await ask(
            self.store, lambda r: st.Read(session_id, trajectory_id, drain, include_steps, r)
        )
        return dict(result)

    async def store_stats(self) -> dict[str, Any]:
        return dict(await ask(self.store, lambda r: st.Stats(r)))

    async def census(self) -> dict[str, Any]:
        return dict(await ask(self.registry, lambda r: reg.Census(r)))

    async def close_all(self, reason: str = "shutdown") -> int:
        """Finalize every live session; returns how many there were."""
        return int(await ask(self.registry, lambda r: reg.CloseAll(reason, r)))


def make_backend(config: ProxyConfig, tokenizer: ChatTokenizer) -> Backend:
    """The engine client ``config.backend`` names."""
    if config.backend == "sim":
        from ..backends.sim import SimConfig, SimEngine

        return SimEngine(
            tokenizer,
            SimConfig(seed=config.sim_seed, token_interval=config.sim_token_interval),
        )
    raise ValueError(f"unknown backend {config.backend!r}")


@asynccontextmanager
async def open_runtime(
    config: ProxyConfig,
    *,
    backend: Backend | None = None,
    tokenizer: ChatTokenizer | None = None,
) -> AsyncIterator[Runtime]:
    """Start the actors; on exit finalize every session into the store, then stop."""
    tok = tokenizer or load_tokenizer(config.tokenizer_path)
    engine = backend or make_backend(config, tok)
    info = await engine.model_info()
    window = config.context_window or info.max_model_len or 32768
    async with trio.open_nursery() as nursery:
        store_box = await nursery.start(st.TrajectoryStore(max_tokens=config.store_max_tokens).run)
        registry_box: trio.MemorySendChannel[Any] | None = None

        def factory(session_id: str, counters: SessionCounters) -> SessionActor:
            assert registry_box is not None
            return SessionActor(
                session_id,
                config=config,
                tokenizer=tok,
                backend=engine,
                store=store_box,
                registry=registry_box,
                context_window=window,
                counters=counters,
            )

        registry = reg.SessionRegistry(factory, max_sessions=config.max_sessions)
        registry_box = await nursery.start(registry.run)
        runtime = Runtime(config, tok, engine, window, store_box, registry_box)
        try:
            yield runtime
        finally:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(config.shutdown_grace):
                    await runtime.close_all("shutdown")
                nursery.cancel_scope.cancel()
                if backend is None:
                    await engine.aclose()
