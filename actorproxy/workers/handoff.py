"""Moving a client connection to the worker that owns its session: the socket itself, over a Unix socket.

The kernel spreads connections over the workers by their addresses (``SO_REUSEPORT``), not
by session. When a worker reads a request head whose session another worker owns, it stops
reading the connection and sends the socket (``SCM_RIGHTS``) to the owner's hand-off socket,
followed by the bytes it has read and not served (the request head, rebuilt, and whatever
came after it). The owner serves the connection from there as if it had accepted it; no byte
is relayed and the connection moves again only when a later request names another
worker's session. One short-lived Unix connection per hand-off: it ends with the bytes, so
the receiver needs no framing.

When the owner cannot take it (it crashed and is restarting), the request gets
``503 worker_unavailable`` with ``Retry-After: 1`` in the caller's format, and the
connection is closed.
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import socket
from collections.abc import Awaitable
from functools import partial
from typing import TYPE_CHECKING

import trio

from ..server import http1
from ..wire import jsonio
from .routing import MAX_BODY, NEED_BODY, body_session, head_session, owner

if TYPE_CHECKING:
    from ..server.http_server import Handoff, HTTPServer, _Connection

log = logging.getLogger("actorproxy.workers")

_ANCILLARY = socket.CMSG_SPACE(array.array("i", [0]).itemsize)
#: Headers of the head that the router has already answered (a ``100 Continue`` sent while reading the body).
_DROPPED_WHEN_CONTINUED = b"expect"


def handoff_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"w{index}.handoff")


def remove_stale(path: str) -> None:
    """Remove the Unix socket file a worker's previous life left at ``path``."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Router:
    """The :class:`~actorproxy.server.http_server.HTTPServer` router of worker ``index`` of ``workers``."""

    def __init__(self, index: int, workers: int, directory: str) -> None:
        self.index, self.workers, self.directory = index, workers, directory
        self.handed_off = 0  # connections sent to their owner
        self.refused = 0  # requests answered 503 because their owner was down

    async def __call__(self, connection: _Connection, request: http1.RequestHead) -> Handoff | None:
        target = request.target.decode("latin-1")
        session = head_session(target, request.headers)
        continued = False
        if session == NEED_BODY:
            if request.expect_continue:  # the client waits for this before it sends the body we need
                request.expect_continue, continued = False, True
                await connection.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = await _whole_body(connection, request)
            session = None if body is None else body_session(body)
        if session is None:
            return None
        worker = owner(session, self.workers)
        if worker == self.index:
            return None
        return partial(self._send, worker, _rebuild(request, continued), target)

    async def _send(self, worker: int, head: bytes, target: str, sock: trio.socket.SocketType, rest: bytes) -> None:
        """Send ``sock`` and the bytes not served yet to ``worker``; a 503 on the connection if it cannot take it."""
        try:
            with trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
                await peer.connect(handoff_path(self.directory, worker))
                data = memoryview(head + rest)
                fds = array.array("i", [sock.fileno()])
                sent = await peer.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                while sent < len(data):
                    sent += await peer.send(data[sent:])
        except OSError as exc:
            self.refused += 1
            log.warning("worker %d cannot take a connection for its session (%s): 503", worker, exc)
            await _refuse(sock, target, worker)
            return
        self.handed_off += 1


async def serve_handoffs(
    directory: str, index: int, server: HTTPServer, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Take the connections other workers hand to worker ``index`` and serve them on ``server``."""
    path = handoff_path(directory, index)
    remove_stale(path)
    listener = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await listener.bind(path)
    listener.listen(1024)
    async with trio.SocketListener(listener) as listeners, trio.open_nursery() as nursery:
        task_status.started()
        while True:
            stream = await listeners.accept()
            nursery.start_soon(_receive, stream, server)


async def _receive(stream: trio.SocketStream, server: HTTPServer) -> None:
    sock = stream.socket
    fd = -1
    try:
        with trio.move_on_after(10):
            data, ancillary, _flags, _address = await sock.recvmsg(1 << 16, _ANCILLARY)
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                    fd = fds[0] if fds else -1
            pieces = [data]
            while data:
                data = await sock.recv(1 << 16)
                pieces.append(data)
            if fd >= 0:
                client = trio.socket.from_stdlib_socket(socket.socket(fileno=fd))
                fd = -1
                server.adopt(client, b"".join(pieces))
    finally:
        if fd >= 0:
            os.close(fd)
        await stream.aclose()


async def _whole_body(connection: _Connection, request: http1.RequestHead) -> bytes | None:
    """The request's whole body once it is in the connection's buffer (left there); ``None``: it will not be."""
    while True:
        copy, reader, pieces = bytearray(connection.buffer), http1.BodyReader(request), []
        try:
            while not reader.done:
                piece = reader.read(copy)
                if piece is None:
                    break
                pieces.append(piece)
        except http1.BadRequest:
            return None  # served here: the app answers 400
        if reader.done:
            return b"".join(pieces)
        if connection.eof or len(connection.buffer) > MAX_BODY:
            return None
        await connection.wait_for_bytes()


def _rebuild(request: http1.RequestHead, continued: bool) -> bytes:
    """The request head as bytes again (names lower-cased; a ``100 Continue`` already sent is not asked for again)."""
    version = b"HTTP/1.1" if request.http_version == "1.1" else b"HTTP/1.0"
    lines = [request.method + b" " + request.target + b" " + version]
    lines += [name + b": " + value for name, value in request.headers
              if not (continued and name == _DROPPED_WHEN_CONTINUED)]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _refuse(sock: trio.socket.SocketType, target: str, worker: int) -> Awaitable[None]:
    message = f"the worker that serves this session (worker {worker}) is restarting; retry"
    if "/v1/messages" in target:
        payload = {"type": "error", "error": {"type": "overloaded_error", "message": message}}
    else:
        payload = {"error": {"message": message, "type": "server_error", "param": None, "code": "worker_unavailable"}}
    body = jsonio.dumps(payload)
    head = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            b"connection: close\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n")
    return _send_all(sock, head + body)


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[await sock.send(view):]
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
