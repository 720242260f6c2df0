"""One request and its response on the HTTP/1.1 server (:mod:`.server`): the ASGI scope, ``receive`` and ``send``.

The connection (:class:`~.server.ServerConnection`) reads the socket and runs one
:class:`Cycle` after another in its own task; a cycle gives the app the request's body
as it arrives (or at once, through the ``actorproxy.body_now`` extension), frames the
app's response (:mod:`actorproxy.http.h1`) so that its head, body and end leave in one write, and
tells the app when the client is gone (``http.disconnect``, or the
``actorproxy.on_disconnect`` callback that cancels the request).
"""

from __future__ import annotations

import email.utils
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import trio

from . import h1
from .state import CLIENT, ERROR, SEND_BODY, SEND_RESPONSE, SERVER

if TYPE_CHECKING:
    from .server import ServerConnection

log = logging.getLogger("actorproxy.http")

#: Bytes of a pipelined next request kept while a response is under way (more: stop reading).
MAX_PIPELINED = 65536
#: Bytes of a request body (with a ``Content-Length``) gathered before the app gets them, at most: a body
#: up to this size is read from the socket in as few calls as it arrives in and given to the app whole.
BODY_AT_ONCE = 1 << 20
#: An ASGI message (``receive``'s and ``send``'s).
Message = MutableMapping[str, Any]
DISCONNECT: Message = {"type": "http.disconnect"}
CONTINUE = h1.CONTINUE
#: Bytes of a request body left unread when its response starts that the connection still reads (and drops) after
#: the response, to serve the next request on it; a larger rest (a 413 decided from ``Content-Length``) is not
#: read: the response says ``connection: close``.
BODY_DISCARD = 4 << 20
#: The scope extension that calls back when the client hangs up: ``scope["extensions"][...](callback)``; the
#: request is then cancelled (the connection ends). The turn lane's turn ends so, without a task per request
#: reading ``http.disconnect`` nor a cancel scope of its own.
DISCONNECT_EXTENSION = "actorproxy.on_disconnect"
#: The scope extension that hands over the whole request body when it has all arrived already
#: (``scope["extensions"][...]()``: its bytes, as if received; ``None``: receive it as usual). The turn lane's
#: body then needs no timeout (the common case: the body came with the head).
BODY_EXTENSION = "actorproxy.body_now"
#: The scope extension that says, after an ``http.disconnect``, whether it came because the body was too slow:
#: ``scope["extensions"][...]()`` is then the 408 to raise (``None``: the client went away; the exception is the
#: server policy's ``slow_body_error``). The turn lane answers it in the caller's format and counts it; an app that
#: does not ask gets the server's own 408 (the policy's ``slow_body_response``).
SLOW_BODY_EXTENSION = "actorproxy.body_too_slow"
#: The scope extension that writes a piece of the response body from any task, at once when the socket takes it
#: (``scope["extensions"][...](body)``: ``None`` once written, else an awaitable that writes the rest;
#: ``trio.BrokenResourceError`` once the client is gone): no ASGI message, no task switch. Only for a response
#: whose head is out, while no ``send`` of the app's runs: the turn lane lets the session's task write a streamed
#: reply's deltas so (``runtime/turn_stream.py: Relay``). An empty body writes nothing and raises if a write
#: failed (the client gone): the ASGI ``send`` returns silently then.
SEND_NOW_EXTENSION = "actorproxy.send_now"
#: The scope extension that writes an interim ``102 Processing`` while no response has started
#: (``await scope["extensions"][...]()``; nothing to an HTTP/1.0 client, which must get no 1xx, or once the
#: response started). A client that skips 1xx responses (httpx, aiohttp) starts its read timeout over with each:
#: the turn lane sends one each ``--heartbeat-interval`` a call that does not stream waits.
PROCESSING_EXTENSION = "actorproxy.processing"
#: The scope extension that waits until every byte of the response written so far reached the client
#: (``await scope["extensions"][...]()``: ``True``; ``False`` once it is gone, or took nothing for
#: ``--send-timeout``): :meth:`ServerConnection.acknowledged`. See :func:`delivered`.
ACKNOWLEDGED_EXTENSION = "actorproxy.acknowledged"


def still_open(scope: Any) -> bool:
    """Whether the reply under way in ``scope`` still has its client: a write that failed (the client gone, its
    connection reset, or stalled past ``--send-timeout``) closed the connection, which the app's ``send`` does not
    say (the :data:`SEND_NOW_EXTENSION`'s probe does). ``True`` on a server without the probe: it raises from
    ``send`` instead."""
    probe = (scope.get("extensions") or {}).get(SEND_NOW_EXTENSION)
    if probe is None:
        return True
    try:
        probe(b"")
    except trio.BrokenResourceError:
        return False
    return True


