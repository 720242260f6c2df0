"""The HTTP floor (actorproxy/http/) knows bytes and ASGI and nothing of the proxy above it."""

from __future__ import annotations

import ast
from functools import partial
from pathlib import Path
from typing import Any

import trio
import trio.testing

import actorproxy.http
from actorproxy.http import server as floor
from actorproxy.http.server import ConnectionLimits

FLOOR = Path(actorproxy.http.__file__).parent


def _imports(path: Path) -> list[str]:
    """The modules ``path`` imports, relative ones made absolute."""
    package = "actorproxy.http"
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = f"{base}.{node.module}" if base and node.module else base or node.module or ""
            found.append(module)
    return found


def test_the_floor_imports_nothing_of_the_proxy_above_it() -> None:
    above = {str(path.relative_to(FLOOR)): [m for m in _imports(path) if m.startswith("actorproxy")
                                            and not m.startswith("actorproxy.http")]
             for path in sorted(FLOOR.glob("*.py"))}
    assert {name: modules for name, modules in above.items() if modules} == {}
    assert len(above) >= 8  # h1, errors, client, sockets, oneshot, sse, server, cycle (and the package)


def test_nothing_outside_the_floor_uses_its_private_names() -> None:
    root = FLOOR.parent
    users = []
    for path in root.rglob("*.py"):
        if path.parent == FLOOR:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("http", "actorproxy.http")):
                users += [f"{path.relative_to(root)}: {alias.name}" for alias in node.names
                          if alias.name.startswith("_")]
    assert users == []


async def _exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` on a new connection; everything the server sends until it closes the connection."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        received = b""
        while chunk := await stream.receive_some(65536):
            received += chunk
        return received


async def _answer_all(scope: Any, receive: Any, send: Any) -> None:
    """Answer 200 once the whole body came; nothing when the server says the client is gone (or too slow)."""
    while (message := await receive())["type"] == "http.request" and message.get("more_body"):
        pass
    if message["type"] == "http.disconnect":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_the_floors_own_policy_answers_in_plain_http(autojump_clock: Any) -> None:
    """Without an application's policy: a body slower than the bound gets a bare 408, a request past
    ``max_connections`` (no probe is known to the floor) a bare 503; both close their connection."""
    limits = ConnectionLimits(body_grace=1.0, body_min_rate=10.0, max_connections=1)
    held = trio.Event()

    async def hold(scope: Any, receive: Any, send: Any) -> None:
        if scope["path"] == "/hold":
            await held.wait()
        await _answer_all(scope, receive, send)

    async with trio.open_nursery() as nursery:
        server = floor.HTTPServer(hold, policy=floor.ServerPolicy(limits))
        url = await nursery.start(partial(server.serve, "127.0.0.1", 0, shutdown_trigger=trio.sleep_forever))
        port = int(url.rsplit(":", 1)[1])
        slow = await _exchange(port, b"POST /slow HTTP/1.1\r\nHost: h\r\nContent-Length: 100\r\n\r\nabc")
        assert slow.startswith(b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n")
        busy = await trio.open_tcp_stream("127.0.0.1", port)  # holds the one connection, busy with a request
        await busy.send_all(b"GET /hold HTTP/1.1\r\nHost: h\r\n\r\n")
        await trio.testing.wait_all_tasks_blocked()
        over = await _exchange(port, b"GET /health HTTP/1.1\r\nHost: h\r\n\r\n")
        assert over.startswith(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n")
        held.set()
        await busy.aclose()
        nursery.cancel_scope.cancel()
