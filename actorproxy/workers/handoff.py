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

What the router reads comes from anyone who reaches the port, before the app's checks: so
it reads a body only where the single process would (the caller passes the route's access
check, its ``Content-Length`` is within the app's limit), keeps it in the connection's
buffer (the reader gathers it there, each byte copied once more at most), waits for it
under the server's rate bound for a body (then ``408``, as the single process answers),
and a request it cannot route is served where it landed, where the app refuses it as the
single process does. An error of its own is logged and answered ``400`` (the connection
then closes): it never ends the worker.
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import socket
from functools import partial
from typing import TYPE_CHECKING, Literal

import trio
from werkzeug.exceptions import RequestEntityTooLarge, RequestTimeout

from ..errors import BadRequest, Overloaded, Unauthorized
from ..http import h1
from ..http.cycle import body_arrives, request_path
from ..http.sockets import send_rest
from ..schema import jsonio
from ..server.admission import Admission, RequestHeaders
from .routing import MAX_BODY, NEED_BODY, body_session, default_admission, head_session, owner

if TYPE_CHECKING:
    from ..http.server import Handoff, HTTPServer, ServerConnection

log = logging.getLogger("actorproxy.workers")

_ANCILLARY = socket.CMSG_SPACE(array.array("i", [0]).itemsize)
#: Seconds a hand-off may take, either side (a full queue on the sender's, a body still arriving on the receiver's).
HANDOFF_TIMEOUT = 10.0
#: Connections handed over and not taken yet that a worker's hand-off socket queues (as the kernel's ``somaxconn``).
_QUEUE = 4096
#: Seconds between two tries at a hand-off socket whose queue is full.
_QUEUE_FULL_RETRY = 0.005
#: Bytes of one hand-off read in one pass of the receiving loop (a head and a usual body); more in a task of its own.
_READ_AT_ONCE = 1 << 20
_READ_SIZE = 1 << 16
#: Headers of the head that the router has already answered (a ``100 Continue`` sent while reading the body).
_DROPPED_WHEN_CONTINUED = b"expect"
#: What :func:`_whole_body` answers for a body slower than the server's rate bound.
_SLOW = b"(slow)"


def handoff_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"w{index}.handoff")


def remove_stale(path: str) -> None:
    """Remove the Unix socket file a worker's previous life left at ``path``."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Router:
    """The :class:`~actorproxy.http.server.HTTPServer` router of worker ``index`` of ``workers``."""

    def __init__(self, index: int, workers: int, directory: str, admission: Admission | None = None) -> None:
        self.index, self.workers, self.directory = index, workers, directory
        #: The app's own admission step: a request it refuses is served where it landed, and refused there.
        self.admission = admission or default_admission()
        self.handed_off = 0  # connections sent to their owner
        self.refused = 0  # requests answered 503 because their owner was down

    async def __call__(self, connection: ServerConnection, request: h1.RequestHead) -> Handoff | None:
        try:
            return await self.route(connection, request)
        except Exception as exc:  # a fault of the router's own: this request's alone, never the worker's
            log.exception("could not route %s %r: answered 400", request.method, request.target[:200])
            error = BadRequest(f"this request could not be routed to its worker ({type(exc).__name__})",
                               code="unroutable_request")
            return partial(self.answer, error, request_path(request.target)[0])

    async def route(self, connection: ServerConnection, request: h1.RequestHead) -> Handoff | None:
        """The hand-off to the worker that owns the request's session; ``None``: served here."""
        path = request_path(request.target)[0]
        headers = RequestHeaders(request.headers)
        session = head_session(path, headers)
        continued = False
        if session == NEED_BODY:
            session = self.key_session(path, headers, connection)
        if session == NEED_BODY:
            try:
                self.admission.check_size(request.length)
            except RequestEntityTooLarge:
                return None  # the app answers 413, from the header
            if request.expect_continue:  # the client waits for this before it sends the body we need
                request.expect_continue, continued = False, True
                await connection.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            body = await _whole_body(connection, request)
            if body is _SLOW:
                return partial(self.answer, RequestTimeout(), path)
            session = None if body is None else body_session(body, path, headers)
        if session is None:
            return None
        worker = owner(session, self.workers)
        if worker == self.index:
            return None
        return partial(self._send, worker, _rebuild(request, continued), path)

    def key_session(self, path: str, headers: RequestHeaders,
                    connection: ServerConnection | None = None) -> str | None | Literal["body"]:
        """Before a body is read: the session an agent's key confines it to, else ``NEED_BODY``; ``None`` when the
        app's admission step refuses the caller (the app refuses it here, without the body, as one process does)."""
        client = connection.client if connection is not None else None
        try:
            admitted = self.admission.admit(path, headers, client[0] if client else None)
        except Unauthorized:
            return None
        return admitted.confined or NEED_BODY

    async def _send(self, worker: int, head: bytes, path: str, sock: trio.socket.SocketType, rest: bytes) -> None:
        """Send ``sock`` and the bytes not served yet to ``worker``; a 503 on the connection if it cannot take it."""
        try:
            await offer(handoff_path(self.directory, worker), sock.fileno(), head + rest)
        except (OSError, trio.TooSlowError) as exc:
            self.refused += 1
            log.warning("worker %d cannot take a connection for its session (%s): 503", worker,
                        exc if isinstance(exc, OSError) else "its hand-off queue stayed full")
            refusal = Overloaded(f"the worker that serves this session (worker {worker}) is restarting; retry",
                                 code="worker_unavailable")
            refusal.retry_after = 1
            await self.answer(refusal, path, sock, rest)
            return
        self.handed_off += 1

    async def answer(self, error: Exception, path: str, sock: trio.socket.SocketType, rest: bytes) -> None:
        """Answer ``error`` on the client's socket as the app's admission step words it (``connection: close``);
        then the connection closes."""
        failed = self.admission.refusal(error, method="", path=path)
        body = jsonio.dumps(failed.data)
        head = [h1.status_line(failed.status), b"content-type: application/json\r\n", b"connection: close\r\n",
                b"content-length: %d\r\n" % len(body)]
        head += [f"{name.lower()}: {value}\r\n".encode("latin-1") for name, value in failed.headers]
        await _send_all(sock, b"".join(head) + b"\r\n" + body)


