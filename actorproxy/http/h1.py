"""HTTP/1.1 on the wire, sans-IO, for both roles: heads in and out, body framing in and out.

The server reads request heads (:func:`parse_request`) and writes responses
(:class:`ResponseFraming`); the client writes request heads (:func:`request_head`) and
reads response heads (:func:`parse_response`). Both read bodies with the one
:class:`BodyDecoder` (``Content-Length``, chunked, or until the connection ends), check
header lines with the one field pattern, and take framing from the headers with the same
rules. Failures are :class:`~.errors.ProtocolError` saying what was wrong, never a hang:
every buffer has a limit.

Why not h11: it is general and careful, and that costs about 190 Python calls and 80 µs
per request on the server (an event object per step, a state machine per side, headers
normalised and validated three times over) and ~536 calls per streamed turn on the
client, most of them re-checking states an exchange never leaves. Here a request head
is one ``find``, one ``split`` and one regex pass over its header lines.

It is as strict as h11 on what it accepts (RFC 9112), and stricter where leniency would
let two readers disagree about where a message ends: a request line of exactly three parts
with a token method, a visible-ASCII target and ``HTTP/1.1`` or ``HTTP/1.0``; a status line
``HTTP/1.x NNN reason``; a ``Host`` on HTTP/1.1 requests; header names that are tokens and
values without control characters; a ``Content-Length`` of digits (repeats must agree);
``Transfer-Encoding`` only ``chunked``. Where the roles differ RFC 9112 lets them: a server
refuses obsolete line folding and ``Transfer-Encoding`` together with ``Content-Length``
(400), a client reads a fold as a space and lets chunked win (the connection is then not
reused). Head lines may end in CRLF or a bare LF, as h11 allows; chunk data ends in CRLF.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from http import HTTPStatus

from .errors import ProtocolError as ProtocolError  # (re-exported: the codec's one error)

#: Largest request head (request line and headers) a server accepts (431 past it); h11's default too.
MAX_REQUEST_HEAD = 16 * 1024
#: Largest response head a client accepts.
MAX_RESPONSE_HEAD = 64 * 1024
#: Largest chunk-size line of a chunked body (with its extensions), and largest trailer section.
MAX_CHUNK_LINE = 1024
MAX_TRAILERS = 64 * 1024

_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_TOKEN_STR = re.compile(_TOKEN.pattern.decode("ascii"))  # the same token, for a head given as text
_TARGET = re.compile(rb"[\x21-\x7e]+")
_BAD_TARGET_STR = re.compile(r"[\x00-\x20\x7f]")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_BAD_VALUE_STR = re.compile(_BAD_VALUE.pattern.decode("ascii"))
#: One header line (without its LF): a token name, a colon, a value without control characters (HTAB allowed),
#: optional whitespace around the value, an optional CR. Anchored at each line's start (``re.M``).
_FIELD = re.compile(rb"^([-!#$%&'*+.^_`|~0-9A-Za-z]+):[ \t]*([^\x00-\x08\x0a-\x1f\x7f]*)\r?$", re.M)
_STATUS = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: ([^\x00-\x08\x0a-\x1f\x7f]*))?")
#: The blank line that ends a head, from the LF before it: the first match ends where ``\r?\n\r?\n``'s would (that
#: pattern, starting with an optional byte, has the regex engine try a match at every byte: 6x the instructions).
_BLANK_LINE = re.compile(rb"\n\r?\n")
#: A ``200`` answer's head whose every line is well formed and ends ``\r\n`` (:func:`whole_ok`).
_OK_HEAD = re.compile(rb"HTTP/1\.1 200(?: [^\x00-\x08\x0a-\x1f\x7f]*)?\r\n"
                      rb"(?:[-!#$%&'*+.^_`|~0-9A-Za-z]+:[^\x00-\x08\x0a-\x1f\x7f]*\r\n)*\r\n")
_OK_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*([0-9]{1,15})[ \t]*\r\n")
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\r\n]{0,%d})?\r?\n" % MAX_CHUNK_LINE)
_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
_STATUS_LINES = {status: b"HTTP/1.1 %d %s\r\n" % (status, reason) for status, reason in _REASONS.items()}
#: Methods that are tokens (``_TOKEN``), so a request line naming one needs no regex for it.
_METHODS = frozenset((b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"PATCH"))


# -- heads in -------------------------------------------------------------------------------------------------------


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


def head_end(buf: bytearray) -> int:
    """Where the head at the start of ``buf`` ends (after its blank line); -1 if it has not ended yet."""
    m = _BLANK_LINE.search(buf)
    return -1 if m is None else m.end()


def parse_request(buffer: bytearray) -> RequestHead | None:
    """The request head at the start of ``buffer``, removed from it; ``None`` while it is incomplete (server role)."""
    if buffer and buffer[0] < 14:  # (a letter, nearly always: no slices compared)
        while buffer[:2] == b"\r\n" or buffer[:1] == b"\n":  # empty lines before a request line are ignored
            del buffer[: 2 if buffer[:1] == b"\r" else 1]
    end = buffer.find(b"\n\r\n")
    # Only where it would come first (not through a long body after the head); past the limit it is too large anyway.
    bare = buffer.find(b"\n\n", 0, end + 1 if end >= 0 else MAX_REQUEST_HEAD + 2)
    if bare >= 0 and (end < 0 or bare < end):
        end, skip = bare, 2
    else:
        skip = 3
    if end < 0:
        if len(buffer) > MAX_REQUEST_HEAD:
            raise ProtocolError("request head too large", 431)
        return None
    if end > MAX_REQUEST_HEAD:
        raise ProtocolError("request head too large", 431)
    head = bytes(buffer[:end])
    del buffer[: end + skip]
    request_line, _, block = head.partition(b"\n")
    parts = request_line.removesuffix(b"\r").split(b" ")
    if len(parts) != 3:
        raise ProtocolError("malformed request line")
    method, target, version = parts
    if method not in _METHODS and not _TOKEN.fullmatch(method) or not _TARGET.fullmatch(target):
        raise ProtocolError("malformed request line")
    if version == b"HTTP/1.1":
        http_version = "1.1"
    elif version == b"HTTP/1.0":
        http_version = "1.0"
    else:
        raise ProtocolError("unsupported HTTP version")
    request = RequestHead(method, target, http_version, fields(block, fold=False) if block else [])
    _request_framing(request)
    return request


def fields(block: bytes, *, fold: bool) -> list[tuple[bytes, bytes]]:
    """The header lines of a head (names lower-cased, values trimmed); ``fold``: read obs-fold as a space.

    Every line must be a field (one regex pass for all of them): a line that is not (a name
    that is no token, a control character in a value, a fold where none is read) leaves the
    count short.
    """
    found = _FIELD.findall(block)
    if len(found) == block.count(b"\n") + 1:
        return [(name.lower(), value.rstrip(b" \t")) for name, value in found]
    if not fold:
        raise ProtocolError("malformed header line")
    out: list[tuple[bytes, bytes]] = []
    for line in block.split(b"\n"):
        line = line.removesuffix(b"\r")
        if line[:1] in (b" ", b"\t") and out:  # obs-fold: RFC 9112 §5.2 has a recipient read it as a space
            value = line.strip(b" \t")
            if _BAD_VALUE.search(value):
                raise ProtocolError(f"malformed header line {line[:100]!r}")
            name, before = out[-1]
            out[-1] = (name, before + b" " + value)
            continue
        m = _FIELD.fullmatch(line)
        if m is None:
            raise ProtocolError(f"malformed header line {line[:100]!r}")
        out.append((m[1].lower(), m[2].rstrip(b" \t")))
    return out


def _tokens(value: bytes) -> set[bytes]:
    """A comma-separated header value's tokens, lower-cased."""
    return {part.strip(b" \t").lower() for part in value.split(b",")}


