"""The engine client's fast paths read exactly what the general code reads.

The SSE splitter's one-``data:``-line events and the body decoder's whole chunks are
read inline (``SSEParser._split_lf``, ``http11_wire._whole_chunks``); random streams,
fed whole and in small pieces, must give the same events, the same bytes left over and
the same errors as the general loops.
"""

from __future__ import annotations

import random

import pytest

from actorproxy.engines import http11_wire
from actorproxy.engines.http11_wire import BodyDecoder, ProtocolError
from actorproxy.engines.sse import SSEParser

_SSE_PARTS = [b"data: ", b"data:", b"data: {}\n\n", b"\n", b"\n\n", b"x", b"yz", b"event: e", b":ping",
              b"error: q", b"data: a\ndata: b", b" "]


def _events(parser: SSEParser, stream: bytes, sizes: random.Random) -> tuple[list[tuple[str, bytes]], bytes]:
    out: list[tuple[str, bytes]] = []
    at = 0
    while at < len(stream):
        step = sizes.randint(1, 9)
        out += [tuple(e) for e in parser.feed(stream[at : at + step])]  # type: ignore[misc]
        at += step
    left = bytes(parser.buffer)
    out += [tuple(e) for e in parser.close()]  # type: ignore[misc]
    return out, left


def test_sse_events_of_lf_streams_are_those_of_the_general_splitter() -> None:
    rnd = random.Random(7)
    for trial in range(3000):
        stream = b"".join(rnd.choice(_SSE_PARTS) for _ in range(rnd.randint(0, 25)))
        general = SSEParser()
        general._cr = True  # the line-by-line loop (an LF-only stream has no "\r" for it to strip)
        got = _events(SSEParser(), stream, random.Random(trial))
        assert got == _events(general, stream, random.Random(trial)), stream
        assert got[0] == _events(SSEParser(), stream, random.Random(trial + 1))[0], stream  # any cut


def _chunked(rnd: random.Random) -> bytes:
    parts = []
    for _ in range(rnd.randint(0, 6)):
        data = bytes(rnd.choice(b"ab\r\n") for _ in range(rnd.randint(0, 12)))
        size = len(data) + (0 if rnd.random() < 0.85 else rnd.randint(-1, 2))
        line = (rnd.choice(["%x", "%X", "%02x"]) % max(size, 0)).encode() + rnd.choice([b"", b";x=1", b" ", b"\t;"])
        parts.append(line + rnd.choice([b"\r\n", b"\n"]) + data + rnd.choice([b"\r\n", b"\r\n", b"\n", b"xx"]))
    parts.append(rnd.choice([b"0\r\n\r\n", b"0\r\nT: v\r\n\r\n", b"0\r\n", b"", b"zz\r\n"]))
    return b"".join(parts)


def _dechunked(stream: bytes, step: int) -> tuple[str, bytes, bytes, bool]:
    decoder, buf, out = BodyDecoder(keep_alive=True, chunked=True), bytearray(), bytearray()
    try:
        for at in range(0, len(stream), step):
            buf += stream[at : at + step]
            decoder.decode(buf, out)
    except ProtocolError as error:
        return str(error), bytes(out), bytes(buf), decoder.done
    return "", bytes(out), bytes(buf), decoder.done


def test_whole_chunks_read_inline_are_read_as_the_general_states_read_them(monkeypatch: pytest.MonkeyPatch) -> None:
    rnd = random.Random(11)
    streams = [_chunked(rnd) for _ in range(4000)]
    steps = [1, 3, 7, 1 << 20]
    inline = [[_dechunked(stream, step) for step in steps] for stream in streams]
    monkeypatch.setattr(http11_wire, "_whole_chunks", lambda buf, pos, out: pos)
    general = [[_dechunked(stream, step) for step in steps] for stream in streams]
    for stream, a, b in zip(streams, inline, general, strict=True):
        assert a == b, stream

