"""The HTTP/1.1 server: plain non-blocking sockets under Trio, serving the ASGI app, one socket write per response.

Why not hypercorn: measured with ``benchmarks/http_floor.py`` (a trivial JSON route,
load generator in another process), hypercorn costs 0.75-1.1 ms of CPU per request
before the app does anything, and a bare h11 server on Trio streams 0.2 ms. Hypercorn
writes each ASGI message with its own socket write (head, body and end of a reply: three
writes; every SSE chunk one more), each behind a lock and a shielded cancel scope, and
passes the request body through memory channels and tasks. Here a reply's head, its body
and its end leave in one write, and the request body is read from the socket when the
app asks for it. The HTTP/1.1 framing itself is :mod:`actorproxy.http.h1` (sans-IO; it replaced h11,
which cost about 80 µs per request: see there).

What the proxy needs of its server, and nothing else: HTTP/1.1 with keep-alive (idle
connections closed after ``keep_alive_timeout``), pipelining, ``Expect: 100-continue``,
chunked bodies both ways, absolute-form targets (``http://host/path``), a 4xx with
``connection: close`` for a request it cannot take (never a 5xx for bad input),
``http.disconnect`` when the client hangs up (so a turn is cancelled and its generation
aborted; every ``receive`` after it is still a checkpoint, so an app that keeps asking
cannot hold the event loop) but an answer for a client that only half-closed after its
request (:meth:`ServerConnection.half_closed`), a 500 when the app fails before answering, and a shutdown
that stops accepting and drops idle connections at once (the caller drains first).

The requests of a connection run one after the other in the connection's task (a task
per request cost a spawn and a join, two scheduling rounds): an app that sets a context
variable resets it when its request ends (the turn lane does; Quart-trio serves each
request in tasks of its own).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import os
import select
import socket
import struct
import termios
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, Protocol

import attrs
import trio

from . import h1
from .cycle import BODY_AT_ONCE, CONTINUE, MAX_PIPELINED, Cycle, Date
from .sockets import send_rest, sent_now
from .state import DONE, SEND_BODY, ConnectionState

log = logging.getLogger("actorproxy.http")

_MAX_RECV = 65536
#: Seconds a connection closed under a client still sending is read (and dropped) before it is closed.
_LINGER = 5.0
#: Bytes a response may leave unsent in the kernel before the socket stops counting as writable (as Trio sets).
_NOTSENT_LOWAT = 16384
#: Writes that complete at once without a scheduling round; every this many, one round (fairness).
_WRITES_PER_ROUND = 16
#: ``accept`` errors that mean the machine is short of something: wait and retry (as ``trio.serve_listeners``).
_ACCEPT_CAPACITY = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
#: ``accept`` errors about one connection (reset or refused before it was taken): take the next one.
_ACCEPT_SKIP = {getattr(errno, name) for name in (
    "EPERM", "ECONNABORTED", "EPROTO", "ENETDOWN", "ENOPROTOOPT", "EHOSTDOWN", "ENONET", "EHOSTUNREACH",
    "EOPNOTSUPP", "ENETUNREACH", "ENOSR", "ESOCKTNOSUPPORT", "EPROTONOSUPPORT", "ETIMEDOUT", "ECONNRESET",
) if hasattr(errno, name)}

#: A private epoll tells a client that closed its socket from one that only half-closed (Linux; see ``half_closed``).
_EPOLL = getattr(select, "epoll", None)

#: An ASGI application.
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]


@attrs.frozen
class ConnectionLimits:
    """What a client may hold of the server: connections, a body's time (docs/security.md, Bounds)."""

    #: Seconds a body may take before its rate counts (``--body-timeout``).
    body_grace: float = 10.0
    #: Bytes per second a body must then arrive at on average, or the request gets 408 (``--body-min-rate``).
    body_min_rate: float = 4096.0
    #: Connections served at once (``--max-connections``); ``None``: no bound.
    max_connections: int | None = None
    #: Seconds a reply may wait for its client to take a byte (``--send-timeout``): then the client counts as gone
    #: (a client that stops reading but keeps its connection would hold its request, and what it holds, for good).
    send_stall: float | None = 120.0


