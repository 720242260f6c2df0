"""Fake engines over real HTTP: an httpx-style handler served on port 0 by the proxy's own server floor.

A test writes its engine as ``handler(request: httpx.Request) -> httpx.Response`` (or a
coroutine of one), as it would for ``httpx.MockTransport``, and the engine clients reach
it over loopback sockets through their own HTTP/1.1 pool, as they reach a real engine: the
server is :class:`actorproxy.http.server.HTTPServer` with the floor's plain policy, taking
a client's EOF for a hang-up as the engines' uvicorn does. A streamed body
(``httpx.Response(stream=...)``) goes out chunk by chunk; when the client hangs up, the
handler's call is cancelled and the response closed (its ``aclose`` runs, so a body can
count the hang-ups it sees).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import trio
from _asgi import request_body

from actorproxy.http.cycle import DISCONNECT_EXTENSION
from actorproxy.http.server import ConnectionLimits, HTTPServer, ServerPolicy

Handler = Callable[[httpx.Request], "httpx.Response | Awaitable[httpx.Response]"]


class HandlerApp:
    """The ASGI app that answers each request with ``handler``'s response."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body = await request_body(receive)
        scope["extensions"][DISCONNECT_EXTENSION](lambda: None)  # a hang-up cancels this call
        headers = [(name.decode("latin-1"), value.decode("latin-1")) for name, value in scope["headers"]]
        host = next((value for name, value in headers if name == "host"), "engine")
        query = scope["query_string"].decode("latin-1")
        url = f"http://{host}{scope['raw_path'].decode('latin-1')}" + (f"?{query}" if query else "")
        request = httpx.Request(scope["method"], url, headers=headers, content=body)
        answer = self.handler(request)
        response = await answer if inspect.isawaitable(answer) else answer
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(name.lower(), value) for name, value in response.headers.raw]})
            async for chunk in _chunks(response):
                if chunk:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            with trio.CancelScope(shield=True):
                await response.aclose()


async def _chunks(response: httpx.Response) -> AsyncIterator[bytes]:
    """The body of a response made with its content (read already) or with a stream (read as it comes)."""
    try:
        yield response.content
    except httpx.ResponseNotRead:
        async for chunk in response.aiter_raw():
            yield chunk


async def start(nursery: trio.Nursery, handler: Handler) -> str:
    """Serve ``handler`` in ``nursery`` (until it is cancelled); the server's URL."""
    server = HTTPServer(HandlerApp(handler), policy=ServerPolicy(ConnectionLimits()), half_close=False)
    url: str = await nursery.start(partial(server.serve, "127.0.0.1", 0, shutdown_trigger=trio.sleep_forever))
    return url


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[str]:
    """``handler`` served while the block runs; its URL. What the block raises comes out as it was raised."""
    try:
        async with trio.open_nursery() as nursery:
            yield await start(nursery, handler)
            nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


#: A URL where nothing listens (port 1 on loopback: refused at once), for a transport failure.
UNREACHABLE = "http://127.0.0.1:1"
