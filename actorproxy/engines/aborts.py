"""Abort calls: coalesced per engine where the engine takes several ids, else each sent at once.

A pause asks every generation in flight to stop, each from its own task. Sent one by
one, a thousand aborts are a thousand HTTP calls to the engine while it streams; an
:class:`AbortBatcher` sends the ones asked in the same round as one call (vLLM takes
a list of ids; SGLang, when allowed, one ``abort_all``). Each caller still gets the
answer for its own request: the acknowledgement stays per request. Where each abort is
a call of its own (SGLang's ``/abort_request`` takes one rid), :class:`OneShot` opens
its connection and sends it in the task that asks, without a scheduling round.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Awaitable, Callable, Collection, Sequence

import attrs
import trio

from ..http.errors import ProtocolError, TransportError
from ..http.h1 import MAX_RESPONSE_HEAD, head_end, parse_response, request_head

_READ_SIZE = 4096


class _Batch:
    def __init__(self) -> None:
        self.ids: list[str] = []
        self.done = trio.Event()
        self.acknowledged: Collection[str] = ()
        self.sent = False  # False once done: the leader was cancelled before the call ended


class AbortBatcher:
    """Coalesce concurrent abort calls; ``send(ids)`` makes the call(s) and returns the ids acknowledged."""

    def __init__(self, send: Callable[[list[str]], Awaitable[Collection[str]]]) -> None:
        self._send = send
        self._open: _Batch | None = None
        self.calls = 0  # abort calls made (statistics, tests)

    async def abort(self, ids: Sequence[str]) -> bool:
        """Abort ``ids`` along with every abort asked in the same round; ``True`` if acknowledged."""
        while True:
            batch = self._open
            if batch is None:
                return await self._lead(ids)
            batch.ids.extend(ids)
            await batch.done.wait()
            if batch.sent:
                return all(i in batch.acknowledged for i in ids)
            # The caller that was sending it was cancelled: send again (and lead, if first).

    async def _lead(self, ids: Sequence[str]) -> bool:
        batch = self._open = _Batch()
        batch.ids.extend(ids)
        try:
            # Every task woken in this round (a pause starts them all at once) joins first.
            await trio.lowlevel.checkpoint()
            self._open = None
            self.calls += 1
            batch.acknowledged = await self._send(batch.ids)
            batch.sent = True
        finally:
            if self._open is batch:
                self._open = None
            batch.done.set()
        return all(i in batch.acknowledged for i in ids)


@attrs.frozen
class Origin:
    """Where :class:`OneShot` requests go: plain HTTP to an IP address (no name to look up, no TLS).

    Made by the engine's client (``HTTP11Client.one_shot_origin``), with the head lines it sends itself.
    """

    family: socket.AddressFamily
    address: tuple[str, int]
    #: The request head's fixed lines (``host`` and the like).
    fixed: bytes
    #: The URL's path prefix (``http://host:port/prefix``).
    prefix: str

    def post(self, path: str, body: bytes, timeout: float) -> OneShot:
        """``POST path`` with a JSON ``body``, on a connection of its own, sent now (see :class:`OneShot`)."""
        head = request_head("POST", self.prefix + path, self.fixed, body,
                            {"content-type": "application/json", "connection": "close"})
        return OneShot(self.family, self.address, bytes(head) + body, timeout)


class OneShot:
    """One request on a connection of its own, sent as it is made; :meth:`status` reads the answer's status.

    The connection is opened and the request written without a scheduling round: on
    loopback a connect completes within its system call, so a pause's aborts reach the
    engine in the round that asks for them, not one round (tens of milliseconds, with a
    thousand streams to read) later. Bytes the socket does not take at once (still
    connecting, elsewhere than loopback) are sent by :meth:`status`. Nothing is kept: the
    connection is closed once the answer is read (or the caller leaves).
    """

    def __init__(self, family: socket.AddressFamily, address: tuple[str, int], request: bytes,
                 timeout: float) -> None:
        self._timeout = timeout
        self._out = memoryview(request)
        self._failed = False
        self._sock = sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            error = sock.connect_ex(address)
            if error not in (0, errno.EINPROGRESS):
                raise OSError(error, os.strerror(error))
            self._send()
        except OSError:
            self._failed = True

    def _send(self) -> None:
        try:
            self._out = self._out[self._sock.send(self._out):]
        except (BlockingIOError, InterruptedError):
            pass  # still connecting, or the socket is full: sent when it is writable

    async def status(self) -> int | None:
        """The answer's status; ``None`` if the engine could not be reached or did not answer in time."""
        sock = self._sock
        try:
            if self._failed:
                await trio.lowlevel.checkpoint()
                return None
            with trio.move_on_after(self._timeout):
                while self._out:
                    await trio.lowlevel.wait_writable(sock)
                    error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if error:
                        return None
                    self._send()
                return await self._read()
            return None
        except (OSError, TransportError):
            return None
        finally:
            self.close()

    def close(self) -> None:
        """Close the connection (the request, if sent, stays sent)."""
        if self._sock.fileno() >= 0:
            trio.lowlevel.notify_closing(self._sock)
            self._sock.close()

    async def _read(self) -> int | None:
        sock, buf, body = self._sock, bytearray(), bytearray()
        status, framing = 0, None
        while True:
            try:
                data = sock.recv(_READ_SIZE)
            except (BlockingIOError, InterruptedError):
                await trio.lowlevel.wait_readable(sock)
                continue
            if not data:  # the engine closed: an answer whose body runs to the end is whole
                if framing is not None:
                    framing.eof()
                    return status
                return None
            buf += data
            while framing is None:  # the head (after any 1xx answers)
                end = head_end(buf)
                if end < 0:
                    if len(buf) > MAX_RESPONSE_HEAD:
                        raise ProtocolError(f"the response head is larger than {MAX_RESPONSE_HEAD // 1024} KiB")
                    break
                status, _, _, framing = parse_response(buf, end, "POST")
            if framing is not None:
                framing.decode(buf, body)
                body.clear()
                if framing.done:
                    return status
