"""The HTTP server's hand-off hook, in one process.

A router may take a connection away after reading a request head (and, if it wants, the
body); the connection is then served by another server from the bytes already read, as if
that server had accepted it (``HTTPServer.adopt``). The real hand-off between processes
(``SCM_RIGHTS``) is in tests/workers/test_workers.py.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import trio
from _asgi import request_body

from actorproxy.http import h1
from actorproxy.http.server import Handoff, ServerConnection
from actorproxy.server.http_server import HTTPServer


def _app(name: bytes) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        body = await request_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": name + b" " + scope["path"].encode() + b" " + body})

    return app


async def _exchange(stream: trio.SocketStream, request: bytes, *markers: bytes) -> bytes:
    """Send ``request``; what comes back until every marker has."""
    await stream.send_all(request)
    received = b""
    while not all(marker in received for marker in markers):
        received += await stream.receive_some(65536)
    return received


async def test_a_router_moves_the_connection_to_another_server_with_the_bytes_read() -> None:
    other = HTTPServer(_app(b"other"))
    routed: list[bytes] = []

    async def router(connection: ServerConnection, request: h1.RequestHead) -> Handoff | None:
        if dict(request.headers).get(b"x-go") != b"other":
            return None
        routed.append(request.target)
        head = request.method + b" " + request.target + b" HTTP/1.1\r\n" + b"".join(
            name + b": " + value + b"\r\n" for name, value in request.headers) + b"\r\n"

        async def handoff(sock: trio.socket.SocketType, rest: bytes) -> None:
            copy = trio.socket.from_stdlib_socket(socket.socket(fileno=os.dup(sock.fileno())))
            other.adopt(copy, head + rest)

        return handoff

    here = HTTPServer(_app(b"here"), router=router)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(lambda task_status: here.serve("127.0.0.1", 0, shutdown_trigger=stop.wait,
                                                                  task_status=task_status))
        await nursery.start(lambda task_status: other.serve("127.0.0.1", 0, shutdown_trigger=stop.wait,
                                                            task_status=task_status))
        port = int(url.rsplit(":", 1)[1])
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        first = await _exchange(stream, b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi", b"0\r\n\r\n")
        assert b"here /a hi" in first
        # This request and the next one, pipelined behind it, were read together: both are served over there.
        second = await _exchange(stream, b"POST /b HTTP/1.1\r\nhost: x\r\nx-go: other\r\ncontent-length: 3\r\n\r\nyou"
                                         b"GET /c HTTP/1.1\r\nhost: x\r\n\r\n", b"/b you", b"other /c")
        assert b"here" not in second
        assert routed == [b"/b"]
        third = await _exchange(stream, b"GET /d HTTP/1.1\r\nhost: x\r\n\r\n", b"/d")
        assert b"other /d" in third  # the connection stays where it went
        await stream.aclose()
        stop.set()
