"""A lean HTTP/1.1 client for engine traffic: a hand-written response reader on Trio, a keep-alive pool.

Why not httpx here: per streamed ``/generate`` httpx + httpcore cost ~1 ms of CPU at one
stream and ~3 ms at 64 (``benchmarks/http_floor.py``). Why not h11 any more: its state
machine cost ~536 Python calls per turn (17% of the proxy's CPU per turn), most of them
re-checking states that an engine's response never leaves. Engine traffic needs little:
one send per request (head and body together), a response head, a body framed by
``Content-Length``, chunked encoding or the connection's end, and for generation streams
server-sent events. :class:`Response` reads the head (:mod:`actorproxy.http.h1`), then
de-chunks the body straight into an :class:`~.sse.SSEParser`'s buffer, which splits it
into events in the same pass (:meth:`Response.receive_events`).

Reads and sends (:mod:`.sockets`) go to the socket itself, without a cancel scope per
read: a read waits at most ``read_timeout``, sends are bounded by the same timeout.

Failures are :class:`~.errors.TransportError` (the engine layer maps them to its own
errors in one table, ``engines/errors.py``): a response that breaks HTTP/1.1 (a bad status line, a bad
chunk size, a truncated body, a head or an event beyond its size limit) is a
:class:`ProtocolError` saying what was wrong. A response not read to its end, or
cancelled anywhere, closes its connection: only a connection whose exchange completed
cleanly goes back to the pool.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from urllib.parse import urlsplit

import trio

from .errors import ConnectError, ConnectTimeout, ProtocolError, ReadTimeout, TransportError
from .h1 import MAX_RESPONSE_HEAD, BodyDecoder, head_end, parse_response, request_head
from .oneshot import Origin
from .sockets import ClientConnection, RelayHub, SocketIO, WakeLater, relay_hub
from .sse import SSEEvent, SSEParser

__all__ = [
    "ConnectError", "ConnectTimeout", "HTTP11Client", "ProtocolError", "ReadTimeout", "Response", "TransportError"
]

#: A server-sent event larger than this is refused (SGLang's cumulative events at 32k tokens are ~2 MiB).
MAX_EVENT = 256 * 1024 * 1024
#: Informational (1xx) answers skipped before the response itself.
_MAX_INFORMATIONAL = 8


class _Unused(Exception):
    """A kept-alive connection the server had closed before answering: retried on a new one."""


class Response:
    """A streamed response: ``status_code``, ``reason_phrase``, ``headers`` (lower-case names).

    Read the body with :meth:`receive` (bytes), :meth:`receive_into` (bytes appended to a
    buffer of the reader's: an engine's stream decoder), :meth:`receive_events` (server-sent
    events), :meth:`aiter_bytes` or :meth:`aread`; then :meth:`aclose`. The connection
    goes back to the pool as soon as the body's end is read.
    """

    __slots__ = ("status_code", "reason_phrase", "headers", "_client", "_conn", "_body", "_sse", "_fault")

    def __init__(
        self, client: HTTP11Client, conn: ClientConnection, status: int, reason: str, headers: dict[str, str],
        body: BodyDecoder,
    ) -> None:
        self.status_code = status
        self.reason_phrase = reason
        self.headers = headers
        self._client = client
        self._conn: ClientConnection | None = conn
        self._body = body
        self._sse: SSEParser | None = None
        self._fault: ProtocolError | None = None  # found after bytes still to deliver
        conn.state.response(body.keep_alive, body.done)
        if body.done:
            self._end()

    async def receive(self) -> bytes | None:
        """The next piece of the body (all that has arrived); ``None`` at its end."""
        out = bytearray()
        await self.receive_into(out)
        return bytes(out) if out else None

    async def receive_events(self) -> list[SSEEvent] | None:
        """The next server-sent events (all that have arrived, at least one); ``None`` at the body's end."""
        sse = self._sse
        if sse is None:
            sse = self._sse = SSEParser()
        while True:
            if not await self.receive_into(sse.buffer):
                return sse.close() or None
            events = sse.split()
            if events:
                return events
            if len(sse.buffer) > MAX_EVENT:
                self._drop()
                raise ProtocolError(f"a server-sent event larger than {MAX_EVENT >> 20} MiB")

    async def receive_into(self, out: bytearray) -> bool:
        """Append the body's bytes that have arrived to ``out``, de-chunked (reading once if none are
        buffered); ``False`` at the body's end (nothing appended)."""
        conn = self._conn
        if conn is None:
            return False
        if self._fault is not None:
            self._drop()
            raise self._raised_fault()
        body = self._body
        before = len(out)
        try:
            while True:
                if conn.buf or body.done:  # (an empty buffer decodes to nothing: a streamed event's read starts here)
                    got = self._decoded(conn, out, before)
                    if got is not None:
                        return got
                if not await self._client._io.fill(conn):
                    body.eof()  # the end of an until-close body, else a ProtocolError
        except BaseException:
            self._drop()
            raise

    def _decoded(self, conn: ClientConnection, out: bytearray, before: int) -> bool | None:
        """``conn.buf`` de-chunked onto ``out``: what :meth:`receive_into` answers, ``None`` when nothing came of it."""
        body = self._body
        try:
            fresh = conn.fresh
            if fresh is not None:  # (conn.buf is empty: the relay hub's arrival, read where it was received)
                conn.fresh = None
                used = body.decode_view(fresh, out)
                if used < len(fresh):
                    conn.buf += fresh[used:]
            if conn.buf or fresh is None:
                body.decode(conn.buf, out)
        except ProtocolError as exc:
            if len(out) == before:
                raise
            # The bytes before the fault first: it is raised at the next read. Kept without its traceback, which
            # holds this frame and so this response: a reference cycle, left for the collector.
            self._fault = exc.with_traceback(None)
            return True
        if body.done:
            conn.state.response_end()
            self._end()
            return len(out) > before
        return True if len(out) > before else None

    def _raised_fault(self) -> ProtocolError:
        """The fault kept, let go of: raised, its traceback holds the reading frame and so this response."""
        fault, self._fault = self._fault, None
        assert fault is not None
        return fault

    def relay_hub(self) -> RelayHub | None:
        """The run's :class:`~.sockets.RelayHub` when this response can be read by it (:meth:`park`), else ``None``."""
        conn = self._conn
        if conn is None or conn.sock is None or self._fault is not None:
            return None
        return relay_hub()

    async def park(self, hub: RelayHub, arrived: Callable[[], bool | WakeLater]) -> bool:
        """Wait while ``hub`` reads the body: ``arrived()`` is called in the hub's task as bytes come (to read them
        with :meth:`received_now`), and returns ``True`` to wait on (or where the wake-up waits: see
        :meth:`RelayHub.park`). Raises what :meth:`receive_into` would of a
        failed read (the connection is then closed); ``True`` when the server closed the connection (read on
        with :meth:`receive_into`: it says what that means)."""
        conn = self._conn
        assert conn is not None
        try:
            return await self._client._io.park(hub, conn, arrived)
        except BaseException:  # (cancelled too: the body is abandoned, as a cancelled read's)
            self._drop()
            raise

    def received_now(self, out: bytearray) -> bool | None:
        """The body's bytes received by the hub, de-chunked onto ``out`` without waiting (see :meth:`park`).

        ``True``: bytes were appended and the body goes on, or a fault follows them (the parked
        reader is then woken: its next read raises it); ``False``: the body ended, nothing appended
        (the reader is woken); ``None``: nothing yet (a part of a chunk), wait on.
        """
        conn = self._conn
        if conn is None:
            return False
        try:
            got = self._decoded(conn, out, len(out))
        except BaseException:
            if conn.hub is not None:
                conn.hub.release(conn)  # (the reader wakes for this failure, not for the close)
            self._drop()
            raise
        if self._fault is not None and conn.hub is not None:
            conn.hub.release(conn)
        return got

    def lying_chunk(self) -> tuple[bytearray, int, int] | None:
        """The body's bytes the hub received, where they lie (``raw[start:stop]``), when they are one whole chunk
        (see :meth:`park`); taken: they are the caller's to read before its callback returns (the hub receives
        into ``raw`` again after). ``None``: read them with :meth:`received_now`."""
        conn = self._conn
        if conn is None or conn.fresh is None or self._fault is not None:
            return None
        fresh = conn.fresh
        span = self._body.lone_chunk(fresh)
        if span is None:
            return None
        conn.fresh = None
        return fresh.obj, *span  # type: ignore[return-value]  # (the view begins the hub's buffer, a bytearray)

    def cut(self) -> None:
        """Close the connection now (a read waiting on it fails); the body is abandoned."""
        self._drop()

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        return _Chunks(self)

    async def aread(self) -> bytes:
        out = bytearray()
        while await self.receive_into(out):
            pass
        return bytes(out)

    @property
    def ended(self) -> bool:
        """Whether the body was read to its end (its connection is back in the pool): closing it cannot wait."""
        return self._conn is None and self._body.done and self._fault is None

    def _end(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            if conn.hub is not None:
                conn.hub.release(conn)  # (its parked reader wakes: the body ended)
            self._client._release(conn)

    def _drop(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    async def aclose(self) -> None:
        """Give the connection back if the body was read to its end, else close it."""
        self._drop()
        await trio.lowlevel.checkpoint()


class _Chunks:
    __slots__ = ("_response",)

    def __init__(self, response: Response) -> None:
        self._response = response

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._response.receive()
        if chunk is None:
            raise StopAsyncIteration
        return chunk


def _ip_family(host: str) -> socket.AddressFamily | None:
    try:
        return socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:
        return None


class HTTP11Client:
    """HTTP/1.1 to one origin (``http://host:port[/prefix]``), with a keep-alive pool.

    ``max_idle``: idle connections kept (the server's concurrency: every running
    generation holds one, and they all come back). There is no cap on connections in
    use: an abort must never queue behind the streams it stops.
    """

    def __init__(
        self,
        base_url: str,
        *,
        max_idle: int = 256,
        keepalive_expiry: float = 4.0,
        connect_timeout: float = 10.0,
        read_timeout: float = 600.0,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self._tls = parts.scheme == "https"
        self._host = parts.hostname
        self._family = _ip_family(parts.hostname)  # an address, not a name: connected without a lookup
        self._port = parts.port or (443 if self._tls else 80)
        self.origin = f"{parts.scheme}://{parts.netloc}"
        #: The URL's path prefix (``http://host:port/prefix``): request paths are under it.
        self.prefix = parts.path.rstrip("/")
        default_port = self._port == (443 if self._tls else 80)
        name = f"[{parts.hostname}]" if self._family == socket.AF_INET6 else parts.hostname
        host = name if default_port else f"{name}:{self._port}"
        self._fixed = f"host: {host}\r\nuser-agent: actorproxy\r\naccept: */*\r\n".encode()
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self._tls else None
        self._idle: deque[ClientConnection] = deque()
        self.max_idle = max_idle
        self.keepalive_expiry = keepalive_expiry
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.opened = 0  # connections opened (statistics, tests)
        self._io = SocketIO(read_timeout)

    async def stream(
        self, method: str, url: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> Response:
        """Send a request; the response once its head arrived (read its body, then ``aclose`` it)."""
        if not url.startswith(self.origin):
            raise ValueError(f"{url!r} is not on {self.origin}")
        target = url[len(self.origin):] or "/"
        try:
            head = request_head(method, target, self._fixed, body, headers)
        except ValueError as exc:
            raise TransportError(f"cannot send this request: {exc}") from exc
        conn = self._checkout()
        if conn is not None:
            try:
                return await self._exchange(conn, method, head, body)
            except _Unused:
                pass  # the server had closed the idle connection: once more on a new one
        return await self._exchange(await self._connect(), method, head, body)

    async def _exchange(self, conn: ClientConnection, method: str, head: bytearray, body: bytes | None) -> Response:
        unanswered = conn.reused  # nothing received yet on a kept connection (see the rule below)
        try:
            conn.state.request(True, True)  # (its body goes with the head, whole)
            try:
                await self._io.send(conn, head, body or b"")
                for _ in range(_MAX_INFORMATIONAL + 1):
                    buf = conn.buf
                    while (end := head_end(buf)) < 0:
                        if len(buf) > MAX_RESPONSE_HEAD:
                            raise ProtocolError(
                                f"the response head is larger than {MAX_RESPONSE_HEAD // 1024} KiB")
                        if not await self._io.fill(conn):
                            raise ProtocolError("the server closed the connection before its response head ended")
                        unanswered = False
                    status, reason, headers, framing = parse_response(buf, end, method)
                    if framing is not None:
                        return Response(self, conn, status, reason, headers, framing)
                raise ProtocolError(f"more than {_MAX_INFORMATIONAL} informational (1xx) responses")
            except TransportError as exc:
                # The one retry rule: nothing received on a kept connection (the server had closed it, or closed
                # or reset it on this request): once more on a new one. A timeout does not retry (the engine may
                # be working on the request).
                if unanswered and not isinstance(exc, ReadTimeout):
                    raise _Unused from exc
                raise
        except BaseException:
            conn.close()
            raise

    def one_shot_origin(self) -> Origin | None:
        """Where requests on connections of their own (:class:`~.oneshot.OneShot`) go, with this client's head.

        ``None`` over TLS or to a host name: a ``OneShot`` connects without a lookup or a handshake.
        """
        if self._tls or self._family is None:
            return None
        return Origin(self._family, (self._host, self._port), self._fixed, self.prefix)

    def _checkout(self) -> ClientConnection | None:
        now = trio.current_time()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: warm, least likely expired
            if now - conn.idle_since < self.keepalive_expiry and not conn.stale():
                return conn
            conn.close()
        return None

    async def _connect(self) -> ClientConnection:
        self.opened += 1
        with trio.move_on_after(self.connect_timeout) as scope:
            try:
                raw = await self._open_tcp()
            except OSError as exc:
                raise ConnectError(f"cannot connect to {self.origin}: {exc}") from exc
        if scope.cancelled_caught:
            raise ConnectTimeout(f"no connection to {self.origin} in {self.connect_timeout:g} s")
        stream: trio.abc.Stream = raw
        if self._ssl is not None:
            tls = trio.SSLStream(raw, self._ssl, server_hostname=self._host, https_compatible=True)
            try:
                with trio.fail_after(self.connect_timeout):
                    await tls.do_handshake()
            except (trio.TooSlowError, trio.BrokenResourceError, OSError) as exc:
                raw.socket.close()
                raise ConnectError(f"TLS handshake with {self.origin} failed: {exc!r}") from exc
            stream = tls
        return ClientConnection(stream, raw)

    async def _open_tcp(self) -> trio.SocketStream:
        """A TCP connection: straight to an address (a pause opens hundreds of abort connections at once,
        and ``trio.open_tcp_stream``'s name lookup and happy-eyeballs nursery cost more than the connect)."""
        if self._family is None:
            return await trio.open_tcp_stream(self._host, self._port)
        sock = trio.socket.socket(self._family, socket.SOCK_STREAM)
        try:
            await sock.connect((self._host, self._port))
        except BaseException:
            sock.close()
            raise
        return trio.SocketStream(sock)

    def _release(self, conn: ClientConnection) -> None:
        """A connection whose response ended: back to the pool if the exchange left it reusable, else closed."""
        if conn.buf or not conn.state.next_cycle():
            conn.close()  # Connection: close, an HTTP/1.0 server, a body to the end, or bytes beyond the response
            return
        conn.reused = True
        conn.idle_since = trio.current_time()
        self._idle.append(conn)
        while len(self._idle) > self.max_idle:
            self._idle.popleft().close()

    @property
    def idle(self) -> int:
        return len(self._idle)

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()
        await trio.lowlevel.checkpoint()

    def __repr__(self) -> str:
        return f"HTTP11Client({self.origin!r}, idle={len(self._idle)})"
