"""An httpx client for an ASGI app in the test's own Trio run: no socket, so MockClock applies.

``httpx.ASGITransport`` buffers the whole response (it cannot test streaming or a
mid-stream hang-up); this transport runs the app in a task of its own and hands
the body over chunk by chunk as the app sends it. Closing a streamed response
early tells the app ``http.disconnect``, as a client hanging up would.

Use it where real sockets are not the point: the test code is the same httpx
code as against a served proxy, and under ``autojump_clock`` every token,
heartbeat and timeout happens at an exact virtual time.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import trio

from actorproxy.config import ProxyConfig
from actorproxy.http.server import ConnectionLimits, HTTPServer, ServerPolicy
from actorproxy.runtime.runtime import Runtime, open_runtime
from actorproxy.server.app import create_app
from actorproxy.sim import SimEngine
from actorproxy.sim.server import RunningSim, SimServerSettings, create_sim_app, sim_state
from actorproxy.tokenization.tokenizer import ChatTokenizer

ASGIApp = Callable[[dict[str, Any], Callable[[], Awaitable[dict[str, Any]]],
                    Callable[[dict[str, Any]], Awaitable[None]]], Awaitable[None]]


async def request_body(receive: Callable[[], Awaitable[dict[str, Any]]]) -> bytes:
    """The request body an ASGI app receives, whole (what came before a hang-up, if the client goes)."""
    body = b""
    while (message := await receive())["type"] == "http.request":
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    return body


class _Body(httpx.AsyncByteStream):
    def __init__(self, chunks: trio.MemoryReceiveChannel[bytes | Exception], hang_up: trio.Event) -> None:
        self._chunks = chunks
        self._hang_up = hang_up

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._chunks:
            if isinstance(chunk, Exception):  # a server closes the connection when its app fails mid-body
                raise httpx.RemoteProtocolError("peer closed connection without sending complete message body") \
                    from chunk
            yield chunk

    async def aclose(self) -> None:
        self._hang_up.set()
        await self._chunks.aclose()


def _only_hang_ups(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(OSError)[1] is None
    return isinstance(exc, OSError)


class InProcessTransport(httpx.AsyncBaseTransport):
    """Each request runs the ASGI ``app`` in a task of ``nursery``; the body streams as it is sent."""

    def __init__(self, app: ASGIApp, nursery: trio.Nursery) -> None:
        self.app = app
        self.nursery = nursery

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = b"".join([part async for part in request.stream])  # type: ignore[union-attr]
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request.method,
            "scheme": request.url.scheme, "path": request.url.path, "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query, "root_path": "",
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "client": ("127.0.0.1", 50000), "server": (request.url.host, request.url.port or 80),
            "extensions": {},
        }
        started = trio.Event()
        hang_up = trio.Event()
        send_chunk, chunks = trio.open_memory_channel[bytes | Exception](math.inf)
        head: dict[str, Any] = {}
        failure: list[BaseException] = []
        request_sent = False

        async def receive() -> dict[str, Any]:
            nonlocal request_sent
            if not request_sent:
                request_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await hang_up.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                head.update(status=message["status"], headers=message.get("headers", []))
                started.set()
            elif message["type"] == "http.response.body":
                if hang_up.is_set():
                    raise OSError("the client hung up")  # what a server reports for a closed socket
                if message.get("body"):
                    send_chunk.send_nowait(message["body"])
                if not message.get("more_body", False):
                    send_chunk.close()

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            except Exception as exc:
                if hang_up.is_set() and _only_hang_ups(exc):
                    pass  # the app noticed the hang-up (a server would close the socket)
                elif hang_up.is_set():
                    raise
                elif started.is_set():
                    try:
                        send_chunk.send_nowait(exc)  # the reader sees the connection close mid-body
                    except trio.ClosedResourceError:
                        raise exc from None  # it failed after a complete response: the test sees it
                else:
                    failure.append(exc)  # no response: the caller gets the app's error
            finally:
                send_chunk.close()
                started.set()

        self.nursery.start_soon(run)
        await started.wait()
        if failure:
            raise failure[0]
        if "status" not in head:
            raise httpx.RemoteProtocolError("the app ended without a response")
        return httpx.Response(head["status"], headers=head["headers"], stream=_Body(chunks, hang_up),
                              request=request)


@asynccontextmanager
async def open_client(app: ASGIApp, *, base_url: str = "http://proxy") -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client whose requests run ``app`` in-process."""
    async with trio.open_nursery() as nursery:
        async with httpx.AsyncClient(transport=InProcessTransport(app, nursery), base_url=base_url) as client:
            yield client
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_app_client(
    engine: SimEngine, tokenizer: ChatTokenizer, config: ProxyConfig | None = None
) -> AsyncIterator[tuple[Runtime, httpx.AsyncClient]]:
    """The proxy's runtime over ``engine`` and an in-process httpx client for its HTTP app."""
    async with open_runtime(config or ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer) as runtime:
        async with open_client(create_app(runtime)) as client:
            yield runtime, client


@asynccontextmanager
async def open_sim_client(
    engine: SimEngine, settings: SimServerSettings | None = None
) -> AsyncIterator[tuple[RunningSim, httpx.AsyncClient]]:
    """The simulated engine's HTTP app (with its fault timer, as a server runs it) and an in-process client for it."""
    app = create_sim_app(engine, settings=settings or SimServerSettings(port=0))
    state = sim_state(app)
    async with trio.open_nursery() as nursery, open_client(app, base_url="http://sim") as client:
        nursery.start_soon(state.faults.run_timer)
        yield RunningSim("http://sim", engine, state.faults, state), client
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def open_sim_server(engine: SimEngine, settings: SimServerSettings | None = None) -> AsyncIterator[RunningSim]:
    """The simulated engine's HTTP app (with its fault timer), served over real HTTP on port 0 by the proxy's own
    server floor in the test's Trio run (under MockClock too): the engine clients reach it as a real engine, through
    their own connections."""
    app = create_sim_app(engine, settings=settings or SimServerSettings(port=0))
    state = sim_state(app)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(state.faults.run_timer)
        server = HTTPServer(app, policy=ServerPolicy(ConnectionLimits()), half_close=False)
        url = await nursery.start(partial(server.serve, "127.0.0.1", 0, shutdown_trigger=trio.sleep_forever))
        yield RunningSim(url, engine, state.faults, state)
        nursery.cancel_scope.cancel()
