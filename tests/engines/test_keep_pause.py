"""The ``keep`` pause: generations frozen in the engine, their streams open, continued after resume.

In-process (the simulated engine freezes in place) under MockClock, over real HTTP against
``actorproxy sim`` speaking vLLM (``/pause?mode=keep``) and SGLang (``/pause_generation`` in_place),
and refused, naming the engine and the
reason, where an engine cannot freeze (llama.cpp; a vLLM without dev mode).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from actorproxy import ProxyConfig, open_proxy
from actorproxy.engines.base import Backend
from actorproxy.engines.llamacpp.client import LlamaCppBackend
from actorproxy.engines.sglang.client import SGLangBackend
from actorproxy.engines.vllm.client import VLLMBackend
from actorproxy.serve import RunningProxy
from actorproxy.sim import SimConfig
from actorproxy.sim.server import RunningSim, SimServerSettings, open_sim_server, served_engine
from actorproxy.testing import SimulatedProxy, TurnResult, open_simulated_proxy
from actorproxy.tokenization.tokenizer import ChatTokenizer

INTERVAL = 0.01
USER = [{"role": "user", "content": "Tell me a story."}]


def story(tokenizer: ChatTokenizer) -> list[int]:
    text = "Once upon a time there was a very long story indeed, and it went on and on."
    return [*tokenizer.encode(text).tolist(), tokenizer.eot_token_id]


async def only_step(sim: SimulatedProxy, session: str) -> dict[str, Any]:
    await sim.finalize(session)
    [step] = (await sim.read(session))["steps"]
    return dict(step)


async def test_keep_freezes_in_flight_generations_and_resumes_them_in_place(
    tokenizer: ChatTokenizer, autojump_clock: trio.testing.MockClock
) -> None:
    ids = story(tokenizer)
    async with open_simulated_proxy(
        tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL), partial_rollout=True
    ) as sim:
        sim.engine.script(ids, routing_key="s")
        result: list[TurnResult] = []

        async def turn() -> None:
            result.append(await sim.chat("s", USER, stream=True))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(turn)
            await sim.wait_for_tokens("s", 5)
            ack = await sim.pause("keep")
            assert (ack["mode"], ack["aborted"], ack["partial_tokens"]) == ("keep", 0, 0)
            state = await sim.pause_state()
            assert state["state"] == "paused" and state["in_flight"] == 1
            frozen_at = state["in_flight_tokens"]["s"]
            await trio.sleep(100 * INTERVAL)  # the trainer updates the weights: nothing is sampled meanwhile
            assert (await sim.pause_state())["in_flight_tokens"]["s"] == frozen_at and sim.engine.paused
            resumed = await sim.resume(weight_version="1")
            assert resumed["woken"] == 0 and resumed["weight_version"] == "1"
        assert result[0].streamed_content == tokenizer.decode(ids[:-1])  # one reply, every token once
        step = await only_step(sim, "s")
        assert step["output_ids"] == ids and step["preemptions"] == 0 and step["status"] == "completed"
        versions = step["concat_versions"][-len(ids):]
        assert versions == [0] * frozen_at + [1] * (len(ids) - frozen_at)  # after the resume: the new version
        assert not sim.engine.paused


async def test_keep_admits_nothing_new_until_resume(
    tokenizer: ChatTokenizer, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_simulated_proxy(tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL)) as sim:
        assert (await sim.pause("keep"))["aborted"] == 0
        done: list[TurnResult] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _append(done, sim.chat("late", USER, max_tokens=4)))
            await trio.testing.wait_all_tasks_blocked()
            assert (await sim.pause_state())["waiting"] == 1 and not done
            assert (await sim.resume(weight_version="2"))["woken"] == 1
        assert done[0].done is not None


async def _append(out: list[TurnResult], call: Any) -> None:
    out.append(await call)


@asynccontextmanager
async def proxy_on(backend: Backend, tokenizer: ChatTokenizer) -> AsyncIterator[httpx.AsyncClient]:
    config = ProxyConfig.of(port=0, partial_rollout=True)
    running: RunningProxy
    async with open_proxy(config, backend=backend, tokenizer=tokenizer) as running, httpx.AsyncClient(
        base_url=running.url, timeout=30
    ) as http:
        yield http


@asynccontextmanager
async def sim_server(tokenizer: ChatTokenizer, **flags: Any) -> AsyncIterator[RunningSim]:
    settings = SimServerSettings(port=0, engine=served_engine(token_interval=0.002), **flags)
    async with open_sim_server(settings, tokenizer=tokenizer) as sim:
        yield sim


@pytest.mark.parametrize(
    ("make", "flags", "reason"),
    [
        (LlamaCppBackend, {}, "llamacpp engines cannot freeze a generation in place"),
        (VLLMBackend, {"vllm_dev_mode": False}, "has no /pause (start it with VLLM_SERVER_DEV_MODE=1)"),
    ],
    ids=["llamacpp", "vllm-without-dev-mode"],
)
async def test_engines_that_cannot_freeze_refuse_keep(
    make: Any, flags: dict[str, Any], reason: str, tokenizer: ChatTokenizer
) -> None:
    async with sim_server(tokenizer, **flags) as running, proxy_on(make(running.url), tokenizer) as http:
        got = await http.post("/v1/rollout/pause", json={"mode": "keep"})
        assert got.status_code == 400, got.text
        error = got.json()["error"]
        assert reason in error["message"] and error["param"] == "mode"
        assert (await http.get("/v1/rollout/pause_state")).json()["state"] == "running"  # nothing paused
        assert not running.engine.paused


@pytest.mark.parametrize(("make", "kind"), [(VLLMBackend, "vllm"), (SGLangBackend, "sglang")], ids=["vllm", "sglang"])
async def test_keep_on_an_engine_server_freezes_it_and_labels_the_tokens_after(
    make: Any, kind: str, tokenizer: ChatTokenizer
) -> None:
    ids = story(tokenizer)
    async with sim_server(tokenizer) as running, proxy_on(make(running.url), tokenizer) as http:
        running.engine.script(ids)
        body = {"messages": USER, "stream": True, "max_tokens": 200}
        pieces: list[str] = []
        async with trio.open_nursery() as nursery, http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": "v"}
        ) as stream:
            lines = stream.aiter_lines()
            while sum(1 for p in pieces if p) < 3:
                line = await anext(lines)
                if line.startswith("data: {"):
                    pieces.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["delta"].get("content")
                                  or "")
            running.faults.stall()  # hold the engine here, so the pause surely finds the generation running
            paused = (await http.post("/v1/rollout/pause", json={"mode": "keep"})).json()
            running.faults.clear_stall()
            assert paused["aborted"] == 0 and paused["engines"] == [{"engine": kind, "ok": True}]
            assert running.engine.paused and running.state.gate.paused  # still frozen: by the keep pause
            resumed = (await http.post("/v1/rollout/resume", json={"weight_version": "3"})).json()
            assert resumed["weight_version"] == "3" and not running.engine.paused
            async for line in lines:
                if line.startswith("data: {"):
                    pieces.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["delta"].get("content")
                                  or "")
            nursery.cancel_scope.cancel()
        assert "".join(pieces) == tokenizer.decode(ids[:-1])
        assert (await http.post("/session/finalize", json={"session_id": "v"})).status_code == 200
        [step] = (await http.post("/trajectory/read", json={"session_id": "v", "include_steps": True})).json()["steps"]
        assert step["output_ids"] == ids and step["preemptions"] == 0
        versions = step["concat_versions"][-len(ids):]
        assert versions[0] == 0 and versions[-1] == 3 and versions == sorted(versions)  # one cut, old then new
        assert len(running.state.records) == 1  # one engine request: continued in place, no re-prefill
