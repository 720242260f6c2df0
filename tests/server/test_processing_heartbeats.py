"""A call that does not stream and waits long for its answer gets ``102 Processing`` heartbeats.

Rollout code mostly calls without streaming, through the OpenAI or Anthropic Python SDK
(httpx) or aiohttp, with a read timeout: often shorter than a weight update's pause or a
long generation, so the call timed out (and was retried, to time out again) with nothing
wrong. Such a client skips an interim 1xx response and starts its read timeout over with
it, so each ``--heartbeat-interval`` such a call waits, the proxy sends one; a client that
would take a 102 for the answer (Python's ``http.client``: ``urllib``, ``requests``) gets
none (``--processing-heartbeats auto``, by its User-Agent).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import aiohttp
import anthropic
import httpx
import openai
import orjson
import pytest
import trio
import trio.testing

from actorproxy import ProxyConfig, open_proxy
from actorproxy.server.lane import TurnLane
from actorproxy.sim import SimConfig, SimEngine

HI = [{"role": "user", "content": "hi"}]
HTTPX = "python-httpx/0.28.1"
PROCESSING = b"HTTP/1.1 102 Processing\r\n\r\n"


@asynccontextmanager
async def proxy_at(tokenizer: Any, sim: SimConfig, **settings: Any) -> AsyncIterator[tuple[str, int]]:
    """The proxy over the real server on port 0 (heartbeats every 10 s): its host and port."""
    config = ProxyConfig.of(port=0, **{"heartbeat_interval": 10, **settings})
    async with open_proxy(config, backend=SimEngine(tokenizer, sim), tokenizer=tokenizer) as running:
        host, port = running.url.removeprefix("http://").rsplit(":", 1)
        yield host, int(port)


async def call_raw(host: str, port: int, path: str, body: dict[str, Any], *, user_agent: str | None,
                   version: str = "1.1", seen: list[tuple[float, bytes]]) -> bytes:
    """POST ``body`` on a connection of its own; every piece received, with when it came (from the call)."""
    stream = await trio.open_tcp_stream(host, port)
    data = orjson.dumps(body)
    head = [f"POST {path} HTTP/{version}", f"host: {host}", "content-type: application/json",
            f"content-length: {len(data)}", "x-session-id: s", "connection: close"]
    if user_agent is not None:
        head.append(f"user-agent: {user_agent}")
    start = trio.current_time()
    async with stream:
        await stream.send_all(("\r\n".join(head) + "\r\n\r\n").encode() + data)
        received = b""
        while piece := await stream.receive_some():
            seen.append((trio.current_time() - start, piece))
            received += piece
    return received


def interim_times(seen: list[tuple[float, bytes]]) -> list[float]:
    """When each ``102 Processing`` came (each arrives on its own: they are seconds apart)."""
    return [at for at, piece in seen for _ in range(piece.count(PROCESSING))]


def final_status(received: bytes) -> int:
    """The final answer's status, after the interim ones."""
    match = re.match(rb"HTTP/1\.[01] (\d{3})", received.replace(PROCESSING, b""))
    assert match is not None, received[:200]
    return int(match.group(1))


