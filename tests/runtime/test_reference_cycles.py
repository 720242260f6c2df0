"""Every kind of request leaves no reference cycle of the proxy's: its objects go by reference counting.

A cycle is left for the cyclic collector, and at many agents its collections stop the loop
(a streamed turn's cycle made collections of 200 ms at c = 64). Each case runs one request
of its kind through the real proxy on port 0, over the in-process simulator or the
simulated engine servers (two: a failed call can go to the other), with the collector off,
then looks at what a collection finds: no strongly connected group of garbage may hold an
object, function, frame or coroutine of ``actorproxy``. Cycles of libraries are left out
(Werkzeug's URL matcher makes a recursive closure a match; Quart keeps a 404's exception,
with its traceback, on its request): they hold none of ours on the cycle itself.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sqlite3
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
from _util import garbage_found

from actorproxy import ProxyConfig, open_proxy
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.sim.server import RunningSim, SimServerSettings, open_sim_server
from actorproxy.store.sqlite import SQLiteStore

HELLO = [{"role": "user", "content": "hi"}]
LONG = "word " * 200


@attrs.define
class Stack:
    """A proxy on port 0 and the simulated engines behind it (``sims``: their servers, when over HTTP)."""

    url: str
    engines: list[SimEngine]
    sims: list[RunningSim]
    corrupters: list[Corrupter] = attrs.Factory(list)
    partial_rollout: bool = False
    turns: int = 0

    def session(self, name: str) -> str:
        self.turns += 1
        return f"{name}-{self.turns}"

    def script(self, text: str, session: str) -> None:
        for engine in self.engines:
            engine.script(text, routing_key=session)

    def running(self) -> int:
        return sum(engine.running for engine in self.engines)


class Corrupter:
    """A TCP relay in front of a simulated server. Armed, it passes on the next bytes of a streamed event with a bad
    chunk-size line after them, then closes: a malformed body after good bytes, in one read."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.armed = False

    async def handle(self, agent_side: trio.SocketStream) -> None:
        async with agent_side, await trio.open_tcp_stream("127.0.0.1", self.port) as engine_side:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.pump, agent_side, engine_side)
                await self.pump(engine_side, agent_side, corrupting=True)
                nursery.cancel_scope.cancel()

    async def pump(self, source: trio.SocketStream, to: trio.SocketStream, corrupting: bool = False) -> None:
        with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
            while data := await source.receive_some():
                if corrupting and self.armed and b"data: " in data:
                    self.armed = False
                    await to.send_all(data + b"zz\r\n")
                    return
                await to.send_all(data)


@asynccontextmanager
async def _stack(tokenizer: Any, backend: str, data_dir: Path, relayed: bool) -> AsyncIterator[Stack]:
    async with AsyncExitStack() as exit_stack:
        # "-partial": a turn aborted by a pause goes on after the resume (--partial-rollout)
        options: dict[str, Any] = {"partial_rollout": True} if backend.endswith("-partial") else {}
        backend = backend.removesuffix("-partial")
        if backend.startswith("sim"):
            engine = SimEngine(tokenizer, SimConfig(seed=5))
            if backend == "sim-sqlite":
                options.update(store_kind="sqlite", data_dir=str(data_dir))
            proxy = await exit_stack.enter_async_context(
                open_proxy(ProxyConfig.of(port=0, **options), backend=engine, tokenizer=tokenizer))
            yield Stack(proxy.url, [engine], [], partial_rollout=bool(options.get("partial_rollout")))
            return
        kind, _, shape = backend.partition("-")
        settings = {"incremental_streaming_output": True} if shape == "incremental" else {}
        sims = [await exit_stack.enter_async_context(open_sim_server(
            SimServerSettings(port=0, **settings), engine=SimEngine(tokenizer, SimConfig(seed=i)), tokenizer=tokenizer))
            for i in range(2)]
        urls = [s.url for s in sims]
        corrupters = []
        if relayed:
            nursery = await exit_stack.enter_async_context(trio.open_nursery())
            for i, sim in enumerate(sims):
                corrupters.append(Corrupter(int(sim.url.rsplit(":", 1)[1])))
                [listener] = await nursery.start(partial(trio.serve_tcp, corrupters[-1].handle, 0, host="127.0.0.1"))
                urls[i] = f"http://127.0.0.1:{listener.socket.getsockname()[1]}"
                exit_stack.callback(nursery.cancel_scope.cancel)
        config = ProxyConfig.of(port=0, backend=kind, backend_urls=tuple(urls), **options)  # type: ignore[arg-type]
        proxy = await exit_stack.enter_async_context(open_proxy(config, tokenizer=tokenizer))
        yield Stack(proxy.url, [s.engine for s in sims], sims, corrupters, bool(options.get("partial_rollout")))


