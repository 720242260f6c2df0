"""A lean HTTP/1.1 client for engine traffic: h11 over Trio streams, a keep-alive pool per engine.

Why not httpx here: per streamed ``/generate`` httpx + httpcore cost ~1 ms of CPU at one
stream and ~3 ms at 64 (``benchmarks/http_floor.py``; its pool scans every connection on
each request and release), more than the proxy's whole per-turn budget. This client does
only what engine traffic needs: one ``send_all`` per request (headers and body together),
a streamed response body (chunked or ``Content-Length``, framed by h11), per-read and
connect timeouts, and a LIFO pool of idle keep-alive connections bounded by the engine's
concurrency. h11 (already installed as hypercorn's dependency) is a small, well-kept,
sans-IO HTTP/1.1 state machine: it does the parsing and framing we should not hand-write.

Failures are :class:`TransportError` (mapped to :class:`BackendError` by
``errors.mapped_errors``). A response not read to its end, or cancelled anywhere, closes
its connection: only a connection whose exchange completed goes back to the pool.
"""

from __future__ import annotations

import select
import ssl
from collections import deque
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import h11
import trio

_READ_SIZE = 64 * 1024


class TransportError(Exception):
    """The engine could not be reached, dropped the connection, broke HTTP, or timed out."""

    status = 502
    #: Nothing reached the engine (the pool marks it down).
    unreachable = False


class ConnectError(TransportError):
    unreachable = True


class ReadTimeout(TransportError):
    status = 504


class ConnectTimeout(ReadTimeout):
    unreachable = True


class _Connection:
    __slots__ = ("stream", "h11", "idle_since", "raw", "reused")

    def __init__(self, stream: trio.abc.Stream, raw: trio.SocketStream) -> None:
        self.stream = stream
        self.raw = raw
        self.h11 = h11.Connection(h11.CLIENT)
        self.idle_since = 0.0
        self.reused = False  # has served a request before (so the engine may have closed it meanwhile)

    def close(self) -> None:
        # Synchronous and immediate: no await, so it is safe in any cleanup path.
        self.raw.socket.close()

    def stale(self) -> bool:
        """An idle connection the engine has closed (or wrote to unasked) is readable."""
        try:
            readable, _, _ = select.select([self.raw.socket.fileno()], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)


class H11Response:
    """A streamed response: ``status_code``, ``headers``; read with :meth:`aiter_bytes` or :meth:`aread`."""

    def __init__(self, client: H11Client, conn: _Connection, response: h11.Response) -> None:
        self.status_code: int = response.status_code
        self.reason_phrase = response.reason.decode("latin-1", errors="replace")
        self.headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in response.headers}
        self._client = client
        self._conn: _Connection | None = conn
        self._ended = False  # the end of the body was parsed along with its last piece

    async def receive(self) -> bytes | None:
        """The next piece of the body; ``None`` at its end (the connection then goes back to the pool)."""
        conn = self._conn
        if conn is None:
            return None
        if self._ended:
            self._conn = None
            self._client._release(conn)
            return None
        parts: list[bytes] = []  # every piece already read: one answer, however many chunks
        try:
            while True:
                event = conn.h11.next_event()
                if type(event) is h11.Data:
                    parts.append(bytes(event.data))
                    continue
                if event is h11.NEED_DATA:
                    if parts:
                        return b"".join(parts)
                    await self._client._receive(conn)
                    continue
                if type(event) is h11.EndOfMessage:
                    if parts:  # the connection is released at the next call (or closed, if none comes)
                        self._ended = True
                        return b"".join(parts)
                    self._conn = None
                    self._client._release(conn)
                    return None
                raise TransportError(f"unexpected HTTP event {type(event).__name__}")
        except h11.RemoteProtocolError as exc:
            self._drop()
            raise TransportError(f"HTTP protocol error: {exc}") from exc
        except BaseException:
            self._drop()
            raise

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        return _Chunks(self)

    async def aread(self) -> bytes:
        parts = []
        while (chunk := await self.receive()) is not None:
            parts.append(chunk)
        return b"".join(parts)

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

    def __init__(self, response: H11Response) -> None:
        self._response = response

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        chunk = await self._response.receive()
        if chunk is None:
            raise StopAsyncIteration
        return chunk


