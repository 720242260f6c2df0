"""One request on a connection of its own, sent in the task that makes it (:class:`OneShot`).

A pause asks hundreds of generations to stop at once, each abort a call of its own
(SGLang's ``/abort_request`` takes one id): opened and written without a scheduling
round, they reach the server in the round that asks for them.
"""

from __future__ import annotations

import errno
import os
import socket

import attrs
import trio

from .errors import ProtocolError, TransportError
from .h1 import MAX_RESPONSE_HEAD, head_end, parse_response, request_head
from .sockets import received, send_rest, sent_now

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

    def post(self, path: str, body: bytes, timeout: float) -> OneShot:
        """``POST path`` with a JSON ``body``, on a connection of its own, sent now (see :class:`OneShot`)."""
        head = request_head("POST", self.prefix + path, self.fixed, body,
                            {"content-type": "application/json", "connection": "close"})
        return OneShot(self.family, self.address, bytes(head) + body, timeout)


class OneShot:
    """One request on a connection of its own, sent as it is made; :meth:`status` reads the answer's status.

    The connection is opened and the request written without a scheduling round: on
    loopback a connect completes within its system call, so a pause's aborts reach the
    server in the round that asks for them, not one round (tens of milliseconds, with a
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
        self._out = self._out[sent_now(self._sock, [self._out]):]  # none yet: still connecting, or the socket is full

    async def status(self) -> int | None:
        """The answer's status; ``None`` if the server could not be reached or did not answer in time."""
        sock = self._sock
        try:
            if self._failed:
                await trio.lowlevel.checkpoint()
                return None
            with trio.move_on_after(self._timeout):
                await send_rest(sock, [self._out], 0)  # (a failed connect fails the send)
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
            data = await received(sock, _READ_SIZE)
            if not data:  # the server closed: an answer whose body runs to the end is whole
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
