"""A turn refused before anything was sent is a status in the caller's format, streamed or not.

Chat completions, Anthropic Messages and Responses alike: an engine that cannot be
reached, one the pool has marked down, a pause waited out, the session capacity
reached: each is the same status and JSON body whether the call streams or not
(503 with ``Retry-After`` where the proxy is unavailable or overloaded), never a
200 with an error event. An error after generation started stays an error event
(test_anthropic.py: ``test_mid_stream_failure_is_an_error_event``), and so does a
refusal after a wait past ``--heartbeat-interval``, when the stream has started to keep
the connection alive (test_waiting_streams.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest
import trio
import trio.testing
from _asgi import open_client
from _util import WrappingBackend

from actorproxy import ProxyConfig
from actorproxy.engines.base import BackendError, GenerateRequest, Generation
from actorproxy.engines.pool import EnginePool
from actorproxy.runtime.runtime import open_runtime
from actorproxy.server.app import create_app
from actorproxy.sim import SimConfig, SimEngine

HI = [{"role": "user", "content": "hi"}]
#: (path, body) of one turn in each protocol; ``stream`` is added per call.
CALLS = [
    pytest.param("/v1/chat/completions", {"model": "m", "max_tokens": 8, "messages": HI}, id="chat"),
    pytest.param("/v1/messages", {"model": "m", "max_tokens": 8, "messages": HI}, id="anthropic"),
    pytest.param("/v1/responses", {"model": "m", "max_output_tokens": 8, "input": "hi"}, id="responses"),
]


@attrs.define
class DownEngine(WrappingBackend):
    """An engine that went away after the proxy started: every connection to it is refused."""

    down: bool = True

    @asynccontextmanager
    async def open_generation(self, request: GenerateRequest) -> AsyncIterator[Generation]:
        if self.down:
            raise BackendError("SGLang /generate: connection refused", unreachable=True)
        async with self.inner.open_generation(request) as generation:
            yield generation


@asynccontextmanager
async def proxy_over(backend: Any, tokenizer: Any, **config: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with open_runtime(ProxyConfig.of(port=0, **config), backend=backend, tokenizer=tokenizer) as runtime, \
            open_client(create_app(runtime)) as http:
        yield http


async def both(http: httpx.AsyncClient, path: str, body: dict[str, Any], session: str) -> list[httpx.Response]:
    """The call not streamed, then streamed (each a session of its own)."""
    return [await http.post(path, json={**body, "stream": stream}, headers={"X-Session-Id": f"{session}-{stream}"})
            for stream in (False, True)]


def assert_same_refusal(replies: list[httpx.Response], status: int, code: str) -> None:
    plain, streamed = replies
    # The streamed call is answered as the plain one: a status and a JSON body, no 200 and an error event.
    assert (streamed.status_code, streamed.headers["content-type"]) == (plain.status_code, "application/json"), \
        (streamed.status_code, streamed.text)
    assert streamed.json() == plain.json()
    assert streamed.headers.get("retry-after") == plain.headers.get("retry-after")
    assert plain.status_code == status, plain.text
    assert plain.headers.get("retry-after") is not None, plain.headers
    data = plain.json()
    if data.get("type") == "error":  # Anthropic's shape: no code, its own error type
        assert data["error"]["type"] == "overloaded_error", data
    else:
        assert data["error"]["code"] == code and data["error"]["type"] == "server_error", data


@pytest.mark.parametrize(("path", "body"), CALLS)
async def test_an_engine_down_is_a_503_before_any_stream(
    path: str, body: dict[str, Any], tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    engine = DownEngine(SimEngine(tokenizer, SimConfig(seed=3)))
    async with proxy_over(engine, tokenizer) as http:
        # The connection refused: unavailable, whatever the pool did with it.
        assert_same_refusal(await both(http, path, body, "refused"), 503, "engine_unavailable")


@pytest.mark.parametrize(("path", "body"), CALLS)
async def test_an_engine_marked_down_is_a_503_before_any_stream(
    path: str, body: dict[str, Any], tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    down = DownEngine(SimEngine(tokenizer, SimConfig(seed=3)))
    pool = EnginePool([down])
    async with proxy_over(pool, tokenizer) as http:
        await http.post(path, json=body, headers={"X-Session-Id": "first"})  # refused: a connection failed
        assert pool.statistics()["engines"][0]["healthy"] is False  # the pool marked it down
        replies = await both(http, path, body, "marked-down")
        assert_same_refusal(replies, 503, "engine_unavailable")
        assert "no healthy inference engine" in replies[1].text
        # Back up: the same turn streams (200, events), and the session's earlier refusal recorded nothing.
        down.down = False
        await pool.check_health()
        ok = await http.post(path, json={**body, "stream": True}, headers={"X-Session-Id": "marked-down-True"})
        assert ok.status_code == 200 and ok.headers["content-type"].startswith("text/event-stream")


@pytest.mark.parametrize(("path", "body"), CALLS)
async def test_a_pause_waited_out_is_a_503_before_any_stream(
    path: str, body: dict[str, Any], tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    engine = SimEngine(tokenizer, SimConfig(seed=3))
    async with proxy_over(engine, tokenizer, pause_wait_timeout=0.2) as http:
        assert (await http.post("/v1/rollout/pause", json={})).json()["status"] == "paused"
        assert_same_refusal(await both(http, path, body, "paused"), 503, "generation_paused")


@pytest.mark.parametrize(("path", "body"), CALLS)
async def test_the_session_capacity_is_a_503_before_any_stream(
    path: str, body: dict[str, Any], tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    engine = SimEngine(tokenizer, SimConfig(seed=3, token_interval=0.01))
    engine.script("word " * 200, routing_key="busy")
    async with proxy_over(engine, tokenizer, max_sessions=1) as http, trio.open_nursery() as nursery:
        busy = {"model": "m", "max_tokens": 300, "messages": HI, "stream": True}

        async def occupy(task_status: trio.TaskStatus[None]) -> None:
            async with http.stream("POST", "/v1/chat/completions", json=busy, headers={"X-Session-Id": "busy"}) as r:
                task_status.started()
                async for _ in r.aiter_bytes():
                    pass

        await nursery.start(occupy)
        assert_same_refusal(await both(http, path, body, "over"), 503, "overloaded")
        nursery.cancel_scope.cancel()
