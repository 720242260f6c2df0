"""A streamed turn that waits to start (generation paused) starts its reply after the heartbeat interval.

An agent whose turn arrives during a weight update would otherwise see nothing at all,
not even a status line, until the pause ends or ``--pause-wait-timeout`` runs out: longer
than the idle timeouts of common HTTP clients (Node's fetch gives up on a response head
after 300 s). So once ``--heartbeat-interval`` passes with the turn still waiting, its
reply starts (200, the SSE head) and a heartbeat follows each interval; a refusal after
that is the stream's error event in the caller's format. A turn that starts or is refused
within the interval is unchanged: its head comes with its first frames, its refusal is a
plain status (test_refused_streams.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from _asgi import open_client
from _util import access_logged, hang_up_after, stop_reading_after_the_head
from prometheus_client.parser import text_string_to_metric_families

from actorproxy import ProxyConfig, open_proxy
from actorproxy.server.app import create_app
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.testing import open_simulated_proxy

HI = [{"role": "user", "content": "hi"}]
#: (path, body, heartbeat line, the line that tells the refusal's code) of one turn in each protocol.
CALLS = [
    pytest.param("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": HI, "stream": True},
                 ": keep-alive", id="chat"),
    pytest.param("/v1/messages", {"model": "m", "max_tokens": 4, "messages": HI, "stream": True},
                 "event: ping", id="anthropic"),
    pytest.param("/v1/responses", {"model": "m", "max_output_tokens": 4, "input": "hi", "stream": True},
                 ": keep-alive", id="responses"),
]


@asynccontextmanager
async def paused_proxy(tokenizer: Any, *, pause_wait_timeout: float) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a proxy (heartbeats every 10 s) whose generation is paused."""
    async with open_simulated_proxy(tokenizer=tokenizer, sim_config=SimConfig(token_interval=0.001),
                                    heartbeat_interval=10, pause_wait_timeout=pause_wait_timeout) as sim, \
            open_client(create_app(sim.runtime)) as http:
        assert (await http.post("/v1/rollout/pause", json={"mode": "abort"})).status_code == 200
        yield http


async def stream_lines(http: httpx.AsyncClient, path: str, body: dict[str, Any], session: str,
                       seen: list[tuple[float, str]]) -> httpx.Response:
    """Stream the call, noting each line with the (virtual) time it came, from the call; read to its end."""
    start = trio.current_time()
    async with http.stream("POST", path, json=body, headers={"X-Session-Id": session}) as reply:
        seen.append((trio.current_time() - start, f"status {reply.status_code}"))
        async for line in reply.aiter_lines():
            if line:
                seen.append((trio.current_time() - start, line))
    return reply


@pytest.mark.parametrize(("path", "body", "heartbeat"), CALLS)
async def test_a_turn_waiting_out_a_pause_streams_heartbeats_then_its_reply(
    path: str, body: dict[str, Any], heartbeat: str, tokenizer: Any, autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[tuple[float, str]] = []
    async with paused_proxy(tokenizer, pause_wait_timeout=600) as http:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_lines, http, path, body, "w", seen)
            await trio.sleep(35)  # a weight update of 35 s
            assert (await http.post("/v1/rollout/resume", json={})).json()["resumed"] is True
        # The head after one interval (with the first heartbeat), then one heartbeat an interval until the resume.
        assert seen[0] == (pytest.approx(10), "status 200"), seen
        beats = [at for at, line in seen if line == heartbeat]
        assert beats[:3] == [pytest.approx(10), pytest.approx(20), pytest.approx(30)], seen
        # Then the reply itself, whole, after the resume.
        lines = [line for _, line in seen]
        if path == "/v1/chat/completions":
            assert lines[-1] == "data: [DONE]"
            chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        elif path == "/v1/messages":
            events = [line[7:] for line in lines if line.startswith("event: ") and line != "event: ping"]
            assert events[0] == "message_start" and events[-1] == "message_stop", events
        else:
            events = [line[7:] for line in lines if line.startswith("event: ")]
            assert events[0] == "response.created" and events[-1] in ("response.completed", "response.incomplete")
        await http.post("/session/finalize", json={"session_id": "w"})
        read = (await http.post("/trajectory/read", json={"session_id": "w", "include_steps": True})).json()
        assert [s["status"] for s in read["steps"]] == ["completed"] and read["steps"][0]["output_ids"]


