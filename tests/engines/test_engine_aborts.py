"""Pausing with many streams in flight through an HTTP engine: every generation gets the
acknowledged abort, and what the proxy recorded is exactly what the engine produced.

The simulated engine's HTTP app (SGLang and vLLM routes) at 40 tokens/s, served on
port 0 by the proxy's own server, behind the proxy's engine clients and HTTP app, all
in the test's Trio run under MockClock: the pause, the slow abort answers and every
token come at exact virtual times, so no bound has to allow for a loaded machine.
"""

from __future__ import annotations

import socket
from collections import Counter
from typing import Any

import orjson
import pytest
import trio
import trio.testing
from _asgi import open_client, open_sim_server

from actorproxy import ProxyConfig
from actorproxy.engines import aborts
from actorproxy.engines.aborts import AbortBatcher
from actorproxy.engines.base import AbortBatch, Backend
from actorproxy.engines.connection import EngineOptions
from actorproxy.engines.pool import EnginePool
from actorproxy.engines.sglang.client import SGLangBackend
from actorproxy.engines.vllm.client import VLLMBackend
from actorproxy.runtime.runtime import open_runtime
from actorproxy.server.app import create_app
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.sim.server import SimServerSettings

INTERVAL = 0.025  # 40 tokens/s


async def _pause_with_streams_in_flight(
    tokenizer: Any, kind: str, *, streams: int, abort_delay: float, abort_calls: int, **proxy: Any
) -> float:
    """Pauses once every stream has 4 frames; returns how long the pause took (virtual seconds)."""
    engine = SimEngine(tokenizer, SimConfig(token_interval=INTERVAL))
    # Incremental SGLang events: cumulative ones grow with every token.
    settings = SimServerSettings(port=0, incremental_streaming_output=True)
    async with open_sim_server(engine, settings) as sim:
        sim.faults.delay_aborts(abort_delay)
        for i in range(streams):
            # Longer than the pause can come, then, after the resume, a short continuation.
            engine.script("word " * 2000, "Done.", routing_key=f"s{i}")
        config = ProxyConfig.of(port=0, backend=kind, backend_urls=(sim.url,), partial_rollout=True, **proxy)
        # What make_backend builds from this config.
        options = EngineOptions(concurrency=config.engines.engine_max_concurrency,
                                abort_all=config.engines.engine_abort_all)
        client: Backend = (SGLangBackend if kind == "sglang" else VLLMBackend)(sim.url, options)
        pool = EnginePool([client], names=[sim.url], max_concurrency=options.concurrency,
                          health_interval=config.engines.engine_health_interval)
        async with open_runtime(config, backend=pool, tokenizer=tokenizer) as runtime, \
                open_client(create_app(runtime)) as client_http:
            seen: Counter[int] = Counter()
            enough = trio.Event()

            async def turn(i: int) -> None:
                body = {"messages": [{"role": "user", "content": "talk"}], "stream": True, "max_tokens": 4000}
                headers = {"X-Session-Id": f"s{i}"}
                async with client_http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                    async for line in r.aiter_lines():
                        seen[i] += line.startswith("data: ")
                        if len([n for n in seen.values() if n >= 4]) == streams:
                            enough.set()

            async with trio.open_nursery() as nursery:
                for i in range(streams):
                    nursery.start_soon(turn, i)
                await enough.wait()
                paused_at = trio.current_time()
                ack = (await client_http.post("/v1/rollout/pause", json={"mode": "abort"})).json()
                pause_took = trio.current_time() - paused_at
                assert ack["aborted"] == streams
                assert sim.state.abort_calls == abort_calls
                # Nothing was cut: every engine request ended by its abort, none by a hang-up.
                records = list(sim.state.records.values())
                assert [r.status for r in records] == ["aborted"] * streams
                resumed = {}
                for record in records:
                    stats = engine.stats(record.rid)
                    assert stats.aborted and not stats.cancelled
                    resumed[record.rid] = list(stats.token_ids)
                await client_http.post("/v1/rollout/resume", json={})
            for i in range(streams):
                await client_http.post("/session/finalize", json={"session_id": f"s{i}"})
                data = await client_http.post("/trajectory/read", json={"session_id": f"s{i}", "include_steps": True})
                [step] = data.json()["steps"]
                first = resumed[step["rid"]]
                # Partial rollout: the step holds the aborted attempt's tokens exactly, then the rest.
                assert step["output_ids"][: len(first)] == first
    return pause_took


