"""Requests on a connection of their own, sent in the task that makes them (:class:`OneShot`, :class:`Pipeline`).

A pause asks hundreds of generations to stop at once, each abort a call of its own
(SGLang's ``/abort_request`` takes one id): opened and written without a scheduling
round, they reach the server in the round that asks for them. A :class:`Pipeline`
carries several of them on one connection, written together (HTTP/1.1 pipelining: the
server answers them in order), so a thousand aborts need a few connections, not a thousand.
"""

from __future__ import annotations

import errno
import os
import socket

import attrs
import trio

from .errors import ProtocolError, TransportError
from .h1 import MAX_RESPONSE_HEAD, BodyDecoder, head_end, parse_response, request_head, whole_ok
from .sockets import received, sent_now
from .state import SEND_BODY, SERVER, ConnectionState

_READ_SIZE = 4096


@attrs.frozen
class Origin:
    """Where :class:`OneShot` requests go: plain HTTP to an IP address (no name to look up, no TLS).

    Made by the pool's client (``HTTP11Client.one_shot_origin``), with the head lines it sends itself.
    """

    family: socket.AddressFamily
    address: tuple[str, int]
    #: The request head's fixed lines (``host`` and the like).
    fixed: bytes
    #: The URL's path prefix (``http://host:port/prefix``).
    prefix: str
    #: Each ``(path, close)`` asked: its request's head without ``content-length`` and the blank line after,
    #: checked and made once (a pause asks a thousand aborts of one path). As many as the code has paths.
    _heads: dict[tuple[str, bool], bytes] = attrs.field(factory=dict, init=False, eq=False, repr=False)

    def post(self, path: str, body: bytes, timeout: float) -> OneShot:
        """``POST path`` with a JSON ``body``, on a connection of its own, sent now (see :class:`OneShot`)."""
        return OneShot(self, self.request(path, body, close=True), timeout)

    def pipeline(self, timeout: float) -> Pipeline:
        """A connection of its own for several requests (:meth:`request`), opened now (see :class:`Pipeline`)."""
        return Pipeline(self, timeout)

    def request(self, path: str, body: bytes, *, close: bool = False) -> bytes:
        """The bytes of ``POST path`` with a JSON ``body`` (``connection: close`` with ``close``)."""
        head = self._heads.get((path, close))
        if head is None:
            fields = {"content-type": "application/json"}
            if close:
                fields["connection"] = "close"
            head = self._heads[path, close] = bytes(request_head("POST", self.prefix + path, self.fixed, None,
                                                                 fields))[:-2]
        return b"%scontent-length: %d\r\n\r\n%s" % (head, len(body), body)


