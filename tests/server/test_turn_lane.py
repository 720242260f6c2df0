"""The turn lane (server/lane.py): the model calls served at the ASGI level, in front of the Quart app.

It must route exactly as the Quart app's URL map would, answer the body limits
in the caller's format as Quart does, and its SSE driver must put the frames
that are ready into one chunk without ever holding one back.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from werkzeug.exceptions import HTTPException
from werkzeug.routing import RequestRedirect

from actorproxy import ProxyConfig, open_proxy
from actorproxy.core.parser import OutputDelta
from actorproxy.core.turn_events import TurnAccepted, TurnDelta, TurnEvent, TurnFailed
from actorproxy.errors import EngineError, ProxyError
from actorproxy.http.cycle import CONTINUE
from actorproxy.runtime.runtime import open_runtime
from actorproxy.runtime.turn_stream import TurnStream
from actorproxy.schema import jsonio
from actorproxy.server import app as app_module
from actorproxy.server.admission import Admission
from actorproxy.server.app import create_app
from actorproxy.server.auth import AccessPolicy
from actorproxy.server.lane import TurnLane
from actorproxy.server.observe import Observer
from actorproxy.server.turns import sse_frames
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.tokenization.tokenizer import ChatTokenizer

PATHS = [
    "/v1/chat/completions", "/v1/messages", "/v1/responses", "/generate",
    "/sess/abc/v1/chat/completions", "/sess/abc/v1/messages", "/sess/a b/v1/responses", "/sess/é/v1/messages",
    "/traj-1/prompt-1/v1/chat/completions", "/traj-1/prompt-1/v1/messages", "/sess/x/y/v1/messages",
    "/sess/v1/messages", "/x/v1/chat/completions", "/a/b/c/v1/chat/completions", "/v1/chat/completions/",
    "//v1/chat/completions", "/sess//v1/messages", "/a//v1/messages", "/v1/messages/count_tokens",
    "/sess/a/v1/messages/count_tokens", "/a/b/generate", "/generate/", "/v1/models", "/session/finalize",
    "/a/b/v1/register_trajectory", "/v1/rollout/pause", "/v1/rollout/pause/", "/v1/chat/completionsx",
    "/v1/xv1/messages",
]


async def test_the_lane_routes_as_the_url_map_does(tokenizer: ChatTokenizer) -> None:
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.0))
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer) as runtime:
        app = create_app(runtime)
        lane = app.asgi_app
        assert isinstance(lane, TurnLane)
        adapter = app.url_map.bind("localhost")
        turn_rules = 0
        for path in PATHS:
            try:
                rule, args = adapter.match(path, method="POST", return_rule=True)
            except RequestRedirect:
                rule, args = None, {}
            except HTTPException:
                rule, args = None, {}
            served_by_lane = rule is not None and rule.endpoint in (
                "generate", "rollout_pause",
                *(prefix + suffix for prefix in ("", "/sess/<url_session>", "/<url_session>/<url_instance>")
                  for suffix in ("/v1/chat/completions", "/v1/messages", "/v1/responses")))
            found = lane.match(path)
            if not served_by_lane:
                assert found is None, (path, found)
                continue
            turn_rules += 1
            assert rule is not None and found is not None, path
            assert (found.rule, found.url_session, found.url_instance) == (
                rule.rule, args.get("url_session"), args.get("url_instance")), path
        assert turn_rules == 12  # the turns, and the pause (served in its connection's first step)


@pytest.fixture
async def small_body_proxy(tokenizer: ChatTokenizer, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 1000)
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.0))
    async with open_proxy(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer) as running:
        yield running.url


async def test_an_oversized_body_is_a_413_in_the_callers_format_as_on_the_quart_routes(small_body_proxy: str) -> None:
    big = b'{"messages": [{"role": "user", "content": "' + b"x" * 2000 + b'"}]}'
    async with httpx.AsyncClient(base_url=small_body_proxy, timeout=30) as http:
        on_lane = await http.post("/v1/chat/completions", content=big, headers={"X-Session-Id": "s"})
        on_quart = await http.post("/session/finalize", content=big)  # a Quart route: the reference
        anthropic = await http.post("/sess/s/v1/messages", content=big)
        assert on_lane.status_code == on_quart.status_code == anthropic.status_code == 413
        assert on_lane.content == on_quart.content
        assert on_lane.json()["error"]["code"] == "request_entity_too_large"
        assert anthropic.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                              "message": on_lane.json()["error"]["message"]}}
        # The connection stays usable: the body was read to its end before the answer.
        ok = await http.post("/v1/chat/completions", headers={"X-Session-Id": "s"},
                             json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert ok.status_code == 200, ok.text


class _Writer:
    """Frames named after what they write."""

    def start(self, accepted: TurnAccepted) -> bytes:
        return b"start;"

    def delta(self, delta: OutputDelta) -> bytes:
        return delta.content.encode() + b";"

    def heartbeat(self) -> bytes:
        return b"beat;"

    def finish(self, done: Any) -> bytes:
        return b"done;"

    def error(self, error: ProxyError) -> bytes:
        return b"error;"


def _stream() -> tuple[trio.MemorySendChannel[TurnEvent], TurnStream]:
    send, receive = trio.open_memory_channel[TurnEvent](100)
    return send, TurnStream(TurnAccepted(0, 1), receive)


async def test_frames_that_are_ready_leave_in_one_chunk() -> None:
    send, events = _stream()
    assert isinstance(await events.receive(), TurnAccepted)
    for piece in ("a", "b", "c"):
        send.send_nowait(TurnDelta(OutputDelta(content=piece)))
    send.send_nowait(TurnFailed(EngineError("x")))
    chunks = [chunk async for chunk in sse_frames(events, TurnAccepted(0, 1), _Writer(), heartbeat=10)]
    assert chunks == [b"start;a;b;c;error;"]  # one send instead of five


async def test_no_frame_waits_for_the_next(autojump_clock: trio.abc.Clock) -> None:
    send, events = _stream()
    assert isinstance(await events.receive(), TurnAccepted)
    frames = sse_frames(events, TurnAccepted(0, 1), _Writer(), heartbeat=5)
    assert await frames.__anext__() == b"start;"  # at once: nothing is ready behind it
    send.send_nowait(TurnDelta(OutputDelta(content="a")))
    assert await frames.__anext__() == b"a;"
    send.send_nowait(TurnDelta(OutputDelta(content="b")))
    send.send_nowait(TurnFailed(EngineError("x")))
    assert await frames.__anext__() == b"b;error;"
    with pytest.raises(StopAsyncIteration):
        await frames.__anext__()


async def test_the_lane_sends_a_heartbeat_after_each_interval_of_silence_and_none_while_chunks_flow(
    autojump_clock: trio.abc.Clock,
) -> None:
    send, events = _stream()
    assert isinstance(await events.receive(), TurnAccepted)
    lane = TurnLane(_no_app, observer=Observer(), admission=Admission(AccessPolicy(), max_body=1000, body_timeout=5))

    async def handler(*_: Any) -> Any:
        return sse_frames(events, TurnAccepted(0, 1), _Writer(), heartbeat=5)

    lane.mount("/v1/chat/completions", handler)
    sent: list[tuple[float, bytes]] = []
    request = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict[str, Any]:
        if request:
            return request.pop()
        await trio.sleep_forever()
        raise AssertionError

    more_body: list[bool] = []

    async def asgi_send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            sent.append((trio.current_time(), message.get("body", b"")))
            more_body.append(message.get("more_body", False))

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lane, scope, receive, asgi_send)
        start = trio.current_time()
        for _ in range(4):  # a chunk every 3 s: no heartbeat
            await trio.sleep(3)
            send.send_nowait(TurnDelta(OutputDelta(content="a")))
        await trio.sleep(12)  # 12 s of silence: two heartbeats, 5 and 10 s after the last chunk
        send.send_nowait(TurnFailed(EngineError("x")))
    assert [(round(at - start), body) for at, body in sent] == [
        (0, b"start;"), (3, b"a;"), (6, b"a;"), (9, b"a;"), (12, b"a;"), (17, b"beat;"), (22, b"beat;"),
        (24, b"error;"),
    ]
    assert more_body == [True] * 7 + [False]  # the body's end leaves with the last frames: one write, not two


@pytest.mark.parametrize("eof_with_the_request", [False, True])
async def test_a_client_that_half_closes_after_its_request_gets_the_answer_and_the_turn_is_kept(
    proxy: Any, engine: SimEngine, eof_with_the_request: bool
) -> None:
    """shutdown(SHUT_WR) once the request is out is not a hang-up (HTTP/1.1 allows it): the turn runs to its end."""
    engine.script("word " * 40, routing_key="half")
    stream = await _turn_waiting_at_the_engine(proxy, engine, "half", 100, eof=eof_with_the_request)
    async with stream:
        await stream.send_eof()  # (again, when it came with the request: harmless)
        # The server read the EOF while the turn waits (its 100 Continue says so), not after the answer.
        data = await _received(stream, CONTINUE)
        engine.resume("test")
        with trio.fail_after(10):
            while chunk := await stream.receive_some(65536):  # until the server closes after the answer
                data += chunk
    head, _, reply = data.rpartition(b"\r\n\r\n")
    assert head.startswith(CONTINUE + b"HTTP/1.1 200 OK\r\n")
    assert jsonio.loads(reply)["choices"][0]["message"]["content"].startswith("word word")
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        step = (await http.get("/session/half")).json()["recent_steps"][-1]
    assert step["status"] != "client_disconnected" and step["finish_reason"] == "stop"
    assert not engine.stats(step["rid"]).aborted


async def _turn_waiting_at_the_engine(
    proxy: Any, engine: SimEngine, session: str, tokens: int, *, eof: bool = False
) -> trio.SocketStream:
    """A non-streaming turn sent on a raw connection (``eof``: the client's EOF right behind it), its generation
    started and paused (``engine.resume`` it)."""
    engine.pause("test")
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    body = b'{"messages":[{"role":"user","content":"talk"}],"max_tokens":%d}' % tokens
    stream = await trio.open_tcp_stream(host, int(port))
    await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Session-Id: %s\r\n"
                          b"Content-Length: %d\r\n\r\n%s" % (session.encode(), len(body), body))
    if eof:
        await stream.send_eof()
    await _until(lambda: engine.running == 1)
    return stream


async def _until(condition: Callable[[], bool]) -> None:
    """Until ``condition`` holds: it turns on bytes the kernel passes over loopback (a request, an EOF, a reset),
    which may come late on a loaded machine and offer nothing to wait on; read again each time every task has
    waited a moment (real time: a test may hold Trio's clock still)."""
    for _ in range(2000):
        if condition():
            return
        await trio.testing.wait_all_tasks_blocked(cushion=0.005)
    raise AssertionError("the proxy never got there")


async def _received(stream: trio.SocketStream, expected: bytes) -> bytes:
    """The first ``len(expected)`` bytes the server sends, which must be ``expected``."""
    data = b""
    with trio.fail_after(10):
        while len(data) < len(expected) and (chunk := await stream.receive_some(len(expected) - len(data))):
            data += chunk
    assert data == expected
    return data


async def _no_app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("a turn route reached the app behind the lane")


async def test_a_client_that_hangs_up_mid_turn_cancels_it_and_the_engine_is_aborted(
    proxy: Any, engine: SimEngine, mock_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Non-streaming: nothing is written while the turn runs, so only the server's reader can notice.

    The turn learns it at its next token and aborts the generation there (docs/architecture.md).
    Trio's clock stands still: the simulated engine's tokens come due only as the test moves it, so
    what the engine generated does not depend on how long a loaded machine keeps the proxy from
    reading its first token (run on the real clock, a stall of 0.2 s let all 400 come due first).
    """
    caplog.set_level(logging.INFO, logger="actorproxy.access")
    engine.script("word " * 400, routing_key="left")
    try:
        stream = await _turn_waiting_at_the_engine(proxy, engine, "left", 500)
        await stream.aclose()  # the client leaves in the middle of the turn
        # The server noticed: the turn was cancelled (its request counted as nginx's 499) while the engine waits.
        await _until(lambda: any(getattr(r, "fields", {}).get("status") == 499 for r in caplog.records))
        engine.resume("test")
        mock_clock.jump(1.5 * engine.config.token_interval)  # the first token comes due, the second not yet
        await trio.testing.wait_all_tasks_blocked()  # no I/O from here to the engine's end: all in this process
        assert engine.running == 0
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
            step = (await http.get("/session/left")).json()["recent_steps"][-1]
            metrics = (await http.get("/metrics")).text
    finally:
        mock_clock.autojump_threshold = 0  # what is left (a generation not aborted, the proxy's shutdown) runs out
    assert step["status"] == "client_disconnected" and step["in_segment"] is False
    stats = engine.stats(step["rid"])
    assert stats.aborted and stats.finish_reason == "abort" and len(stats.token_ids) == 1
    # Counted and logged all the same (nginx's 499: the client closed the request), not dropped.
    [line] = [m for m in metrics.splitlines() if m.startswith("actorproxy_requests_total{")
              and 'route="/v1/chat/completions"' in m]
    assert 'status="499"' in line and line.endswith(" 1.0")
