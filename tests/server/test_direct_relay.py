"""A streamed reply's deltas written by the session's own task (``runtime/turn_stream.py: Relay``).

Over the own HTTP server and the in-process simulator, with Trio's clock moved by hand: each
token comes due alone, so the agent's task is waiting (the relay open) when it is relayed.
"""

from __future__ import annotations

import gc
import socket
import weakref
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from actorproxy.core.turn_events import TurnDelta, TurnEvent
from actorproxy.runtime import generate
from actorproxy.runtime.agent_channel import AgentChannel
from actorproxy.runtime.turn_stream import TurnStream
from actorproxy.schema import jsonio
from actorproxy.sim import SimEngine


def _request(session: str, tokens: int, path: bytes = b"/v1/chat/completions") -> bytes:
    body = b'{"messages":[{"role":"user","content":"talk"}],"max_tokens":%d,"stream":true}' % tokens
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nX-Session-Id: %s\r\nContent-Length: %d\r\n\r\n%s"
            % (path, session.encode(), len(body), body))


async def _open(proxy: Any, *, receive_buffer: int | None = None) -> trio.SocketStream:
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    sock = trio.socket.socket()
    if receive_buffer is not None:  # before connecting: the window the client offers stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    await sock.connect((host, int(port)))
    return trio.SocketStream(sock)


async def _started(proxy: Any, engine: SimEngine, session: str, tokens: int, *,
                   receive_buffer: int | None = None) -> trio.SocketStream:
    """A streamed turn of ``session`` sent on a connection of its own, its generation started (no token due yet)."""
    engine.pause("test")
    stream = await _open(proxy, receive_buffer=receive_buffer)
    await stream.send_all(_request(session, tokens))
    while engine.running != 1:
        await trio.testing.wait_all_tasks_blocked(cushion=0.005)
    engine.resume("test")
    return stream


async def _tokens_due(clock: trio.testing.MockClock, engine: SimEngine, count: int) -> None:
    """Let ``count`` tokens come due one at a time, every task idle between them."""
    for _ in range(count):
        clock.jump(engine.config.token_interval)
        await trio.testing.wait_all_tasks_blocked()


async def _read_to_the_end(stream: trio.SocketStream) -> bytes:
    data = b""
    with trio.fail_after(30):
        while not data.endswith(b"0\r\n\r\n"):  # the chunked body's end
            chunk = await stream.receive_some(65536)
            assert chunk, data
            data += chunk
    return data


def _content(data: bytes) -> str:
    """The text of a chat completion's SSE chunks (the chunked framing's sizes skipped)."""
    text = ""
    for line in data.split(b"\n"):
        line = line.strip()
        if line.startswith(b"data: {"):
            for choice in jsonio.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    return text


@pytest.fixture
def handed_over(monkeypatch: pytest.MonkeyPatch) -> list[TurnEvent]:
    """Every event a turn sends through its channel to the agent's task."""
    events: list[TurnEvent] = []
    original = AgentChannel.hand_over

    async def counted(self: AgentChannel, event: TurnEvent) -> None:
        events.append(event)
        await original(self, event)

    monkeypatch.setattr(AgentChannel, "hand_over", counted)
    return events


async def test_a_streamed_turns_deltas_reach_the_agent_with_no_event_each(
    proxy: Any, engine: SimEngine, mock_clock: trio.testing.MockClock, handed_over: list[TurnEvent]
) -> None:
    """Each token is written by the session's task while the agent's task waits: no channel event, no task switch.

    Before the relay every delta was a ``TurnDelta`` through the channel (30 of them here).
    """
    engine.script("word " * 30, routing_key="direct")
    try:
        stream = await _started(proxy, engine, "direct", 100)
        await _tokens_due(mock_clock, engine, 40)
        data = await _read_to_the_end(stream)
        await stream.aclose()
    finally:
        mock_clock.autojump_threshold = 0
    assert _content(data).split() == ["word"] * 30  # every token, in order
    assert data.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert [type(e).__name__ for e in handed_over if isinstance(e, TurnDelta)] == []
    assert [type(e).__name__ for e in handed_over] == ["TurnAccepted", "TurnDone"]


