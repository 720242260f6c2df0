"""The server's HTTP/1.1 codec (server/http1.py), sans-IO: what it accepts, what it refuses, how it frames."""

from __future__ import annotations

import pytest

from actorproxy.server import http1


def parse(data: bytes) -> http1.RequestHead | None:
    return http1.parse_head(bytearray(data))


def test_a_request_head_and_what_is_left_behind_it() -> None:
    buffer = bytearray(b"\r\nPOST /a?b HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nX-A:  v \r\n\r\nabcGET")
    request = http1.parse_head(buffer)
    assert request is not None
    assert (request.method, request.target, request.http_version) == (b"POST", b"/a?b", "1.1")
    assert request.headers == [(b"host", b"x"), (b"content-length", b"3"), (b"x-a", b"v")]
    assert request.length == 3 and not request.chunked and request.keep_alive
    assert buffer == b"abcGET"
    assert http1.parse_head(bytearray(b"GET / HTTP/1.1\r\nHost: x\r\n")) is None  # not complete yet


def test_bare_line_feeds_keep_alive_and_expect() -> None:
    request = parse(b"GET / HTTP/1.0\nConnection: Keep-Alive\n\n")
    assert request is not None and request.keep_alive and request.http_version == "1.0"
    assert not parse(b"GET / HTTP/1.0\r\n\r\n").keep_alive  # type: ignore[union-attr]
    assert not parse(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").keep_alive  # type: ignore[union-attr]
    assert parse(b"PUT / HTTP/1.1\r\nHost: x\r\nExpect: 100-Continue\r\n\r\n").expect_continue  # type: ignore[union-attr]


def test_the_head_ends_at_its_first_empty_line_whatever_the_body_holds() -> None:
    buffer = bytearray(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\n\r\nab\n\ncd")
    request = http1.parse_head(buffer)
    assert request is not None and request.length == 6 and buffer == b"ab\n\ncd"
    buffer = bytearray(b"POST / HTTP/1.1\nHost: x\nContent-Length: 6\n\nab\r\n\r\n")  # bare, then CRLFs
    request = http1.parse_head(buffer)
    assert request is not None and request.headers[-1] == (b"content-length", b"6") and buffer == b"ab\r\n\r\n"
    long_line = b"GET / HTTP/1.1\r\nX-A: " + b"a" * http1.MAX_HEAD + b"\n\n"
    with pytest.raises(http1.BadRequest) as info:
        parse(long_line)
    assert info.value.status == 431


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
    with pytest.raises(http1.BadRequest) as refused:
        parse(head)
    assert refused.value.status == status


def test_repeated_equal_lengths_are_one_length() -> None:
    request = parse(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3, 3\r\n\r\n")
    assert request is not None and request.length == 3


def body(head: bytes, pieces: list[bytes]) -> tuple[bytes, bool, bytes]:
    """Feed ``pieces`` one by one; the body read, whether it ended, and what is left in the buffer."""
    request = parse(head)
    assert request is not None
    reader, buffer, out = http1.BodyReader(request), bytearray(), b""
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
    with pytest.raises(http1.BadRequest):
        body(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", [wire])


def test_a_length_body_takes_its_length_only() -> None:
    assert body(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n", [b"a", b"bcGET"]) == (b"abc", True, b"GET")


def test_response_framing() -> None:
    get = parse(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    head = parse(b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n")
    old = parse(b"GET / HTTP/1.0\r\n\r\n")
    assert get is not None and head is not None and old is not None
    sized = http1.ResponseFraming(get, 200, [(b"content-length", b"2")])
    expected = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ndate: D\r\n\r\n"
    assert sized.head(200, [(b"content-length", b"2")], b"D") == expected
    assert sized.piece(b"abc") == b"ab" and sized.end() == (b"", True)
    short = http1.ResponseFraming(get, 200, [(b"content-length", b"5")])
    assert short.piece(b"ab") == b"ab" and short.end() == (b"", False)  # cut short: the connection must close
    chunked = http1.ResponseFraming(get, 200, [])
    assert b"transfer-encoding: chunked\r\n" in chunked.head(200, [], b"D")
    assert chunked.piece(b"hello") == b"5\r\nhello\r\n" and chunked.end() == (b"0\r\n\r\n", True)
    bodiless = http1.ResponseFraming(head, 200, [(b"content-length", b"5")])
    assert bodiless.piece(b"hello") == b"" and bodiless.end() == (b"", True)
    until_close = http1.ResponseFraming(old, 200, [])
    assert until_close.close and b"connection: close\r\n" in until_close.head(200, [], b"D")
    said = http1.ResponseFraming(get, 200, [(b"connection", b"close")])
    assert said.close and said.head(200, [(b"connection", b"close")], b"D").count(b"connection") == 1
    with pytest.raises(ValueError):
        sized.head(200, [(b"x", b"a\r\nInjected: 1")], b"D")
    assert http1.error_response(431, b"D").startswith(b"HTTP/1.1 431 Request Header Fields Too Large\r\n")
