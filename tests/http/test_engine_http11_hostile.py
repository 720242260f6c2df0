"""A broken or hostile engine cannot hang or crash the engine client: a clear 502, at once.

A raw TCP server on port 0 (test_engine_http11's scripted ``Server``) answers with bad
bytes: a bad status line or header, a bad chunk size, a truncated body, a head or an
event beyond its limit. Each must fail the request with a :class:`BackendError` whose
message says what was wrong, without waiting for the read timeout, and the connection
must not go back to the pool. The sans-IO framing (:mod:`actorproxy.http.h1`,
:mod:`actorproxy.http.sse`) is checked with hypothesis: any split of a valid body
decodes to the same bytes and events, and any mutation of one decodes or raises
:class:`ProtocolError`, nothing else.
"""

from __future__ import annotations

import pytest
import trio
from _util import sse_reference
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_http11 import serving, sized

from actorproxy.engines.base import BackendError, GenerateRequest, SamplingParams
from actorproxy.engines.errors import mapped_errors
from actorproxy.engines.sglang.client import SGLangBackend
from actorproxy.http import client as http11
from actorproxy.http.client import HTTP11Client
from actorproxy.http.errors import ProtocolError
from actorproxy.http.h1 import BodyDecoder, head_end, parse_response
from actorproxy.http.sse import SSEEvent, SSEParser

OK = b"HTTP/1.1 200 OK\r\n"
CHUNKED_HEAD = OK + b"Transfer-Encoding: chunked\r\n\r\n"

# (bad bytes, close the connection after them, what the error says)
MALFORMED = [
    pytest.param(b"NOT HTTP AT ALL\r\n\r\n", False, "status line", id="not-http"),
    pytest.param(b"HTTP/2 200 OK\r\ncontent-length: 0\r\n\r\n", False, "status line", id="http2-status-line"),
    pytest.param(b"HTTP/1.1 2000 OK\r\ncontent-length: 0\r\n\r\n", False, "status line", id="four-digit-status"),
    pytest.param(b"HTTP/1.1 042 Odd\r\n\r\n", False, "not a status code", id="status-below-100"),
    pytest.param(OK + b"no colon\r\ncontent-length: 0\r\n\r\n", False, "header line", id="header-without-colon"),
    pytest.param(OK + b" folded\r\ncontent-length: 0\r\n\r\n", False, "header line", id="obs-fold-first"),
    pytest.param(OK + b"x-a: a\x00b\r\ncontent-length: 0\r\n\r\n", False, "header line", id="nul-in-header"),
    pytest.param(OK + b"content-length : 0\r\n\r\n", False, "header line", id="space-before-colon"),
    pytest.param(OK + b"content-length: abc\r\n\r\n", False, "Content-Length", id="content-length-not-a-number"),
    pytest.param(OK + b"content-length: -1\r\n\r\n", False, "Content-Length", id="negative-content-length"),
    pytest.param(OK + b"content-length: 5\r\ncontent-length: 6\r\n\r\nhello", False, "Content-Length",
                 id="conflicting-content-lengths"),
    pytest.param(OK + b"transfer-encoding: gzip\r\n\r\n", False, "Transfer-Encoding", id="gzip-transfer-coding"),
    pytest.param(CHUNKED_HEAD + b"zz\r\nhello\r\n0\r\n\r\n", False, "chunk size", id="chunk-size-not-hex"),
    pytest.param(CHUNKED_HEAD + b"-5\r\nhello\r\n0\r\n\r\n", False, "chunk size", id="negative-chunk-size"),
    pytest.param(CHUNKED_HEAD + b"3\r\nhello\r\n0\r\n\r\n", False, "CRLF", id="chunk-longer-than-its-size"),
    pytest.param(CHUNKED_HEAD + b"1" * 5000, False, "chunk size", id="endless-chunk-size-line"),
    pytest.param(CHUNKED_HEAD + b"0\r\nx-t: " + b"a" * 70_000, False, "trailers", id="endless-trailers"),
    pytest.param(b"HTTP/1.1 101 Switching Protocols\r\n\r\n", False, "switched protocols", id="switching-protocols"),
    pytest.param(b"HTTP/1.1 100 Continue\r\n\r\n" * 20, False, "informational", id="endless-100-continue"),
    pytest.param(OK + b"x-big: " + b"a" * 70_000, False, "larger than 64 KiB", id="oversized-head"),
    pytest.param(OK + b"content-length: 100\r\n\r\nhello", True, "truncated", id="truncated-sized-body"),
    pytest.param(CHUNKED_HEAD + b"5\r\nhello\r\n", True, "truncated", id="truncated-chunked-body"),
    pytest.param(CHUNKED_HEAD + b"5\r\nhel", True, "truncated", id="truncated-chunk"),
    pytest.param(OK + b"content-le", True, "before its response head ended", id="closed-mid-head"),
    pytest.param(b"", True, "before its response head ended", id="closed-without-answering"),
]


