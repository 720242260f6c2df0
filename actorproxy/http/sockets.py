"""Socket I/O on Trio, written once for the server, the client pool and one-shot connections.

:func:`sent_now` and :func:`send_rest` are every send: what a non-blocking socket takes at
once, then the rest as the socket becomes writable (no copy of the parts); :func:`received`
reads what is there, or waits for it (the pool's reads, below, share one buffer instead). The rest of the
module is the client's: one pooled connection, its reads and sends, and their timeouts.

Reads go to the socket itself, not through Trio's stream wrappers: a non-blocking
``recv_into`` first, into the client's one receive buffer (no fresh allocation per
read), and a wait only when nothing has arrived. A read that finds its bytes waiting
costs no scheduling round, but two in a row yield once, so a server that streams
without pause cannot starve the other tasks. After a read that took less than the
buffer (the socket is drained: a streamed event, one at a time), the next read waits
first: one ``recv`` per arrival, not a failed one before every wait. TLS connections go through the
``trio.SSLStream`` instead.

A read waits at most ``read_timeout``. Rather than a cancel scope per read (which
costs more than the read itself at thousands of streamed tokens a second), the
waiting connections are listed in :class:`ReadDeadlines` with the tick of its clock
they began waiting at (no clock read per wait), and one sleeping task, ticking every
quarter of the timeout (at most every second), closes those that waited the whole
timeout (at most two ticks late); the closed read then fails with :class:`ReadTimeout`.

A reader that takes many small arrivals in a row (a relayed token stream) may park on the
run's :class:`RelayHub` instead of waiting for each: its socket joins an ``epoll`` of the
hub's own once (edge-triggered, not re-armed per arrival), and one hub task, woken when
any of those sockets is readable, receives each one's bytes and calls the reader's callback
with them, in the hub's task: no wait, wake-up or ``epoll_ctl`` per arrival. Bytes that find
the connection's buffer empty (the common arrival) are not copied into it: the callback reads
them where the hub received them (``ClientConnection.fresh``), and only what it leaves is
copied, once it returns (an SGLang cumulative event is hundreds of KB; each copy costs about
an instruction a byte). The reader is woken once the callback says so, or the read fails (an error, the
end of file, its deadline, the connection closed); its cancellation takes the socket out
of the hub at once (synchronously), so the hub never reads for a reader that left. A task step
of the hub reads at most ``HUB_ARRIVALS`` sockets, then lets the other tasks run: a decoding
step of a thousand streams arrives at once, and read in one step it held a pause's request
back for tens of milliseconds.
"""

from __future__ import annotations

import math
import select
import socket
from collections.abc import Callable, Sequence
from functools import partial

import outcome
import trio

from .errors import ReadTimeout, TransportError
from .state import ConnectionState

_READ_SIZE = 256 * 1024
#: The relay hub's one receive buffer (one a run): an SGLang cumulative event repeats the whole reply (~560 KB at
#: 16,000 tokens, ~1.1 MB at 32,000); one that has arrived whole is received whole, and read where it lies.
_HUB_READ_SIZE = 2 * 1024 * 1024
#: The arrivals the relay hub reads in one task step, at most (~2 ms of a step's tokens): a thousand streams' step
#: read in one task step held every other task back for tens of milliseconds (a pause's request among them).
HUB_ARRIVALS = 64
_CLOSED = (trio.BrokenResourceError, trio.ClosedResourceError, OSError, ValueError)