async def offer(path: str, fd: int, data: bytes) -> None:
    """Send the socket ``fd`` and ``data`` to the hand-off socket at ``path``, then close the Unix connection.

    In the common case (the owner's queue has room, its socket buffer takes ``data``) this is
    three system calls and no scheduling round: a hand-off must not wait behind the sender's
    busy loop. A full queue is retried for ``HANDOFF_TIMEOUT`` seconds at most
    (``trio.TooSlowError``); an owner that is not there raises the ``OSError``.
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
        peer.setblocking(False)
        with trio.fail_after(HANDOFF_TIMEOUT):
            while True:
                try:
                    peer.connect(path)
                    break
                except (BlockingIOError, InterruptedError):  # a Unix socket's queue is full: EAGAIN, not in progress
                    await trio.sleep(_QUEUE_FULL_RETRY)
            view = memoryview(data)
            fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))]
            while True:  # the descriptor goes with the first bytes that leave
                try:
                    sent = peer.sendmsg([view], fds)
                    break
                except (BlockingIOError, InterruptedError):
                    await trio.lowlevel.wait_writable(peer)
            try:
                await send_rest(peer, [view], sent)
            finally:
                trio.lowlevel.notify_closing(peer)


async def serve_handoffs(
    directory: str, index: int, server: HTTPServer, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Take the connections other workers hand to worker ``index`` and serve them on ``server``.

    Every hand-off waiting is taken in one pass of the loop (not one per scheduling round:
    when many new sessions land on the other workers at once, the owner's busy loop would
    make the last one wait for as many rounds as there are hand-offs before it), and each is
    read at once, since its sender wrote it whole before closing: the connection is served
    from the next round. Only a hand-off whose bytes are not all there yet (a big body) is
    finished in a task of its own, within ``HANDOFF_TIMEOUT``.
    """
    path = handoff_path(directory, index)
    remove_stale(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(path)
        listener.listen(_QUEUE)
        listener.setblocking(False)
        async with trio.open_nursery() as nursery:
            task_status.started()

            def take(stream: socket.socket) -> None:
                incoming = _Incoming(stream)
                if not incoming.read_now(server):
                    nursery.start_soon(incoming.finish, server)

            await server.accept_from(listener, take)
    finally:
        trio.lowlevel.notify_closing(listener)
        listener.close()


class _Incoming:
    """One hand-off being received: the client's socket (its descriptor) and the bytes sent with it."""

    __slots__ = ("stream", "fd", "pieces")

    def __init__(self, stream: socket.socket) -> None:
        stream.setblocking(False)
        self.stream, self.fd = stream, -1
        self.pieces: list[bytes] = []

    def read_now(self, server: HTTPServer) -> bool:
        """Read what is there (``_READ_AT_ONCE`` bytes at most); ``True`` when the hand-off is done with (the
        connection adopted by ``server``, or nothing whole to adopt) and closed, ``False`` when more must come."""
        budget = _READ_AT_ONCE
        try:
            while budget > 0:
                try:
                    data, ancillary, _flags, _address = self.stream.recvmsg(_READ_SIZE, _ANCILLARY)
                except (BlockingIOError, InterruptedError):
                    return False
                self._take_descriptor(ancillary)
                if not data:
                    self._adopt(server)
                    break
                self.pieces.append(data)
                budget -= len(data)
            else:
                return False
        except Exception:  # the sender failed midway, or this socket cannot be served: this hand-off alone ends
            log.exception("a connection handed over could not be taken; it is closed")
        self.close()
        return True

    async def finish(self, server: HTTPServer) -> None:
        """Receive the rest in a task of its own (``HANDOFF_TIMEOUT`` at most), then adopt the connection."""
        try:
            with trio.move_on_after(HANDOFF_TIMEOUT):
                while True:
                    await trio.lowlevel.wait_readable(self.stream)
                    if self.read_now(server):
                        return
            log.warning("a connection handed over came without the rest of its bytes within %g s (%d received): "
                        "it is closed", HANDOFF_TIMEOUT, sum(map(len, self.pieces)))
        finally:
            self.close()

    def _take_descriptor(self, ancillary: list[tuple[int, int, bytes]]) -> None:
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
                for fd in fds:  # one is sent; any other is closed, never leaked
                    if self.fd < 0:
                        self.fd = fd
                    else:
                        os.close(fd)

    def _adopt(self, server: HTTPServer) -> None:
        if self.fd >= 0:
            client = trio.socket.from_stdlib_socket(socket.socket(fileno=self.fd))
            self.fd = -1
            server.adopt(client, b"".join(self.pieces))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.stream.fileno() >= 0:
            trio.lowlevel.notify_closing(self.stream)
            self.stream.close()


async def _whole_body(connection: ServerConnection, request: h1.RequestHead) -> bytes | None:
    """The request's whole body once it is in the connection's buffer (left there); ``None``: it will not be;
    ``_SLOW``: it comes slower than the server's bound for a body (``--body-timeout``, ``--body-min-rate``).

    The connection's reader is told to gather it (``connection.want``: past the bytes it holds
    between requests); each new byte is copied once, into the body taken apart here.
    """
    reader, pending, pieces, size, seen = h1.BodyDecoder.of_request(request), bytearray(), [], 0, 0
    started, mark = trio.current_time(), connection.received - len(connection.buffer)
    connection.want = request.length if not request.chunked else MAX_BODY
    try:
        while True:
            buffer = connection.buffer
            if len(buffer) > seen:
                with memoryview(buffer) as view:
                    pending += view[seen:]
                seen = len(buffer)
                while not reader.done and (piece := reader.read(pending)) is not None:
                    pieces.append(piece)
                    size += len(piece)
            if reader.done:  # (an empty body is done before a byte arrives)
                return b"".join(pieces)
            if connection.eof or size > MAX_BODY:
                return None
            if not await body_arrives(connection, started, mark):
                return _SLOW
    except h1.ProtocolError:
        return None  # served here: the app answers 400
    finally:
        connection.want = 0


def _rebuild(request: h1.RequestHead, continued: bool) -> bytes:
    """The request head as bytes again (names lower-cased; a ``100 Continue`` already sent is not asked for again)."""
    version = b"HTTP/1.1" if request.http_version == "1.1" else b"HTTP/1.0"
    lines = [request.method + b" " + request.target + b" " + version]
    lines += [name + b": " + value for name, value in request.headers
              if not (continued and name == _DROPPED_WHEN_CONTINUED)]
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _send_all(sock: trio.socket.SocketType, data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[await sock.send(view):]
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
