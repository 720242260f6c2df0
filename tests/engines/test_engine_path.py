"""The proxy in front of real engine clients: `actorproxy sim` over HTTP behind `actorproxy run`."""

from __future__ import annotations

import base64
import json
from array import array
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
from _util import SIM_ENGINES, WEATHER_TOOL, finalized_at, hang_up_after

from actorproxy import ProxyConfig, open_proxy
from actorproxy.serve import RunningProxy
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.sim.policy import alternatives
from actorproxy.sim.server import RunningSim, SimServerSettings, open_sim_server, served_engine

INTERVAL = 0.001
TOOL_REPLY = (
    '<think>\nCheck it.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)
ANSWER = "<think>\nDone.\n</think>\n\nIt is cold in Oslo."


@asynccontextmanager
async def stack(
    tokenizer: Any, kind: str, count: int = 1, **settings: Any
) -> AsyncIterator[tuple[RunningProxy, list[RunningSim], httpx.AsyncClient]]:
    proxy_settings = settings.pop("proxy", {})
    async with AsyncExitStack() as exit_stack:
        sims = []
        for i in range(count):
            engine = SimEngine(tokenizer, SimConfig(seed=i, token_interval=INTERVAL, weight_version="7"))
            sims.append(
                await exit_stack.enter_async_context(
                    open_sim_server(SimServerSettings(port=0, **settings), engine=engine, tokenizer=tokenizer)
                )
            )
        config = ProxyConfig.of(
            port=0, backend=kind, backend_urls=tuple(s.url for s in sims),  # type: ignore[arg-type]
            engine_health_interval=0.2, **proxy_settings,
        )
        proxy = await exit_stack.enter_async_context(open_proxy(config, tokenizer=tokenizer))
        client = await exit_stack.enter_async_context(httpx.AsyncClient(base_url=proxy.url, timeout=30))
        yield proxy, sims, client


def _sse_content(text: str) -> tuple[str, list[dict[str, Any]], str | None]:
    content, calls, finish = "", [], None
    for block in text.split("\n\n"):
        if not block.startswith("data: ") or block == "data: [DONE]":
            continue
        chunk = json.loads(block[6:])
        if "error" in chunk:
            return content, calls, "error:" + chunk["error"]["message"]
        for choice in chunk["choices"]:
            content += choice["delta"].get("content") or ""
            calls += choice["delta"].get("tool_calls") or []
            finish = choice["finish_reason"] or finish
    return content, calls, finish


async def _tool_loop(client: httpx.AsyncClient, session: str, *, stream_second: bool) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Weather in Oslo?"}]
    headers = {"X-Session-Id": session}
    first = (await client.post("/v1/chat/completions", json={"messages": messages, "tools": [WEATHER_TOOL]},
                               headers=headers)).json()
    reply = first["choices"][0]["message"]
    assert first["choices"][0]["finish_reason"] == "tool_calls", first
    messages += [reply, {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "-3 °C"}]
    body = {"messages": messages, "tools": [WEATHER_TOOL], "stream": stream_second}
    response = await client.post("/v1/chat/completions", json=body, headers=headers)
    if stream_second:
        content, _, finish = _sse_content(response.text)
    else:
        content = response.json()["choices"][0]["message"]["content"]
        finish = response.json()["choices"][0]["finish_reason"]
    assert (content, finish) == ("It is cold in Oslo.", "stop")


ENGINES = SIM_ENGINES


@pytest.mark.parametrize(("kind", "settings"), ENGINES)
async def test_exact_tokens_through_each_engine(tokenizer: Any, kind: str, settings: dict[str, Any]) -> None:
    async with stack(tokenizer, kind, **settings) as (proxy, [sim], client):
        sim.engine.script(TOOL_REPLY, ANSWER, TOOL_REPLY, ANSWER)
        await _tool_loop(client, "plain", stream_second=False)
        await _tool_loop(client, "streamed", stream_second=True)
        for session in ("plain", "streamed"):
            await client.post("/session/finalize", json={"session_id": session})
        emitted = [list(sim.engine.stats(r.rid).token_ids) for r in sim.state.records.values()]
        logprobs = [list(sim.engine.stats(r.rid).logprobs) for r in sim.state.records.values()]
        recorded = []
        for session in ("plain", "streamed"):
            data = (await client.post("/trajectory/read", json={"session_id": session, "include_steps": True})).json()
            [segment] = data["data"]
            assert segment["num_steps"] == 2
            for step in data["steps"]:
                recorded.append((step["output_ids"], step["output_logprobs"]))
                start = step["prompt_tokens"]
                assert segment["token_ids"][start : start + len(step["output_ids"])] == step["output_ids"]
            # Every sampled token carries the engine's weight version label "7" (llama.cpp has none: 0).
            sampled_versions = {v for v, m in zip(segment["versions"], segment["loss_mask"], strict=True) if m}
            assert sampled_versions == ({0} if kind == "llamacpp" else {7})
        assert [ids for ids, _ in recorded] == emitted
        assert [lps for _, lps in recorded] == logprobs


def _spelled_top(tokenizer: Any, token_id: int, logprob: float, k: int) -> list[tuple[float, bytes]]:
    """The ``top_logprobs`` a reply lists for a token the engine sampled with ``logprob``: the simulated engine's
    ``k`` likeliest, each a logprob and its bytes (checked where the token alone is a whole character)."""
    return [(lp, tokenizer.decode([t]).encode()) for t, lp in alternatives(token_id, logprob, k)]


def _listed_top(entry: dict[str, Any]) -> list[tuple[float, bytes]]:
    return [(a["logprob"], bytes(a["bytes"])) for a in entry["top_logprobs"]]


@pytest.mark.parametrize(("kind", "settings"), ENGINES)
async def test_top_logprobs_are_the_engines_through_each_engine(
    tokenizer: Any, kind: str, settings: dict[str, Any]
) -> None:
    """``top_logprobs: k`` lists each sampled token's k likeliest, as the engine reported them, the likeliest first:
    the same in a JSON reply and a stream, for every engine protocol and stream shape."""
    async with stack(tokenizer, kind, **settings) as (proxy, [sim], client):
        sim.engine.script(ANSWER, ANSWER)
        messages = [{"role": "user", "content": "Weather in Oslo?"}]
        body = {"messages": messages, "logprobs": True, "top_logprobs": 4, "max_tokens": 64}
        whole = (await client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "t"})).json()
        streamed = await client.post("/v1/chat/completions", json=body | {"stream": True},
                                     headers={"X-Session-Id": "u"})
        chunks = [json.loads(b[6:]) for b in streamed.text.split("\n\n") if b.startswith("data: {")]
        stream_content = [entry for chunk in chunks for choice in chunk["choices"]
                          for entry in (choice.get("logprobs") or {}).get("content", [])]
        for session, content in (("t", whole["choices"][0]["logprobs"]["content"]), ("u", stream_content)):
            await client.post("/session/finalize", json={"session_id": session})
            data = (await client.post("/trajectory/read", json={"session_id": session, "include_steps": True})).json()
            [step] = data["steps"]
            assert len(content) == len(step["output_ids"]) > 5
            for entry, token, logprob in zip(content, step["output_ids"], step["output_logprobs"], strict=True):
                listed, expected = _listed_top(entry), _spelled_top(tokenizer, token, logprob, 4)
                assert [lp for lp, _ in listed] == pytest.approx([lp for lp, _ in expected]), (session, token)
                assert [b for (_, b), (_, want) in zip(listed, expected, strict=True) if b"\xef\xbf\xbd" not in want] \
                    == [want for _, want in expected if b"\xef\xbf\xbd" not in want]