async def test_a_streamed_turns_objects_go_by_reference_counting(
    proxy: Any, engine: SimEngine, mock_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a relayed turn ended, its ``TurnStream`` (and the reply, request and closures it holds) is freed at once,
    with the cycle collector off: no reference cycle keeps a turn's objects for a collection to find.

    A closure that named itself (``TurnStream.relay_to``'s first taker) made each streamed turn's objects cyclic
    garbage: ~30,000 objects a young collection at 64 streaming agents, and collections of up to 0.2 s.
    """
    streams: list[weakref.ref[TurnStream]] = []
    original = TurnStream.__init__

    def noted(self: TurnStream, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        streams.append(weakref.ref(self))

    monkeypatch.setattr(TurnStream, "__init__", noted)
    engine.script("word " * 5, routing_key="freed")
    gc.disable()
    try:
        stream = await _started(proxy, engine, "freed", 20)
        await _tokens_due(mock_clock, engine, 10)
        data = await _read_to_the_end(stream)
        await stream.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert _content(data).split() == ["word"] * 5
        assert len(streams) == 1
        assert streams[0]() is None, gc.get_referrers(streams[0]())
    finally:
        gc.enable()
        mock_clock.autojump_threshold = 0


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The tokens of each engine event a session read and recorded."""
    counts: list[int] = []
    record = generate.record_tokens

    def counted(step: Any, ids: Any, logprobs: Any, version: str) -> None:
        counts.append(len(ids))
        record(step, ids, logprobs, version)

    monkeypatch.setattr(generate, "record_tokens", counted)
    return counts


async def test_a_slow_reader_holds_the_session_back_and_loses_nothing(
    proxy: Any, engine: SimEngine, mock_clock: trio.testing.MockClock, recorded: list[int]
) -> None:
    """An agent that stops reading: the session's task waits on the socket (back-pressure), reads no more of the
    engine's stream meanwhile, and the agent gets every token in order once it reads."""
    tokens = 3000
    engine.script("word " * tokens, routing_key="slow")
    try:
        stream = await _started(proxy, engine, "slow", tokens + 10, receive_buffer=4096)
        for _ in range(tokens // 100):  # every token comes due, a hundred at a time; nobody reads
            mock_clock.jump(100 * engine.config.token_interval)
            await trio.testing.wait_all_tasks_blocked(cushion=0.005)
        held_at = sum(recorded)
        mock_clock.jump(100 * engine.config.token_interval)
        await trio.testing.wait_all_tasks_blocked(cushion=0.005)
        assert sum(recorded) == held_at < tokens  # the engine's stream is not read on
        data = await _read_to_the_end(stream)  # the agent reads: the turn goes on to its end
        await stream.aclose()
    finally:
        mock_clock.autojump_threshold = 0
    assert _content(data).split() == ["word"] * tokens


async def test_an_agent_that_hangs_up_while_the_session_waits_on_its_socket_aborts_the_generation(
    proxy: Any, engine: SimEngine, mock_clock: trio.testing.MockClock, recorded: list[int]
) -> None:
    """The session's task waits to write a delta to a full socket; the agent leaves: the wait ends, the turn is
    recorded as the agent's leaving and the engine's generation is aborted (not read to its end)."""
    tokens = 6000
    engine.script("word " * tokens, routing_key="stuck")
    try:
        stream = await _started(proxy, engine, "stuck", tokens + 10, receive_buffer=4096)
        before = -1
        while sum(recorded) != before:  # until the socket is full and the session's task waits on it
            before = sum(recorded)
            mock_clock.jump(100 * engine.config.token_interval)
            await trio.testing.wait_all_tasks_blocked(cushion=0.005)
        assert engine.running == 1 and sum(recorded) < tokens // 2
        await stream.aclose()  # unread bytes: the kernel answers with a reset
    finally:
        mock_clock.autojump_threshold = 0
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        step = (await http.get("/session/stuck")).json()["recent_steps"][-1]
    assert step["status"] == "client_disconnected" and step["in_segment"] is False
    stats = engine.stats(step["rid"])
    assert stats.aborted and stats.finish_reason == "abort" and len(stats.token_ids) < tokens
    assert step["completion_tokens"] == len(stats.token_ids)  # every token the engine sent is recorded