@pytest.mark.parametrize(("path", "body", "heartbeat"), CALLS)
async def test_a_turn_refused_after_its_stream_started_gets_the_error_event(
    path: str, body: dict[str, Any], heartbeat: str, tokenizer: Any, autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[tuple[float, str]] = []
    async with paused_proxy(tokenizer, pause_wait_timeout=25) as http:
        await stream_lines(http, path, body, "late", seen)
        assert seen[0] == (pytest.approx(10), "status 200"), seen
        assert [at for at, line in seen if line == heartbeat] == [pytest.approx(10), pytest.approx(20)]
        # The pause outlasted --pause-wait-timeout: the refusal is the stream's error, in the caller's format.
        assert seen[-1][0] == pytest.approx(25)
        data = [json.loads(line[6:]) for _, line in seen if line.startswith("data: {")]
        if path == "/v1/chat/completions":
            assert data[-1]["error"]["code"] == "generation_paused" and seen[-1][1] == "data: [DONE]"
        elif path == "/v1/messages":
            assert data[-1]["type"] == "error" and data[-1]["error"]["type"] == "overloaded_error"
            assert "paused" in data[-1]["error"]["message"]
            assert not any(line == "event: message_start" for _, line in seen)
        else:
            assert data[-1]["type"] == "response.failed"
            assert data[-1]["response"]["error"]["code"] == "generation_paused"
        # Its step is recorded as refused, with nothing sampled.
        assert (await http.post("/v1/rollout/resume", json={})).json()["resumed"] is True
        await http.post("/session/finalize", json={"session_id": "late"})
        read = await http.post("/trajectory/read", json={"session_id": "late", "include_steps": True})
        assert [(s["status"], s["output_ids"]) for s in read.json()["steps"]] == [("error", [])], read.text


async def test_a_turn_that_starts_within_the_interval_sends_no_heartbeat_first(
    tokenizer: Any, autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_simulated_proxy(tokenizer=tokenizer, sim_config=SimConfig(token_interval=0.001),
                                    heartbeat_interval=10) as sim, open_client(create_app(sim.runtime)) as http:
        assert (await http.post("/v1/rollout/pause", json={"mode": "abort"})).status_code == 200
        seen: list[tuple[float, str]] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_lines, http, "/v1/chat/completions",
                               {"messages": HI, "max_tokens": 4, "stream": True}, "s", seen)
            await trio.sleep(9)
            await http.post("/v1/rollout/resume", json={})
        assert not any(line == ": keep-alive" for _, line in seen), seen
        assert seen[0][1] == "status 200" and seen[1][1].startswith("data: {") and seen[-1][1] == "data: [DONE]"


@pytest.mark.parametrize(("path", "body"), [
    pytest.param("/v1/chat/completions", {"messages": HI, "max_tokens": 4}, id="chat"),
    pytest.param("/generate", {"trajectory_uid": "t", "prompt_uid": "p", "messages": HI, "max_tokens": 4},
                 id="gateway"),
    pytest.param("/generate", {"prompt_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}, id="token-in"),
])
async def test_a_call_that_does_not_stream_waits_out_the_pause_with_nothing_sent(
    path: str, body: dict[str, Any], tokenizer: Any, autojump_clock: trio.testing.MockClock,
) -> None:
    """Its reply is one JSON document whose status is its result's: nothing starts early (the gateway's
    ``/generate`` has no streamed form at all: ``stream`` is an unknown field there, 400)."""
    seen: list[tuple[float, str]] = []
    async with paused_proxy(tokenizer, pause_wait_timeout=600) as http:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_lines, http, path, body, "s", seen)
            await trio.sleep(35)
            assert (await http.post("/v1/rollout/resume", json={})).json()["resumed"] is True
        assert [at for at, _ in seen] == [pytest.approx(35, abs=0.1)] * 2, seen  # the head with the result
        assert seen[0][1] == "status 200" and "error" not in json.loads(seen[1][1]), seen
        if path == "/generate":
            refused = await http.post(path, json={**body, "stream": True})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream", refused.text


async def _waiting(http: httpx.AsyncClient, count: int) -> None:
    """Until the proxy counts ``count`` turns waiting for the pause: it turns on bytes sent over loopback (a
    request, a hang-up), with nothing to wait on here."""
    for _ in range(400):
        if (await http.get("/v1/rollout/pause_state")).json()["waiting"] == count:
            return
        await trio.testing.wait_all_tasks_blocked(cushion=0.005)
    raise AssertionError(f"the proxy never counted {count} turns waiting")


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
async def test_an_agent_that_leaves_while_its_turn_waits_is_withdrawn_at_once(
    stream: bool, tokenizer: Any, caplog: pytest.LogCaptureFixture,
) -> None:
    """Over the real server: an agent gives up on a turn that waits for the pause (its client's timeout).

    The turn stops waiting then, not at the resume: it is no longer counted, and the resume does not
    start a generation for nobody. Its step is ``client_disconnected`` with nothing sampled.
    """
    caplog.set_level(logging.WARNING)
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.0))
    config = ProxyConfig.of(port=0, heartbeat_interval=0.05)
    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running, \
            httpx.AsyncClient(base_url=running.url, timeout=30) as http:
        assert (await http.post("/v1/rollout/pause", json={"mode": "abort"})).status_code == 200
        body = {"messages": HI, "max_tokens": 4, "stream": stream}
        if stream:  # the agent reads its first heartbeat, then hangs up
            await hang_up_after(http, "/v1/chat/completions", body, "gone", events=1, marker=": keep-alive")
        else:  # nothing comes before the result: the agent hangs up once its turn waits
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: http.post("/v1/chat/completions", json=body,
                                                     headers={"X-Session-Id": "gone"}))
                await _waiting(http, 1)
                nursery.cancel_scope.cancel()
        await _waiting(http, 0)
        assert (await http.post("/v1/rollout/resume", json={})).json()["woken"] == 0
        after = await http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 4},
                                headers={"X-Session-Id": "gone"})
        assert after.status_code == 200, after.text
        steps = (await http.get("/session/gone")).json()["recent_steps"]
    assert [(s["status"], s["completion_tokens"]) for s in steps][:1] == [("client_disconnected", 0)], steps
    assert [s["status"] for s in steps][1:] == ["completed"], steps
    assert engine.requests_started == 1  # the follow-up turn only: none for the agent that left
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