class ClientConnection:
    """One keep-alive connection to a server: its stream, raw socket, unparsed bytes and protocol ``state``."""

    __slots__ = ("stream", "raw", "sock", "buf", "fresh", "state", "idle_since", "reused", "eager", "drained",
                 "expired", "hub")

    def __init__(self, stream: trio.abc.Stream, raw: trio.SocketStream) -> None:
        self.stream = stream
        self.raw = raw
        # The socket itself, read without Trio's wrappers (plain TCP only; TLS goes through the stream).
        sock = getattr(raw.socket, "_sock", None) if stream is raw else None
        self.sock: socket.socket | None = sock if isinstance(sock, socket.socket) else None
        self.buf = bytearray()  # bytes received and not parsed yet
        #: An arrival left where the hub received it (``buf`` was empty), for its callback to read; what is
        #: left of it goes to ``buf`` when the callback returns.
        self.fresh: memoryview | None = None
        self.state = ConnectionState()  # where the exchange under way stands (``.state``): reusable when it ended
        self.idle_since = 0.0
        self.reused = False  # has served a request before (so the server may have closed it meanwhile)
        self.eager = False  # the last read found its bytes waiting (the next such read yields)
        self.drained = False  # the last read took less than the buffer: the next one waits first
        self.expired = False  # closed by ReadDeadlines
        self.hub: RelayHub | None = None  # the hub reading it for a parked reader

    def close(self) -> None:
        # Synchronous and immediate: no await, so it is safe in any cleanup path. Trio's
        # close wakes a task waiting on the socket (with ClosedResourceError); a reader
        # parked on the hub is woken by the hub, the socket out of its epoll first.
        if self.hub is not None:
            self.hub.closing(self)
        self.raw.socket.close()

    def stale(self) -> bool:
        """An idle connection the server has closed (or wrote to unasked) is readable.

        Asked of the raw socket through ``poll`` (plain and TLS alike: a TLS stream's bytes are the raw
        socket's too). Not ``select``: ``select`` refuses a descriptor past 1024 (``ValueError``), and a
        proxy serving hundreds of streams holds such descriptors; each of its idle engine connections
        would count as closed, and every turn would open a connection of its own. Not a ``MSG_PEEK``
        receive either: the quiet case raised ``BlockingIOError``, 3.4 µs against poll's 0.5.
        """
        try:
            poller = select.poll()
            poller.register(self.raw.socket.fileno(), select.POLLIN)
            return bool(poller.poll(0))  # readable: bytes nobody asked for, the end of file, or an error
        except (OSError, ValueError):  # (closed: no descriptor)
            return True