class H11Client:
    """HTTP/1.1 to one engine origin (``http://host:port[/prefix]``), with a keep-alive pool.

    ``max_idle``: idle connections kept (the engine's concurrency: every running
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
        self._port = parts.port or (443 if self._tls else 80)
        self.origin = f"{parts.scheme}://{parts.netloc}"
        default_port = self._port == (443 if self._tls else 80)
        self._host_header = (parts.hostname if default_port else f"{parts.hostname}:{self._port}").encode()
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self._tls else None
        self._idle: deque[_Connection] = deque()
        self.max_idle = max_idle
        self.keepalive_expiry = keepalive_expiry
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.opened = 0  # connections opened (statistics, tests)

    async def stream(
        self, method: str, url: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> H11Response:
        """Send a request; the response once its head arrived (read its body, then ``aclose`` it)."""
        if not url.startswith(self.origin):
            raise ValueError(f"{url!r} is not on {self.origin}")
        target = url[len(self.origin):] or "/"
        head = [(b"host", self._host_header), (b"user-agent", b"actorproxy"), (b"accept", b"*/*")]
        if body is not None:
            head.append((b"content-length", str(len(body)).encode()))
        if headers:
            head += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        request = h11.Request(method=method, target=target.encode(), headers=head)
        conn = self._checkout()
        if conn is not None:
            try:
                return await self._exchange(conn, request, body)
            except _Unused:
                pass  # the engine had closed the idle connection: once more on a new one
        return await self._exchange(await self._connect(), request, body)

    async def _exchange(self, conn: _Connection, request: h11.Request, body: bytes | None) -> H11Response:
        reused = conn.reused
        try:
            data = conn.h11.send(request) or b""
            if body:
                data += conn.h11.send(h11.Data(data=body)) or b""
            data += conn.h11.send(h11.EndOfMessage()) or b""
            try:
                await conn.stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                if reused:
                    raise _Unused from exc
                raise TransportError(f"send failed: {exc!r}") from exc
            while True:
                event = conn.h11.next_event()
                if event is h11.NEED_DATA:
                    got = await self._receive(conn, reused_unanswered=reused)
                    reused = reused and got == 0
                    continue
                if type(event) is h11.Response:
                    return H11Response(self, conn, event)
                if type(event) is h11.InformationalResponse:
                    continue
                if type(event) is h11.ConnectionClosed and reused:
                    raise _Unused
                raise TransportError(f"unexpected HTTP event {type(event).__name__}")
        except h11.ProtocolError as exc:
            conn.close()
            raise TransportError(f"HTTP protocol error: {exc}") from exc
        except BaseException:
            conn.close()
            raise

    async def _receive(self, conn: _Connection, *, reused_unanswered: bool = False) -> int:
        """Read what the engine sent into the connection's parser (an empty read is its EOF)."""
        with trio.move_on_after(self.read_timeout) as scope:
            try:
                data = await conn.stream.receive_some(_READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                if reused_unanswered:
                    raise _Unused from exc
                raise TransportError(f"the engine dropped the connection: {exc!r}") from exc
        if scope.cancelled_caught:
            raise ReadTimeout(f"no data from the engine in {self.read_timeout:g} s")
        if not data and reused_unanswered:
            raise _Unused
        # b"" is the end: h11 then reports it (or a body cut short as an error)
        conn.h11.receive_data(data if type(data) is bytes else bytes(data))
        return len(data)

    def _checkout(self) -> _Connection | None:
        now = trio.current_time()
        while self._idle:
            conn = self._idle.pop()  # the most recently used: warm, least likely expired
            if now - conn.idle_since < self.keepalive_expiry and not conn.stale():
                return conn
            conn.close()
        return None

    async def _connect(self) -> _Connection:
        self.opened += 1
        with trio.move_on_after(self.connect_timeout) as scope:
            try:
                raw = await trio.open_tcp_stream(self._host, self._port)
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
        return _Connection(stream, raw)

    def _release(self, conn: _Connection) -> None:
        if conn.h11.our_state is not h11.DONE or conn.h11.their_state is not h11.DONE:
            conn.close()  # Connection: close, or an HTTP/1.0 engine
            return
        conn.h11.start_next_cycle()
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
        return f"H11Client({self.origin!r}, idle={len(self._idle)})"


class _Unused(Exception):
    """A kept-alive connection the engine had closed before answering: retried on a new one."""