async def _call(url: str, path: str, body: Any = None, *, session: str | None = None,
                hang_up_after: int | None = None, streaming: trio.Event | None = None) -> tuple[int, bytes]:
    """One request on a connection of its own (closed after it); its status and everything that came.

    ``hang_up_after``: the client leaves once that many SSE events came; ``streaming`` is set once two came (the
    stream's opening and a token's).
    """
    host, port = url.removeprefix("http://").rsplit(":", 1)
    raw = json.dumps(body).encode() if not isinstance(body, bytes) else body
    head = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\nconnection: close\r\n" % path.encode()
    if session is not None:
        head += b"x-session-id: %s\r\n" % session.encode()
    data = b""
    async with await trio.open_tcp_stream(host, int(port)) as stream:
        await stream.send_all(head + b"content-length: %d\r\n\r\n" % len(raw) + raw)
        while chunk := await stream.receive_some():
            data += chunk
            if streaming is not None and data.count(b"data: ") >= 2:
                streaming.set()
            if hang_up_after is not None and data.count(b"data: ") >= hang_up_after:
                break
    await trio.testing.wait_all_tasks_blocked()
    return int(data.split(b" ", 2)[1]), data


def _turn(path: str, body: dict[str, Any], status: int = 200) -> Callable[[Stack], Awaitable[None]]:
    async def run(stack: Stack) -> None:
        got, data = await _call(stack.url, path, body, session="s")  # one session: each run is its next turn
        assert got == status, data
        if body.get("stream"):
            assert data.endswith(b"\r\n0\r\n\r\n"), data[-300:]

    return run


async def _generate(stack: Stack) -> None:
    body = {"trajectory_uid": stack.session("g"), "prompt_uid": "p", "messages": HELLO, "max_tokens": 8}
    assert (await _call(stack.url, "/generate", body))[0] == 200


async def _generate_token_in(stack: Stack) -> None:
    body = {"prompt_ids": [1, 2, 3, 4], "sampling_params": {"max_tokens": 8}}
    assert (await _call(stack.url, "/generate", body))[0] == 200


async def _engine_failover(stack: Stack) -> None:
    """The engine that served a session's turn answers its next call with a 500: the turn goes to the other."""
    session = stack.session("failover")
    body = {"messages": HELLO, "max_tokens": 8}
    before = [len(sim.state.records) for sim in stack.sims]
    assert (await _call(stack.url, "/v1/chat/completions", body, session=session))[0] == 200
    [served] = [sim for sim, count in zip(stack.sims, before, strict=True) if len(sim.state.records) > count]
    served.faults.fail_next_requests(1)
    status, data = await _call(stack.url, "/v1/chat/completions", body, session=session)
    assert status == 200 and served.faults.fail_next == 0, data


def _engine_failure(stream: bool) -> Callable[[Stack], Awaitable[None]]:
    """Both engines answer the turn's call with a 500: the turn fails (502)."""
    async def run(stack: Stack) -> None:
        for sim in stack.sims:
            sim.faults.fail_next_requests(1)
        body = {"messages": HELLO, "max_tokens": 8, "stream": stream}
        status, data = await _call(stack.url, "/v1/chat/completions", body, session=stack.session("failed"))
        assert status == 502 and all(sim.faults.fail_next == 0 for sim in stack.sims), data

    return run


async def _stream_cut(stack: Stack) -> None:
    """The engine's connection closes in the middle of its streamed body: the streamed turn ends in an error."""
    session = stack.session("cut")
    stack.script(LONG, session)
    for sim in stack.sims:
        sim.faults.drop_next_stream(after_tokens=3)
    body = {"messages": HELLO, "max_tokens": 300, "stream": True}
    status, data = await _call(stack.url, "/v1/chat/completions", body, session=session)
    assert status == 200 and b'"error"' in data, data[-300:]
    for sim in stack.sims:
        sim.faults.clear()


async def _bad_chunk(stack: Stack) -> None:
    """The engine's streamed body turns malformed after good bytes, in the same read: the turn ends in an error."""
    session = stack.session("malformed")
    stack.script(LONG, session)
    for corrupter in stack.corrupters:
        corrupter.armed = True
    body = {"messages": HELLO, "max_tokens": 300, "stream": True}
    status, data = await _call(stack.url, "/v1/chat/completions", body, session=session)
    assert status == 200 and b"chunk size" in data, data[-300:]