CALLS = [
    pytest.param("/v1/chat/completions", {"model": "m", "max_tokens": 4, "messages": HI}, id="chat"),
    pytest.param("/v1/messages", {"model": "m", "max_tokens": 4, "messages": HI}, id="anthropic"),
    pytest.param("/v1/responses", {"model": "m", "max_output_tokens": 4, "input": "hi"}, id="responses"),
    pytest.param("/generate", {"trajectory_uid": "t", "prompt_uid": "p", "messages": HI, "max_tokens": 4},
                 id="gateway"),
    pytest.param("/generate", {"prompt_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}, id="token-in"),
]


@pytest.mark.parametrize(("path", "body"), CALLS)
async def test_a_call_waiting_out_a_pause_gets_102_each_interval_then_its_answer(
    path: str, body: dict[str, Any], tokenizer: Any, autojump_clock: trio.testing.MockClock,
) -> None:
    seen: list[tuple[float, bytes]] = []
    async with proxy_at(tokenizer, SimConfig(token_interval=0.001)) as (host, port), \
            httpx.AsyncClient(base_url=f"http://{host}:{port}") as http:
        assert (await http.post("/v1/rollout/pause", json={"mode": "abort"})).status_code == 200
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: call_raw(host, port, path, body, user_agent=HTTPX, seen=seen))
            await trio.sleep(35)  # a weight update of 35 s
            assert (await http.post("/v1/rollout/resume", json={})).json()["resumed"] is True
    assert interim_times(seen) == [pytest.approx(10), pytest.approx(20), pytest.approx(30)], seen
    received = b"".join(piece for _, piece in seen)
    assert final_status(received) == 200 and received.startswith(PROCESSING * 3 + b"HTTP/1.1 200 OK\r\n"), received
    assert b'"error":{' not in received and b'"error": {' not in received


@pytest.mark.parametrize(("path", "body"), [
    pytest.param("/v1/chat/completions", {"messages": HI, "max_tokens": 4}, id="chat"),
    pytest.param("/generate", {"prompt_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}, id="token-in"),
])
async def test_a_long_generation_gets_them_too(path: str, body: dict[str, Any], tokenizer: Any,
                                               autojump_clock: trio.testing.MockClock) -> None:
    """Not paused: an engine that takes 25 s before the first token (a long prefill)."""
    seen: list[tuple[float, bytes]] = []
    async with proxy_at(tokenizer, SimConfig(prefill_latency=25, token_interval=0.001)) as (host, port):
        received = await call_raw(host, port, path, body, user_agent="OpenAI/Python 3.57.0", seen=seen)
    assert interim_times(seen) == [pytest.approx(10), pytest.approx(20)], seen
    assert final_status(received) == 200


async def test_a_refusal_after_them_is_a_plain_status(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    """A 1xx commits to nothing: the pause outlasting --pause-wait-timeout is the usual 503, in the caller's format."""
    seen: list[tuple[float, bytes]] = []
    async with proxy_at(tokenizer, SimConfig(token_interval=0.001), pause_wait_timeout=25) as (host, port), \
            httpx.AsyncClient(base_url=f"http://{host}:{port}") as http:
        assert (await http.post("/v1/rollout/pause", json={"mode": "abort"})).status_code == 200
        received = await call_raw(host, port, "/v1/messages", {"model": "m", "max_tokens": 4, "messages": HI},
                                  user_agent="Anthropic/Python 2.14.0", seen=seen)
    assert interim_times(seen) == [pytest.approx(10), pytest.approx(20)], seen
    assert final_status(received) == 503
    answer = received[received.index(b"HTTP/1.1 503"):]
    assert orjson.loads(answer.partition(b"\r\n\r\n")[2])["error"]["type"] == "overloaded_error", answer


@pytest.mark.parametrize(("user_agent", "version", "setting", "sent"), [
    pytest.param("python-requests/2.32.3", "1.1", "auto", False, id="requests"),
    pytest.param("Python-urllib/3.11", "1.1", "auto", False, id="urllib"),
    pytest.param(None, "1.1", "auto", False, id="no-user-agent"),
    pytest.param("Python/3.11 aiohttp/3.14.5", "1.1", "auto", True, id="aiohttp"),
    pytest.param("AsyncOpenAI/Python 3.57.0", "1.1", "auto", True, id="async-openai"),
    pytest.param(HTTPX, "1.0", "auto", False, id="http-1.0"),
    pytest.param(HTTPX, "1.1", "never", False, id="never"),
    pytest.param("python-requests/2.32.3", "1.1", "always", True, id="always"),
])
async def test_who_gets_them(user_agent: str | None, version: str, setting: Literal["auto", "always", "never"],
                             sent: bool, tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    seen: list[tuple[float, bytes]] = []
    async with proxy_at(tokenizer, SimConfig(prefill_latency=15, token_interval=0.001),
                        processing_heartbeats=setting) as (host, port):
        received = await call_raw(host, port, "/v1/chat/completions", {"messages": HI, "max_tokens": 4},
                                  user_agent=user_agent, version=version, seen=seen)
    assert interim_times(seen) == ([pytest.approx(10)] if sent else []), seen
    assert final_status(received) == 200


async def test_a_streamed_call_gets_none(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    """A streamed call's waiting is its SSE heartbeats' (tests/server/test_waiting_streams.py), never a 1xx."""
    seen: list[tuple[float, bytes]] = []
    async with proxy_at(tokenizer, SimConfig(prefill_latency=15, token_interval=0.001)) as (host, port):
        received = await call_raw(host, port, "/v1/chat/completions",
                                  {"messages": HI, "max_tokens": 4, "stream": True}, user_agent=HTTPX, seen=seen)
    assert interim_times(seen) == [] and received.startswith(b"HTTP/1.1 200 OK\r\n"), received
    assert b": keep-alive" in received


def test_the_user_agents_auto_picks() -> None:
    lane = TurnLane(None, observer=None, admission=None)  # type: ignore[arg-type]
    takes = ["python-httpx/0.28.1", "OpenAI/Python 1.99.0", "AsyncOpenAI/Python 3.57.0", "Anthropic/Python 0.64.0",
             "AsyncAnthropic/Python 2.14.0", "Python/3.12 aiohttp/3.10.5", "node",
             "ai/7.0.173 ai-sdk-provider-utils/5.0.81 node.js/22"]
    not_taken = ["python-requests/2.32.3", "Python-urllib/3.11", "curl/8.5.0", "OpenAI/JS 4.0.0", "Mozilla/5.0",
                 "", "openai-python", "node-fetch/1.0", "ai/7.0.173 ai-sdk-provider-utils/5.0.81 runtime/bun/1.2"]
    assert [ua for ua in takes if not lane.takes_processing(ua)] == []
    assert [ua for ua in not_taken if lane.takes_processing(ua)] == []
    assert not lane.takes_processing(None)


# --- the real clients, against the real clock: a call that takes 2 s, a client whose read timeout is 1 s ---

def _openai(url: str) -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=1.0, max_retries=0)
    reply = client.chat.completions.create(model="m", messages=HI, max_tokens=4,  # type: ignore[arg-type]
                                           extra_headers={"X-Session-Id": "openai"})
    return reply.choices[0].finish_reason


def _anthropic(url: str) -> str:
    client = anthropic.Anthropic(base_url=url, api_key="none", timeout=1.0, max_retries=0)
    reply = client.messages.create(model="m", max_tokens=4, messages=HI,  # type: ignore[arg-type]
                                   extra_headers={"X-Session-Id": "anthropic"})
    return str(reply.stop_reason)


def _httpx(url: str) -> str:
    reply = httpx.post(url + "/generate", timeout=1.0,
                       json={"trajectory_uid": "h", "prompt_uid": "p", "messages": HI, "max_tokens": 4})
    reply.raise_for_status()
    return str(reply.json()["finish_reason"])


def _aiohttp(url: str) -> str:
    async def call() -> str:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(sock_read=1.0)) as session:
            async with session.post(url + "/v1/responses", json={"input": "hi", "max_output_tokens": 4},
                                    headers={"X-Session-Id": "aiohttp"}) as reply:
                reply.raise_for_status()
                return str((await reply.json())["status"])

    return asyncio.run(call())


@pytest.mark.parametrize("client", [_openai, _anthropic, _httpx, _aiohttp], ids=lambda f: f.__name__[1:])
async def test_real_clients_outlast_their_read_timeout(client: Any, tokenizer: Any) -> None:
    sim = SimConfig(prefill_latency=2.0, token_interval=0.001)
    async with proxy_at(tokenizer, sim, heartbeat_interval=0.3) as (host, port):
        outcome = await trio.to_thread.run_sync(client, f"http://{host}:{port}")
    assert outcome in ("stop", "length", "end_turn", "max_tokens", "completed", "incomplete"), outcome
