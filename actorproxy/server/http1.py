"""HTTP/1.1 for the server side, sans-IO: request heads and bodies in, response bytes out.

Why not h11 (which the server used until now, and which the simulated engines' hypercorn
still uses): h11 is general and careful, and that costs about 190 Python calls and 80 µs
per request (an event object per step, a state machine per side, headers normalised and
validated three times over), a fifth of what the proxy's whole ingress cost per turn. A
request head here is one ``find``, one ``split`` and a loop over its lines.

It is as strict as h11 on what it accepts (RFC 9112), and stricter where leniency would
let two readers disagree about where a request ends: a request line of exactly three
parts with a token method, a visible-ASCII target and ``HTTP/1.1`` or ``HTTP/1.0``; a
``Host`` on HTTP/1.1; header names that are tokens and values without control
characters; no obsolete line folding; a ``Content-Length`` of digits (repeats must
agree); ``Transfer-Encoding`` only ``chunked``, and never together with
``Content-Length``; heads up to 16 KiB (431 past it). Lines may end in CRLF or a bare LF,
as h11 allowed. Anything else is :class:`BadRequest` with the status to answer (always a
4xx: a request the proxy cannot take is the client's error).
"""

from __future__ import annotations

import re
from http import HTTPStatus

#: Largest request head (request line and headers) accepted; h11's default too.
MAX_HEAD = 16 * 1024
#: Largest chunk-size line of a chunked body (with its extensions).
_MAX_CHUNK_LINE = 1024

_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_TARGET = re.compile(rb"[\x21-\x7e]+")
#: One header line (without its LF): a token name, a colon, a value without control characters (HTAB allowed),
#: optional whitespace around the value, an optional CR. Anchored at each line's start (``re.M``).
_FIELD = re.compile(rb"^([-!#$%&'*+.^_`|~0-9A-Za-z]+):[ \t]*([^\x00-\x08\x0a-\x1f\x7f]*)\r?$", re.M)
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


