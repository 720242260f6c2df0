"""The HTTP/1.1 server: h11 on Trio streams, serving the ASGI app, one socket write per response.

Why not hypercorn: measured with ``benchmarks/http_floor.py`` (a trivial JSON route,
load generator in another process), hypercorn costs 0.75-1.1 ms of CPU per request
before the app does anything, and a bare h11 server on Trio streams 0.2 ms. Hypercorn
writes each ASGI message with its own socket write (head, body and end of a reply: three
writes; every SSE chunk one more), each behind a lock and a shielded cancel scope, and
passes the request body through memory channels and tasks. Here a reply's head, its body
and its end leave in one write, and the request body is read from the socket when the
app asks for it.

What the proxy needs of its server, and nothing else: HTTP/1.1 with keep-alive (idle
connections closed after ``keep_alive_timeout``), ``Expect: 100-continue``, chunked
bodies both ways (h11 does the framing), absolute-form targets (``http://host/path``),
a 4xx with ``connection: close`` for a request h11 cannot parse (400 where h11 would
say 501: bad input is never a 5xx), ``http.disconnect`` when the client hangs up (so a
turn is cancelled and its generation aborted; every ``receive`` after it is still a
checkpoint, so an app that keeps asking cannot hold the event loop), a 500 when the app
fails before answering, and a shutdown that stops accepting and drops idle connections
at once (``serve_proxy`` drains first).
Each request runs in a task of its own, as under hypercorn, so context variables set
while serving one request never leak into the next one on the connection.
"""

from __future__ import annotations

import email.utils
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import unquote

import h11
import trio

from .drain import ASGIApp, Message

log = logging.getLogger("actorproxy.http")

_MAX_RECV = 65536
#: Bytes of a pipelined next request kept while a response is under way (more: stop reading).
_MAX_PIPELINED = 65536
_DISCONNECT: Message = {"type": "http.disconnect"}


class _Date:
    """The ``date`` header, formatted once per second."""

    second = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        second = int(time.time())
        if second != cls.second:
            cls.second, cls.value = second, email.utils.formatdate(second, usegmt=True).encode()
        return cls.value


class _Connection:
    """One client connection: its requests one after the other."""

    def __init__(self, server: HTTPServer, stream: trio.SocketStream) -> None:
        self.server, self.stream = server, stream
        self.h11 = h11.Connection(h11.SERVER)
        self.write_lock = trio.Lock()
        self.closed = False  # the client went away (or the socket failed)
        sock = stream.socket
        self.client = _address(sock.getpeername())
        self.local = _address(sock.getsockname())

    async def run(self) -> None:
        try:
            while True:
                request = None
                with trio.move_on_after(self.server.keep_alive_timeout):  # idle: the client may not come back
                    request = await self.next_request()
                if request is None:
                    return
                async with trio.open_nursery() as nursery:  # a fresh context per request
                    nursery.start_soon(_Cycle(self, request).run)
                if self.h11.our_state is not h11.DONE or self.h11.their_state is not h11.DONE or self.closed:
                    return  # unread body, a close asked for, or a broken reply: the connection cannot go on
                self.h11.start_next_cycle()
        finally:
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    async def next_request(self) -> h11.Request | None:
        """The next request's head; ``None`` when the connection should close."""
        try:
            event = await self.read_event()
        except h11.RemoteProtocolError as error:
            if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                # h11's hint, but a request it cannot take is the client's error (its 501 for a transfer
                # coding other than chunked too): never a 5xx for bad input.
                status = error.error_status_hint if error.error_status_hint < 500 else 400
                await self.write(self.h11.send(h11.Response(status_code=status, headers=[
                    (b"content-length", b"0"), (b"connection", b"close"), (b"date", _Date.now())])))
            return None
        return event if isinstance(event, h11.Request) else None

    async def read_event(self) -> Any:
        """The next h11 event, reading the socket as needed (EOF or a broken socket: ``ConnectionClosed``)."""
        while True:
            event = self.h11.next_event()
            if event is not h11.NEED_DATA:
                return event
            try:
                data = await self.stream.receive_some(_MAX_RECV)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            self.h11.receive_data(data)

    async def write(self, data: bytes) -> None:
        if self.closed or not data:
            await trio.lowlevel.checkpoint()  # an app sending into a closed connection still lets others run
            return
        await _acquire(self.write_lock)
        try:
            await self.stream.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            self.closed = True
        finally:
            self.write_lock.release()


