"""Shutdown: SIGTERM drains (no 5xx, nothing completed lost, exit 0); SIGKILL loses no completed step."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import trio
import trio.testing
from _proxyproc import ProxyProcess

from actorproxy.config import ProxyConfig
from actorproxy.schema.converter import CONVERTER
from actorproxy.serve import serve_proxy
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.store.base import ReadQuery
from actorproxy.store.sqlite import SQLiteStore

HI = [{"role": "user", "content": "hi"}]


async def test_an_idle_keep_alive_connection_does_not_hold_shutdown(tokenizer: Any) -> None:
    """Issue 11 #9: one idle keep-alive connection held SIGTERM shutdown for the whole 30 s grace."""
    stop = trio.Event()
    engine = SimEngine(tokenizer, SimConfig(token_interval=0.001))
    async with trio.open_nursery() as nursery:
        running = await nursery.start(
            lambda task_status: serve_proxy(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer,
                                            shutdown_trigger=stop.wait, task_status=task_status)
        )
        port = int(running.url.rsplit(":", 1)[1])
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        await stream.send_all(b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
        assert (await stream.receive_some(4096)).startswith(b"HTTP/1.1 200")
        stop.set()  # the connection stays open and idle
        stopping = trio.current_time()
    assert trio.current_time() - stopping < 5.0  # was the whole 30 s grace period
    await stream.aclose()


async def test_draining_refuses_new_turns_in_the_callers_format_and_finishes_the_rest(tokenizer: Any) -> None:
    stop = trio.Event()
    engine = SimEngine(tokenizer, SimConfig(token_interval=0.01))
    seen: list[str] = []
    async with trio.open_nursery() as nursery:
        running = await nursery.start(
            lambda task_status: serve_proxy(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer,
                                            shutdown_trigger=stop.wait, task_status=task_status)
        )
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            started = trio.Event()

            async def stream() -> None:
                body = {"messages": HI, "stream": True, "max_tokens": 30}
                async with http.stream("POST", "/v1/chat/completions", json=body,
                                       headers={"X-Session-Id": "inflight"}) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        started.set()
                        seen.append(line)

            async with trio.open_nursery() as streams:
                streams.start_soon(stream)
                await started.wait()
                await refused_while_draining(http, running, stop)
    assert [line for line in seen if line][-1] == "data: [DONE]"  # the turn in flight finished


async def refused_while_draining(http: httpx.AsyncClient, running: Any, stop: trio.Event) -> None:
    stop.set()
    await trio.testing.wait_all_tasks_blocked()
    assert running.runtime.draining
    new = {"X-Session-Id": "new"}
    openai = await http.post("/v1/chat/completions", json={"messages": HI}, headers=new)
    assert openai.status_code == 503 and openai.headers["retry-after"], openai.text
    assert openai.json()["error"]["code"] == "shutting_down"
    anthropic = await http.post("/v1/messages", json={"messages": HI, "max_tokens": 5, "model": "m"},
                                headers=new)
    assert anthropic.status_code == 503 and anthropic.json()["type"] == "error"
    assert anthropic.headers["retry-after"]


def _stored(data_dir: Path) -> dict[str, Any]:
    """Everything in the SQLite store, read by a new process's store (recovering what a crash left)."""
    store = SQLiteStore(str(data_dir))
    try:
        store.recover()
        result: dict[str, Any] = store.read(ReadQuery(None, None, False, True), CONVERTER.unstructure)
        result["stats"] = store.stats()
        return result
    finally:
        store.close()


async def _stream_turn(http: httpx.AsyncClient, session: str, messages: list[dict[str, Any]],
                       first: trio.Event | None = None, max_tokens: int = 40) -> tuple[int, str, int]:
    """A streamed turn: (status, content, completion tokens)."""
    body = {"messages": messages, "stream": True, "max_tokens": max_tokens,
            "stream_options": {"include_usage": True}}
    content, tokens = [], 0
    async with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": session}) as r:
        if r.status_code != 200:
            return r.status_code, (await r.aread()).decode(), 0
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                content.append(choice["delta"].get("content") or "")
                if first is not None:
                    first.set()
    return r.status_code, "".join(content), tokens


async def test_sigterm_with_100_streams_in_flight_drains_them_all(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proxy = ProxyProcess(tmp_path / "proxy.log", "--data-dir", str(data), "--sim-token-interval", "0.05")
    try:
        url = await proxy.started()
        results: dict[str, tuple[int, str, int]] = {}
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
            firsts = [trio.Event() for _ in range(100)]

            async def one(i: int) -> None:
                results[f"s{i}"] = await _stream_turn(http, f"s{i}", HI, firsts[i])

            async with trio.open_nursery() as nursery:
                for i in range(100):
                    nursery.start_soon(one, i)
                for event in firsts:  # every stream has produced tokens: 100 turns in flight
                    await event.wait()
                proxy.proc.send_signal(signal.SIGTERM)
        assert await proxy.wait() == 0
    finally:
        proxy.kill()
    assert sorted(status for status, _, _ in results.values()) == [200] * 100
    stored = _stored(data)
    steps = {s["session_id"]: s for s in stored["steps"]}
    assert len(stored["steps"]) == 100 and all(s["status"] == "completed" for s in steps.values())
    for session, (_, _, tokens) in results.items():
        assert len(steps[session]["output_ids"]) == tokens > 0
    assert sorted(s["boundary_reason"] for s in stored["data"]) == ["shutdown"] * 100
    assert stored["stats"]["recovered_steps"] == 0  # a clean stop leaves no journal


async def test_sigkill_loses_no_completed_step_and_no_finalized_segment(tmp_path: Path) -> None:
    """50 sessions: 20 finalized, 20 open, 10 generating when the process is killed."""
    data = tmp_path / "data"
    proxy = ProxyProcess(tmp_path / "proxy.log", "--data-dir", str(data), "--sim-token-interval", "0.02")
    completed: dict[tuple[str, int], int] = {}  # (session, step) -> completion tokens the agent received
    conversations: dict[str, list[dict[str, Any]]] = {}
    try:
        url = await proxy.started()
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:

            async def turns(session: str, count: int) -> None:
                messages = list(HI)
                for step in range(count):
                    status, content, tokens = await _stream_turn(http, session, messages, max_tokens=12)
                    assert status == 200
                    completed[(session, step)] = tokens
                    messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "more"}]
                conversations[session] = messages

            async with trio.open_nursery() as nursery:
                for i in range(40):
                    nursery.start_soon(turns, f"s{i}", 2)
                for i in range(40, 50):
                    nursery.start_soon(turns, f"s{i}", 1)
            for i in range(20):
                assert (await http.post("/session/finalize", json={"session_id": f"s{i}"})).status_code == 200
            before = (await http.post("/trajectory/read", json={})).json()["data"]
            generating = [trio.Event() for _ in range(10)]

            async def generate(i: int) -> None:
                try:
                    session = f"s{40 + i}"
                    await _stream_turn(http, session, conversations[session], generating[i], max_tokens=400)
                except httpx.HTTPError:
                    pass  # killed mid-stream

            async with trio.open_nursery() as nursery:
                for i in range(10):
                    nursery.start_soon(generate, i)
                for event in generating:
                    await event.wait()
                # Polled (bounded): the journal commits in the proxy's writer thread within ~50 ms of a step's
                # end, and /trajectory/stats is the only sign of it another process can see.
                with trio.fail_after(10):
                    while (await http.get("/trajectory/stats")).json()["journal_steps"] < 50:  # noqa: ASYNC110
                        await trio.sleep(0.02)
                proxy.proc.kill()
                proxy.proc.wait()
                nursery.cancel_scope.cancel()
    finally:
        proxy.kill()
    restarted = ProxyProcess(tmp_path / "proxy2.log", "--data-dir", str(data))
    try:
        url = await restarted.started()
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            stored = (await http.post("/trajectory/read", json={"include_steps": True})).json()
            stats = (await http.get("/trajectory/stats")).json()
    finally:
        restarted.kill()
    assert len(before) == 20
    by_id = {s["trajectory_id"]: s for s in stored["data"]}
    assert len(by_id) == len(stored["data"]) == 50  # each segment once
    for segment in before:  # finalized before the kill: byte-identical after it
        assert by_id[segment["trajectory_id"]] == segment
    recovered = [s for s in stored["data"] if s["boundary_reason"] == "recovered"]
    got = {(s["session_id"], s["step_index"]): s for s in stored["steps"]}
    # A "generating" turn may finish (the simulated policy stops before 400 tokens) between the journal
    # check and the kill: its step then completed and must be recovered like the others, though the
    # agent may never have read its last chunk. Only those steps may come on top of the 90 counted.
    late = {key for key in got if key not in completed}
    assert late <= {(f"s{40 + i}", 1) for i in range(10)}, late
    assert all(got[key]["status"] == "completed" for key in late)
    assert len(recovered) == 30 and stats["recovered_steps"] == 50 + len(late) and stats["recovered_segments"] == 30
    assert len(got) == len(stored["steps"]) == 90 + len(late)  # each completed step once, nothing else
    assert {key: len(s["output_ids"]) for key, s in got.items() if key not in late} == completed
    for segment in recovered:
        ids = [t for i in segment["step_indices"] for t in got[(segment["parent_traj_id"], i)]["concat_token_ids"]]
        assert segment["token_ids"] == ids