def _codings(values: list[bytes]) -> list[bytes]:
    """The transfer codings of ``Transfer-Encoding`` values; only ``chunked`` alone is accepted."""
    if values == [b"chunked"]:  # (the one value sent, nearly always)
        return values
    codings = [c for value in values for part in value.split(b",") if (c := part.strip(b" \t").lower())]
    if codings != [b"chunked"]:
        raise ProtocolError(f"unsupported Transfer-Encoding {b', '.join(values)[:100]!r}")
    return codings


def _content_length(values: list[bytes]) -> int:
    """The body length ``Content-Length`` values give: all copies equal, digits only."""
    if len(values) == 1 and values[0].isdigit() and len(values[0]) <= 18:  # one plain number, nearly always
        return int(values[0])
    lengths = {part.strip(b" \t") for value in values for part in value.split(b",")}
    length = lengths.pop() if len(lengths) == 1 else b""
    if not length.isdigit() or len(length) > 18:
        raise ProtocolError(f"bad Content-Length {b', '.join(values)[:100]!r}")
    return int(length)


def _request_framing(request: RequestHead) -> None:
    """Body framing, keep-alive and ``Expect`` of a request from its headers."""
    lengths: list[bytes] = []
    encodings: list[bytes] = []
    hosts = 0
    for name, value in request.headers:
        if name == b"content-length":
            lengths.append(value)
        elif name == b"transfer-encoding":
            encodings.append(value)
        elif name == b"host":
            hosts += 1
        elif name == b"connection":
            tokens = _tokens(value)
            if b"close" in tokens:
                request.keep_alive = False
            elif b"keep-alive" in tokens and request.http_version == "1.0":
                request.keep_alive = True
        elif name == b"expect" and value.lower() == b"100-continue" and request.http_version == "1.1":
            request.expect_continue = True
    if request.http_version == "1.1" and hosts != 1:
        raise ProtocolError("an HTTP/1.1 request needs one Host header")
    if encodings:
        _codings(encodings)
        if lengths:
            raise ProtocolError("both Transfer-Encoding and Content-Length")
        request.chunked = True
    elif lengths:
        request.length = _content_length(lengths)