async def _client_gone(stack: Stack) -> None:
    """The agent hangs up in the middle of a streamed turn: the generation is aborted."""
    session = stack.session("gone")
    stack.script(LONG, session)
    body = {"messages": HELLO, "max_tokens": 300, "stream": True}
    await _call(stack.url, "/v1/chat/completions", body, session=session, hang_up_after=3)
    while stack.running():
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(0.01)  # the engine's next step, on the autojump clock (no time passes)


def _paused(mode: str) -> Callable[[Stack], Awaitable[None]]:
    """A pause while a turn streams, then the resume; the turn ends however the pause's ``mode`` ends it (an
    ``abort`` pause: with an error, or with --partial-rollout by going on after the resume)."""
    async def run(stack: Stack) -> None:
        session = stack.session("paused")
        stack.script("word " * 40, session)
        body = {"messages": HELLO, "max_tokens": 60, "stream": True}
        streaming = trio.Event()
        streamed: list[bytes] = []

        async def turn() -> None:
            streamed.append((await _call(stack.url, "/v1/chat/completions", body, session=session,
                                         streaming=streaming))[1])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(turn)
            await streaming.wait()
            for engine in stack.engines:  # no token comes due until the pause is in (the clock jumps meanwhile)
                engine.pause("test")
            assert (await _call(stack.url, "/v1/rollout/pause", {"mode": mode}))[0] == 200
            assert (await _call(stack.url, "/v1/rollout/resume", {}))[0] == 200
            for engine in stack.engines:
                engine.resume("test")
        interrupted = b"generation_interrupted" in streamed[0]
        assert interrupted == (mode == "abort" and not stack.partial_rollout), streamed[0][-300:]

    return run


async def _finalized(stack: Stack) -> None:
    """A turn, its session finalized, its trajectory read, then drained."""
    session = stack.session("final")
    assert (await _call(stack.url, "/v1/chat/completions", {"messages": HELLO, "max_tokens": 8}, session=session)
            )[0] == 200
    assert (await _call(stack.url, "/session/finalize", {"session_id": session}))[0] == 200
    assert (await _call(stack.url, "/trajectory/read", {"session_id": session, "include_steps": True}))[0] == 200
    assert (await _call(stack.url, "/trajectory/read", {"session_id": session, "drain": True}))[0] == 200


async def _discarded(stack: Stack) -> None:
    """A session dropped that the store holds nothing of (the store's 404, answered inside the proxy)."""
    assert (await _call(stack.url, "/session/discard", {"session_id": stack.session("dropped")}))[0] == 200


async def _store_read_fails(stack: Stack) -> None:
    """The store's disk fails a read: 507 store_failed (and the store refuses new turns until its disk works)."""
    read = SQLiteStore.read

    def failing(*_: Any) -> Any:
        raise sqlite3.OperationalError("disk I/O error")

    SQLiteStore.read = failing  # type: ignore[method-assign]
    try:
        status, data = await _call(stack.url, "/trajectory/read", {"session_id": stack.session("unread")})
    finally:
        SQLiteStore.read = read  # type: ignore[method-assign]
    assert status == 507 and b"store_failed" in data, data