async def delivered(scope: Any) -> bool:
    """Whether the reply under way in ``scope`` reached its client so far: still open (:func:`still_open`) and every
    byte written acknowledged by the client (:data:`ACKNOWLEDGED_EXTENSION`), waited for. A write returns once the
    kernel has the bytes, so a reply that fits in the buffers is written whole whether or not the client ever
    takes it (a broken network, a hung process): a drain asks this before it deletes what it sent. ``True`` on a
    server without the extension while :func:`still_open` says so."""
    acknowledged = (scope.get("extensions") or {}).get(ACKNOWLEDGED_EXTENSION)
    if acknowledged is None:
        await trio.lowlevel.checkpoint()
        return still_open(scope)
    return bool(await acknowledged())


class Date:
    """The ``date`` header, formatted once per second."""

    second = -1
    value = b""

    @classmethod
    def now(cls) -> bytes:
        second = int(time.time())
        if second != cls.second:
            cls.second, cls.value = second, email.utils.formatdate(second, usegmt=True).encode()
        return cls.value


class Cycle:
    """One request and its response: the ASGI ``receive`` and ``send`` of the app's call."""

    def __init__(self, connection: ServerConnection, request: h1.RequestHead) -> None:
        self.connection = connection
        self.request = request
        self.method = request.method.decode("ascii")
        path, raw_path, query = request_path(request.target)
        self.scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.1"},
            "http_version": request.http_version,
            "method": self.method,
            "scheme": "http",
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": request.headers,
            "client": connection.client,
            "server": connection.local,
            "extensions": {DISCONNECT_EXTENSION: self.add_disconnect_callback, BODY_EXTENSION: self.body_now,
                           SLOW_BODY_EXTENSION: self.too_slow, SEND_NOW_EXTENSION: self.send_now,
                           PROCESSING_EXTENSION: self.processing, ACKNOWLEDGED_EXTENSION: connection.acknowledged},
        }
        self.on_disconnect: list[Callable[[], None]] = []
        self.body = body = h1.BodyDecoder.of_request(request)
        # Where the request and its response stand (the body's end, the response's start and end, keep-alive,
        # a body that broke: ``ERROR`` on the client's side) is the connection's ``state``; the flags here are ASGI's.
        self.state = state = connection.state
        state.request(request.keep_alive, body.done, request.expect_continue)
        self.read_lock: trio.Lock | None = None  # made by the first ``receive`` (the turn lane takes ``body_now``)
        self.body_given = False  # the app has the body's last message
        self.slow_body = False  # the body came slower than the server's minimum rate: answer 408, not 400
        self.started = trio.current_time()  # for the body's rate (``body_due``)
        self.mark = connection.received - len(connection.buffer)  # ``connection.received`` before the body
        self.head: tuple[int, list[tuple[bytes, bytes]]] | None = None  # ``http.response.start``'s, until a body
        self.framing: h1.ResponseFraming | None = None

    async def run(self) -> None:
        server = self.connection.server
        tracker = server.tracker
        if tracker is not None:
            tracker.started()
        try:
            await server.app(self.scope, self.receive, self.send)
        except Exception:
            log.exception("error in the ASGI app serving %s %s", self.method, self.scope["path"])
        finally:
            if tracker is not None:
                tracker.finished()
            # What pointed back at this cycle (its bound methods in the scope, the app's disconnect callbacks)
            # is dropped with the app's call: the request's objects go by reference counting, not at a collection.
            self.scope.pop("extensions", None)
            self.on_disconnect = []
        state = self.state
        if state.server == SEND_RESPONSE:
            await self.error_response(408 if self.slow_body else 400 if state.client == ERROR else 500)
        elif state.server == SEND_BODY:  # a reply cut short: the client must not reuse the connection
            state.fail(SERVER)
            self.connection.closed = True

    async def error_response(self, status: int) -> None:
        self.state.response(False, True)
        if status == 408:
            await self.connection.write(self.timeout_response())
            return
        await self.connection.write(h1.error_response(status, Date.now()))

    def too_slow(self) -> Exception | None:
        """The 408 to answer when the body came slower than the server's bound (``None``: it did not)."""
        if not self.slow_body:
            return None
        return self.connection.server.policy.slow_body_error()

    def timeout_response(self) -> bytes:
        """The 408 for a body that came too slowly (the server policy's), and the connection closes."""
        policy = self.connection.server.policy
        error = self.too_slow() or policy.slow_body_error()
        return policy.slow_body_response(self.method, str(self.scope["path"]), error, Date.now())

    async def receive(self) -> Message:
        lock = self.read_lock
        if lock is None:
            lock = self.read_lock = trio.Lock()
        await _acquire(lock)  # one reader at a time; a disconnect is seen by every later call
        try:
            return await self._receive()
        finally:
            lock.release()

    async def _receive(self) -> Message:
        connection = self.connection
        if connection.closed or self.state.client == ERROR:
            # A checkpoint: an app that keeps asking (a drain loop) must not hold the event loop forever.
            await trio.lowlevel.checkpoint()
            return DISCONNECT
        body = self.body
        if self.body_given:
            return await self.wait_disconnect()
        try:
            while True:
                if body.done:
                    data: bytes | None = b""
                elif connection.eof or len(connection.buffer) >= self.gathered():
                    data = body.read(connection.buffer)
                else:
                    data = None  # a body up to BODY_AT_ONCE is given whole: one message, not one per read
                if data is not None:
                    if body.done:
                        self.body_given = True
                        if self.state.client == SEND_BODY:  # (a bodiless request's ended with its head)
                            self.state.request_end()
                    if len(connection.buffer) <= MAX_PIPELINED:
                        connection.room.unpark_all()
                    return {"type": "http.request", "body": data, "more_body": not body.done}
                if connection.eof:
                    break
                if self.state.expect_continue:  # (no response has started)
                    self.state.expect_continue = False
                    await connection.write(CONTINUE)
                if not await self.more_body():  # too slow: the client gets a 408 unless the app answers
                    self.slow_body = True
                    self.state.fail(CLIENT)
                    return DISCONNECT
        except h1.ProtocolError:  # the client is still there: it gets a 400 unless the app answers
            self.state.fail(CLIENT)
            return DISCONNECT
        self.state.fail(CLIENT)  # the body was cut short by the client's end
        connection.closed = True
        return DISCONNECT

    async def more_body(self) -> bool:
        """Wait for more of the body (or the EOF); ``False`` when it comes slower than the server's bound.

        The bound is Kestrel's ``MinRequestBodyDataRate``: none for ``body_grace`` seconds
        from the head, then the bytes that arrived must keep up with ``body_min_rate`` per
        second on average. So a body that stops is given up at the later of the grace's end
        and the moment its rate falls under the bound, and a slow but steady one is taken.
        """
        return await body_arrives(self.connection, self.started, self.mark)

    async def discard_rest(self) -> bool:
        """After the response: read and drop the rest of the body (its rate bounded); whether it all came."""
        body, connection, state = self.body, self.connection, self.state
        if state.client != SEND_BODY:
            return state.client != ERROR
        try:
            while not body.done:
                if body.read(connection.buffer) is not None:
                    connection.room.unpark_all()
                    continue
                if connection.eof or connection.closed or not await self.more_body():
                    return False
        except h1.ProtocolError:
            state.fail(CLIENT)
            return False
        state.request_end()
        return True

    def leaves_body(self) -> bool:
        """Whether the response is starting with more of the body unread than the connection will read after it."""
        body = self.body
        if self.body_given or body.done:
            return False
        if self.state.expect_continue:  # no 100 Continue went out: the client may never send it
            return True
        return body.chunked or body.remaining - len(self.connection.buffer) > BODY_DISCARD

    async def wait_disconnect(self) -> Message:
        """After the body: wait until the client is gone (a pipelined next request is kept for later)."""
        connection = self.connection
        while not connection.gone:
            await connection.arrived.park()
        connection.closed = True
        return DISCONNECT

    def gathered(self) -> int:
        """Bytes of the body to gather in the buffer before the app gets them (the reader may hold that many)."""
        body = self.body
        if body.chunked or body.done or self.body_given:
            return 0
        return min(body.remaining, BODY_AT_ONCE)

    def whole(self) -> bool:
        """Whether the whole request has arrived (its body given to the app, or all of it in the buffer)."""
        body = self.body
        return self.body_given or body.done or (not body.chunked and len(self.connection.buffer) >= body.remaining)

    def body_now(self) -> bytes | None:
        """The whole body if it has all arrived (then received: the next ``receive`` waits for the disconnect)."""
        body, buffer = self.body, self.connection.buffer
        if self.body_given or body.chunked or (self.read_lock is not None and self.read_lock.locked()):
            return None
        if body.done:
            data = b""
        elif len(buffer) >= body.remaining and self.state.client == SEND_BODY:  # (not after a 408 for it)
            data = body.read(buffer) or b""
            self.state.request_end()
            if len(buffer) <= MAX_PIPELINED:
                self.connection.room.unpark_all()
        else:
            return None
        self.body_given = True
        return data

    def add_disconnect_callback(self, callback: Callable[[], None]) -> None:
        """When the client hangs up after the body (at once if it has already): ``callback()``, then the request is
        cancelled (in the connection's cancel scope, which ends the connection)."""
        self.on_disconnect.append(callback)
        if self.connection.gone:
            self.hung_up()

    def hung_up(self) -> None:
        """The client went away while this request is served (after its body)."""
        connection = self.connection
        connection.closed = True
        callbacks, self.on_disconnect = self.on_disconnect, []
        for callback in callbacks:
            callback()
        if callbacks:
            connection.scope.cancel()

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.head = (int(message["status"]), list(message.get("headers", ())))
            return
        state = self.state
        if kind != "http.response.body" or self.head is None:
            return
        out = b""
        framing = self.framing
        starts = state.server != SEND_BODY
        if starts:
            if state.server != SEND_RESPONSE:  # the response has ended (or broke)
                return
            status, headers = self.head
            framing = h1.ResponseFraming(self.request, status, headers)
            if self.leaves_body() or self.slow_body:  # a 413 from the head, a 408: the rest is not read, it ends
                framing.close = True
            out = framing.head(status, headers, Date.now())
            self.framing = framing
        assert framing is not None  # (made as the response starts)
        body = message.get("body", b"")
        if body:
            out += framing.piece(body)
        if message.get("more_body", False):
            if starts:
                state.response(not framing.close)
        else:
            end, whole = framing.end()
            out += end
            if starts:  # the whole response in one message (the common case): one transition
                state.response(not framing.close, whole)
            elif whole:
                state.response_end()
            if not whole:  # shorter than its content-length: nothing more goes out, the connection ends
                state.fail(SERVER)
                self.connection.closed = True
        await self.connection.write(out)


    async def processing(self) -> None:
        """An interim ``102 Processing`` (:data:`PROCESSING_EXTENSION`), while no response has started."""
        if (self.head is None and self.state.server == SEND_RESPONSE and self.request.http_version == "1.1"
                and not self.state.expect_continue):
            await self.connection.write(h1.PROCESSING)

    def send_now(self, body: bytes) -> Awaitable[None] | None:
        """Write ``body`` as the next piece of the response under way (:data:`SEND_NOW_EXTENSION`).

        ``None`` when the socket took it all (or the response has ended); else the awaitable
        that writes the rest, waiting for the socket, which the caller awaits before it writes
        anything else. Another write waiting for the socket goes first (the connection's write
        lock). A closed connection (the client gone) raises :class:`trio.BrokenResourceError`.
        """
        framing = self.framing
        if framing is None or self.state.server != SEND_BODY:
            return None
        if not body:  # a probe: has a write failed (the client gone)? The app's ``send`` does not say so
            if self.connection.closed:
                raise trio.BrokenResourceError("the client is gone")
            return None
        return self.connection.write_now(framing.piece(body))