def whole_ok(buf: bytearray) -> int:
    """The length of the plain ``200`` answer that starts ``buf``, its body whole; 0 when it is not one (or not
    whole yet): read it with :func:`parse_response`.

    Plain: ``HTTP/1.1``, every header line well formed (as :func:`parse_response` reads them, without obs-fold)
    and ended by ``\r\n``, one ``Content-Length`` and neither ``Connection`` nor ``Transfer-Encoding``: the
    connection stays open and the body is that length, with nothing more to parse. A pause reads a thousand
    abort answers of this shape (``http/oneshot.py``), and their whole parse was ~14 % of its work.
    """
    m = _OK_HEAD.match(buf)
    if m is None:
        return 0
    end = m.end()
    head = bytes(buf[:end]).lower()
    if b"\r\nconnection:" in head or b"\r\ntransfer-encoding:" in head:
        return 0
    length = _OK_LENGTH.findall(head)
    if len(length) != 1 or head.count(b"\r\ncontent-length:") != 1:
        return 0
    whole = end + int(length[0])
    return whole if len(buf) >= whole else 0


def parse_response(buf: bytearray, end: int, method: str) -> tuple[int, str, dict[str, str], BodyDecoder | None]:
    """Status, reason, headers (lower-case names, repeats joined by ``, ``) and body framing of the response head
    that ends at ``end`` (:func:`head_end`; removed from ``buf``); no framing for a 1xx answer (read the next head).

    Client role: ``method`` is the request's (a ``HEAD`` response has no body).
    """
    head = bytes(buf[:end]).rstrip(b"\r\n")
    del buf[:end]
    status_line, _, block = head.partition(b"\n")
    m = _STATUS.fullmatch(status_line.removesuffix(b"\r"))
    if m is None:
        raise ProtocolError(f"not an HTTP/1.x status line: {status_line[:100]!r}")
    status, reason = int(m[2]), (m[3] or b"").decode("latin-1").strip()
    headers: dict[str, str] = {}
    for name, value in fields(block, fold=True) if block else ():
        key, text = name.decode("ascii"), value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    if status < 200:
        if status < 100:
            raise ProtocolError(f"status {status} is not a status code")
        if status == 101:
            raise ProtocolError("the server switched protocols (101)")
        return status, reason, headers, None
    return status, reason, headers, _response_framing(status, method, headers, http10=m[1] == b"0")