_CHAT = {"messages": HELLO, "max_tokens": 8}
_MESSAGES = {"model": "m", "messages": HELLO, "max_tokens": 8}
_RESPONSES = {"input": "hi", "max_output_tokens": 16}
#: Each kind of request (the name of its case) and how to make it.
KINDS: dict[str, Callable[[Stack], Awaitable[None]]] = {
    "chat": _turn("/v1/chat/completions", _CHAT),
    "chat-streamed": _turn("/v1/chat/completions", {**_CHAT, "stream": True}),
    "messages": _turn("/v1/messages", _MESSAGES),
    "messages-streamed": _turn("/v1/messages", {**_MESSAGES, "stream": True}),
    "responses": _turn("/v1/responses", _RESPONSES),
    "responses-streamed": _turn("/v1/responses", {**_RESPONSES, "stream": True}),
    "generate": _generate,
    "generate-token-in": _generate_token_in,
    "bad-request": _turn("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    "client-gone": _client_gone,
    "pause-abort": _paused("abort"),
    "pause-keep": _paused("keep"),
    "finalize-read-drain": _finalized,
    "discard-unknown": _discarded,
    "store-read-fails": _store_read_fails,
    "engine-failover": _engine_failover,
    "engine-failure": _engine_failure(stream=False),
    "engine-failure-streamed": _engine_failure(stream=True),
    "engine-stream-cut": _stream_cut,
    "engine-bad-chunk": _bad_chunk,
}
#: What goes through an engine client: each of them over the simulated servers too.
_ENGINE_PATHS = ["chat", "chat-streamed", "generate", "generate-token-in", "client-gone", "pause-abort",
                 "engine-failover", "engine-failure", "engine-failure-streamed", "engine-stream-cut",
                 "engine-bad-chunk"]
_NEEDS_SERVERS = {"engine-failover", "engine-failure", "engine-failure-streamed", "engine-stream-cut",
                  "engine-bad-chunk"}
#: What reaches the trajectory store: over its SQLite backend too (the in-memory one otherwise).
_STORE_PATHS = ["finalize-read-drain", "discard-unknown", "store-read-fails"]
CASES = [pytest.param("sim", kind, id=f"sim-{kind}") for kind in KINDS
         if kind not in _NEEDS_SERVERS and kind != "store-read-fails"] + [
    pytest.param("sim-sqlite", kind, id=f"sim-sqlite-{kind}") for kind in _STORE_PATHS] + [
    pytest.param(backend, "pause-abort", id=f"{backend}-pause-abort") for backend in ("sim-partial", "sglang-partial")
] + [
    pytest.param(backend, kind, id=f"{backend}-{kind}")
    for backend in ("sglang", "sglang-incremental", "vllm", "llamacpp") for kind in _ENGINE_PATHS]


def _ours(o: object) -> bool:
    """An object of the proxy's, or a function, frame or coroutine of its code."""
    if isinstance(o, types.FunctionType):
        return o.__module__.startswith("actorproxy")
    if isinstance(o, types.FrameType):
        return "/actorproxy/" in o.f_code.co_filename
    if isinstance(o, types.CoroutineType):
        return "/actorproxy/" in o.cr_code.co_filename
    if isinstance(o, types.MethodType):
        o = o.__self__
    return (type(o).__module__ or "").startswith("actorproxy")


def _cycles(garbage: list[object]) -> list[list[object]]:
    """The strongly connected groups of ``garbage`` (the cycles themselves, not what merely hangs off one)."""
    at = {id(o): i for i, o in enumerate(garbage)}
    edges = [[at[id(r)] for r in gc.get_referents(o) if id(r) in at] for o in garbage]
    order: list[int | None] = [None] * len(garbage)
    low = [0] * len(garbage)
    stack: list[int] = []
    on_stack = [False] * len(garbage)
    found: list[list[object]] = []
    counter = 0
    for root in range(len(garbage)):  # Tarjan's algorithm, iteratively
        if order[root] is not None:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                order[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack[v] = True
            for j in range(i, len(edges[v])):
                w = edges[v][j]
                if order[w] is None:
                    work += [(v, j + 1), (w, 0)]
                    break
                if on_stack[w]:
                    low[v] = min(low[v], order[w])  # type: ignore[type-var]
            else:
                if low[v] == order[v]:
                    group = []
                    while True:
                        w = stack.pop()
                        on_stack[w] = False
                        group.append(w)
                        if w == v:
                            break
                    if len(group) > 1 or v in edges[v]:
                        found.append([garbage[k] for k in group])
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
    return found


def _name(o: object) -> str:
    if isinstance(o, types.FrameType):
        return f"frame {o.f_code.co_qualname}"
    if isinstance(o, types.FunctionType | types.MethodType):
        return f"{type(o).__name__} {o.__qualname__}"
    if isinstance(o, types.CoroutineType):
        return f"coroutine {o.cr_code.co_qualname}"
    if isinstance(o, types.TracebackType):
        return f"traceback {o.tb_frame.f_code.co_qualname}"
    return type(o).__name__


@pytest.mark.parametrize(("backend", "kind"), CASES)
async def test_a_request_leaves_no_cycle_of_ours(
    tokenizer: Any, autojump_clock: trio.testing.MockClock, tmp_path: Path, backend: str, kind: str
) -> None:
    request = KINDS[kind]
    async with _stack(tokenizer, backend, tmp_path, relayed=kind == "engine-bad-chunk") as stack:
        await request(stack)  # twice first: what the first requests of a kind cache is no garbage
        await request(stack)
        with garbage_found() as garbage:
            await request(stack)
    ours = [sorted(map(_name, group)) for group in _cycles(garbage) if any(map(_ours, group))]
    assert ours == [], "\n".join(map(str, ours))