@pytest.mark.parametrize(("raw", "close", "says"), MALFORMED)
async def test_a_malformed_response_is_a_clear_502_not_a_hang(raw: bytes, close: bool, says: str) -> None:
    async with serving(lambda n, _: raw) as server:
        server.close_after_each = close  # else the server stays silent after its bytes
        client = HTTP11Client(server.url)  # a 600 s read timeout: failing must not wait for it
        with trio.fail_after(20):
            with pytest.raises(BackendError) as caught, mapped_errors("engine"):
                response = await client.stream("POST", server.url + "/generate", b"{}")
                await response.aread()
        assert caught.value.status == 502 and not caught.value.unreachable
        assert says in str(caught.value), str(caught.value)
        assert client.idle == 0


async def test_an_obs_folded_header_reads_as_one_value() -> None:
    async with serving(lambda n, _: OK + b"x-a: 1\r\n  2\r\ncontent-length: 2\r\n\r\nok") as server:
        client = HTTP11Client(server.url)
        response = await client.stream("GET", server.url + "/a")
        assert response.headers["x-a"] == "1 2" and await response.aread() == b"ok"


async def test_bytes_beyond_the_response_keep_its_connection_out_of_the_pool() -> None:
    async with serving(lambda n, _: sized(b"ok") + b"HTTP/1.1 200 OK\r\n") as server:
        client = HTTP11Client(server.url)
        assert await (await client.stream("GET", server.url + "/a")).aread() == b"ok"
        assert client.idle == 0


async def test_an_event_beyond_its_limit_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http11, "MAX_EVENT", 1000)
    endless = CHUNKED_HEAD + b"7d0\r\ndata: " + b"x" * 1994 + b"\r\n"  # 2000 bytes and no blank line
    async with serving(lambda n, _: endless) as server:
        client = HTTP11Client(server.url)
        response = await client.stream("POST", server.url + "/generate", b"{}")
        with trio.fail_after(20), pytest.raises(BackendError) as caught, mapped_errors("engine"):
            await response.receive_events()
        assert "larger than" in str(caught.value) and client.idle == 0


def _sglang_event(ids: list[int]) -> bytes:
    entries = ",".join(f"[-0.5,{t},null]" for t in ids)
    data = b'data: {"text":"","output_ids":%s,"meta_info":{"id":"r","finish_reason":null,' % str(ids).encode()
    event = data + b'"output_token_logprobs":[%s]}}\n\n' % entries.encode()
    return b"%x\r\n%s\r\n" % (len(event), event)