def _response_framing(status: int, method: str, headers: Mapping[str, str], *, http10: bool) -> BodyDecoder:
    """The framing RFC 9112 §6.3 gives a response (1xx answers are handled by the caller)."""
    connection = headers.get("connection")
    keep_alive = not http10 and (connection is None or b"close" not in _tokens(connection.encode("latin-1")))
    if method == "HEAD" or status in (204, 304):
        return BodyDecoder(keep_alive=keep_alive, length=0)
    coding = headers.get("transfer-encoding")
    if coding is not None:
        _codings([coding.encode("latin-1")])
        # With Content-Length too, chunked wins and the connection must not be reused.
        return BodyDecoder(keep_alive=keep_alive and "content-length" not in headers, chunked=True)
    length = headers.get("content-length")
    if length is None:
        return BodyDecoder(keep_alive=False)
    return BodyDecoder(keep_alive=keep_alive, length=_content_length([length.encode("latin-1")]))


# -- bodies in ------------------------------------------------------------------------------------------------------


class BodyDecoder:
    """One message body's framing: moves its bytes out of the connection's buffer, de-chunked (both roles).

    ``length``: a ``Content-Length`` body; ``chunked``; neither: until the connection ends
    (a response only). ``remaining``: bytes of a sized body not read yet.
    """

    __slots__ = ("done", "keep_alive", "chunked", "remaining", "_state")

    def __init__(self, *, keep_alive: bool, length: int | None = None, chunked: bool = False) -> None:
        self.done = length == 0
        self.keep_alive = keep_alive and (chunked or length is not None)
        self.chunked = chunked
        self.remaining = length if length is not None else -1  # -1: until the connection ends
        self._state = _SIZE

    @classmethod
    def of_request(cls, request: RequestHead) -> BodyDecoder:
        """A request's body (server role)."""
        if request.chunked:
            return cls(keep_alive=request.keep_alive, chunked=True)
        return cls(keep_alive=request.keep_alive, length=request.length)

    def read(self, buffer: bytearray) -> bytes | None:
        """The body bytes ``buffer`` holds (taken out of it); ``None``: nothing yet, read more.

        Once the body has ended ``done`` is set (the returned bytes may be empty). A sized
        body's bytes are copied once (:meth:`decode` into a bytearray would copy twice).
        """
        if not self.chunked and self.remaining >= 0:
            if not buffer:
                return None
            take = min(self.remaining, len(buffer))
            data = take_bytes(buffer, take)
            self.remaining -= take
            self.done = self.remaining == 0
            return data
        out = bytearray()
        self.decode(buffer, out)
        if not out and not self.done:
            return None
        return bytes(out)

    def decode(self, buf: bytearray, out: bytearray) -> None:
        """Append to ``out`` the body bytes at the start of ``buf`` and remove them (and framing) from it."""
        if self.done:
            return
        if self.chunked:
            if self._state == _SIZE:  # (between chunks, nearly always)
                pos = whole_chunks(buf, 0, out)
                if pos == len(buf):  # every chunk was whole (a streamed event): nothing left to look at
                    if pos:
                        buf.clear()
                    return
            else:
                pos = 0
            self._dechunk(buf, out, pos)
            return
        left, n = self.remaining, len(buf)
        if left < 0 or n <= left:
            out += buf
            del buf[:]
            if left > 0:
                self.remaining = left - n
                self.done = n == left
            return
        out += buf[:left]
        del buf[:left]
        self.remaining = 0
        self.done = True

    def lone_chunk(self, view: memoryview) -> tuple[int, int] | None:
        """Where the data of the chunk ``view`` holds lies in it, when ``view`` is exactly one whole chunk (not
        the last) that starts the body's next; ``None`` otherwise. Taking them is the caller's (nothing changes:
        the next chunk's size line is what comes next either way)."""
        if self._state != _SIZE or not self.chunked or self.done:
            return None
        m = _CHUNK_LINE.match(view)
        if m is None:
            return None
        start = m.end()
        stop = start + int(m[1], 16)
        if stop == start or stop + 2 != len(view) or view[stop] != 13 or view[stop + 1] != 10:
            return None
        return start, stop

    def decode_view(self, view: memoryview, out: bytearray) -> int:
        """Append to ``out`` the body bytes at the start of ``view`` (an arrival where it was received, not
        copied to the connection's buffer first); how many bytes of ``view`` that used.

        Whole chunks, a chunk's part, a sized body's bytes: each copied once. A chunked body
        is walked through its states by position, and the walk stops where judgment is needed:
        a chunk line cut short or malformed (``_SIZE``), a chunk's CRLF cut short or wrong
        (``_CRLF``), the trailers (``_TRAILERS``, past the last chunk's line). That is for
        :meth:`decode`, from the connection's buffer, to judge: nothing here raises. It is the
        chunked decoder's one walk: :meth:`decode` runs it over a view of its buffer too.
        """
        if self.done:
            return 0
        n = len(view)
        if not self.chunked:
            left = self.remaining
            if left < 0 or n <= left:
                out += view
                if left > 0:
                    self.remaining = left - n
                    self.done = n == left
                return n
            out += view[:left]
            self.remaining = 0
            self.done = True
            return left
        pos = 0
        while True:
            state = self._state
            if state == _SIZE:
                pos = whole_chunks(view, pos, out)
                if pos == n:
                    return n
                m = _CHUNK_LINE.match(view, pos)
                if m is None:
                    return pos
                size, pos = int(m[1], 16), m.end()
                if size == 0:
                    self._state = _TRAILERS
                    return pos
                self.remaining, self._state = size, _DATA  # (a whole one whole_chunks refused: its CRLF is judged)
            elif state == _DATA:
                left = self.remaining
                if n - pos < left:
                    out += view[pos:] if pos else view
                    self.remaining = left - (n - pos)
                    return n
                out += view[pos : pos + left]
                pos += left
                self._state = _CRLF
            elif state == _CRLF:
                if n - pos < 2 or view[pos] != 13 or view[pos + 1] != 10:
                    return pos
                pos += 2
                self._state = _SIZE
            else:
                return pos

    def eof(self) -> None:
        """The connection ended: the body's end if it runs until then, else an error."""
        if self.done:
            return
        if self.remaining >= 0 or self.chunked:
            raise ProtocolError("the connection closed before the body ended (truncated)")
        self.done = True

    def _dechunk(self, buf: bytearray, out: bytearray, pos: int) -> None:
        # The walk (:meth:`decode_view`) from ``pos``, where :meth:`decode` left off (the whole chunks before it are
        # copied out already), over a view of the buffer released before it is resized; then a judgment of where
        # it stopped; then one removal of what it used (several events in one read: one removal, not one each).
        with memoryview(buf) as view:
            pos += self.decode_view(view[pos:] if pos else view, out)
        try:
            state, n = self._state, len(buf)
            if state == _SIZE:
                if n - pos > MAX_CHUNK_LINE or buf.find(b"\n", pos) >= 0:
                    raise ProtocolError(f"bad chunk size line {bytes(buf[pos : pos + 40])!r}")
            elif state == _CRLF:
                if n - pos >= 2 or n > pos and buf[pos] != 13:
                    raise ProtocolError("chunk data is not followed by CRLF (a wrong chunk size)")
            elif state == _TRAILERS:
                del buf[:pos]
                pos = 0
                self._trailers(buf)
        finally:
            if pos:
                del buf[:pos]

    def _trailers(self, buf: bytearray) -> None:
        if buf.startswith(b"\r\n") or buf.startswith(b"\n"):
            del buf[: 1 if buf[0] == 10 else 2]
            self.done = True
            return
        if len(buf) < 2:
            return
        end = head_end(buf)
        if end < 0:
            if len(buf) > MAX_TRAILERS:
                raise ProtocolError(f"the trailers are larger than {MAX_TRAILERS // 1024} KiB")
            return
        del buf[:end]
        self.done = True