class ReadDeadlines:
    """The connections waiting for bytes, with the tick they began at; one task closes the late ones.

    The task ticks every ``period`` (a quarter of the timeout, at most a second) while
    any connection waits; a connection that has waited the timeout (at most two ticks
    more) is closed.
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.period = min(1.0, timeout / 4)
        #: Ticks a wait may span: one more than the timeout holds, as a wait may begin just before a tick.
        self.ticks = math.ceil(timeout / self.period) + 1 if self.period > 0 else 1
        self._tick = 0
        self._waiting: dict[ClientConnection, int] = {}
        self._watching = False

    def arm(self, conn: ClientConnection) -> None:
        self._waiting[conn] = self._tick
        if not self._watching:
            self._watching = True
            trio.lowlevel.spawn_system_task(self._watch, name="actorproxy.http read deadlines")

    def disarm(self, conn: ClientConnection) -> None:
        self._waiting.pop(conn, None)

    async def _watch(self) -> None:
        try:
            while self._waiting:
                await trio.sleep(self.period)
                self._tick += 1
                oldest = self._tick - self.ticks
                for conn in [c for c, began in self._waiting.items() if began <= oldest]:
                    del self._waiting[conn]
                    conn.expired = True
                    conn.close()
        finally:
            self._watching = False


#: Where a parked reader's wake-up is handed, to be called later (:meth:`RelayHub.park`).
WakeLater = Callable[[Callable[[], None]], None]


class _Parked:
    """A reader parked on the hub: its task, connection, deadlines and callback."""

    __slots__ = ("task", "conn", "fd", "deadlines", "arrived", "woken")

    def __init__(self, task: trio.lowlevel.Task, conn: ClientConnection, fd: int, deadlines: ReadDeadlines,
                 arrived: Callable[[], bool | WakeLater]) -> None:
        self.task = task
        self.conn = conn
        self.fd = fd
        self.deadlines = deadlines
        self.arrived = arrived
        self.woken = False


class RelayHub:
    """The run's readers parked while their connections are read for them (see the module).

    One per Trio run (:func:`relay_hub`); its task is a system task, started with the hub.
    """

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._parked: dict[int, _Parked] = {}
        self._recv = bytearray(_HUB_READ_SIZE)
        self._view = memoryview(self._recv)
        trio.lowlevel.spawn_system_task(self._serve, name="actorproxy.http relay hub")

    @property
    def parked(self) -> int:
        """Readers parked now."""
        return len(self._parked)

    async def park(self, conn: ClientConnection, deadlines: ReadDeadlines, arrived: Callable[[], bool | WakeLater]
                   ) -> bool:
        """Wait while the hub reads ``conn``: each arrival's bytes go to ``conn.buf`` (or lie in ``conn.fresh``
        while ``conn.buf`` is empty) and ``arrived()`` is called, in the hub's task; it returns ``True`` to wait
        on. Returns once it returned ``False`` (or the connection left the hub: :meth:`release`), or once the
        wake-up it handed on was called when it returned where to hand it (a :data:`WakeLater`: the connection
        leaves the hub at once, its reader wakes when told, with ``False``); raises as
        :meth:`SocketIO.fill` does when the read fails (the error, the read deadline, the connection closed).
        ``True`` at the end of file (nothing received: read it with :meth:`SocketIO.fill`). ``conn.sock``
        must be a plain socket.
        """
        sock = conn.sock
        assert sock is not None and conn.hub is None
        fd = sock.fileno()
        reader = _Parked(trio.lowlevel.current_task(), conn, fd, deadlines, arrived)
        try:
            self._epoll.register(fd, select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET)
        except OSError as exc:  # (closed meanwhile)
            await trio.lowlevel.checkpoint()
            raise TransportError(f"the server dropped the connection: {exc!r}") from exc
        self._parked[fd] = reader
        conn.hub = self
        deadlines.arm(conn)

        def abort(_: object) -> trio.lowlevel.Abort:
            reader.woken = True  # (Trio wakes it, with the cancellation)
            self._leave(reader)  # cancelled: out of the hub now, before anything else runs
            return trio.lowlevel.Abort.SUCCEEDED

        try:
            return bool(await trio.lowlevel.wait_task_rescheduled(abort))
        finally:
            self._leave(reader)

    def _reader_of(self, conn: ClientConnection) -> _Parked | None:
        """The reader parked on ``conn``, if any."""
        reader = self._parked.get(conn.sock.fileno()) if conn.sock is not None else None
        return reader if reader is not None and reader.conn is conn else None

    def release(self, conn: ClientConnection) -> None:
        """Take ``conn`` out of the hub (its parked reader is woken once the callback under way returns)."""
        reader = self._reader_of(conn)
        if reader is not None:
            self._leave(reader)

    def closing(self, conn: ClientConnection) -> None:
        """``conn`` is being closed (cut, or by its read deadline): its reader wakes with the failed read."""
        reader = self._reader_of(conn)
        if reader is None:
            conn.hub = None
            return
        failure: TransportError = (ReadTimeout(f"no data from the server in {reader.deadlines.timeout:g} s")
                                   if conn.expired else TransportError("the connection was closed"))
        self._wake(reader, outcome.Error(failure))

    def _leave(self, reader: _Parked) -> None:
        """Out of the epoll and the deadlines (synchronous; once only)."""
        if self._parked.get(reader.fd) is reader:
            del self._parked[reader.fd]
            reader.conn.hub = None
            reader.deadlines.disarm(reader.conn)
            try:
                self._epoll.unregister(reader.fd)
            except (OSError, ValueError):  # (the socket was closed already: gone from the epoll with it)
                pass

    def _wake(self, reader: _Parked, result: outcome.Outcome[bool]) -> None:
        self._leave(reader)
        if not reader.woken:
            reader.woken = True
            trio.lowlevel.reschedule(reader.task, result)

    async def _serve(self) -> None:
        epoll, parked, view = self._epoll, self._parked, self._view
        try:
            while True:
                await trio.lowlevel.wait_readable(epoll.fileno())
                while True:
                    ready = epoll.poll(0, HUB_ARRIVALS)
                    for fd, events in ready:
                        reader = parked.get(fd)
                        if reader is not None:
                            self._arrival(reader, view, events & _ENDED)
                    if len(ready) < HUB_ARRIVALS:
                        break
                    # More are ready (the epoll keeps them): the other tasks run first, a pause's request among
                    # them, not after a thousand streams' tokens.
                    await trio.lowlevel.checkpoint()
        finally:
            for reader in list(parked.values()):
                self._wake(reader, outcome.Error(TransportError("the relay hub stopped")))
            epoll.close()

    def _arrival(self, reader: _Parked, view: memoryview, ended: int) -> None:
        """A socket became readable: its bytes received, then the reader's callback (its reader woken when done).

        Edge-triggered: the socket is read until a read takes less than the buffer (drained), so
        no arrival waits for another to be seen; the hub's epoll is not readable again until
        something new arrives (level-triggered, every poll would make it readable once more:
        a second, empty wake-up of the hub per arrival). ``ended``: the poll said the peer shut
        down or the socket failed (``_ENDED``): then it is read on to the end of file or the error,
        which came with the last bytes and would make no edge of its own.
        """
        conn = reader.conn
        sock = conn.sock
        assert sock is not None
        parked = self._parked
        while True:
            try:
                n = sock.recv_into(view)
            except BlockingIOError:
                return
            except OSError as exc:
                self._wake(reader, outcome.Error(TransportError(f"the server dropped the connection: {exc!r}")))
                return
            if not n:  # the end of file: the reader's next read finds it
                conn.drained = False
                self._wake(reader, outcome.Value(True))
                return
            conn.drained = n < _HUB_READ_SIZE
            if conn.buf:
                conn.buf += view[:n]
            else:  # read where it lies (the callback de-chunks it once, into its reader's buffer)
                conn.fresh = view[:n]
            reader.deadlines.arm(conn)  # (the wait for the next arrival begins)
            try:
                more = reader.arrived()
            except BaseException as exc:  # (a fault of the callback is the reader's, raised in its task)
                self._wake(reader, outcome.Error(exc))
                return
            finally:
                if conn.fresh is not None:  # (what the callback left: before the buffer is received into again)
                    conn.buf += conn.fresh
                    conn.fresh = None
            if more is not True or parked.get(reader.fd) is not reader:  # (or it left the hub meanwhile)
                if isinstance(more, bool):
                    self._wake(reader, outcome.Value(False))
                else:  # woken when told; out of the hub now (if the body's end did not take it out already)
                    self._leave(reader)
                    more(partial(self._wake, reader, outcome.Value(False)))
                return
            if conn.drained and not ended:
                return


#: What a poll of the hub's epoll reports when no more bytes will come: the peer shut down, or the socket failed.
_ENDED = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR if hasattr(select, "epoll") else 0

_HUB: trio.lowlevel.RunVar[RelayHub | None] = trio.lowlevel.RunVar("actorproxy.http relay hub", default=None)


def relay_hub() -> RelayHub | None:
    """This Trio run's :class:`RelayHub`, started at its first use; ``None`` without ``epoll`` (not Linux)."""
    hub = _HUB.get()
    if hub is None and hasattr(select, "epoll"):
        hub = RelayHub()
        _HUB.set(hub)
    return hub