async def test_a_stream_broken_midway_delivers_its_tokens_then_a_clear_error() -> None:
    stream = CHUNKED_HEAD + _sglang_event([5]) + _sglang_event([5, 6]) + b"zz\r\n"
    async with serving(lambda n, _: stream if b"/generate" in _ else sized(b"{}")) as server:
        backend = SGLangBackend(server.url)
        got: list[int] = []
        with trio.fail_after(20), pytest.raises(BackendError) as caught:
            async with backend.open_generation(GenerateRequest([1, 2], SamplingParams(max_new_tokens=8))) as gen:
                async for event in gen:
                    got += getattr(event, "token_ids", ())
        assert got == [5, 6]
        assert caught.value.status == 502 and "chunk size" in str(caught.value)
        await backend.aclose()


async def test_an_engine_streaming_without_pause_does_not_starve_the_other_tasks() -> None:
    # 8 MB of keep-alive comments, then the end: the reader finds bytes waiting at every
    # read, and must still let the rest of the proxy run meanwhile.
    ping = b": ping\n\n" * 8000
    stream = CHUNKED_HEAD + (b"%x\r\n%s\r\n" % (len(ping), ping)) * 128 + b"0\r\n\r\n"
    async with serving(lambda n, _: stream) as server:
        client = HTTP11Client(server.url)
        response = await client.stream("POST", server.url + "/generate", b"{}")
        ticks = 0
        done = False

        async def other_task() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await trio.lowlevel.checkpoint()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(other_task)
            with trio.fail_after(60):
                assert await response.receive_events() is None  # comments only: no event
            done = True
        assert ticks > 10


# -- sans-IO framing, property-based ------------------------------------------------


def _chunked(body: bytes, cuts: list[int], trailer: bytes) -> bytes:
    points = sorted({c % (len(body) + 1) for c in cuts} | {0, len(body)})
    pieces = [body[a:b] for a, b in zip(points, points[1:], strict=False) if b > a]
    wire = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces)
    return wire + b"0\r\n" + trailer + b"\r\n"


def _decode(wire: bytes, splits: list[int], decoder: BodyDecoder) -> bytes:
    points = sorted({s % (len(wire) + 1) for s in splits} | {0, len(wire)})
    buf, out = bytearray(), bytearray()
    for a, b in zip(points, points[1:], strict=False):
        buf += wire[a:b]
        decoder.decode(buf, out)
    return bytes(out)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(st.binary(max_size=300), st.lists(st.integers(0, 400), max_size=8), st.lists(st.integers(0, 3000), max_size=12),
       st.sampled_from([b"", b"x-trailer: 1\r\n"]))
def test_any_split_of_a_chunked_body_decodes_to_the_body(
    body: bytes, cuts: list[int], splits: list[int], trailer: bytes
) -> None:
    wire = _chunked(body, cuts, trailer)
    decoder = BodyDecoder(keep_alive=True, chunked=True)
    assert _decode(wire + b"NEXT", splits, decoder) == body
    assert decoder.done


@settings(max_examples=500, derandomize=True, database=None, deadline=None)
@given(st.binary(min_size=1, max_size=200), st.lists(st.integers(0, 400), max_size=6),
       st.integers(0, 10_000), st.sampled_from(["flip", "drop", "insert"]), st.binary(min_size=1, max_size=8),
       st.lists(st.integers(0, 3000), max_size=8))
def test_a_mutated_chunked_body_decodes_or_raises_a_protocol_error(
    body: bytes, cuts: list[int], at: int, how: str, noise: bytes, splits: list[int]
) -> None:
    wire = bytearray(_chunked(body, cuts, b""))
    i = at % len(wire)
    if how == "flip":
        wire[i] ^= noise[0] or 1
    elif how == "drop":
        del wire[i : i + len(noise)]
    else:
        wire[i:i] = noise
    decoder = BodyDecoder(keep_alive=True, chunked=True)
    try:
        out = _decode(bytes(wire), splits, decoder)
        decoder.eof()
    except ProtocolError:
        return
    assert len(out) <= len(wire)