_SIZE, _DATA, _CRLF, _TRAILERS = range(4)


def whole_chunks(buf: bytearray | memoryview, pos: int, out: bytearray) -> int:
    """Copy to ``out`` the whole non-empty chunks from ``pos`` on; where the first that is not (all) here begins.

    ``BodyDecoder.decode``'s common case, in a tight loop (several events read at once);
    anything else (a chunk cut short, the last chunk, a bad line) is left to it, from the returned position.
    """
    match, n = _CHUNK_LINE.match, len(buf)
    view: memoryview | None = None
    try:
        while pos < n and (m := match(buf, pos)) is not None:
            start = m.end()
            stop = start + int(m[1], 16)
            if stop == start or n < stop + 2 or buf[stop] != 13 or buf[stop + 1] != 10:
                break
            if view is None:
                if stop + 2 == n:  # the read holds this one chunk (a streamed event): a view that goes at once
                    # (A view received where it lies is sliced itself: a view of it would be one more to make.)
                    out += buf[start:stop] if type(buf) is memoryview else memoryview(buf)[start:stop]
                    return n
                # Several chunks (a whole reply read at once): one view for them all (~1,300 instructions a
                # memoryview), released before the buffer may be resized.
                view = memoryview(buf)
            out += view[start:stop]
            pos = stop + 2
        return pos
    finally:
        if view is not None:
            view.release()


