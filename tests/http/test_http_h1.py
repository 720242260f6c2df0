"""The HTTP/1.1 codec (actorproxy/http/h1.py), sans-IO, in both roles: what it accepts, what it refuses, how it frames.

The client role's response heads and chunked bodies over hostile bytes are also in test_engine_http11_hostile.py
and test_engine_fast_paths.py (the same decoder reads request bodies here)."""

from __future__ import annotations

from collections.abc import Callable
from http import HTTPStatus

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actorproxy.http import h1


def parse(data: bytes) -> h1.RequestHead | None:
    return h1.parse_request(bytearray(data))


def test_a_request_head_and_what_is_left_behind_it() -> None:
    buffer = bytearray(b"\r\nPOST /a?b HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nX-A:  v \r\n\r\nabcGET")
    request = h1.parse_request(buffer)
    assert request is not None
    assert (request.method, request.target, request.http_version) == (b"POST", b"/a?b", "1.1")
    assert request.headers == [(b"host", b"x"), (b"content-length", b"3"), (b"x-a", b"v")]
    assert request.length == 3 and not request.chunked and request.keep_alive
    assert buffer == b"abcGET"
    assert h1.parse_request(bytearray(b"GET / HTTP/1.1\r\nHost: x\r\n")) is None  # not complete yet


