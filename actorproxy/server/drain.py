"""Receive every request body to its end before the response starts.

Why: when a route answers before the request body has fully arrived (a 404,
a 405, a 401 from the access check, a 400 decided from the headers), the server
finishes the response while the client is still sending. h11 cannot start the
connection's next cycle with the request half-read, so the server closes the
keep-alive connection right after the response — with unread bytes in the
socket, an abortive close — while the client already reuses it for its next
request, which is then lost (issue 11, finding 5: about 1 in 300 requests after
a 404/405 on a kept-alive connection never got an answer).

This ASGI middleware holds back the response's start until the request's last
body message has been received (by the app, or by the middleware itself, which
discards it). A body that does not finish within ``timeout`` is abandoned and
the response says ``connection: close``, so the client knows not to reuse the
connection.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


class DrainRequestBody:
    """Wraps an ASGI app so that no HTTP response starts before its request's body was received."""

    def __init__(self, app: ASGIApp, *, timeout: float = 60.0) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        received = trio.Event()

        async def watched() -> Message:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                received.set()  # the body's last piece, or the client went away
            return message

        async def drain() -> bool:
            """Receive (and discard) until the body is complete; whether it completed in time."""
            with trio.move_on_after(self.timeout):
                async with trio.open_nursery() as nursery:

                    async def pump() -> None:
                        while not received.is_set():  # a disconnect is final: no receive after it
                            await watched()  # cancel-safe: a memory channel loses nothing

                    nursery.start_soon(pump)
                    await received.wait()
                    nursery.cancel_scope.cancel()
            return received.is_set()

        async def guarded_send(message: Message) -> None:
            if message["type"] == "http.response.start" and not received.is_set() and not await drain():
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, watched, guarded_send)


async def discard_body(receive: Receive, limit: float) -> bool:
    """Discard the rest of a request's body; whether it ended (or the client left) within ``limit`` seconds."""
    with trio.move_on_after(limit):
        while True:
            message = await receive()  # cancel-safe: a memory channel loses nothing
            if message["type"] != "http.request" or not message.get("more_body", False):
                return True
    return False