def take_bytes(buffer: bytearray, n: int) -> bytes:
    """The first ``n`` bytes of ``buffer``, taken out of it (copied once: a slice of a bytearray copies twice)."""
    if n == len(buffer):
        data = bytes(buffer)
        buffer.clear()
        return data
    with memoryview(buffer) as view:
        data = bytes(view[:n])
    del buffer[:n]
    return data


# -- heads and bodies out -------------------------------------------------------------------------------------------


def request_head(
    method: str, target: str, fixed: bytes, body: bytes | None, headers: Mapping[str, str] | None
) -> bytearray:
    """A request's head: ``fixed`` (host and the like), ``content-length``, ``headers``; ``ValueError`` if unsafe."""
    if not _TOKEN_STR.fullmatch(method) or _BAD_TARGET_STR.search(target):
        raise ValueError(f"invalid request line {method!r} {target!r}")
    out = bytearray(f"{method} {target} HTTP/1.1\r\n".encode())
    out += fixed
    if body is not None:
        out += b"content-length: %d\r\n" % len(body)
    if headers:
        for name, value in headers.items():
            if not _TOKEN_STR.fullmatch(name) or _BAD_VALUE_STR.search(value):
                raise ValueError(f"invalid header {name!r}: {value[:100]!r}")
            out += f"{name}: {value}\r\n".encode("latin-1")
    out += b"\r\n"
    return out


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    return b"HTTP/1.1 %d Unknown\r\n" % status if line is None else line


def error_response(status: int, date: bytes) -> bytes:
    """A bodiless error reply that closes the connection."""
    return status_line(status) + b"content-length: 0\r\nconnection: close\r\ndate: " + date + b"\r\n\r\n"


#: The interim answer to ``Expect: 100-continue`` (and to a client that only half-closed: see the server).
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
#: An interim answer while the response is being worked on (RFC 2518's ``102 Processing``; RFC 9110 15.2:
#: a client must parse and skip a 1xx it does not expect). Sent only to clients known to (see the turn lane).
PROCESSING = b"HTTP/1.1 102 Processing\r\n\r\n"


class ResponseFraming:
    """How a response's body goes out: its head, then each piece, then its end (server role)."""

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
        lines = b"".join([name + b": " + value + b"\r\n" for name, value in headers])
        if lines.count(b"\n") != len(headers) or lines.count(b"\r") != len(headers):  # one CRLF per field
            raise ValueError("a response header holds a line break")
        out = [status_line(status), lines]
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