@pytest.mark.parametrize(
    ("kind", "proxy", "calls"),
    [
        pytest.param("sglang", {}, 8, id="sglang-one-abort-each"),
        pytest.param("sglang", {"engine_abort_all": True}, 1, id="sglang-abort-all"),
        pytest.param("vllm", {}, 1, id="vllm-one-call-with-every-id"),
    ],
)
async def test_pause_aborts_every_stream_and_records_exactly_what_the_engine_made(
    tokenizer: Any, kind: str, proxy: dict[str, Any], calls: int, autojump_clock: trio.testing.MockClock
) -> None:
    # Batched aborts keep the per-request acknowledgement: each stream still ends
    # with its own abort finish and exactly the engine's tokens.
    await _pause_with_streams_in_flight(tokenizer, kind, streams=8, abort_delay=0.0, abort_calls=calls, **proxy)


async def test_a_pauses_aborts_pipelined_on_a_few_connections_stop_every_stream_with_its_own_finish(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.testing.MockClock
) -> None:
    # 8 streams, 3 connections: the simulated engine's server answers each connection's calls in order.
    monkeypatch.setattr(aborts, "ABORT_CONNECTIONS", 3)
    await _pause_with_streams_in_flight(tokenizer, "sglang", streams=8, abort_delay=0.0, abort_calls=8)
    # A slow engine answers a connection's calls one after another: 3 deep, 3 times the delay.
    took = await _pause_with_streams_in_flight(tokenizer, "sglang", streams=8, abort_delay=0.5, abort_calls=8)
    assert took == pytest.approx(1.5)


