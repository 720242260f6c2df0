"""HTTP/1.1 on the wire, sans-IO: the request head we write, the response head and body framing we read.

What :mod:`.http11` needs of RFC 9112 for engine traffic, strictly: a status line
``HTTP/1.x NNN reason``, header lines ``name: value`` (no control bytes; an obs-fold line
continues the value before it, read as a space), a
body framed by ``Transfer-Encoding: chunked`` (the only transfer coding: we never ask for
another), else ``Content-Length`` (all copies equal), else the connection's end (never
reused). ``Connection: close`` or HTTP/1.0 means the connection is not reused. Anything
else is a :class:`ProtocolError` that says what was wrong, not a hang: every buffer has
a limit (chunk size lines, trailers; the head's limit is checked by the reader).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

#: A chunk-size line (size, extensions) or a trailer section longer than this is refused.
MAX_CHUNK_LINE = 4096
MAX_TRAILERS = 64 * 1024
#: A response head (status line and headers) larger than this is refused.
MAX_HEAD = 64 * 1024


class TransportError(Exception):
    """The engine could not be reached, dropped the connection, broke HTTP, or timed out."""

    status = 502
    #: Nothing reached the engine (the pool marks it down).
    unreachable = False


class ProtocolError(TransportError):
    """The engine's response is not well-formed HTTP/1.1 (or exceeds a size limit)."""

    def __init__(self, message: str) -> None:
        super().__init__(f"malformed HTTP response from the engine: {message}")


class ReadTimeout(TransportError):
    status = 504


_BLANK_LINE = re.compile(rb"\r?\n\r?\n")
_LINE_END = re.compile(rb"\r?\n")
_STATUS = re.compile(rb"HTTP/1\.([01]) ([0-9]{3})(?: ([^\x00-\x08\x0a-\x1f\x7f]*))?")
_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\r\n]{0,%d})?\r?\n" % MAX_CHUNK_LINE)
_TOKEN_STR = re.compile(r"[-!#$%&'*+.^_`|~0-9A-Za-z]+")
_BAD_VALUE_STR = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f]")


def request_head(
    method: str, target: str, fixed: bytes, body: bytes | None, headers: Mapping[str, str] | None
) -> bytearray:
    """A request's head: ``fixed`` (host and the like), ``content-length``, ``headers``; ``ValueError`` if unsafe."""
    if not _TOKEN_STR.fullmatch(method) or _BAD_TARGET.search(target):
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


def head_end(buf: bytearray) -> int:
    """Where the head at the start of ``buf`` ends (after its blank line); -1 if it has not ended yet."""
    m = _BLANK_LINE.search(buf)
    return -1 if m is None else m.end()