@settings(max_examples=500, derandomize=True, database=None, deadline=None)
@given(st.binary(max_size=120), st.sampled_from([b"", b"HTTP/1.1 200 OK\r\n", b"HTTP/1.0 204 x\r\n"]))
def test_any_response_head_parses_or_raises_a_protocol_error(noise: bytes, start: bytes) -> None:
    buf = bytearray(start + noise + b"\r\n\r\n")
    try:
        status, _, headers, framing = parse_response(buf, head_end(buf), "POST")
    except ProtocolError:
        return
    assert 100 <= status <= 999 and all(k == k.lower() for k in headers)
    assert framing is None or isinstance(framing, BodyDecoder)


_names = st.sampled_from(["", "error", "x"])
_datas = st.lists(st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=20),
                  min_size=1, max_size=3)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(st.lists(st.tuples(_names, _datas), max_size=6), st.lists(st.sampled_from([b"\n", b"\r\n", b"\r"]), min_size=1),
       st.booleans(), st.lists(st.integers(0, 2000), max_size=10))
def test_any_split_of_an_event_stream_gives_the_same_events(
    events: list[tuple[str, list[str]]], eols: list[bytes], comments: bool, splits: list[int]
) -> None:
    # Lines end in LF, CRLF or a lone CR (the spec's three), mixed in one stream; a CR at the end of a read
    # and an LF at the start of the next are one line end.
    wire = b""
    ends = iter(eols * 100)
    for name, lines in events:
        block = [b": ping"] if comments else []
        block += [b"event: " + name.encode()] if name else []
        block += [b"data: " + line.encode() for line in lines]
        for line in [*block, b""]:
            end = next(ends)
            wire += line + (b"\r\n" if end == b"\n" and wire.endswith(b"\r") and not line else end)  # (not CRLF)
    parser = SSEParser()
    points = sorted({s % (len(wire) + 1) for s in splits} | {0, len(wire)})
    got: list[SSEEvent] = []
    for a, b in zip(points, points[1:], strict=False):
        got += parser.feed(wire[a:b])
    got += parser.close()
    want = [(name or "message", "\n".join(lines).encode()) for name, lines in events]
    assert [(e.event, e.data) for e in got] == want == sse_reference(wire)


def test_a_last_event_without_its_blank_line_still_counts() -> None:
    parser = SSEParser()
    assert parser.feed(b"data: 1\n\ndata: [DONE]") == [SSEEvent("message", b"1")]
    assert parser.close() == [SSEEvent("message", b"[DONE]")]


_VALID = [
    CHUNKED_HEAD + b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    OK + b"content-length: 11\r\n\r\nhello world",
    CHUNKED_HEAD + _sglang_event([5]) + _sglang_event([5, 6]) + b"0\r\n\r\n",
]


@settings(max_examples=60, derandomize=True, database=None, deadline=None)
@given(st.sampled_from(_VALID), st.integers(0, 10_000), st.sampled_from(["flip", "drop", "insert", "cut"]),
       st.binary(min_size=1, max_size=8), st.booleans())
def test_a_mutated_response_over_a_socket_ends_in_a_body_or_a_clear_error(
    valid: bytes, at: int, how: str, noise: bytes, events: bool
) -> None:
    raw = bytearray(valid)
    i = at % len(raw)
    if how == "flip":
        raw[i] ^= noise[0] or 1
    elif how == "drop":
        del raw[i : i + len(noise)]
    elif how == "insert":
        raw[i:i] = noise
    else:
        del raw[i:]

    async def exchange() -> None:
        async with serving(lambda n, _: bytes(raw)) as server:
            server.close_after_each = True  # a truncation must end in an error, not a wait
            client = HTTP11Client(server.url)
            with trio.fail_after(20):
                try:
                    response = await client.stream("POST", server.url + "/generate", b"{}")
                    if events:
                        while await response.receive_events() is not None:
                            pass
                    else:
                        await response.aread()
                except http11.TransportError:
                    pass
            await client.aclose()

    trio.run(exchange)