class Tracker(Protocol):
    """Counts the requests in flight (``started`` when the app is called, ``finished`` when it returns)."""

    def started(self) -> None: ...

    def finished(self) -> None: ...


class ServerPolicy:
    """What a server built on this floor decides above HTTP; these defaults answer in plain HTTP.

    ``limits``: its bounds. At ``max_connections``, ``headroom`` more connections are taken
    for requests :meth:`is_probe` accepts (none by default); anything else on them gets
    :meth:`overloaded`. A body slower than the limits' rate gets :meth:`slow_body_response`
    (the app, told through the ``SLOW_BODY_EXTENSION``, gets :meth:`slow_body_error`).
    """

    headroom = 16

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits

    def is_probe(self, request: h1.RequestHead) -> bool:
        return False

    def overloaded(self, date: bytes) -> bytes:
        return h1.error_response(503, date)

    def slow_body_error(self) -> Exception:
        limits = self.limits
        return h1.ProtocolError(f"the request body did not arrive in time: after {limits.body_grace:g} s it must "
                                f"arrive at {limits.body_min_rate:g} bytes/s at least", 408)

    def slow_body_response(self, method: str, path: str, error: Exception, date: bytes) -> bytes:
        return h1.error_response(408, date)

    def accept_failed(self, now: float, reason: str) -> None:
        log.warning("accept failed: %s", reason)


#: Moves a connection to another process (``actorproxy.workers``): called with the client's socket and the
#: bytes read from it and not served yet, once this process has stopped reading it.
Handoff = Callable[[trio.socket.SocketType, bytes], Awaitable[None]]
#: Looks at each request head before it is served: a :data:`Handoff` takes the connection away, ``None``
#: serves the request here. It may wait for more of the request in ``connection.buffer``.
Router = Callable[["ServerConnection", h1.RequestHead], Awaitable[Handoff | None]]


