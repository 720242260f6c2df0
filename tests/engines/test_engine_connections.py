"""Engine connections are reused: a counting TCP relay in front of `actorproxy sim` sees one connection.

Every turn used to open a new TCP connection to the engine (the stream was closed as
soon as its finish event was parsed, before ``[DONE]`` and the end of the chunked body
were read, so httpx could not return the connection to its pool).
"""

from __future__ import annotations

from array import array
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import trio
from _util import SIM_ENGINES

from actorproxy import ProxyConfig, open_proxy
from actorproxy.engines.base import GenerateRequest, SamplingParams
from actorproxy.engines.connection import EngineOptions
from actorproxy.engines.factory import make_engine_client
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.sim.relay import CountingRelay, open_counting_relay
from actorproxy.sim.server import RunningSim, SimServerSettings, open_sim_server

ENGINES = SIM_ENGINES


@asynccontextmanager
async def relayed_proxy(
    tokenizer: Any, kind: str, settings: dict[str, Any]
) -> AsyncIterator[tuple[RunningSim, CountingRelay, httpx.AsyncClient]]:
    engine = SimEngine(tokenizer, SimConfig(token_interval=0.001))
    async with open_sim_server(SimServerSettings(port=0, **settings), engine=engine, tokenizer=tokenizer) as sim:
        target = urlsplit(sim.url)
        assert target.hostname is not None and target.port is not None
        async with open_counting_relay(target.hostname, target.port) as relay:
            # No periodic health check during the test: it could run beside a turn.
            config = ProxyConfig.of(port=0, backend=kind, backend_urls=(relay.url,),  # type: ignore[arg-type]
                                 engine_health_interval=3600)
            async with open_proxy(config, tokenizer=tokenizer) as proxy:
                async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
                    yield sim, relay, client


@pytest.mark.parametrize(("kind", "settings"), ENGINES)
async def test_sequential_turns_share_one_engine_connection(
    tokenizer: Any, kind: str, settings: dict[str, Any]
) -> None:
    async with relayed_proxy(tokenizer, kind, settings) as (sim, relay, client):
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        for turn in range(8):
            body = {"messages": messages, "max_tokens": 12, "stream": turn % 2 == 1}
            response = await client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "one"})
            assert response.status_code == 200, response.text
            if turn % 2 == 0:
                reply = response.json()["choices"][0]["message"]["content"]
            else:
                assert response.text.endswith("data: [DONE]\n\n")
                reply = "ok"
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"more {turn}"}]
        assert len(sim.state.records) == 8
        assert relay.accepted == 1


async def test_the_keepalive_pool_holds_as_many_connections_as_the_engine_runs_generations(tokenizer: Any) -> None:
    # 80 concurrent generations need 80 connections; the second wave must find them all
    # in the pool (it used to keep 64, so 16 were opened again every wave).
    engine = SimEngine(tokenizer, SimConfig(token_interval=0.001))
    async with open_sim_server(SimServerSettings(port=0), engine=engine, tokenizer=tokenizer) as sim:
        target = urlsplit(sim.url)
        assert target.hostname is not None and target.port is not None
        async with open_counting_relay(target.hostname, target.port) as relay:
            client = make_engine_client("sglang", relay.url, EngineOptions(
                concurrency=80, abort_grace=30.0, keepalive_expiry=60.0  # slow machines: no time-outs
            ))
            all_started = trio.Event()
            started = 0

            async def one() -> None:
                nonlocal started
                request = GenerateRequest(array("i", [1, 2, 3]), SamplingParams(max_new_tokens=3))
                async with client.open_generation(request) as generation:
                    started += 1
                    if started % 80 == 0:
                        all_started.set()
                    await all_started.wait()  # every stream holds its connection at once
                    async for _ in generation:
                        pass

            try:
                for _wave in range(2):
                    all_started = trio.Event()
                    async with trio.open_nursery() as nursery:
                        for _ in range(80):
                            nursery.start_soon(one)
            finally:
                await client.aclose()
            assert relay.accepted == 80