class SocketIO:
    """Reads and sends for the connections of one client (they share its receive buffer)."""

    def __init__(self, read_timeout: float) -> None:
        self.read_timeout = read_timeout
        self._deadlines = ReadDeadlines(read_timeout)
        self._recv = bytearray(_READ_SIZE)
        self._view = memoryview(self._recv)

    async def fill(self, conn: ClientConnection) -> int:
        """Read what the server sent into ``conn.buf``: the number of bytes, 0 at its end."""
        sock = conn.sock
        if sock is None:
            return await self._fill_stream(conn)
        if not conn.drained:  # (after a read that took less than the buffer, a recv now would find nothing)
            try:
                n = sock.recv_into(self._recv)
            except BlockingIOError:
                pass
            except OSError as exc:
                raise TransportError(f"the server dropped the connection: {exc!r}") from exc
            else:
                conn.drained = n < _READ_SIZE
                conn.buf += self._view[:n]  # before any await: another task may read into the buffer then
                if conn.eager:  # two reads in a row without waiting: let the other tasks run
                    conn.eager = False
                    await trio.lowlevel.checkpoint()
                else:
                    conn.eager = True
                    await trio.lowlevel.checkpoint_if_cancelled()
                return n
        # The wait, in this coroutine (one a streamed token, with the recv after it).
        conn.eager = False
        deadlines = self._deadlines
        deadlines.arm(conn)
        try:
            while True:
                try:
                    await trio.lowlevel.wait_readable(sock)
                    n = sock.recv_into(self._recv)
                except BlockingIOError:
                    continue
                except _CLOSED as exc:
                    if conn.expired:
                        raise ReadTimeout(f"no data from the server in {self.read_timeout:g} s") from None
                    raise TransportError(f"the server dropped the connection: {exc!r}") from exc
                conn.drained = n < _READ_SIZE
                conn.buf += self._view[:n]
                return n
        finally:
            deadlines.disarm(conn)

    async def park(self, hub: RelayHub, conn: ClientConnection, arrived: Callable[[], bool | WakeLater]) -> bool:
        """Wait for ``conn``'s arrivals on ``hub`` (see :meth:`RelayHub.park`), within this client's read timeout."""
        return await hub.park(conn, self._deadlines, arrived)

    async def _fill_stream(self, conn: ClientConnection) -> int:
        with trio.move_on_after(self.read_timeout) as scope:
            try:
                data = await conn.stream.receive_some(_READ_SIZE)
            except _CLOSED as exc:
                raise TransportError(f"the server dropped the connection: {exc!r}") from exc
        if scope.cancelled_caught:
            raise ReadTimeout(f"no data from the server in {self.read_timeout:g} s")
        conn.buf += data
        return len(data)

    async def send(self, conn: ClientConnection, head: bytearray, body: bytes) -> None:
        """Head and body, in one system call when the socket takes them (no copy of the body)."""
        sock = conn.sock
        sent = 0
        if sock is not None:
            try:
                sent = sent_now(sock, [head, body])
            except OSError as exc:
                raise TransportError(f"send failed: {exc!r}") from exc
            if sent == len(head) + len(body):
                await trio.lowlevel.checkpoint_if_cancelled()
                return
        with trio.move_on_after(self.read_timeout) as scope:
            try:
                if sock is None:
                    await conn.stream.send_all(memoryview(bytes(head) + body)[sent:])
                else:  # the rest as it goes, without a copy of the body (a long prompt: hundreds of KB)
                    await send_rest(sock, [memoryview(head), memoryview(body)], sent)
            except _CLOSED as exc:
                raise TransportError(f"send failed: {exc!r}") from exc
        if scope.cancelled_caught:
            raise ReadTimeout(f"the server took no data in {self.read_timeout:g} s")


