"""An agent that hangs up: the step keeps exactly the tokens the engine generated.

Issue 28: after client disconnects, step tokens equalled the engine's for only 47 of
200 SGLang turns and 112 of 200 vLLM turns. The turn aborts the generation and reads
on to the engine's ``abort`` finish, but that read was bounded at 5 s *in all*: an
engine still sending tokens then (a busy engine slow to answer the abort call, or a
backlog a loaded proxy reads late) had its stream cut, losing what it had generated
since, silently. The bound now runs from the last token, as a pause's does.

The simulated engine's HTTP app (SGLang in both stream shapes, vLLM) behind the
proxy's real engine clients and HTTP app, in the test's Trio run under MockClock.
The engine answers abort calls 6 s late (and generates until then), longer than the
5 s drain; many sessions disconnect at random points, before and during their
streams, in their first and second turns.
"""

from __future__ import annotations

import random
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from _asgi import open_client, open_sim_server

from actorproxy import ProxyConfig
from actorproxy.engines.base import Backend
from actorproxy.engines.connection import EngineOptions
from actorproxy.engines.pool import EnginePool
from actorproxy.engines.sglang.client import SGLangBackend
from actorproxy.engines.vllm.client import VLLMBackend
from actorproxy.runtime.runtime import open_runtime
from actorproxy.server.app import create_app
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.sim.server import SimServerSettings
from actorproxy.tokenization import ChatTokenizer

INTERVAL = 0.05  # 20 tokens/s
SESSIONS = 24
ABORT_DELAY = 6.0  # > ABORT_DRAIN_SECONDS: the engine goes on generating until then


async def _turn(client: httpx.AsyncClient, session: str, messages: list[dict[str, Any]], *, stream: bool,
                leave_after: float | None) -> dict[str, Any] | None:
    """One turn; the client hangs up ``leave_after`` seconds in (``None``: read to its end)."""
    body = {"messages": messages, "stream": stream, "max_tokens": 2000}
    headers = {"X-Session-Id": session}
    with trio.move_on_after(leave_after if leave_after is not None else float("inf")):
        async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            if not stream:
                return dict((await response.aread()) and response.json())
            async for _ in response.aiter_lines():
                pass
    return None


@pytest.mark.parametrize(
    ("kind", "incremental"),
    [pytest.param("sglang", False, id="sglang-cumulative"), pytest.param("sglang", True, id="sglang-incremental"),
     pytest.param("vllm", False, id="vllm")],
)
async def test_steps_of_agents_that_hung_up_hold_exactly_the_tokens_the_engine_generated(
    tokenizer: ChatTokenizer, kind: str, incremental: bool, autojump_clock: trio.testing.MockClock
) -> None:
    rng = random.Random(f"{kind}{incremental}")
    engine = SimEngine(tokenizer, SimConfig(token_interval=INTERVAL, prefill_latency=0.2))
    settings = SimServerSettings(port=0, incremental_streaming_output=incremental)
    async with open_sim_server(engine, settings) as sim:
        sim.faults.delay_aborts(ABORT_DELAY)
        config = ProxyConfig.of(port=0, backend=kind, backend_urls=(sim.url,))
        options = EngineOptions(concurrency=config.engines.engine_max_concurrency)
        backend: Backend = (SGLangBackend if kind == "sglang" else VLLMBackend)(sim.url, options)
        pool = EnginePool([backend], names=[sim.url], max_concurrency=options.concurrency,
                          health_interval=config.engines.engine_health_interval)
        async with open_runtime(config, backend=pool, tokenizer=tokenizer) as runtime, \
                open_client(create_app(runtime)) as client:

            async def session(i: int) -> None:
                name = f"s{i}"
                messages: list[dict[str, Any]] = [{"role": "user", "content": "talk"}]
                if i % 2:  # a second turn: the first one is answered whole
                    engine.script("Short.", routing_key=name)
                    first = await _turn(client, name, messages, stream=False, leave_after=None)
                    assert first is not None
                    messages += [first["choices"][0]["message"], {"role": "user", "content": "more"}]
                engine.script("word " * 500, routing_key=name)
                # Before the first token (prefill), or anywhere in the first 40 of 500.
                await _turn(client, name, messages, stream=rng.random() < 0.7, leave_after=rng.uniform(0.0, 2.2))

            async with trio.open_nursery() as nursery:
                for i in range(SESSIONS):
                    nursery.start_soon(session, i)
            await sim.state.wait_idle()
            assert sim.state.abort_calls > 0
            cut = left = 0
            for i in range(SESSIONS):
                await client.post("/session/finalize", json={"session_id": f"s{i}"})
                read = await client.post("/trajectory/read", json={"session_id": f"s{i}", "include_steps": True})
                steps = read.json().get("steps", [])
                rids = [r.rid for r in sim.state.records.values() if engine.stats(r.rid).routing_key == f"s{i}"]
                assert sorted(s["rid"] for s in steps) == sorted(rids)  # every engine request has its step
                for step in steps:
                    stats = engine.stats(step["rid"])
                    assert step["output_ids"] == list(stats.token_ids), (i, step["status"])
                    cut += stats.cancelled
                    if step["status"] == "client_disconnected" and step["output_ids"]:
                        left += 1
                        assert stats.aborted  # ended by the engine's acknowledged abort, not a hang-up
            assert cut == 0
            assert left >= SESSIONS // 2  # most hung up mid-stream