async def _chat_turns(http: httpx.AsyncClient) -> dict[str, float]:
    """``actorproxy_turns_total`` of the chat route, by status."""
    families = text_string_to_metric_families((await http.get("/metrics")).text)
    return {sample.labels["status"]: sample.value for family in families for sample in family.samples
            if sample.name == "actorproxy_turns_total" and sample.labels["route"] == "/v1/chat/completions"}


@pytest.mark.parametrize(("refusal", "status"), [("generation_paused", "503"), ("trajectory_version_changed", "409")])
async def test_a_refusal_after_an_early_start_is_counted_and_logged_as_that_error(
    refusal: str, status: str, tokenizer: Any, autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Over the real server: the stream went out as a 200, but its turn was refused, and the metrics say so.

    Refused when the pause outlasts --pause-wait-timeout (25 s), or at a resume after 15 s that
    installs another weight version in a trajectory begun under the first (no --partial-rollout).
    """
    caplog.set_level(logging.INFO, logger="actorproxy.access")
    engine = SimEngine(tokenizer, SimConfig(token_interval=0.001))
    config = ProxyConfig.of(port=0, heartbeat_interval=10, pause_wait_timeout=25)
    body = {"messages": HI, "max_tokens": 4, "stream": True}
    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running, \
            httpx.AsyncClient(base_url=running.url, timeout=100) as http:
        if refusal == "trajectory_version_changed":  # the trajectory's first turn, under weight version 0
            first = await http.post("/v1/chat/completions", json={**body, "stream": False},
                                    headers={"X-Session-Id": "r"})
            assert first.status_code == 200, first.text
        assert (await http.post("/v1/rollout/pause", json={"mode": "abort"})).status_code == 200
        seen: list[tuple[float, str]] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream_lines, http, "/v1/chat/completions", body, "r", seen)
            if refusal == "trajectory_version_changed":
                await trio.sleep(15)
                assert (await http.post("/v1/rollout/resume", json={"weight_version": "1"})).status_code == 200
        assert seen[0] == (pytest.approx(10), "status 200"), seen
        errors = [json.loads(line[6:])["error"] for _, line in seen if line.startswith('data: {"error"')]
        assert [error["code"] for error in errors] == [refusal], seen
        turns = await _chat_turns(http)
    assert turns == ({status: 1} if refusal == "generation_paused" else {"200": 1, status: 1}), turns
    lines = [r.fields for r in caplog.records if r.name == "actorproxy.access"]  # type: ignore[attr-defined]
    line = [fields for fields in lines if fields["path"] == "/v1/chat/completions"][-1]  # the streamed turn's
    assert (line["status"], line["error"]) == (int(status), refusal), lines


@pytest.mark.parametrize("when", ["mid-reply", "after-an-early-start"])
async def test_a_client_that_hangs_up_mid_stream_is_counted_and_logged_as_499(
    when: str, tokenizer: Any, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
) -> None:
    """Over the real server: the stream's head said 200, but the client left before its end, as one that
    leaves before any answer does: a 499 ``client_disconnected`` (nginx's "client closed request").

    It leaves after five frames of its running reply, or after the first heartbeat of a stream started
    early while its turn waits out a pause. Its step is ``client_disconnected`` all the same.
    """
    caplog.set_level(logging.INFO, logger="actorproxy.access")
    engine = SimEngine(tokenizer, SimConfig(token_interval=0.001))
    engine.script("word " * 400, routing_key="gone")
    config = ProxyConfig.of(port=0, heartbeat_interval=10)
    body = {"messages": HI, "max_tokens": 500, "stream": True}
    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running, \
            httpx.AsyncClient(base_url=running.url, timeout=100) as http:
        if when == "mid-reply":
            await hang_up_after(http, "/v1/chat/completions", body, "gone", events=5)
        else:
            assert (await http.post("/v1/rollout/pause", json={"mode": "abort"})).status_code == 200
            await hang_up_after(http, "/v1/chat/completions", body, "gone", events=1, marker=": keep-alive")
        # Until the server has seen the hang-up and ended the request: the client's EOF may be a half-close,
        # so once the reply has started only the reset that answers the next frame (a heartbeat) tells.
        for _ in range(60):
            lines = [r.fields for r in caplog.records  # type: ignore[attr-defined]
                     if r.name == "actorproxy.access" and r.fields["session"] == "gone"]
            if lines:
                break
            await trio.sleep(1)
        step = (await http.get("/session/gone")).json()["recent_steps"][-1]
        turns = await _chat_turns(http)
    assert [(line["status"], line.get("error")) for line in lines] == [(499, "client_disconnected")], lines
    assert turns == {"499": 1}, turns
    assert (step["status"], step["in_segment"]) == ("client_disconnected", False), step
    if when == "mid-reply":  # its generation was aborted where the client left
        stats = engine.stats(step["rid"])
        assert stats.aborted and 0 < step["completion_tokens"] == len(stats.token_ids) < 400, step
    else:  # nothing generated: it never started
        assert step["completion_tokens"] == 0 and engine.requests_started == 0, step


@pytest.mark.parametrize(("path", "body", "heartbeat"), CALLS)
async def test_a_refusal_logs_the_proxys_code_however_it_was_delivered(
    path: str, body: dict[str, Any], heartbeat: str, tokenizer: Any, autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Over the real server: the pause outlasts --pause-wait-timeout (25 s) for a call that does not stream
    (a plain 503) and one that does (started early, at 10 s: the stream's error frame). Both are logged
    ``status=503 error=generation_paused``, the proxy's own code, also where the plain reply's body names
    only Anthropic's error type (``overloaded_error``); so is an empty body, a plain 400, on the lane's
    ``/v1/messages`` and on the app's ``/v1/messages/count_tokens`` alike."""
    caplog.set_level(logging.INFO, logger="actorproxy.access")
    engine = SimEngine(tokenizer, SimConfig(token_interval=0.001))
    config = ProxyConfig.of(port=0, heartbeat_interval=10, pause_wait_timeout=25)
    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running, \
            httpx.AsyncClient(base_url=running.url, timeout=100) as http:
        assert (await http.post("/v1/rollout/pause", json={"mode": "abort"})).status_code == 200
        plain = await http.post(path, json={**body, "stream": False}, headers={"X-Session-Id": "plain"})
        assert plain.status_code == 503, plain.text
        seen: list[tuple[float, str]] = []
        await stream_lines(http, path, body, "streamed", seen)
        assert seen[0] == (pytest.approx(10), "status 200"), seen
        empty = [(await http.post(route, content=b"", headers={"X-Session-Id": route})).status_code
                 for route in ("/v1/messages", "/v1/messages/count_tokens")]
        assert empty == [400, 400]
    lines = {r.fields["session"]: (r.fields["status"], r.fields.get("error"))  # type: ignore[attr-defined]
             for r in caplog.records if r.name == "actorproxy.access" and r.fields["session"]}
    assert lines == {"plain": (503, "generation_paused"), "streamed": (503, "generation_paused"),
                     "/v1/messages": (400, "invalid_request"),
                     "/v1/messages/count_tokens": (400, "invalid_request")}, lines


async def test_an_agent_that_stops_reading_its_stream_is_cut_after_the_send_timeout(
    tokenizer: Any, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    """An agent that stops reading its stream, its connection left open (a hung process), held its turn and its
    generation for good: once the reply waited ``--send-timeout`` seconds without a byte taken, the turn ends as
    one whose agent hung up (aborted at the engine, ``client_disconnected``, a 499)."""
    caplog.set_level(logging.INFO, logger="actorproxy.access")
    logged = access_logged(request)
    engine = SimEngine(tokenizer, SimConfig(token_interval=0.001))
    engine.script("word " * 100000, routing_key="stuck")
    config = ProxyConfig.of(port=0, send_timeout=30.0)
    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running:
        sock = await stop_reading_after_the_head(running.url, "/v1/chat/completions", {
            "messages": HI, "max_tokens": 100000, "stream": True}, b"x-session-id: stuck\r\n")
        with trio.fail_after(3600):
            await logged.wait()  # its request ended
        step = (await running.runtime.describe_session("stuck")).recent_steps[-1].step
        sock.close()
    lines = [(r.fields["status"], r.fields.get("error")) for r in caplog.records  # type: ignore[attr-defined]
             if r.name == "actorproxy.access"]
    assert lines == [(499, "client_disconnected")], lines
    kept = len(step.output_ids)
    assert step.status == "client_disconnected" and 0 < kept < 100000, (step.status, kept)
    stats = engine.stats(step.rid)  # its generation was aborted where the agent's socket held it back
    assert stats.aborted and len(stats.token_ids) == kept