def sent_now(sock: socket.socket, parts: Sequence[bytes | bytearray | memoryview]) -> int:
    """Bytes of ``parts`` a non-blocking socket takes at once (one system call; 0 when it is full or connecting).

    Any other failure is the ``OSError`` itself (the peer is gone).
    """
    try:
        return sock.sendmsg(parts)
    except (BlockingIOError, InterruptedError):
        return 0


async def received(sock: socket.socket, size: int) -> bytes:
    """Up to ``size`` bytes the socket holds, waiting for some when none are there; ``b""`` at the peer's end."""
    while True:
        try:
            return sock.recv(size)
        except (BlockingIOError, InterruptedError):
            await trio.lowlevel.wait_readable(sock)


async def send_rest(sock: socket.socket, parts: list[memoryview], sent: int, stall: float | None = None) -> None:
    """Send ``parts`` after their first ``sent`` bytes, waiting for the socket between sends (no copy).

    ``stall``: seconds the peer may take no byte at all (the socket stays full); then ``trio.TooSlowError``."""
    while True:
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if not parts:
            return
        parts[0] = parts[0][sent:]
        if stall is None:
            await trio.lowlevel.wait_writable(sock)
        else:
            with trio.fail_after(stall):
                await trio.lowlevel.wait_writable(sock)
        sent = sent_now(sock, parts)