class BadRequest(Exception):
    """A request that cannot be taken; ``status`` is what to answer (the connection then closes)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class RequestHead:
    """A parsed request head. Header names are lower-cased; values are as sent, trimmed."""

    __slots__ = ("method", "target", "http_version", "headers", "keep_alive", "length", "chunked",
                 "expect_continue")

    def __init__(self, method: bytes, target: bytes, http_version: str, headers: list[tuple[bytes, bytes]]) -> None:
        self.method, self.target, self.http_version, self.headers = method, target, http_version, headers
        self.keep_alive = http_version == "1.1"
        self.length = 0  # the body's length when not chunked
        self.chunked = False
        self.expect_continue = False


def parse_head(buffer: bytearray) -> RequestHead | None:
    """The request head at the start of ``buffer``, removed from it; ``None`` while it is incomplete."""
    while buffer[:2] == b"\r\n" or buffer[:1] == b"\n":  # empty lines before a request line are ignored
        del buffer[: 2 if buffer[:1] == b"\r" else 1]
    end = buffer.find(b"\n\r\n")
    # Only where it would come first (not through a long body after the head); past MAX_HEAD it is too large anyway.
    bare = buffer.find(b"\n\n", 0, end + 1 if end >= 0 else MAX_HEAD + 2)
    if bare >= 0 and (end < 0 or bare < end):
        end, skip = bare, 2
    else:
        skip = 3
    if end < 0:
        if len(buffer) > MAX_HEAD:
            raise BadRequest("request head too large", 431)
        return None
    if end > MAX_HEAD:
        raise BadRequest("request head too large", 431)
    head = bytes(buffer[:end])
    del buffer[: end + skip]
    request_line, _, block = head.partition(b"\n")
    request_line = request_line.removesuffix(b"\r")
    parts = request_line.split(b" ")
    if len(parts) != 3:
        raise BadRequest("malformed request line")
    method, target, version = parts
    if not _TOKEN.fullmatch(method) or not _TARGET.fullmatch(target):
        raise BadRequest("malformed request line")
    if version == b"HTTP/1.1":
        http_version = "1.1"
    elif version == b"HTTP/1.0":
        http_version = "1.0"
    else:
        raise BadRequest("unsupported HTTP version")
    headers: list[tuple[bytes, bytes]] = []
    if block:
        # Every line must be a field (one regex pass for all of them): a line that is not (obsolete line
        # folding, a name that is no token, a control character in a value) leaves the count short.
        fields = _FIELD.findall(block)
        if len(fields) != block.count(b"\n") + 1:
            raise BadRequest("malformed header line")
        headers = [(name.lower(), value.rstrip(b" \t")) for name, value in fields]
    request = RequestHead(method, target, http_version, headers)
    _framing(request)
    return request


def _framing(request: RequestHead) -> None:
    """Body framing, keep-alive and ``Expect`` from the headers."""
    lengths: list[bytes] = []
    encodings: list[bytes] = []
    hosts = 0
    for name, value in request.headers:
        if name == b"content-length":
            lengths.extend(part.strip(b" \t") for part in value.split(b","))
        elif name == b"transfer-encoding":
            encodings.extend(part.strip(b" \t").lower() for part in value.split(b","))
        elif name == b"host":
            hosts += 1
        elif name == b"connection":
            tokens = {part.strip(b" \t").lower() for part in value.split(b",")}
            if b"close" in tokens:
                request.keep_alive = False
            elif b"keep-alive" in tokens and request.http_version == "1.0":
                request.keep_alive = True
        elif name == b"expect" and value.lower() == b"100-continue" and request.http_version == "1.1":
            request.expect_continue = True
    if request.http_version == "1.1" and hosts != 1:
        raise BadRequest("an HTTP/1.1 request needs one Host header")
    if encodings:
        if encodings != [b"chunked"]:
            raise BadRequest("only the chunked transfer coding is accepted")
        if lengths:
            raise BadRequest("both Transfer-Encoding and Content-Length")
        request.chunked = True
    elif lengths:
        if len(set(lengths)) != 1 or not lengths[0].isdigit() or len(lengths[0]) > 18:
            raise BadRequest("bad Content-Length")
        request.length = int(lengths[0])


class BodyReader:
    """Takes a request body out of a buffer as its bytes arrive: Content-Length or chunked."""

    __slots__ = ("remaining", "chunked", "in_chunk", "done", "_trailers")

    def __init__(self, request: RequestHead) -> None:
        self.chunked = request.chunked
        self.remaining = request.length  # of the body, or of the current chunk when chunked
        self.in_chunk = False
        self.done = not request.chunked and request.length == 0
        self._trailers = False

    def read(self, buffer: bytearray) -> bytes | None:
        """The body bytes ``buffer`` holds (taken out of it); ``None``: nothing yet, read more.

        Once the body has ended ``done`` is set (the returned bytes may be empty). A broken
        chunked framing raises :class:`BadRequest`.
        """
        if not self.chunked:
            if not buffer:
                return None
            take = min(self.remaining, len(buffer))
            data = _take(buffer, take)
            self.remaining -= take
            self.done = self.remaining == 0
            return data
        pieces: list[bytes] = []
        while not self.done:
            if self.in_chunk:
                if self.remaining:
                    if not buffer:
                        break
                    take = min(self.remaining, len(buffer))
                    pieces.append(_take(buffer, take))
                    self.remaining -= take
                    continue
                line = _line(buffer)  # the CRLF after the chunk's data
                if line is None:
                    break
                if line:
                    raise BadRequest("chunk data longer than its size")
                self.in_chunk = False
                continue
            line = _line(buffer)
            if line is None:
                break
            if self._trailers:  # after the last chunk: trailer fields, then an empty line
                self.done = not line
                continue
            size = line.partition(b";")[0].strip(b" \t")
            if not _HEX.fullmatch(size):
                raise BadRequest("bad chunk size")
            self.remaining = int(size, 16)
            if self.remaining == 0:
                self._trailers = True
            else:
                self.in_chunk = True
        if not pieces and not self.done:
            return None
        return b"".join(pieces)


def _take(buffer: bytearray, n: int) -> bytes:
    """The first ``n`` bytes of ``buffer``, taken out of it (copied once: a slice of a bytearray copies twice)."""
    if n == len(buffer):
        data = bytes(buffer)
        buffer.clear()
        return data
    with memoryview(buffer) as view:
        data = bytes(view[:n])
    del buffer[:n]
    return data


def _line(buffer: bytearray) -> bytes | None:
    """One line (without its CRLF or LF) taken from ``buffer``; ``None`` while it is incomplete."""
    end = buffer.find(b"\n")
    if end < 0:
        if len(buffer) > _MAX_CHUNK_LINE:
            raise BadRequest("chunk line too long")
        return None
    line = bytes(buffer[:end]).removesuffix(b"\r")
    del buffer[: end + 1]
    if len(line) > _MAX_CHUNK_LINE:
        raise BadRequest("chunk line too long")
    return line


def status_line(status: int) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))


def error_response(status: int, date: bytes) -> bytes:
    """A bodiless error reply that closes the connection."""
    return status_line(status) + b"content-length: 0\r\nconnection: close\r\ndate: " + date + b"\r\n\r\n"


class ResponseFraming:
    """How a response's body goes out: its head, then each piece, then its end."""

    __slots__ = ("chunked", "bodiless", "remaining", "close", "_said_close")

    def __init__(self, request: RequestHead, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.bodiless = request.method == b"HEAD" or status in (204, 304) or status < 200
        self.close = not request.keep_alive
        self._said_close = False  # the app's headers say it already
        length: int | None = None
        for name, value in headers:
            lowered = name.lower()
            if lowered == b"content-length":
                length = int(value)
            elif lowered == b"connection" and b"close" in value.lower():
                self.close = self._said_close = True
        self.chunked = length is None and not self.bodiless and request.http_version == "1.1"
        if length is None and not self.bodiless and not self.chunked:
            self.close = True  # HTTP/1.0 without a length: the body ends with the connection
        self.remaining = length

    def head(self, status: int, headers: list[tuple[bytes, bytes]], date: bytes) -> bytes:
        fields = b"".join([name + b": " + value + b"\r\n" for name, value in headers])
        if fields.count(b"\n") != len(headers) or fields.count(b"\r") != len(headers):  # one CRLF per field
            raise ValueError("a response header holds a line break")
        out = [status_line(status), fields]
        if self.chunked:
            out.append(b"transfer-encoding: chunked\r\n")
        if self.close and not self._said_close:
            out.append(b"connection: close\r\n")
        out.append(b"date: " + date + b"\r\n\r\n")
        return b"".join(out)

    def piece(self, data: bytes) -> bytes:
        if self.bodiless or not data:
            return b""
        if self.chunked:
            return b"%x\r\n%s\r\n" % (len(data), data)
        if self.remaining is not None:
            data = data[: self.remaining]  # never more than announced
            self.remaining -= len(data)
        return data

    def end(self) -> tuple[bytes, bool]:
        """The bytes that end the body, and whether the body is whole (an announced length unmet: not)."""
        if self.chunked:
            return b"0\r\n\r\n", True
        return b"", self.bodiless or not self.remaining