def test_bare_line_feeds_keep_alive_and_expect() -> None:
    request = parse(b"GET / HTTP/1.0\nConnection: Keep-Alive\n\n")
    assert request is not None and request.keep_alive and request.http_version == "1.0"
    assert not parse(b"GET / HTTP/1.0\r\n\r\n").keep_alive  # type: ignore[union-attr]
    assert not parse(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").keep_alive  # type: ignore[union-attr]
    assert parse(b"PUT / HTTP/1.1\r\nHost: x\r\nExpect: 100-Continue\r\n\r\n").expect_continue  # type: ignore[union-attr]


def test_the_head_ends_at_its_first_empty_line_whatever_the_body_holds() -> None:
    buffer = bytearray(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nab\n\ncd")
    request = h1.parse_request(buffer)
    assert request is not None and request.length == 6 and buffer == b"ab\n\ncd"
    buffer = bytearray(b"POST / HTTP/1.1\nHost: x\nContent-Length: 6\n\nab\r\n\r\n")  # bare, then CRLFs
    request = h1.parse_request(buffer)
    assert request is not None and request.headers[-1] == (b"content-length", b"6") and buffer == b"ab\r\n\r\n"
    long_line = b"GET / HTTP/1.1\r\nX-A: " + b"a" * h1.MAX_REQUEST_HEAD + b"\n\n"
    with pytest.raises(h1.ProtocolError) as info:
        parse(long_line)
    assert info.value.status_hint == 431


def test_field_values_are_trimmed_and_keep_tabs_and_high_bytes_inside() -> None:
    request = parse(b"GET / HTTP/1.1\r\nHost:x\r\nX-A: \t a\tb \xff \t\r\nX-B:\r\nX-C: c\n\r\n")
    assert request is not None
    assert request.headers == [(b"host", b"x"), (b"x-a", b"a\tb \xff"), (b"x-b", b""), (b"x-c", b"c")]


@pytest.mark.parametrize(("head", "status"), [
    (b"GET  / HTTP/1.1\r\nHost: x\r\n\r\n", 400),  # two spaces
    (b"GET / HTTP/2\r\nHost: x\r\n\r\n", 400),
    (b"GET / http/1.1\r\nHost: x\r\n\r\n", 400),
    (b"G\xffT / HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /\xff HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\n\r\n", 400),  # no Host
    (b"GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\n: empty\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\rb\r\n\r\n", 400),  # a bare CR inside a value
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\r\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX : a\r\n\r\n", 400),  # whitespace before the colon
    (b"GET / HTTP/1.1\r\nHost: x\r\nnot a field X: a\r\n\r\n", 400),  # a field inside a bad line
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 9999999999999999999\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    (b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000 + b"\r\n\r\n", 431),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000, 431),  # too large before it even ends
])
def test_what_is_refused_and_with_what(head: bytes, status: int) -> None:
    with pytest.raises(h1.ProtocolError) as refused:
        parse(head)
    assert refused.value.status_hint == status


def test_repeated_equal_lengths_are_one_length() -> None:
    request = parse(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3, 3\r\n\r\n")
    assert request is not None and request.length == 3


def body(head: bytes, pieces: list[bytes]) -> tuple[bytes, bool, bytes]:
    """Feed ``pieces`` one by one; the body read, whether it ended, and what is left in the buffer."""
    request = parse(head)
    assert request is not None
    reader, buffer, out = h1.BodyDecoder.of_request(request), bytearray(), b""
    for piece in pieces:
        buffer += piece
        while not reader.done and (data := reader.read(buffer)) is not None:
            out += data
    return out, reader.done, bytes(buffer)


def test_a_chunked_body_in_any_split_with_extensions_and_trailers() -> None:
    wire = b"3;ext=1\r\nabc\r\n10\r\n" + b"d" * 16 + b"\r\n0\r\nTrailer: x\r\n\r\nNEXT"
    head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    assert body(head, [wire]) == (b"abc" + b"d" * 16, True, b"NEXT")
    assert body(head, [wire[i:i + 1] for i in range(len(wire))]) == (b"abc" + b"d" * 16, True, b"NEXT")
    assert body(head, [wire[:12]]) == (b"abc", False, b"")  # the rest has not come yet


@pytest.mark.parametrize("wire", [b"zz\r\nab\r\n", b"2\r\nabc\r\n", b"1" * 2000])
def test_a_broken_chunked_body_is_a_bad_request(wire: bytes) -> None:
    with pytest.raises(h1.ProtocolError):
        body(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", [wire])


def test_a_length_body_takes_its_length_only() -> None:
    assert body(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n", [b"a", b"bcGET"]) == (b"abc", True, b"GET")


def test_response_framing() -> None:
    get = parse(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    head = parse(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
    old = parse(b"GET / HTTP/1.0\r\n\r\n")
    assert get is not None and head is not None and old is not None
    sized = h1.ResponseFraming(get, 200, [(b"content-length", b"2")])
    expected = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ndate: D\r\n\r\n"
    assert sized.head(200, [(b"content-length", b"2")], b"D") == expected
    assert sized.piece(b"abc") == b"ab" and sized.end() == (b"", True)
    short = h1.ResponseFraming(get, 200, [(b"content-length", b"5")])
    assert short.piece(b"ab") == b"ab" and short.end() == (b"", False)  # cut short: the connection must close
    chunked = h1.ResponseFraming(get, 200, [])
    assert b"transfer-encoding: chunked\r\n" in chunked.head(200, [], b"D")
    assert chunked.piece(b"hello") == b"5\r\nhello\r\n" and chunked.end() == (b"0\r\n\r\n", True)
    bodiless = h1.ResponseFraming(head, 200, [(b"content-length", b"5")])
    assert bodiless.piece(b"hello") == b"" and bodiless.end() == (b"", True)
    until_close = h1.ResponseFraming(old, 200, [])
    assert until_close.close and b"connection: close\r\n" in until_close.head(200, [], b"D")
    said = h1.ResponseFraming(get, 200, [(b"connection", b"close")])
    assert said.close and said.head(200, [(b"connection", b"close")], b"D").count(b"connection") == 1
    with pytest.raises(ValueError):
        sized.head(200, [(b"x", b"a\r\nInjected: 1")], b"D")
    assert h1.error_response(431, b"D").startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")


# -- both roles: what one side writes, the other reads; one field pattern for both ---------------------------------


def test_a_request_the_client_writes_is_the_request_the_server_reads() -> None:
    head = h1.request_head("POST", "/generate?x=1", b"host: engine:30000\r\n", b"{}", {"content-type": "a/b"})
    buffer = bytearray(head) + b"{}"
    request = h1.parse_request(buffer)
    assert request is not None and (request.method, request.target) == (b"POST", b"/generate?x=1")
    assert request.headers == [(b"host", b"engine:30000"), (b"content-length", b"2"), (b"content-type", b"a/b")]
    decoder = h1.BodyDecoder.of_request(request)
    assert decoder.read(buffer) == b"{}" and decoder.done and not buffer
    for bad in ({"x": "a\r\nInjected: 1"}, {"bad name": "v"}):
        with pytest.raises(ValueError):
            h1.request_head("GET", "/", b"", None, bad)
    with pytest.raises(ValueError):
        h1.request_head("GET", "/a b", b"", None, None)


def test_a_response_the_server_writes_is_the_response_the_client_reads() -> None:
    request = parse(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert request is not None
    framing = h1.ResponseFraming(request, 201, [(b"x-a", b"1")])
    wire = bytearray(framing.head(201, [(b"x-a", b"1")], b"D") + framing.piece(b"hello") + framing.end()[0])
    status, reason, headers, body = h1.parse_response(wire, h1.head_end(wire), "GET")
    assert (status, reason, headers["x-a"], headers["date"]) == (201, "Created", "1", "D")
    assert body is not None and body.chunked and body.keep_alive
    out = bytearray()
    body.decode(wire, out)
    assert out == b"hello" and body.done and not wire


@pytest.mark.parametrize("line", [b"Bad Header", b": empty", b"X: a\x00b", b"X: a\rb", b"X : a"])
def test_a_bad_header_line_is_refused_in_both_roles(line: bytes) -> None:
    with pytest.raises(h1.ProtocolError, match="header line"):
        parse(b"GET / HTTP/1.1\r\nHost: x\r\n" + line + b"\r\n\r\n")
    wire = bytearray(b"HTTP/1.1 200 OK\r\n" + line + b"\r\ncontent-length: 0\r\n\r\n")
    with pytest.raises(h1.ProtocolError, match="header line"):
        h1.parse_response(wire, h1.head_end(wire), "GET")


def test_a_fold_is_refused_by_the_server_and_read_as_a_space_by_the_client() -> None:
    with pytest.raises(h1.ProtocolError):
        parse(b"GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n  2\r\n\r\n")
    wire = bytearray(b"HTTP/1.1 200 OK\r\nX-A: 1\r\n  2\r\ncontent-length: 0\r\n\r\n")
    _, _, headers, _ = h1.parse_response(wire, h1.head_end(wire), "GET")
    assert headers["x-a"] == "1 2"


def test_length_and_coding_rules_are_the_same_in_both_roles() -> None:
    for value, length in ((b"3, 3", 3), (b"0", 0)):
        request = parse(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: " + value + b"\r\n\r\n")
        assert request is not None and request.length == length
        wire = bytearray(b"HTTP/1.1 200 OK\r\nContent-Length: " + value + b"\r\n\r\n")
        body = h1.parse_response(wire, h1.head_end(wire), "GET")[3]
        assert body is not None and body.remaining == length
    for header in (b"Content-Length: 3, 4", b"Content-Length: -1", b"Transfer-Encoding: gzip"):
        with pytest.raises(h1.ProtocolError):
            parse(b"POST / HTTP/1.1\r\nHost: x\r\n" + header + b"\r\n\r\n")
        wire = bytearray(b"HTTP/1.1 200 OK\r\n" + header + b"\r\n\r\n")
        with pytest.raises(h1.ProtocolError):
            h1.parse_response(wire, h1.head_end(wire), "GET")
    # Both: refused by a server (two readers could disagree), chunked for a client, which then drops the connection.
    both = b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"
    with pytest.raises(h1.ProtocolError):
        parse(b"POST / HTTP/1.1\r\nHost: x\r\n" + both)
    wire = bytearray(b"HTTP/1.1 200 OK\r\n" + both)
    body = h1.parse_response(wire, h1.head_end(wire), "GET")[3]
    assert body is not None and body.chunked and not body.keep_alive


# -- the head's end: one search, the same answer as the reference rule -------------------------------------------------

_HEAD_BYTES = st.lists(st.sampled_from([b"\r", b"\n", b"a", b":", b" "]), max_size=40).map(b"".join)


def _reference_head_end(buf: bytes) -> int:
    """The end of the first blank line as RFC 9112 reads it (CRLF or bare LF line ends): the rule, spelled slowly."""
    ends = [i + 2 for i in range(len(buf) - 1) if buf[i : i + 2] == b"\n\n"]
    ends += [i + 3 for i in range(len(buf) - 2) if buf[i : i + 3] == b"\n\r\n"]
    return min(ends, default=-1)


@settings(max_examples=2000, derandomize=True, database=None, deadline=None)
@given(_HEAD_BYTES)
def test_a_head_ends_after_its_first_blank_line_in_any_mix_of_line_ends(data: bytes) -> None:
    assert h1.head_end(bytearray(data)) == _reference_head_end(data)
    # The server's reading agrees: a head found there is the bytes before that blank line.
    buffer = bytearray(b"GET / HTTP/1.1\r\nHost: x\r\n" + data)
    try:
        request = h1.parse_request(buffer)
    except h1.ProtocolError:
        return
    end = _reference_head_end(b"\n" + data)
    assert (request is None) == (end < 0)
    if request is not None:
        assert bytes(buffer) == data[end - 1 :]


# -- the common heads' short cuts decide as the general rules do ------------------------------------------------------


def _outcome(call: Callable[[], object]) -> object:
    try:
        return call()
    except h1.ProtocolError as error:
        return ("refused", str(error), error.status_hint)


def _general_content_length(values: list[bytes]) -> int:
    lengths = {part.strip(b" \t") for value in values for part in value.split(b",")}
    length = lengths.pop() if len(lengths) == 1 else b""
    if not length.isdigit() or len(length) > 18:
        raise h1.ProtocolError(f"bad Content-Length {b', '.join(values)[:100]!r}")
    return int(length)


def _general_codings(values: list[bytes]) -> list[bytes]:
    codings = [c for value in values for part in value.split(b",") if (c := part.strip(b" \t").lower())]
    if codings != [b"chunked"]:
        raise h1.ProtocolError(f"unsupported Transfer-Encoding {b', '.join(values)[:100]!r}")
    return codings


_VALUE_BYTES = st.lists(st.sampled_from([b"0", b"1", b"9", b"12", b"9" * 18, b"9" * 19, b"", b" ", b"\t", b",", b"a",
                                         b"chunked", b"CHUNKED", b"gzip", b"\xd9\xa1", b"+1", b"-1"]),
                        max_size=5).map(b"".join)


@settings(max_examples=1500, derandomize=True, database=None, deadline=None)
@given(st.lists(_VALUE_BYTES, min_size=1, max_size=3))
def test_content_length_and_transfer_coding_values_are_read_as_the_general_rules_read_them(values: list[bytes]) -> None:
    assert _outcome(lambda: h1._content_length(values)) == _outcome(lambda: _general_content_length(values))
    assert _outcome(lambda: h1._codings(values)) == _outcome(lambda: _general_codings(values))


@settings(max_examples=1500, derandomize=True, database=None, deadline=None)
@given(st.lists(st.sampled_from([b"\r\n", b"\n", b"\r", b" ", b"\x00", b"\x0d\x0d\n"]), max_size=4).map(b"".join),
       st.sampled_from([b"GET", b"POST", b"HEAD", b"PUT", b"DELETE", b"OPTIONS", b"PATCH", b"get", b"BREW", b"P@ST",
                        b"", b"GET\x00", b"\xff"]),
       st.sampled_from([b"/", b"/a?b", b"", b"/\x7f", b"*", b"/\xff"]),
       st.sampled_from([b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n", b"Host: x\r\nContent-Length: 3\r\n",
                        b"Host: x\r\nContent-Length: 3, 3\r\n", b"Host: x\r\nTransfer-Encoding: chunked\r\n", b""]))
def test_a_request_head_is_read_as_the_general_rules_read_it(lead: bytes, method: bytes, target: bytes,
                                                               fields: bytes) -> None:
    """With the known methods looked up (and no empty line before it), as with every method matched by the regex."""
    wire = lead + method + b" " + target + b" HTTP/1.1\r\n" + fields + b"\r\nabc"
    buffer = bytearray(wire)
    fast = _outcome(lambda: _seen(h1.parse_request(buffer), buffer))
    general = bytearray(wire)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(h1, "_METHODS", frozenset())
        assert fast == _outcome(lambda: _seen(h1.parse_request(general), general))
    assert all(h1._TOKEN.fullmatch(known) for known in h1._METHODS)


def _seen(request: h1.RequestHead | None, buffer: bytearray) -> object:
    if request is None:
        return None
    return (request.method, request.target, request.headers, request.length, request.chunked, request.keep_alive,
            bytes(buffer))


def test_status_lines_and_a_response_without_a_connection_header() -> None:
    for status in [*range(100, 600), 99, 999, 0]:
        reason = {s.value: s.phrase.encode() for s in HTTPStatus}.get(status, b"Unknown")
        assert h1.status_line(status) == b"HTTP/1.1 %d %s\r\n" % (status, reason)
    for headers, keep in [({}, True), ({"connection": "close"}, False), ({"connection": "Keep-Alive, CLOSE"}, False),
                          ({"connection": "keep-alive"}, True), ({"connection": ""}, True)]:
        framing = h1._response_framing(200, "POST", {**headers, "content-length": "2"}, http10=False)
        assert framing.keep_alive is keep
        assert not h1._response_framing(200, "POST", {**headers, "content-length": "2"}, http10=True).keep_alive


def _fed(reader: h1.BodyDecoder, pieces: list[bytes], *, views: bool) -> tuple[bytes, bool, bytes, str]:
    """Each piece de-chunked as the client does it: ``views``, an arrival into an empty buffer read where it lies
    (``decode_view``, what it leaves to ``decode`` from the buffer), else appended and decoded; what came out,
    whether the body ended, what is left, and the error, if any."""
    buffer, out = bytearray(), bytearray()
    try:
        for piece in pieces:
            if views and not buffer:
                used = reader.decode_view(memoryview(piece), out)
                buffer += piece[used:]
                if not buffer:
                    continue
            else:
                buffer += piece
            reader.decode(buffer, out)
    except h1.ProtocolError as exc:
        return bytes(out), reader.done, bytes(buffer), type(exc).__name__
    return bytes(out), reader.done, bytes(buffer), ""


_CHUNKS = st.lists(st.binary(min_size=1, max_size=40), max_size=5)
_CUTS = st.lists(st.integers(0, 400), max_size=8)


@given(_CHUNKS, st.sampled_from([b"", b";x=1"]), st.sampled_from([b"0\r\n\r\n", b"0\r\nT: x\r\n\r\n", b""]),
       st.sampled_from([b"", b"NEXT", b"zz\r\n", b"\r\nQ"]), _CUTS)
def test_an_arrival_read_where_it_lies_de_chunks_as_the_buffer_does(
    chunks: list[bytes], extension: bytes, last: bytes, after: bytes, cuts: list[int],
) -> None:
    # (``after`` without the last chunk: more chunks, or a malformed one, or a chunk's missing CRLF.)
    wire = b"".join(b"%x%s\r\n%s\r\n" % (len(chunk), extension, chunk) for chunk in chunks) + last + after
    bounds = sorted({0, len(wire), *(cut for cut in cuts if cut < len(wire))})
    pieces = [wire[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    through_buffer = _fed(h1.BodyDecoder(keep_alive=True, chunked=True), pieces, views=False)
    assert _fed(h1.BodyDecoder(keep_alive=True, chunked=True), pieces, views=True) == through_buffer
    if last and not through_buffer[3]:
        assert through_buffer[:3] == (b"".join(chunks), True, after)


@given(_CHUNKS, st.integers(0, 4), st.sampled_from([-2, -1, 1, 2]), st.sampled_from([b"", b"0\r\n\r\n", b"1\r\nx\r\n"]),
       _CUTS)
def test_a_chunk_whose_size_lies_gives_the_same_bytes_and_error_however_it_arrives(
    chunks: list[bytes], which: int, lie: int, after: bytes, cuts: list[int],
) -> None:
    """The chunk's data is taken (its size's worth) and its missing CRLF refused, whether the CRLF's place came
    with the chunk or after it, in the buffer or where the arrival lies."""
    if not chunks:
        chunks = [b"abc"]
    which %= len(chunks)
    sizes = [len(chunk) + (lie if i == which else 0) for i, chunk in enumerate(chunks)]
    wire = b"".join(b"%x\r\n%s\r\n" % (max(size, 1), chunk) for size, chunk in zip(sizes, chunks, strict=True)) + after
    bounds = sorted({0, len(wire), *(cut for cut in cuts if cut < len(wire))})
    pieces = [wire[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    whole = _fed(h1.BodyDecoder(keep_alive=True, chunked=True), [wire], views=False)
    for views in (False, True):
        split = _fed(h1.BodyDecoder(keep_alive=True, chunked=True), pieces, views=views)
        assert (split[0], split[1], split[3]) == (whole[0], whole[1], whole[3])  # (what is left: up to the fault)
    if whole[3]:
        assert whole[0].startswith(b"".join(chunks[:which]))


@pytest.mark.parametrize("views", [False, True])
def test_a_missing_chunk_crlf_is_refused_at_the_first_byte_that_shows_it(views: bool) -> None:
    for wire, at in [(b"2\r\nabc\r\n", 5), (b"2\r\nab\rc", 6)]:
        def fed(upto: int, wire: bytes = wire) -> tuple[bytes, bool, bytes, str]:
            return _fed(h1.BodyDecoder(keep_alive=True, chunked=True), [wire[i : i + 1] for i in range(upto)],
                        views=views)
        assert fed(at)[::3] == (b"ab", "")
        assert fed(at + 1)[::3] == (b"ab", "ProtocolError")


@given(st.binary(max_size=60), st.sampled_from([None, 0, 5, 30]), _CUTS)
def test_a_sized_or_until_close_arrival_read_where_it_lies_takes_what_the_buffer_does(
    wire: bytes, length: int | None, cuts: list[int],
) -> None:
    bounds = sorted({0, len(wire), *(cut for cut in cuts if cut < len(wire))})
    pieces = [wire[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    through_buffer = _fed(h1.BodyDecoder(keep_alive=True, length=length), pieces, views=False)
    assert _fed(h1.BodyDecoder(keep_alive=True, length=length), pieces, views=True) == through_buffer
    assert through_buffer[0] == (wire if length is None else wire[:length])


@given(_CHUNKS, st.sampled_from([b"", b";x=1"]), st.sampled_from([b"", b"0\r\n\r\n", b"zz", b"\r\n"]), _CUTS)
def test_a_lone_chunk_is_found_where_it_lies_only_when_the_arrival_is_exactly_one(
    chunks: list[bytes], extension: bytes, after: bytes, cuts: list[int],
) -> None:
    wire = b"".join(b"%x%s\r\n%s\r\n" % (len(chunk), extension, chunk) for chunk in chunks) + after
    for cut in [len(wire), *cuts]:
        arrival = memoryview(wire[:cut])
        span = h1.BodyDecoder(keep_alive=True, chunked=True).lone_chunk(arrival)
        out = bytearray()
        used = h1.BodyDecoder(keep_alive=True, chunked=True).decode_view(arrival, out)
        one = len(chunks) >= 1 and len(arrival) == len(b"%x%s\r\n%s\r\n" % (len(chunks[0]), extension, chunks[0]))
        assert (span is not None) == one
        if span is not None:  # the chunk's data, as de-chunking gives it
            assert (bytes(arrival[span[0] : span[1]]), used) == (bytes(out), len(arrival))


_UVICORN_OK = b"HTTP/1.1 200 OK\r\ndate: Sun, 30 Nov 2026 03:00:00 GMT\r\nserver: uvicorn\r\ncontent-length: 2\r\n" \
    b"content-type: application/json\r\n\r\n{}"


@pytest.mark.parametrize("answer", [
    _UVICORN_OK,
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n\r\n",  # the engine stub's
    b"HTTP/1.1 200\r\nCONTENT-LENGTH:   5 \r\n\r\nhello",
])
def test_a_plain_ok_answer_is_read_by_its_length_as_the_whole_parse_reads_it(answer: bytes) -> None:
    wire = bytearray(answer + b"HTTP/1.1 200 OK\r\n")  # the next answer's start follows
    whole = h1.whole_ok(wire)
    assert whole == len(answer)
    status, _, _, body = h1.parse_response(wire, h1.head_end(wire), "POST")
    assert status == 200 and body is not None and body.keep_alive and not body.chunked
    assert len(answer) - len(wire) + len(b"HTTP/1.1 200 OK\r\n") + body.remaining == whole


@pytest.mark.parametrize("answer", [
    _UVICORN_OK[:-1],  # the body not whole yet
    _UVICORN_OK[:40],  # nor the head
    _UVICORN_OK.replace(b"200 OK", b"404 Not Found"),
    _UVICORN_OK.replace(b"HTTP/1.1", b"HTTP/1.0"),
    _UVICORN_OK.replace(b"server: uvicorn", b"connection: close"),
    _UVICORN_OK.replace(b"server: uvicorn", b"Connection: keep-alive"),
    _UVICORN_OK.replace(b"server: uvicorn", b"transfer-encoding: chunked"),
    _UVICORN_OK.replace(b"server: uvicorn", b"content-length: 2"),  # twice
    _UVICORN_OK.replace(b"content-length: 2", b"content-length: 2, 2"),
    _UVICORN_OK.replace(b"content-length: 2", b"x-length: 2"),  # no length: the body runs to the end
    _UVICORN_OK.replace(b"server: uvicorn\r\n", b"server: uvicorn\n"),  # a bare LF
    _UVICORN_OK.replace(b"server: uvicorn", b"server: uvi\r\n corn"),  # obs-fold
    _UVICORN_OK.replace(b"server: uvicorn", b"Bad Header: x"),
    _UVICORN_OK.replace(b"server: uvicorn", b"server: a\rb"),
])
def test_any_other_answer_is_left_to_the_whole_parse(answer: bytes) -> None:
    assert h1.whole_ok(bytearray(answer)) == 0