@pytest.mark.parametrize(("kind", "settings"), ENGINES)
async def test_min_tokens_ignore_eos_and_stop_ids_through_each_engine(
    tokenizer: Any, kind: str, settings: dict[str, Any]
) -> None:
    """vLLM's ``ignore_eos``, ``min_tokens`` and ``stop_token_ids`` change what is sampled, through every engine
    protocol (llama-server has no ``min_tokens``: a 400 saying so); the call's own stop id ends the reply unshown,
    and the session goes on after it."""
    eot = tokenizer.eot_token_id
    hi, dot = tokenizer.encode("Hi")[0], tokenizer.encode(".")[0]
    filler = tokenizer.encode(" so")[0]
    user = [{"role": "user", "content": "Greet."}]
    async with stack(tokenizer, kind, **settings) as (proxy, [sim], client):
        # ignore_eos: the end of turn is sampled as any token, and the reply runs to its budget.
        sim.engine.script([hi, dot, eot])
        reply = await client.post("/v1/chat/completions", json={"messages": user, "ignore_eos": True, "max_tokens": 6},
                                  headers={"X-Session-Id": "long"})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["finish_reason"] == "length"
        _, [step] = await finalized_at(proxy.url, "long")
        assert step["output_ids"] == [hi, dot, eot, filler, filler, filler]
        assert reply.json()["choices"][0]["message"]["content"] == "Hi. so so so"

        # min_tokens: no stop id before 4 tokens; then the reply ends as the policy ends it.
        sim.engine.script([hi, dot, eot])
        reply = await client.post("/v1/chat/completions", json={"messages": user, "min_tokens": 4, "max_tokens": 9},
                                  headers={"X-Session-Id": "min"})
        if kind == "llamacpp":
            assert reply.status_code == 400, reply.text
            assert "min_tokens is not supported by llama.cpp" in reply.json()["error"]["message"]
        else:
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["finish_reason"] == "stop"
            _, [step] = await finalized_at(proxy.url, "min")
            assert step["output_ids"] == [hi, dot, filler, filler, eot]
            assert step["sampling"]["min_tokens"] == 4

        # stop_token_ids: the reply ends at the call's own stop id, whose text is not shown; the next turn
        # continues the same segment.
        sim.engine.script([hi, dot, hi, eot], [hi, eot])
        body = {"messages": user, "stop_token_ids": [dot]}
        reply = await client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "stop"})
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert (choice["finish_reason"], choice["message"]["content"]) == ("stop", "Hi")
        history = [*user, choice["message"], {"role": "user", "content": "Again."}]
        again = await client.post("/v1/chat/completions", json={**body, "messages": history},
                                  headers={"X-Session-Id": "stop"})
        assert again.status_code == 200, again.text
        _, [first, second] = await finalized_at(proxy.url, "stop")
        assert first["output_ids"] == [hi, dot]
        assert first["segment_index"] == second["segment_index"]