class BodyDecoder:
    """One response body's framing: moves its bytes out of the connection's buffer, de-chunked."""

    __slots__ = ("done", "keep_alive", "_chunked", "_left", "_state")

    def __init__(self, *, keep_alive: bool, length: int | None = None, chunked: bool = False) -> None:
        self.done = length == 0
        self.keep_alive = keep_alive and (chunked or length is not None)
        self._chunked = chunked
        self._left = length if length is not None else -1  # -1: until the connection ends
        self._state = _SIZE

    @classmethod
    def of(cls, status: int, method: str, headers: Mapping[str, str], *, http10: bool) -> BodyDecoder:
        """The framing RFC 9112 §6.3 gives a response (1xx answers are handled by the caller)."""
        connection = {t.strip().lower() for t in headers.get("connection", "").split(",")}
        keep_alive = not http10 and "close" not in connection
        if method == "HEAD" or status in (204, 304):
            return cls(keep_alive=keep_alive, length=0)
        coding = headers.get("transfer-encoding")
        if coding is not None:
            if [c.strip().lower() for c in coding.split(",") if c.strip()] != ["chunked"]:
                raise ProtocolError(f"unsupported Transfer-Encoding {coding[:100]!r}")
            # With Content-Length too, chunked wins and the connection must not be reused.
            return cls(keep_alive=keep_alive and "content-length" not in headers, chunked=True)
        length = headers.get("content-length")
        if length is None:
            return cls(keep_alive=False)
        values = {v.strip() for v in length.split(",")}
        value = values.pop() if len(values) == 1 else ""
        if not (value.isascii() and value.isdigit() and len(value) <= 18):
            raise ProtocolError(f"bad Content-Length {length[:100]!r}")
        return cls(keep_alive=keep_alive, length=int(value))

    def decode(self, buf: bytearray, out: bytearray) -> None:
        """Append to ``out`` the body bytes at the start of ``buf`` and remove them (and framing) from it."""
        if self.done:
            return
        if self._chunked:
            self._dechunk(buf, out)
            return
        left, n = self._left, len(buf)
        if left < 0 or n <= left:
            out += buf
            del buf[:]
            if left > 0:
                self._left = left - n
                self.done = n == left
            return
        out += buf[:left]
        del buf[:left]
        self._left = 0
        self.done = True

    def eof(self) -> None:
        """The connection ended: the body's end if it runs until then, else an error."""
        if self.done:
            return
        if self._left >= 0 or self._chunked:
            raise ProtocolError("the engine closed the connection before the body ended (truncated response)")
        self.done = True

    def _dechunk(self, buf: bytearray, out: bytearray) -> None:
        # Whole chunks are copied out from a moving position and removed together at the
        # end (several events in one read: one removal, not one per chunk).
        pos = 0
        try:
            while True:
                state = self._state
                if state == _SIZE:
                    pos = _whole_chunks(buf, pos, out)
                    m = _CHUNK_LINE.match(buf, pos)
                    if m is None:
                        if len(buf) - pos > MAX_CHUNK_LINE or buf.find(b"\n", pos) >= 0:
                            raise ProtocolError(f"bad chunk size line {bytes(buf[pos : pos + 40])!r}")
                        return
                    size, start = int(m[1], 16), m.end()
                    if size == 0:
                        pos = start
                        self._state = _TRAILERS
                        continue
                    stop = start + size
                    if len(buf) >= stop + 2:  # the whole chunk is here: one copy
                        if buf[stop] != 13 or buf[stop + 1] != 10:
                            raise ProtocolError("chunk data is not followed by CRLF (a wrong chunk size)")
                        out += memoryview(buf)[start:stop]  # (the view is gone before the del)
                        pos = stop + 2
                        continue
                    pos = start
                    self._left, self._state = size, _DATA
                    continue
                if pos:  # the other states read from the start of the buffer
                    del buf[:pos]
                    pos = 0
                if state == _DATA:
                    left, n = self._left, len(buf)
                    if n < left:
                        out += buf
                        del buf[:]
                        self._left = left - n
                        return
                    out += buf[:left]
                    del buf[:left]
                    self._state = _CRLF
                elif state == _CRLF:
                    if len(buf) < 2:
                        if buf and buf[0] != 13:
                            raise ProtocolError("chunk data is not followed by CRLF (a wrong chunk size)")
                        return
                    if buf[0] != 13 or buf[1] != 10:
                        raise ProtocolError("chunk data is not followed by CRLF (a wrong chunk size)")
                    del buf[:2]
                    self._state = _SIZE
                else:
                    self._trailers(buf)
                    return
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


def parse_head(buf: bytearray, end: int, method: str) -> tuple[int, str, dict[str, str], BodyDecoder | None]:
    """Status, reason, headers (lower-case names, repeats joined by ``, ``) and framing of the
    head that ends at ``end`` (removed from ``buf``); no framing for a 1xx answer (read the next head)."""
    head = bytes(buf[:end]).rstrip(b"\r\n")
    del buf[:end]
    lines = _LINE_END.split(head)
    m = _STATUS.fullmatch(lines[0])
    if m is None:
        raise ProtocolError(f"not an HTTP/1.x status line: {lines[0][:100]!r}")
    status, reason = int(m[2]), (m[3] or b"").decode("latin-1").strip()
    headers: dict[str, str] = {}
    key = ""
    for line in lines[1:]:
        if line[:1] in (b" ", b"\t") and key:  # obs-fold: RFC 9112 §5.2 has clients read it as a space
            value = line.strip(b" \t")
            if _BAD_VALUE.search(value):
                raise ProtocolError(f"malformed header line {line[:100]!r}")
            headers[key] += " " + value.decode("latin-1")
            continue
        name, colon, raw = line.partition(b":")
        value = raw.strip(b" \t")
        if not colon or not _TOKEN.fullmatch(name) or _BAD_VALUE.search(value):
            raise ProtocolError(f"malformed header line {line[:100]!r}")
        key, text = name.decode("ascii").lower(), value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    if status < 200:
        if status < 100:
            raise ProtocolError(f"status {status} is not a status code")
        if status == 101:
            raise ProtocolError("the engine switched protocols (101)")
        return status, reason, headers, None
    return status, reason, headers, BodyDecoder.of(status, method, headers, http10=m[1] == b"0")


def _whole_chunks(buf: bytearray, pos: int, out: bytearray) -> int:
    """Copy to ``out`` the whole non-empty chunks from ``pos`` on; where the first that is not (all) here begins.

    ``BodyDecoder._dechunk``'s common case, in a tight loop (several events read at once);
    anything else (a chunk cut short, the last chunk, a bad line) is left to it, from the returned position.
    """
    match, n = _CHUNK_LINE.match, len(buf)
    with memoryview(buf) as view:
        while (m := match(buf, pos)) is not None:
            start = m.end()
            stop = start + int(m[1], 16)
            if stop == start or n < stop + 2 or buf[stop] != 13 or buf[stop + 1] != 10:
                break
            out += view[start:stop]
            pos = stop + 2
    return pos