async def test_a_slow_abort_answer_is_waited_for_not_turned_into_a_hang_up(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    # The engine answers the abort calls after 2.5 s (> the 2 s abort grace): the streams
    # used to be cut at 2 s, losing the tokens in flight and never aborting in the engine.
    # Under MockClock the 20 streams' backlog costs no time, so the controller's and the
    # turn's own bounds (ABORT_BOUND, 10 s) stay as they are in production.
    took = await _pause_with_streams_in_flight(tokenizer, "sglang", streams=20, abort_delay=2.5, abort_calls=20)
    assert took == pytest.approx(2.5)  # the pause waited for the slow answers, and no longer


async def test_the_abort_batcher_sends_a_round_once_and_survives_a_cancelled_sender() -> None:
    calls: list[list[str]] = []
    gate = trio.Event()

    async def send(ids: list[str]) -> list[str]:
        calls.append(list(ids))  # the sender's own id comes first
        await gate.wait()
        return [i for i in ids if i != "b"]  # the engine refused "b"

    batcher = AbortBatcher(send)
    results: dict[str, bool] = {}
    scopes = {rid: trio.CancelScope() for rid in "abc"}

    async def ask(rid: str) -> None:
        with scopes[rid]:
            results[rid] = await batcher.abort([rid])

    async with trio.open_nursery() as nursery:
        for rid in "abc":
            nursery.start_soon(ask, rid)
        await trio.testing.wait_all_tasks_blocked()
        assert [sorted(c) for c in calls] == [["a", "b", "c"]]  # one call for the round
        sender = calls[0][0]
        scopes[sender].cancel()  # the task making the call leaves: the others send again themselves
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
    others = sorted(set("abc") - {sender})
    assert [sorted(c) for c in calls] == [["a", "b", "c"], others]
    assert results == {rid: rid != "b" for rid in others}  # each caller gets its own request's answer


def _listening_engine() -> tuple[socket.socket, SGLangBackend]:
    """A listening socket on port 0 that accepts nothing by itself, and an SGLang client of it."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.setblocking(False)
    return listener, SGLangBackend(f"http://127.0.0.1:{listener.getsockname()[1]}")


async def test_aborts_asked_at_once_each_go_on_a_connection_of_their_own_and_get_their_own_answer() -> None:
    """A pause's SGLang aborts: one call per rid (SGLang takes one), each sent by the asking task, none awaited."""
    listener, backend = _listening_engine()
    results: dict[str, bool] = {}
    scopes = {rid: trio.CancelScope() for rid in ("r0", "r1", "r2", "r3")}
    requests: list[tuple[socket.socket, bytes]] = []

    async def ask(rid: str) -> None:
        with scopes[rid]:
            results[rid] = await backend.abort_now(rid)

    try:
        async with trio.open_nursery() as nursery:
            for rid in scopes:
                nursery.start_soon(ask, rid)
            await trio.testing.wait_all_tasks_blocked()
            while True:  # every request is there already, though none was answered
                try:
                    conn, _ = listener.accept()
                except BlockingIOError:
                    break
                requests.append((conn, conn.recv(65536)))
            connections = {}
            for conn, raw in requests:
                head, _, body = raw.partition(b"\r\n\r\n")
                assert head.startswith(b"POST /abort_request HTTP/1.1\r\n") and b"connection: close" in head
                connections[orjson.loads(body)["rid"]] = conn
            assert sorted(connections) == ["r0", "r1", "r2", "r3"]
            scopes["r3"].cancel()  # its caller leaves: its connection is closed, the others wait on
            await trio.testing.wait_all_tasks_blocked()
            assert connections["r3"].recv(10) == b""
            connections["r1"].sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 3\r\n\r\nno!")
            connections["r0"].sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n")
            connections["r2"].sendall(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nconnection: close\r\n\r\n")
            connections["r2"].shutdown(socket.SHUT_WR)
        assert results == {"r0": True, "r1": False, "r2": True}  # each caller gets its own request's answer
        assert backend.abort_calls == 4
    finally:
        for conn, _ in requests:
            conn.close()
        listener.close()
        await backend.aclose()


async def test_an_abort_asked_at_once_of_an_unreachable_engine_is_not_acknowledged() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    listener.close()  # nothing listens there now
    backend = SGLangBackend(f"http://127.0.0.1:{port}")
    try:
        assert await backend.abort_now("a") is False  # refused: the caller cuts its stream
        assert backend.control.opened == 0  # type: ignore[attr-defined]  # (not through the pool)
    finally:
        await backend.aclose()


class _Asked:
    """What a pause's abort needs of a generation: its rid, and where its answer goes."""

    def __init__(self, rid: str, answers: dict[str, bool]) -> None:
        self.rid, self._answers = rid, answers

    def abort_answered(self, acknowledged: bool) -> None:
        self._answers[self.rid] = acknowledged


def _requests(raw: bytes) -> list[str]:
    """The rids of the abort calls pipelined in ``raw`` (each a head, then its JSON body)."""
    rids = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"POST /abort_request HTTP/1.1\r\n") and b"connection: close" not in head
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        rids.append(orjson.loads(rest[:length])["rid"])
        raw = rest[length:]
    return rids


async def test_a_pauses_aborts_share_a_few_connections_pipelined_each_caller_with_its_own_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang takes one rid a call: a pause's calls go pipelined on at most ABORT_CONNECTIONS connections,
    written once the pause has asked them all; each connection's answers are read by one task of the
    pause's (``batch.rest``), nothing by the generations; a call whose connection closed unanswered is
    sent again on its own."""
    monkeypatch.setattr(aborts, "ABORT_CONNECTIONS", 2, raising=False)
    listener, backend = _listening_engine()
    answers: dict[str, bool] = {}
    rids = [f"r{i}" for i in range(5)]
    batch = AbortBatch()
    left = [backend.start_abort(_Asked(rid, answers), batch) for rid in rids]  # type: ignore[arg-type]
    # A thousand generations asked in one pass: no task each (the pause read 1,000 answers in 1,000 tasks).
    assert left == [None] * 5 and len(batch.rest) == 2
    accepted: list[socket.socket] = []

    def accept() -> list[socket.socket]:
        while True:
            try:
                conn, _ = listener.accept()
            except BlockingIOError:
                return accepted
            accepted.append(conn)
            conn.setblocking(False)

    try:
        [a, b] = accept()  # two connections for five calls, opened as they were asked
        with pytest.raises(BlockingIOError):
            a.recv(10)  # nothing written while the pause asks
        batch.close()
        assert _requests(a.recv(65536)) == ["r0", "r2", "r4"]  # all written at once, back to back
        assert _requests(b.recv(65536)) == ["r1", "r3"]
        async with trio.open_nursery() as nursery:
            for rest in batch.rest:
                nursery.start_soon(rest)
            await trio.testing.wait_all_tasks_blocked()
            a.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"
                      b"HTTP/1.1 404 Not Found\r\ncontent-length: 3\r\n\r\nno!"
                      b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n")
            b.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
            b.close()  # r3 unanswered: sent again on a connection of its own
            await trio.testing.wait_all_tasks_blocked()
            [again] = accept()[2:]
            assert _requests(again.recv(65536).replace(b"connection: close", b"x: y")) == ["r3"]
            again.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
        assert answers == {"r0": True, "r1": True, "r2": False, "r3": True, "r4": True}  # each its own answer
        assert a.recv(10) == b""  # every answer read: the connection closed
        assert backend.abort_calls == 6
    finally:
        for conn in accepted:
            conn.close()
        listener.close()
        await backend.aclose()