class ServerConnection:
    """One client connection: its requests one after the other.

    The socket is a plain non-blocking one, read and written with its own calls; Trio is
    asked only to wait (``wait_readable``/``wait_writable``). Trio's socket streams spend a
    failed ``recv`` before every wait and a scheduling round after every ``send`` that went
    through at once: per request, a syscall and a round more than needed, and per SSE chunk
    a round more.
    """

    def __init__(self, server: HTTPServer, sock: socket.socket, data: bytes = b"") -> None:
        self.server, self.sock = server, sock
        self.buffer = bytearray(data)  # bytes read and not yet taken (an adopted connection's come with it)
        self.received = len(data)  # bytes read from the client so far (a body's rate is measured on it)
        self.state = ConnectionState()  # where the exchange under way stands (HTTP/1.1, sans-IO): see ``.state``
        self.probe_only = False  # taken past --max-connections: a health probe is served, anything else 503
        self.moved = False  # handed to another server by the router: the reader reads nothing more
        # The transport, which the protocol state does not see (the reader reads ahead of what is parsed):
        self.eof = False  # the client sent its last byte (or the socket failed)
        self.gone = False  # the client is gone (not only done sending): a request in flight is then cancelled
        self.closed = False  # nothing more is written: the client went away, a write failed, or a reply broke
        self.arrived = trio.lowlevel.ParkingLot()  # tasks waiting for bytes (or the EOF)
        self.serving = trio.lowlevel.ParkingLot()  # the reader after an EOF, until the request that came with it runs
        self.room = trio.lowlevel.ParkingLot()  # the reader, while the buffer is full
        self.cycle: Cycle | None = None  # the request being served
        self.want = 0  # bytes of a body the router waits for before the request is served (``gathering``)
        # Not a trio.Lock: a write :meth:`write_now` began may be finished by another task than the one that
        # began it (a relayed token's frame is written in the relay hub's task, its back-pressure awaited in
        # the session's), and a Lock may be released only by its owner.
        self.write_lock = trio.Semaphore(1, max_value=1)
        self.writes = 0  # writes since the last scheduling round one of them took
        self.idle_since: float | None = None  # waiting for a request since (``trio.current_time``)
        self.timed_out = False  # idle longer than the keep-alive timeout: close
        self.scope = trio.CancelScope()  # the connection's: cancelled when a client gone means its request must end
        self.client = _address(sock.getpeername())
        self.local = _address(sock.getsockname())

    async def run(self) -> None:
        server = self.server
        server.connections.add(self)
        try:
            with self.scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self.read)
                    await self.serve()
                    nursery.cancel_scope.cancel()
            if not self.moved and self.state.request_unread and not (self.eof or self.closed):  # may still be sending
                await self.close_gently()
        finally:
            server.connections.discard(self)
            trio.lowlevel.notify_closing(self.sock)
            self.sock.close()
            server.released.unpark_all()

    async def serve(self) -> None:
        state = self.state
        while True:
            request = await self.next_request()
            if request is None:
                return
            if self.probe_only:
                request.keep_alive = False  # one request, then the connection makes room
                if not self.server.policy.is_probe(request):
                    state.request(False, not request.chunked and not request.length)  # a body is left unread
                    await self.write(self.server.policy.overloaded(Date.now()))
                    return
            if self.server.router is not None:
                handoff = await self.server.router(self, request)
                if handoff is not None:
                    await self.hand_off(handoff)
                    return
            cycle = self.cycle = Cycle(self, request)
            if self.eof:
                self.serving.unpark_all()
            try:
                await cycle.run()  # in this task: no task to spawn and join per request
            finally:
                self.cycle = None
            if state.server == DONE and state.client == SEND_BODY and not self.closed:
                await cycle.discard_rest()  # answered before its body came: the rest is read (and dropped) now
            if self.closed or not state.next_cycle():
                return  # unread body, a close asked for, or a broken reply: the connection cannot go on

    async def hand_off(self, handoff: Handoff) -> None:
        """Give the connection to ``handoff`` in this step, with every byte read and not served.

        Not after the reader has stopped: stopping it takes a scheduling round of a busy loop, and
        the request (a new session's first turn) would wait for it. The reader is parked (this task
        runs), so the buffer holds all it read; from here on it reads nothing (``moved``), and what
        the client sends next is the new server's.
        """
        self.moved = True
        await handoff(trio.socket.from_stdlib_socket(self.sock), bytes(self.buffer))

    async def close_gently(self) -> None:
        """End a connection whose client may still be sending its body: our side first, then what comes is dropped.

        Closing a socket with unread bytes sends a reset, and a reset can destroy the answer
        before the client reads it (it is still writing its body, not reading yet). So, as
        nginx's lingering close: shut our side (the client reads the answer, then the end),
        read and drop what still comes, for ``_LINGER`` seconds at most, then close.
        """
        sock = self.sock
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        with trio.move_on_after(_LINGER):
            while True:
                await trio.lowlevel.wait_readable(sock)
                try:
                    if not sock.recv(_MAX_RECV):
                        return
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    return

    def read_arrived(self) -> None:
        """Take what a connection just accepted already brought (its first request, usually): no wait, no round.

        A new client sends its request as it connects; read at once, the request is served in
        the connection's first step instead of two scheduling rounds later (a round is long when
        many streams relay a backlog, and a pause must not wait behind them). What did not
        arrive yet, an EOF or an error is left to :meth:`read`.
        """
        try:
            data = self.sock.recv(_MAX_RECV)
        except OSError:  # nothing yet (BlockingIOError), or failed: the reader finds out
            return
        if data:
            self.buffer += data
            self.received += len(data)
            self.idle_since = None

    async def read(self) -> None:
        """The connection's only reader: whatever the client sends goes to the buffer, its EOF to ``eof``.

        Reading on while a request is served is how a client that hangs up is noticed (and a
        pipelined request kept) without a task per request; at most ``MAX_PIPELINED`` bytes
        wait in the buffer before reading stops until they are taken.
        """
        sock = self.sock
        while True:
            # A request body being gathered (``Cycle.gathered``) may fill the buffer past that, and is read in
            # one call as far as it has arrived.
            if len(self.buffer) > MAX_PIPELINED + self.gathering():
                await self.room.park()
                continue
            # Wait first, then read: one recv per arrival (the wait is the checkpoint).
            await trio.lowlevel.wait_readable(sock)
            if self.moved:  # handed over meanwhile: what arrived is the new server's
                return
            try:
                data: bytes | None = sock.recv(min(max(_MAX_RECV, self.gathering() - len(self.buffer)), BODY_AT_ONCE))
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:  # reset: gone for sure
                data = None
            if data:
                self.buffer += data
                self.received += len(data)
                self.arrived.unpark_all()
                continue
            self.eof = True
            self.arrived.unpark_all()
            if data is not None and self.server.half_close:  # a clean EOF: perhaps only the end of what it sends
                await self.half_closed()
            self.client_gone()
            return

    def gathering(self) -> int:
        """Bytes of the current request's body the buffer may gather (``Cycle.gathered``, or what the router waits
        for: ``want``; 0 between requests)."""
        cycle = self.cycle
        return self.want if cycle is None else cycle.gathered()

    async def half_closed(self) -> None:
        """The client sent its EOF: if after a whole request, wait until it turns out gone, answering it meanwhile.

        HTTP/1.1 lets a client shut its sending side and read the answer (RFC 9112 9.6; h11
        allows it, hypercorn and nginx take it as an abort); a client that closed its socket for
        good sends the same EOF. What tells them apart is the next byte this side sends: a closed
        socket answers it with a reset. So, if nothing of the answer is out yet, an interim
        ``100 Continue`` goes out at once (every HTTP/1.1 client parses 1xx responses before its
        answer, RFC 9110 15.2), and a private epoll that asks for no event (epoll still reports
        ``EPOLLHUP``/``EPOLLERR``, never the readable EOF) wakes this task when the reset comes:
        the turn is then cancelled as before, within a round trip. A half-closed client is
        answered, and the connection closed after the answer. A request that came with the EOF
        is waited for until it is served; an EOF on HTTP/1.0 (no 1xx may be sent to it), before
        a whole request, or with nothing left to serve, returns at once: the client is gone.
        """
        cycle = self.cycle
        while cycle is None:  # the request that came with the EOF is not served yet
            if not self.buffer.strip():
                return
            await self.serving.park()  # until the server starts it (or stops serving, which cancels this task)
            cycle = self.cycle
        if not cycle.whole() or cycle.request.http_version != "1.1" or _EPOLL is None:
            return  # (no epoll, not Linux: an EOF is a hang-up, as it always was there)
        with _EPOLL() as watch:
            watch.register(self.sock.fileno(), 0)
            if not self.state.response_started and self.write_lock.value:
                await self.write(CONTINUE)
            try:
                await trio.lowlevel.wait_readable(watch.fileno())
            finally:
                trio.lowlevel.notify_closing(watch.fileno())

    def client_gone(self) -> None:
        """The client is gone: the request being served (past its body) is told so, and cancelled if it asked to be."""
        self.gone = True
        self.arrived.unpark_all()  # a receive waiting for the disconnect
        cycle = self.cycle
        if cycle is not None and cycle.body_given:
            cycle.hung_up()

    async def wait_for_bytes(self) -> None:
        """Until more bytes (or the EOF) arrive."""
        if len(self.buffer) > MAX_PIPELINED:
            self.room.unpark_all()
        await self.arrived.park()

    async def next_request(self) -> h1.RequestHead | None:
        """The next request's head; ``None`` when the connection should close.

        A client that sends no whole head within the keep-alive timeout is dropped: the
        server's sweeper marks the connection ``timed_out`` and wakes it (no timer per
        request; a head that arrived first is still served).
        """
        try:
            while True:
                request = h1.parse_request(self.buffer) if self.buffer else None
                if request is not None:
                    self.idle_since, self.timed_out = None, False
                    self.room.unpark_all()
                    return request
                if self.eof:
                    if self.buffer.strip():  # a head cut short
                        raise h1.ProtocolError("incomplete request head")
                    return None
                if self.timed_out:
                    return None
                if self.idle_since is None:
                    self.idle_since = trio.current_time()
                await self.wait_for_bytes()
        except h1.ProtocolError as error:
            self.idle_since = None
            await self.write(h1.error_response(error.status_hint, Date.now()))
            return None

    async def write(self, data: bytes) -> None:
        """Send ``data``: at once when the socket takes it all, else waiting until it is writable again.

        A write that goes through at once takes no scheduling round (the task waits for
        something right after: the next request, the next token), except one in
        ``_WRITES_PER_ROUND``, so that a sender that never waits still lets others run.
        Waiting while the client does not read is the backpressure: the kernel holds at most
        its socket buffer, never the proxy.
        """
        if self.closed or not data:
            await trio.lowlevel.checkpoint()  # an app sending into a closed connection still lets others run
            return
        await trio.lowlevel.checkpoint_if_cancelled()
        lock = self.write_lock
        if not lock.value:  # another write waits for the socket: this one goes after it
            async with lock:
                if not self.closed:
                    await self._send(data, 0)
            return
        try:
            sent = sent_now(self.sock, [data])
        except OSError:  # the client is gone (a reset, a broken pipe)
            self.closed = True
            return
        if sent == len(data):  # the common case: no lock taken, no scheduling round
            self.writes += 1
            if self.writes >= _WRITES_PER_ROUND:
                self.writes = 0
                await trio.lowlevel.cancel_shielded_checkpoint()
            return
        lock.acquire_nowait()  # free: nothing was awaited since it was found free
        try:
            await self._send(data, sent)
        finally:
            lock.release()

    def write_now(self, data: bytes) -> Awaitable[None] | None:
        """Send ``data`` at once if the socket takes it all (``None``); else the awaitable that sends the rest.

        A write of any task, in no cancel scope of the connection's: it is not counted
        against ``_WRITES_PER_ROUND`` (its task waits for its own next thing right after).
        Unlike :meth:`write`, a connection that is closed (the client gone, or a write cut
        short) raises :class:`trio.BrokenResourceError`: the writing task is not the
        request's, and nothing else would tell it.
        """
        if self.closed:
            raise trio.BrokenResourceError("the client is gone")
        if self.write_lock.value:
            try:
                sent = self.sock.send(data)  # (``sent_now`` without its list: one frame, one call)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:  # the client is gone (a reset, a broken pipe)
                self.closed = True
                raise trio.BrokenResourceError("the client is gone") from None
            if sent == len(data):
                return None
            self.write_lock.acquire_nowait()  # now: no other write may come between the two parts
            return self._write_rest(data, sent)
        return self.write(data)  # after the write that waits for the socket

    async def _write_rest(self, data: bytes, sent: int) -> None:
        """The rest of a write :meth:`write_now` began (it holds the write lock for it)."""
        try:
            await self._send(data, sent)
        finally:
            self.write_lock.release()

    async def acknowledged(self) -> bool:
        """Whether every byte written so far reached the client: the peer acknowledged it (Linux's ``SIOCOUTQ``:
        the bytes of the send queue not yet acknowledged; on a Unix socket, not yet read), waited for up to
        ``--send-timeout``. ``False`` once the connection is closed, or when the client took nothing more for that
        long: then it counts as gone, as a write that stalled (:meth:`_send`). A socket whose queue cannot be
        measured answers ``True`` while open.

        A write returns once the kernel has the bytes: a reply that fits in the buffers is "sent" whether or not
        the client ever takes it. A drain asks this before it deletes what it sent.
        """
        stall = self.server.limits.send_stall
        deadline = trio.current_time() + (stall if stall is not None else math.inf)
        pause = _ACK_FIRST_WAIT
        while not self.closed:
            try:
                queued = struct.unpack("i", fcntl.ioctl(self.sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
            except (OSError, ValueError):  # (not measurable here, or the socket closed meanwhile)
                return not self.closed
            if not queued:
                return True
            now = trio.current_time()
            if now >= deadline:
                self._stalled(f"acknowledged none of the last {queued} bytes of its reply")
                return False
            # No readiness event says "acknowledged": the queue is looked at again, less often as it waits.
            await trio.sleep(min(pause, deadline - now))
            pause = min(pause * 2, _ACK_LONGEST_WAIT)
        return False

    async def _send(self, data: bytes, sent: int) -> None:
        """Send ``data[sent:]``, waiting for the socket as needed (the caller holds the write lock)."""
        self.writes = 0
        try:
            await send_rest(self.sock, [memoryview(data)], sent, self.server.limits.send_stall)
        except OSError:  # the client is gone (a reset, a broken pipe)
            self.closed = True
        except trio.TooSlowError:  # it took no byte for --send-timeout seconds: as gone
            self._stalled("took no byte of its reply")
        except BaseException:  # cancelled while the socket was full: nothing after it can be framed
            self.closed = True
            raise

    def _stalled(self, what: str) -> None:
        """The client ``what`` for ``--send-timeout`` seconds: it counts as gone, as if it had hung up."""
        log.info("a client %s for %g s: its connection is closed as if it had hung up", what,
                 self.server.limits.send_stall)
        self.closed = True
        self.client_gone()


#: Seconds a reply's wait for its client's acknowledgement (:meth:`ServerConnection.acknowledged`) first looks
#: again, doubling up to the longest.
_ACK_FIRST_WAIT = 0.001
_ACK_LONGEST_WAIT = 0.1
#: Clients reuse connections between requests (agents between turns); an idle one is closed after this many seconds.
KEEP_ALIVE = 75.0
#: Rollouts open hundreds of connections at once; a small listen backlog would reset them.
BACKLOG = 4096


class HTTPServer:
    """Serves ``app`` on one listening socket until told to stop (``tracker``: counts its requests in flight).

    ``half_close``: a client's EOF after a whole request may be a half-close, answered
    (:meth:`ServerConnection.half_closed`); ``False``: an EOF is a hang-up, as uvicorn (and
    the engines it serves) take it.
    """

    def __init__(self, app: ASGIApp, *, policy: ServerPolicy, keep_alive_timeout: float = KEEP_ALIVE,
                 router: Router | None = None, tracker: Tracker | None = None, half_close: bool = True) -> None:
        self.app = app
        self.half_close = half_close
        self.keep_alive_timeout = keep_alive_timeout
        self.policy = policy
        self.limits = policy.limits
        self.router = router
        self.tracker = tracker
        self._nursery: trio.Nursery | None = None
        self.connections: set[ServerConnection] = set()
        self.open = 0  # connections accepted (or adopted) and not closed yet
        self.released = trio.lowlevel.ParkingLot()  # tasks waiting for a connection to close

    async def serve(
        self,
        host: str,
        port: int,
        *,
        backlog: int = BACKLOG,
        shutdown_trigger: Callable[[], Awaitable[None]],
        task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED,
        sock: trio.socket.SocketType | None = None,
    ) -> None:
        """Listen on ``host:port`` (its URL goes to ``task_status``); stop when ``shutdown_trigger`` returns.

        ``sock``: a socket already bound (a shared port, a Unix socket) to listen on instead.
        Stopping drops every connection at once, idle or not: what should finish was drained before.
        """
        if sock is None:
            listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        else:
            listener = socket.socket(fileno=sock.detach())  # served with our own accept loop
        try:
            if sock is None:
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                listener.bind((host, port))  # once, at start: a host name's lookup may block the loop here
            listener.setblocking(False)
            listener.listen(backlog)
            bound = listener.getsockname()
            if listener.family == socket.AF_UNIX:
                url = f"unix:{bound}"
            else:
                url = (f"http://[{bound[0]}]:{bound[1]}" if listener.family == socket.AF_INET6
                       else f"http://{bound[0]}:{bound[1]}")
                log.info("Running on %s (CTRL + C to quit)", url)
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._accept, listener, nursery)
                nursery.start_soon(self._sweep)
                task_status.started(url)
                await shutdown_trigger()
                nursery.cancel_scope.cancel()
        finally:
            trio.lowlevel.notify_closing(listener)
            listener.close()

    def adopt(self, sock: trio.socket.SocketType, data: bytes) -> None:
        """Serve a connection accepted elsewhere (handed over by another process), ``data`` already read from it."""
        if self._nursery is None:
            raise RuntimeError("the server is not serving")
        self._nursery.start_soon(self.serve_connection, socket.socket(fileno=sock.detach()), data)

    async def _accept(self, listener: socket.socket, nursery: trio.Nursery) -> None:
        """Accept connections for as long as the server runs, each served in a task of its own."""

        def take(sock: socket.socket) -> None:
            probe_only = self.admit()
            if probe_only is None:  # past the headroom too: closed at once
                sock.close()
                return
            connection = self.connection(sock, b"", probe_only)
            if connection is not None:
                connection.read_arrived()
                nursery.start_soon(self.serve_one, connection)

        await self.accept_from(listener, take)

    async def accept_from(self, listener: socket.socket, take: Callable[[socket.socket], None]) -> NoReturn:
        """Hand ``take`` every connection ``listener`` accepts, all those waiting in one pass of the loop.

        Out of descriptors (or memory), the failure is logged (rate-limited), the connection idle
        the longest is closed, and accepting waits until a connection closes or a while passes.
        """
        while True:
            await trio.lowlevel.wait_readable(listener)
            while True:
                try:
                    sock, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    break
                except OSError as error:
                    if error.errno in _ACCEPT_SKIP:
                        continue
                    if error.errno not in _ACCEPT_CAPACITY:
                        raise
                    self.policy.accept_failed(trio.current_time(), os.strerror(error.errno or 0))
                    self.close_idle()
                    with trio.move_on_after(0.1):  # until a connection closes, or a while
                        await self.released.park()
                    break
                take(sock)

    def admit(self) -> bool | None:
        """Whether a new connection is served (``False``), only for a health probe (``True``) or closed (``None``).

        Under ``max_connections`` it is served; at the bound the longest-idle connection is
        closed to make room; with none idle, the headroom takes it for a probe only.
        """
        bound = self.limits.max_connections
        if bound is None or self.open < bound or self.close_idle():
            return False
        return True if self.open < bound + self.policy.headroom else None

    def close_idle(self) -> bool:
        """Close the connection idle the longest (waiting for a request); whether there was one."""
        idle = [c for c in self.connections if c.idle_since is not None and not c.timed_out]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.idle_since or 0.0)
        oldest.timed_out = True
        oldest.arrived.unpark_all()
        return True

    async def _sweep(self) -> None:
        """Drop the connections idle for ``keep_alive_timeout``: one task asleep until the next one is due."""
        timeout = self.keep_alive_timeout
        while True:
            now = trio.current_time()
            wake = now + timeout  # a connection idle from now on is due no earlier
            for connection in self.connections:
                since = connection.idle_since
                if since is None:
                    continue
                if since + timeout <= now:
                    connection.timed_out = True
                    connection.arrived.unpark_all()
                else:
                    wake = min(wake, since + timeout)
            await trio.sleep_until(wake)

    async def serve_connection(self, sock: socket.socket, data: bytes = b"") -> None:
        """Serve the requests of one accepted connection (``data``: read from it already) until it ends; the
        socket is closed after."""
        connection = self.connection(sock, data)
        if connection is not None:
            await self.serve_one(connection)

    def connection(self, sock: socket.socket, data: bytes, probe_only: bool = False) -> ServerConnection | None:
        """A connection just accepted, counted at once (``probe_only``: taken past the bound, see :meth:`admit`).

        Counted and known as idle before its task runs: a burst of accepts sees every
        connection it took, and can close the longest-idle ones to make room.
        """
        try:
            sock.setblocking(False)
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if hasattr(socket, "TCP_NOTSENT_LOWAT"):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, _NOTSENT_LOWAT)
            connection = ServerConnection(self, sock, data)
        except OSError:  # gone before it could be served
            sock.close()
            return None
        connection.probe_only = probe_only
        if not data:
            connection.idle_since = trio.current_time()
        self.connections.add(connection)
        self.open += 1
        return connection

    async def serve_one(self, connection: ServerConnection) -> None:
        """Serve ``connection`` until it ends (made by :meth:`connection`)."""
        try:
            await connection.run()
        except Exception:  # a fault while serving one connection ends that connection, never the server
            log.exception("a connection from %s failed; it is closed", connection.client)
        finally:
            self.open -= 1


def _address(name: Any) -> tuple[str, int] | None:
    return (str(name[0]), int(name[1])) if isinstance(name, tuple) and len(name) >= 2 else None
