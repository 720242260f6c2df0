"""Connections are bounded, and idle ones cannot take the health check down (issue 28 §8).

Under ``ulimit -n 1024``, 1,500 idle connections made ``/health`` time out and logged
``accept failed: Too many open files`` at ERROR ten times a second. Now the server holds
at most ``max_connections``: the longest-idle one makes room for a new one, a probe is
still answered when every connection is busy, anything else gets a clear 503, and a
failing ``accept`` is one log line per window.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import resource
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from _asgi import request_body
from _children import die_with_parent
from _proxyproc import ProxyProcess

from actorproxy.http.server import ConnectionLimits
from actorproxy.server.http_server import HTTPServer
from actorproxy.server.limits import HEADROOM, LOG_EVERY, raise_open_files_limit

BOUND = 4


class Held:
    """Answers ``/hold`` once the test lets it (a request in flight), anything else at once."""

    def __init__(self) -> None:
        self.release = trio.Event()
        self.holding = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await request_body(receive)
        if scope["path"] == "/hold":
            self.holding += 1
            await self.release.wait()
        body = scope["path"].encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


@pytest.fixture
async def served() -> AsyncIterator[tuple[Held, int]]:
    app = Held()
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        server = HTTPServer(app, limits=ConnectionLimits(max_connections=BOUND))
        url = await nursery.start(lambda task_status: server.serve("127.0.0.1", 0, shutdown_trigger=stop.wait,
                                                                     task_status=task_status))
        yield app, int(url.rsplit(":", 1)[1])
        app.release.set()
        stop.set()


async def _get(port: int, path: str) -> tuple[int, bytes]:
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nhost: x\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some(65536):
            data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            if b"content-length: " in head.lower() and len(body) >= int(
                    head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]):
                break
        return int(data.split(b" ", 2)[1]), data


async def test_at_the_bound_a_new_connection_closes_the_longest_idle_one(served: tuple[Held, int]) -> None:
    _, port = served
    idle = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(BOUND)]
    await trio.testing.wait_all_tasks_blocked()
    assert (await _get(port, "/x"))[0] == 200
    assert await idle[0].receive_some(10) == b""  # the longest idle: closed to make room
    for stream in idle[1:]:
        await stream.send_all(b"GET /y HTTP/1.1\r\nhost: x\r\n\r\n")  # the others are still served
        assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
        await stream.aclose()


async def test_with_every_connection_busy_a_probe_is_answered_and_the_rest_refused(served: tuple[Held, int]) -> None:
    app, port = served
    busy = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(BOUND)]
    for stream in busy:
        await stream.send_all(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
    await trio.testing.wait_all_tasks_blocked()
    assert app.holding == BOUND
    assert (await _get(port, "/health"))[0] == 200  # the headroom serves the health check
    status, data = await _get(port, "/v1/chat/completions")
    assert status == 503
    head, _, body = data.partition(b"\r\n\r\n")
    assert b"connection: close" in head and b"retry-after: 1" in head
    assert json.loads(body)["error"]["code"] == "overloaded"
    app.release.set()
    for stream in busy:
        assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
        await stream.aclose()


def test_past_the_headroom_a_connection_is_closed_at_once() -> None:
    """None idle to make room: served under the bound, a probe only in the headroom, closed past it."""
    server = HTTPServer(Held(), limits=ConnectionLimits(max_connections=BOUND))
    for open_now, admitted in ((BOUND - 1, False), (BOUND, True), (BOUND + HEADROOM - 1, True),
                               (BOUND + HEADROOM, None)):
        server.open = open_now
        assert server.admit() is admitted
    assert HTTPServer(Held()).admit() is False  # no bound


class _Exhausted:
    """A listening socket whose ``accept`` fails as when the process is out of descriptors."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.calls = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def accept(self) -> Any:
        self.calls += 1
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))


async def test_a_failing_accept_is_logged_once_per_window(autojump_clock: Any,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """It was logged at ERROR every 0.1 s (268 lines in 21 s)."""
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())  # the listener is readable: accept is tried
    exhausted = _Exhausted(listener)
    server = HTTPServer(Held())
    with caplog.at_level(logging.ERROR, logger="actorproxy.http"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server._accept, exhausted, nursery)
            await trio.sleep(LOG_EVERY * 6 - 1)
            nursery.cancel_scope.cancel()
    client.close()
    listener.close()
    lines = [r.getMessage() for r in caplog.records if "accept failed" in r.getMessage()]
    assert exhausted.calls >= 500  # retried all along
    assert len(lines) == 6, lines
    assert "Too many open files" in lines[0] and "time(s) since the last such line" in lines[-1]


def test_the_open_files_limit_is_raised_to_the_hard_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(256, soft)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        raised = raise_open_files_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == raised
        assert raised == hard or hard == resource.RLIM_INFINITY
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _ulimit(n: int) -> None:
    die_with_parent()
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))  # `ulimit -n n`: soft and hard


async def test_under_a_low_ulimit_idle_connections_leave_health_answered(tmp_path: Path) -> None:
    """The issue's case, scaled: ``ulimit -n 256`` and 400 idle connections, then ``/health``."""
    proxy = ProxyProcess(tmp_path / "proxy.log", preexec=lambda: _ulimit(256))
    idle: list[trio.SocketStream] = []
    try:
        port = int((await proxy.started()).rsplit(":", 1)[1].strip("/"))
        with trio.fail_after(60):  # a bound on waiting for another process, not a timing
            for _ in range(400):
                idle.append(await trio.open_tcp_stream("127.0.0.1", port))
            for _ in range(3):
                assert (await _get(port, "/health"))[0] == 200
        text = proxy.log_path.read_text()
        assert text.count("accept failed") <= 1, text[-2000:]
    finally:
        for stream in idle:
            await stream.aclose()
        proxy.kill()