async def test_client_disconnect_reaches_the_engine(tokenizer: Any) -> None:
    async with stack(tokenizer, "sglang") as (proxy, [sim], client):
        sim.engine.script("word " * 600, routing_key="gone")
        body = {"messages": [{"role": "user", "content": "talk"}], "stream": True, "max_tokens": 700}
        await hang_up_after(client, "/v1/chat/completions", body, "gone")
        with trio.fail_after(10):  # describe waits for the session's turn to end (its mailbox is serial)
            step = (await client.get("/session/gone")).json()["recent_steps"][-1]
        assert step["status"] == "client_disconnected" and not step["in_segment"]
        stats = sim.engine.stats(step["rid"])
        assert stats.aborted and stats.finish_reason == "abort"
        data = (await client.post("/session/finalize", json={"session_id": "gone"})).json()
        assert data["steps"] == 1
        steps = (await client.post("/trajectory/read", json={"session_id": "gone", "include_steps": True})).json()
        assert steps["steps"][0]["output_ids"] == list(stats.token_ids)  # nothing generated was lost
        assert 0 < len(stats.token_ids) < 600


async def test_engine_failures_give_clean_errors_and_the_session_goes_on(tokenizer: Any) -> None:
    async with stack(tokenizer, "sglang") as (proxy, [sim], client):
        headers = {"X-Session-Id": "f"}
        messages = [{"role": "user", "content": "hi"}]
        sim.faults.fail_next_requests(1)
        failed = await client.post("/v1/chat/completions", json={"messages": messages}, headers=headers)
        assert failed.status_code == 502 and failed.json()["error"]["code"] == "engine_error"
        # A stream dropped mid-way: an error frame, then [DONE]; no hang.
        sim.engine.script("one two three four five six seven eight", routing_key="f")
        sim.faults.drop_next_stream(after_tokens=3)
        dropped = await client.post("/v1/chat/completions", json={"messages": messages, "stream": True},
                                    headers=headers)
        assert dropped.status_code == 200
        _, _, finish = _sse_content(dropped.text)
        assert finish is not None and finish.startswith("error:")
        assert dropped.text.endswith("data: [DONE]\n\n")
        ok = await client.post("/v1/chat/completions", json={"messages": messages}, headers=headers)
        assert ok.status_code == 200
        data = (await client.get("/session/f")).json()
        assert [s["status"] for s in data["recent_steps"]] == ["error", "error", "completed"]
        assert data["open_segment"]["steps"] == 1


