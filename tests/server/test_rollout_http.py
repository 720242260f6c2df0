"""The trainer's pause/resume over HTTP, with streaming agents kept alive by heartbeats."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.testing
from _asgi import open_client

from actorproxy.server.app import create_app
from actorproxy.sim import SimConfig
from actorproxy.testing import open_simulated_proxy

INTERVAL = 0.005


async def test_pause_resume_over_http_with_heartbeats(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    # In-process HTTP under MockClock: the pause, the heartbeats and the resume happen at exact
    # virtual times, so the test counts the heartbeats instead of hoping some were sent.
    async with open_simulated_proxy(
        tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL),
        partial_rollout=True, heartbeat_interval=0.05,
    ) as sim, open_client(create_app(sim.runtime)) as http:
        text = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
        ids = tokenizer.encode(text).tolist() + [tokenizer.eot_token_id]
        sim.engine.script(ids, routing_key="h")
        lines: list[str] = []
        body = {"messages": [{"role": "user", "content": "count"}], "stream": True}

        async def agent() -> None:
            async with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": "h"}) as r:
                async for line in r.aiter_lines():
                    lines.append(line)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(agent)
            await sim.wait_for_tokens("h", 4)
            ack = await http.post("/v1/rollout/pause", json={"mode": "abort"})
            assert ack.status_code == 200 and ack.json()["aborted"] == 1
            # What the new weights sample next: the rest of the text, after the tokens already kept.
            sim.engine.script(ids[ack.json()["partial_tokens"]:], routing_key="h")
            state = (await http.get("/v1/rollout/pause_state")).json()
            assert state["state"] == "paused" and state["waiting"] == 1 and "in_flight_tokens" not in state
            paused_at = trio.current_time()
            await trio.sleep(0.3)  # the weight update: six heartbeat intervals of silence
            resumed = await http.post("/v1/rollout/resume", json={"weight_version": "5", "bump_epoch": True})
            assert resumed.json()["epoch"] == 1 and resumed.json()["woken"] == 1
            assert trio.current_time() - paused_at == pytest.approx(0.3)
        # The paused stream stayed alive: one heartbeat per 50 ms of silence. (Counted at the end:
        # the last one is due at the very instant the resume comes, in either order.)
        assert lines.count(": keep-alive") == 6
        chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
        assert content == text, (content, text)
        await http.post("/session/finalize", json={"session_id": "h"})
        step = (await http.post("/trajectory/read", json={"session_id": "h", "include_steps": True})).json()["steps"][0]
        assert step["output_ids"] == ids and step["preemptions"] == 1


async def test_rollout_bad_input_and_retry_after(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    async with open_simulated_proxy(
        tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL), pause_wait_timeout=0.2,
    ) as sim, open_client(create_app(sim.runtime)) as http:
        bad = [("/v1/rollout/pause", {"mode": "sleep"}), ("/v1/rollout/pause", {"mood": "abort"}),
               ("/v1/rollout/resume", {"bump_epoch": "yes"}), ("/v1/rollout/resume", {"weight_version": []})]
        for path, body in bad:
            r = await http.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["message"], (path, body)
        assert (await http.post("/v1/rollout/pause", content=b"{oops")).status_code == 400
        assert (await http.post("/v1/rollout/pause")).json()["status"] == "paused"  # empty body: defaults
        waited_from = trio.current_time()
        r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                            headers={"X-Session-Id": "late"})
        assert trio.current_time() - waited_from == pytest.approx(0.2)  # it waited out pause_wait_timeout
        assert r.status_code == 503 and r.headers["Retry-After"] == "5"
        assert r.json()["error"]["code"] == "generation_paused"
        # A streamed turn that waited out the pause also gets a plain 503: no stream had started.
        r = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "stream": True}, headers={"X-Session-Id": "late3"})
        assert r.status_code == 503 and r.headers["Retry-After"] == "5"
        assert r.headers["content-type"].startswith("application/json")
        r = await http.post("/v1/messages", json={"model": "m", "max_tokens": 8,
                                                  "messages": [{"role": "user", "content": "hi"}]},
                            headers={"X-Session-Id": "late2"})
        assert r.status_code == 503 and r.json()["type"] == "error" and r.headers["Retry-After"] == "5"
        assert (await http.post("/v1/rollout/resume", json={})).json()["resumed"] is True
        ok = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 4}, headers={"X-Session-Id": "late"})
        assert ok.status_code == 200
