"""Server-sent events, sans-IO: bytes in, events out (no I/O, no Trio).

:class:`SSEParser` keeps the bytes not yet split in :attr:`SSEParser.buffer`, a
bytearray the HTTP reader de-chunks a body straight into (:meth:`SSEParser.split`
then cuts the events out), so a body's bytes are copied once on their way to the
events. The common event, one ``data:`` line, is one slice; other shapes (several
``data:`` lines, ``event:`` names, comments) are read per line.

Lines end as the SSE spec (WHATWG HTML, "event stream interpretation") lets them: in
``\\n``, ``\\r\\n`` or a lone ``\\r``. When a read's new bytes hold a ``\\r``, their line ends
are made ``\\n`` (:meth:`SSEParser._line_feeds`), and they are split as an ``\\n``-only
stream is; a ``\\r`` that ends a read ends its line at once, and an ``\\n``
that begins the next read is then dropped (one ``\\r\\n``, not two line ends). A stream
without ``\\r`` pays one ``find`` a read for this, as it did before. A UTF-8 byte order
mark (U+FEFF) that starts the stream is dropped, as the spec says.
"""

from __future__ import annotations

from typing import NamedTuple


class SSEEvent(NamedTuple):
    #: ``message`` unless an ``event:`` line names it (older llama.cpp's ``error:`` lines: ``error``).
    event: str
    #: The ``data:`` lines, joined by ``\n``.
    data: bytes


class SSEParser:
    """Server-sent events from raw bytes; lines end in ``\\n``, ``\\r\\n`` or a lone ``\\r``; a missing
    final blank line is tolerated."""

    __slots__ = ("buffer", "_scan", "_after_cr", "_start")

    def __init__(self, *, at_start: bool = True) -> None:
        #: Bytes received and not split into events yet (append to it, then :meth:`split`).
        self.buffer = bytearray()
        self._scan = 0  # where the search for the next blank line resumes
        self._after_cr = 0  # 1 + where the byte after a "\r" that ended the last read goes (0: none)
        self._start = at_start  # the buffer starts the stream: a byte order mark there is dropped

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        self.buffer += chunk
        return self.split()

    def split(self) -> list[SSEEvent]:
        """The events complete in :attr:`buffer` (removed from it)."""
        buf, scan = self.buffer, self._scan
        if self._start and not self._bom_dropped(buf):
            return []
        if not self._after_cr and buf.find(b"\r", scan) < 0:
            return self._split_lf(buf, scan)
        after_cr = self._line_feeds(buf, scan)
        events = self._split_lf(buf, scan)
        self._after_cr = len(buf) + 1 if after_cr else 0
        return events

    def _bom_dropped(self, buf: bytearray) -> bool:
        """At the stream's start: a UTF-8 byte order mark (U+FEFF) there dropped, as the spec does; ``False``
        while the bytes so far are no more than a part of one (nothing to split yet)."""
        if len(buf) < 3 and _BOM.startswith(buf):
            return False
        self._start = False
        if buf.startswith(_BOM):
            del buf[:3]
        return True

    def _line_feeds(self, buf: bytearray, scan: int) -> bool:
        """Every line end from ``scan`` on made one ``\\n``, as the spec reads them: ``\\r\\n``, or a
        lone ``\\r``. ``True``: the buffer ends in a ``\\r`` (made ``\\n`` at once: the line has
        ended); an ``\\n`` that the next read begins with ends the same line, and is dropped then."""
        after = self._after_cr - 1
        if after >= 0:  # (the previous read ended in "\r": a "\n" after it belongs to it)
            if after >= len(buf):
                return True  # (nothing came since)
            if buf[after] == 10:
                del buf[after]
        cr = buf.find(b"\r", scan)
        if cr < 0:
            return False
        ends_in_cr = buf[-1] == 13
        buf[cr:] = buf[cr:].replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        return ends_in_cr

    def _split_lf(self, buf: bytearray, scan: int) -> list[SSEEvent]:
        """:meth:`split` when lines end in ``\\n`` only: the common event (one ``data:`` line) inline.

        The same events as the general loop (``_event`` for any other shape), with one ``\\n`` search per
        event instead of a two-byte search for the blank line and another for a second line.
        """
        events: list[SSEEvent] = []
        find, n, start = buf.find, len(buf), 0
        view = memoryview(buf)
        try:
            while True:
                if start >= scan:  # (before ``scan``: the start of an event that came in part, no blank line there)
                    nl = find(b"\n", start)
                    if nl < 0 or nl + 1 >= n:
                        break
                    if buf[nl + 1] == 10 and buf.startswith(b"data: ", start):
                        events.append(_new(SSEEvent, ("message", bytes(view[start + 6 : nl]))))
                        start = scan = nl + 2
                        continue
                    scan = nl
                end = find(b"\n\n", scan)
                if end < 0:
                    break
                event = _event(buf, start, end)
                if event is not None:
                    events.append(event)
                start = scan = end + 2
        finally:
            view.release()  # before the buffer is resized
        if start:
            del buf[:start]
        self._scan = max(0, len(buf) - 2)
        return events

    def close(self) -> list[SSEEvent]:
        """Flush at end of stream: a last event without its blank line still counts."""
        events = self.split()
        buf = self.buffer
        end = len(buf)
        while end and buf[end - 1] == 10:  # (line ends are "\n" once split)
            end -= 1
        if end:
            event = _event(buf, 0, end)
            if event is not None:
                events.append(event)
        del buf[:]
        self._scan = self._after_cr = 0
        self._start = False
        return events


_BOM = b"\xef\xbb\xbf"

#: ``tuple.__new__``: an :class:`SSEEvent` made without its generated ``__new__`` (half the cost).
_new = tuple.__new__


def _event(buf: bytearray, start: int, end: int) -> SSEEvent | None:
    """The event in ``buf[start:end]`` (its lines, ``\\n`` line ends, without the blank line); ``None`` if it
    has no data."""
    if buf.startswith(b"data: ", start) and buf.find(b"\n", start, end) < 0:
        return SSEEvent("message", bytes(memoryview(buf)[start + 6 : end]))
    name, data = "message", []
    for line in bytes(buf[start:end]).split(b"\n"):
        if not line or line.startswith(b":"):  # comments: keep-alive pings
            continue
        field, _, value = line.partition(b":")
        if value.startswith(b" "):
            value = value[1:]
        if field == b"data":
            data.append(value)
        elif field == b"event":
            name = value.decode("utf-8", errors="replace") or "message"
        elif field == b"error":  # older llama.cpp writes `error: {...}` lines
            name = "error"
            data.append(value)
    if not data:
        return None
    return SSEEvent(name, b"\n".join(data))