async def test_pool_sticks_balances_and_fails_over(tokenizer: Any) -> None:
    async with stack(tokenizer, "sglang", count=3) as (proxy, sims, client):
        for i in range(6):
            r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                "max_tokens": 4}, headers={"X-Session-Id": f"s{i}"})
            assert r.status_code == 200
        served = [len(s.state.records) for s in sims]
        assert served == [2, 2, 2]
        # Later turns stick to their engine.
        engines = (await client.get("/health")).json()["engines"]
        assert engines["sticky_sessions"] == 6
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 4}, headers={"X-Session-Id": "s0"})
        assert [len(s.state.records) for s in sims].count(3) == 1
        # One engine goes away: its sessions move to the others without an error.
        victim = next(i for i, s in enumerate(sims) if len(s.state.records) == 3)
        sims[victim].faults.unhealthy = True
        sims[victim].faults.fail_next_requests(100)
        await proxy.runtime.backend.check_health()  # type: ignore[attr-defined]
        assert not (await client.get("/health")).json()["engines"]["engines"][victim]["healthy"]
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 4}, headers={"X-Session-Id": "s0"})
        assert r.status_code == 200
        assert len(sims[victim].state.records) == 3


async def test_routed_experts_and_versions_arrive_on_steps(tokenizer: Any) -> None:
    async with stack(tokenizer, "sglang", enable_return_routed_experts=True,
                     proxy={"use_rollout_routing_replay": True}) as (proxy, [sim], client):
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 6}, headers={"X-Session-Id": "r3"})
        assert r.status_code == 200
        await client.post("/session/finalize", json={"session_id": "r3"})
        data = (await client.post("/trajectory/read", json={"session_id": "r3", "include_steps": True})).json()
        [step] = data["steps"]
        experts = array("i", base64.b64decode(step["routed_experts"]))
        config = sim.engine.config
        rows = step["prompt_tokens"] + step["completion_tokens"] - 1
        assert len(experts) == rows * config.num_layers * config.moe_topk
        assert all(0 <= e < config.num_experts for e in experts)
        assert step["weight_version"] == "7"
        assert set(step["concat_versions"][step["concat_context_token_count"] :]) == {7}


async def test_a_stopped_engine_is_failed_over(tokenizer: Any) -> None:
    settings = SimServerSettings(port=0, engine=served_engine(token_interval=INTERVAL))
    async with open_sim_server(settings, tokenizer=tokenizer) as live:
        with trio.socket.socket() as probe:  # a port nobody listens on: a stopped engine
            await probe.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
        config = ProxyConfig.of(port=0, backend="sglang", backend_urls=(dead, live.url), engine_health_interval=60)
        async with open_proxy(config, tokenizer=tokenizer) as proxy, httpx.AsyncClient(base_url=proxy.url) as client:
            for i in range(4):
                body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                r = await client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": f"s{i}"})
                assert r.status_code == 200, r.text
            engines = (await client.get("/health")).json()["engines"]
            # The first health check already found it down; no turn was sent there.
            assert [e["healthy"] for e in engines["engines"]] == [False, True]
            assert len(live.state.records) == 4