class _Cycle:
    """One request and its response: the ASGI ``receive`` and ``send`` of the app's call."""

    def __init__(self, connection: _Connection, request: h11.Request) -> None:
        self.connection = connection
        self.method = request.method.decode("ascii")
        path, _, query = _origin_form(request.target).partition(b"?")
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.1"},
            "http_version": request.http_version.decode("ascii"),
            "method": self.method,
            "scheme": "http",
            "path": unquote(path.decode("ascii")),
            "raw_path": path,
            "query_string": query,
            "root_path": "",
            "headers": list(request.headers),
            "client": connection.client,
            "server": connection.local,
            "extensions": {},
        }
        self.read_lock = trio.Lock()
        self.pending: Any = None  # an h11 event read ahead
        self.body_done = False
        self.head: tuple[int, list[tuple[bytes, bytes]]] | None = None
        self.head_sent = False
        self.complete = False

    async def run(self) -> None:
        try:
            await self.connection.server.app(self.scope, self.receive, self.send)
        except Exception:
            log.exception("error in the ASGI app serving %s %s", self.method, self.scope["path"])
        if not self.head_sent:
            await self.error_response(500)
        elif not self.complete:
            self.connection.closed = True  # a reply cut short: the client must not reuse the connection

    async def error_response(self, status: int) -> None:
        connection = self.connection
        if connection.h11.our_state is not h11.SEND_RESPONSE:
            return
        self.head_sent = self.complete = True
        head = h11.Response(status_code=status, headers=[(b"content-length", b"0"), (b"connection", b"close"),
                                                         (b"date", _Date.now())])
        await connection.write(connection.h11.send(head) + (connection.h11.send(h11.EndOfMessage()) or b""))

    async def receive(self) -> Message:
        await _acquire(self.read_lock)  # one reader at a time; a disconnect is seen by every later call
        try:
            return await self._receive()
        finally:
            self.read_lock.release()

    async def _receive(self) -> Message:
        connection = self.connection
        if connection.closed:
            # A checkpoint: an app that keeps asking (a drain loop) must not hold the event loop forever.
            await trio.lowlevel.checkpoint()
            return _DISCONNECT
        if self.body_done:
            return await self.wait_disconnect()
        if connection.h11.they_are_waiting_for_100_continue:
            await connection.write(connection.h11.send(h11.InformationalResponse(
                status_code=100, headers=[(b"date", _Date.now())])))
        try:
            event = self.pending if self.pending is not None else await connection.read_event()
            self.pending = None
            if isinstance(event, h11.Data):
                body = bytes(event.data)
                following = connection.h11.next_event()  # already here? (no read: NEED_DATA if not)
                if isinstance(following, h11.EndOfMessage):  # the whole body in one message
                    self.body_done = True
                    return {"type": "http.request", "body": body, "more_body": False}
                if following is not h11.NEED_DATA:
                    self.pending = following
                return {"type": "http.request", "body": body, "more_body": True}
        except h11.RemoteProtocolError:
            event = h11.ConnectionClosed()
        if isinstance(event, h11.EndOfMessage):
            self.body_done = True
            return {"type": "http.request", "body": b"", "more_body": False}
        connection.closed = True
        return _DISCONNECT

    async def wait_disconnect(self) -> Message:
        """After the body: wait until the client hangs up (a pipelined next request is kept for later)."""
        connection = self.connection
        while True:
            if len(connection.h11.trailing_data[0]) > _MAX_PIPELINED:
                await trio.sleep_forever()  # read no more until this response is done
            try:
                data = await connection.stream.receive_some(_MAX_RECV)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                data = b""
            if not data:
                connection.closed = True
                return _DISCONNECT
            connection.h11.receive_data(data)

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.head = (int(message["status"]), list(message.get("headers", ())))
            return
        if kind != "http.response.body" or self.complete or self.head is None:
            return
        connection = self.connection
        h = connection.h11
        out = b""
        status, headers = self.head
        if not self.head_sent:
            self.head_sent = True
            headers.append((b"date", _Date.now()))
            out = h.send(h11.Response(status_code=status, headers=headers)) or b""
        body = message.get("body", b"")
        if body and self.method != "HEAD" and status not in (204, 304):
            out += h.send(h11.Data(data=body)) or b""
        if not message.get("more_body", False):
            self.complete = True
            out += h.send(h11.EndOfMessage()) or b""
        await connection.write(out)


class HTTPServer:
    """Serves ``app`` on one listening socket until told to stop."""

    def __init__(self, app: ASGIApp, *, keep_alive_timeout: float = 75.0) -> None:
        self.app = app
        self.keep_alive_timeout = keep_alive_timeout

    async def serve(
        self,
        host: str,
        port: int,
        *,
        backlog: int = 4096,
        shutdown_trigger: Callable[[], Awaitable[None]],
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Listen on ``host:port`` (its URL goes to ``task_status``); stop when ``shutdown_trigger`` returns.

        Stopping drops every connection at once, idle or not: what should finish was drained before.
        """
        sock = trio.socket.socket(trio.socket.AF_INET6 if ":" in host else trio.socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        await sock.bind((host, port))
        sock.listen(backlog)
        listener = trio.SocketListener(sock)
        bound = sock.getsockname()
        url = f"http://[{bound[0]}]:{bound[1]}" if sock.family == socket.AF_INET6 else f"http://{bound[0]}:{bound[1]}"
        log.info("Running on %s (CTRL + C to quit)", url)
        async with listener, trio.open_nursery() as nursery:
            nursery.start_soon(trio.serve_listeners, self._connection, [listener])
            task_status.started(url)
            await shutdown_trigger()
            nursery.cancel_scope.cancel()

    async def _connection(self, stream: trio.SocketStream) -> None:
        await _Connection(self, stream).run()


async def _acquire(lock: trio.Lock) -> None:
    """Take ``lock``; no scheduling round when it is free (the common case: the I/O after it yields anyway)."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


def _origin_form(target: bytes) -> bytes:
    """The path and query of a request target: an absolute-form one (``http://host/p?q``, RFC 9112 3.2.2) cut."""
    if target[:1] == b"/":
        return target
    scheme, sep, rest = target.partition(b"://")
    if sep and scheme.lower() in (b"http", b"https"):
        slash = rest.find(b"/")
        return rest[slash:] if slash >= 0 else b"/" + rest[len(rest.partition(b"?")[0]):]
    return target


def _address(name: Any) -> tuple[str, int] | None:
    return (str(name[0]), int(name[1])) if isinstance(name, tuple) and len(name) >= 2 else None