class Pipeline:
    """Requests on one connection of its own, written back to back; their answers read in order by one reader.

    The connection is opened as the pipeline is made, without a scheduling round (on
    loopback a connect completes within its system call). :meth:`add` queues a request,
    :meth:`flush` writes what is queued in one system call (what the socket does not take
    at once is sent before the answers are read), and :meth:`status` awaits the answer to
    the next request in turn: the server answers pipelined requests in order. Where the
    connection stands is its :class:`~.state.ConnectionState`, the exchange whose answer is
    being read: an answer that says ``connection: close``, the server's end of file, a
    broken answer or the timeout end it, and the requests still unanswered get ``None``.
    Nothing is kept: the reader closes the connection when it is done (:meth:`close`).
    """

    def __init__(self, origin: Origin, timeout: float) -> None:
        self._timeout = timeout
        self._unsent = bytearray()
        self._requests = 0
        self._answers: list[int] = []  # the statuses read, in order
        self.state = ConnectionState()  # the exchange whose answer is read (the requests went out whole before)
        self._buf, self._status = bytearray(), 0  # the answer being read
        self._framing: BodyDecoder | None = None  # its body's (while ``state.server`` is ``SEND_BODY``)
        self._sock = sock = socket.socket(origin.family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            error = sock.connect_ex(origin.address)
            if error not in (0, errno.EINPROGRESS):
                raise OSError(error, os.strerror(error))
        except OSError:
            self.state.fail(SERVER)

    @property
    def requests(self) -> int:
        """Requests added."""
        return self._requests

    @property
    def ended(self) -> bool:
        """No more answers come: the server closed, said it closes, or the connection failed or was closed."""
        state = self.state
        return not state.keep_alive and state.server != SEND_BODY

    def add(self, request: bytes) -> int:
        """Queue ``request`` (sent by :meth:`flush`, or before the answers are read); its index for :meth:`status`."""
        self._unsent += request
        self._requests += 1
        return self._requests - 1

    def flush(self) -> None:
        """Write what is queued, as far as the socket takes it now (none yet: still connecting, or full)."""
        if self._unsent and not self.ended:
            try:
                del self._unsent[:sent_now(self._sock, [self._unsent])]
            except OSError:
                self.state.fail(SERVER)

    async def status(self, index: int) -> int | None:
        """The answer's status to request ``index``; ``None`` if the server could not be reached or did not
        answer it (in time, or before closing). One reader, asking for the requests in order."""
        if index >= len(self._answers) and not self.ended:
            await self._read_until(index)
        if index < len(self._answers):
            return self._answers[index]
        await trio.lowlevel.checkpoint()
        return None

    def close(self) -> None:
        """Close the connection (the requests sent stay sent); the answers not read are ``None``."""
        if not self.ended:
            self.state.fail(SERVER)
        if self._sock.fileno() >= 0:
            trio.lowlevel.notify_closing(self._sock)
            self._sock.close()

    async def _read_until(self, index: int) -> None:
        """Read answers until the one to request ``index`` (or the end), bounded by the timeout."""
        try:
            with trio.move_on_after(self._timeout) as scope:
                while self._unsent:  # (a failed connect fails the send)
                    await trio.lowlevel.wait_writable(self._sock)
                    del self._unsent[:sent_now(self._sock, [self._unsent])]
                while index >= len(self._answers) and not self.ended:
                    await self._read()
            if scope.cancelled_caught:
                self.state.fail(SERVER)
        except (OSError, TransportError):
            self.state.fail(SERVER)

    async def _read(self) -> None:
        """One read's answers (the server closing ends them: an answer whose body runs to the end is whole)."""
        buf, state = self._buf, self.state
        data = await received(self._sock, _READ_SIZE)
        if not data:
            if self._framing is not None:
                self._framing.eof()  # whole if it runs to the end, else a ProtocolError
                self._answer()
            state.closed(SERVER)
            return
        buf += data
        body = bytearray()
        while (buf or self._framing is not None) and not self.ended:
            framing = self._framing
            if framing is None:  # the head (after any 1xx answers)
                whole = whole_ok(buf)
                if whole:  # (the usual answer, an abort's: nothing to parse but its length)
                    del buf[:whole]
                    state.request(True, True)
                    state.response(True)
                    self._status = 200
                    self._answer()
                    continue
                end = head_end(buf)
                if end < 0:
                    if len(buf) > MAX_RESPONSE_HEAD:
                        raise ProtocolError(f"the response head is larger than {MAX_RESPONSE_HEAD // 1024} KiB")
                    return
                self._status, _, _, framing = parse_response(buf, end, "POST")
                if framing is None:
                    continue  # a 1xx answer: the answer itself follows
                state.request(True, True)  # the request this answers went out whole
                state.response(framing.keep_alive)
                self._framing = framing
            framing.decode(buf, body)
            body.clear()
            if not framing.done:
                return
            self._answer()

    def _answer(self) -> None:
        """The answer being read is whole: its status kept, the next exchange begins (unless this one ended it)."""
        self.state.response_end()
        self._answers.append(self._status)
        self._framing = None
        self.state.next_cycle()


class OneShot:
    """One request on a connection of its own, sent as it is made; :meth:`status` reads the answer's status.

    The connection is opened and the request written without a scheduling round: on
    loopback a connect completes within its system call, so a pause's aborts reach the
    server in the round that asks for them, not one round (tens of milliseconds, with a
    thousand streams to read) later. Bytes the socket does not take at once (still
    connecting, elsewhere than loopback) are sent by :meth:`status`. Nothing is kept: the
    connection is closed once the answer is read (or the caller leaves).
    """

    def __init__(self, origin: Origin, request: bytes, timeout: float) -> None:
        self._pipeline = Pipeline(origin, timeout)
        self._pipeline.add(request)
        self._pipeline.flush()

    async def status(self) -> int | None:
        """The answer's status; ``None`` if the server could not be reached or did not answer in time.

        The connection is closed once it returns (or the caller leaves).
        """
        try:
            return await self._pipeline.status(0)
        finally:
            self._pipeline.close()

    def close(self) -> None:
        """Close the connection (the request, if sent, stays sent)."""
        self._pipeline.close()