async def _acquire(lock: trio.Lock) -> None:
    """Take ``lock``; no scheduling round when it is free (the common case: the I/O after it yields anyway)."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


async def body_arrives(connection: ServerConnection, started: float, mark: int) -> bool:
    """Wait for more of a body whose head came at ``started`` (``connection.received`` was ``mark`` before its first
    byte); ``False`` when it comes slower than the server's bound (:meth:`Cycle.more_body`)."""
    limits = connection.server.limits
    arrived = connection.received - mark
    due = started + max(limits.body_grace, arrived / limits.body_min_rate)
    with trio.move_on_at(due):
        await connection.wait_for_bytes()
        return True
    return False


def request_path(target: bytes) -> tuple[str, bytes, bytes]:
    """A request target's path as the app sees it (origin-form, percent-decoded), its raw path and its query."""
    raw_path, _, query = _origin_form(target).partition(b"?")
    return unquote(raw_path.decode("ascii")), raw_path, query


def _origin_form(target: bytes) -> bytes:
    """The path and query of a request target: an absolute-form one (``http://host/p?q``, RFC 9112 3.2.2) cut."""
    if target[:1] == b"/":
        return target
    scheme, sep, rest = target.partition(b"://")
    if sep and scheme.lower() in (b"http", b"https"):
        slash = rest.find(b"/")
        return rest[slash:] if slash >= 0 else b"/" + rest[len(rest.partition(b"?")[0]):]
    return target
