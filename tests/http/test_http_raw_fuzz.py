"""Raw bytes to the proxy's own HTTP/1.1 server (actorproxy/http/server.py with the proxy's policy,
server/http_server.py): never a 5xx, never a hang, never a stop.

The route fuzz (test_fuzz_routes.py) sends well-framed HTTP with bad bodies through
httpx. This one sends what no client library would, on a fresh socket each: request
lines and headers built from hostile pieces (bytes outside ASCII, NUL, bare LF, HTTP/2
and HTTP/1.0 request lines, absolute-form and ``*`` targets, negative, huge and
conflicting Content-Length, chunked bodies cut short, ``Expect: 100-continue``, a
pipelined request behind the body), then either half-closes the socket or waits for
the answer. Every answer must be below 500; an error with a body is JSON in the format
of the route it names (Anthropic's on ``/v1/messages``, OpenAI's elsewhere), one
without a body (h11 could not parse the request) closes the connection. A half-closed
connection must be closed by the server within the socket's timeout: that is "never a
hang", and after every case ``/health`` must answer on a fresh connection. At the end
a bystander session's record is unchanged and a real turn still succeeds. Also: heads
that arrive a few bytes at a time or never finish (slowloris), and pipelined requests.
Derandomized, so CI sees the same cases each run.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote_to_bytes

import attrs
import httpx
import pytest
from _util import proxy_in_thread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actorproxy import ProxyConfig

#: No exchange may take longer than this (the sockets' own timeout): past it, the server hangs.
TIMEOUT = 10.0
#: How long a connection that was not half-closed waits for an answer before it half-closes.
ANSWER_WAIT = 1.0

BODY = b'{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}'
METHODS = [b"POST", b"POST", b"POST", b"GET", b"PUT", b"OPTIONS", b"BREW", b"", b"G\xffT", b"POST "]
TARGETS = [b"/v1/chat/completions", b"/v1/messages", b"/v1/responses", b"/generate", b"/sess/raw/v1/chat/completions",
           b"/t/p/v1/messages", b"/health", b"/v1/models", b"/session/finalize", b"*", b"http://h/v1/chat/completions",
           b"/%ff%fe", b"/v1/%00", b"/health?a=%", b"//v1/messages", b"/\xff", b"/" + b"a" * 9000, b""]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2", b"HTTP/1.1 x", b"http/1.1"]
EOLS = [b"\r\n", b"\r\n", b"\r\n", b"\n"]
HEADERS = [
    b"Expect: 100-continue", b"Content-Type: application/json", b"Connection: close", b"X-Session-Id: raw",
    b"X-Session-Id: \xff\xfe", b"Authorization: Bearer nope", b"X: " + b"a" * 20000, b"Bad Header", b": empty",
    b"X:\x00", b"X-Turn-Id: t1", b"Connection: keep-alive, upgrade", b"Upgrade: h2c", b" folded",
]
BODIES = [BODY, BODY, b"{", b"\xff\x00", b"", b"[]", b'{"model":"m","input":"hi","max_output_tokens":4}',
          b'{"session_id":"raw"}']
#: How the body is framed: its length, chunked, or a lie about either.
FRAMINGS = ["length", "length", "length", "chunked", "short", "long", "negative", "huge", "twice", "none",
            "bad-chunk", "unfinished-chunks", "gzip", "chunked-twice"]
TRAILERS = [b"", b"", b"", b"GET /health HTTP/1.1\r\n\r\n", b"\x00\x01garbage"]


def frame(body: bytes, framing: str) -> tuple[list[bytes], bytes]:
    """The framing headers and the body as sent."""
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
    return {
        "length": ([b"Content-Length: %d" % len(body)], body),
        "chunked": ([b"Transfer-Encoding: chunked"], chunked),
        "short": ([b"Content-Length: %d" % (len(body) + 5)], body),  # never completes
        "long": ([b"Content-Length: %d" % max(0, len(body) - 3)], body),  # the rest reads as the next request
        "negative": ([b"Content-Length: -1"], body),
        "huge": ([b"Content-Length: 99999999999"], body),
        "twice": ([b"Content-Length: %d" % len(body), b"Content-Length: 3"], body),
        "none": ([], body),
        "bad-chunk": ([b"Transfer-Encoding: chunked"], b"zz\r\n" + body),
        "unfinished-chunks": ([b"Transfer-Encoding: chunked"], chunked[:-7]),
        "gzip": ([b"Transfer-Encoding: gzip, chunked"], chunked),
        "chunked-twice": ([b"Transfer-Encoding: chunked", b"Transfer-Encoding: chunked"], chunked),
    }[framing]


@st.composite
def raw_requests(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A request built from hostile pieces, and its target.

    A third are well-formed but for their target and body (so the routes are reached), a
    third have one hostile piece, a third are hostile throughout.
    """
    hostility = draw(st.integers(0, 2))
    spoiled = draw(st.sampled_from(["method", "target", "version", "eol", "host", "framing", "headers", "body",
                                    "blank"]))

    def piece(name: str, good: list[Any], bad: list[Any]) -> Any:
        sane = hostility == 0 or (hostility == 1 and name != spoiled)
        return draw(st.sampled_from(good if sane else good + bad))

    eol = piece("eol", [b"\r\n"], EOLS)
    target = piece("target", TARGETS[:7], TARGETS)
    method, version = piece("method", [b"POST", b"GET"], METHODS), piece("version", [b"HTTP/1.1"], VERSIONS)
    line = method + b" " + target + b" " + version
    framing, body = frame(piece("body", [BODY], BODIES), piece("framing", ["length", "chunked"], FRAMINGS))
    headers = [b"Host: x"] if piece("host", [True], [False]) else []
    headers += framing + piece("headers", [[], [b"Content-Type: application/json"], [b"X-Session-Id: raw"]],
                               [draw(st.lists(st.sampled_from(HEADERS), max_size=3))])
    headers = draw(st.permutations(headers))
    blank = piece("blank", [eol], [b""])
    return eol.join([line, *headers, b""]) + blank + body + piece("trailer", [b""], TRAILERS), target


@attrs.frozen
class Reply:
    status: int
    headers: dict[bytes, bytes]
    body: bytes


def parse_replies(data: bytes) -> tuple[list[Reply], bool]:
    """The complete responses in ``data`` (interim 1xx ones skipped), and whether ``data`` ends after one."""
    replies: list[Reply] = []
    while data:
        head_end = data.find(b"\r\n\r\n")
        if head_end < 0:
            return replies, False
        status_line, *lines = data[:head_end].split(b"\r\n")
        assert status_line.startswith(b"HTTP/1.1 "), data[:200]
        status = int(status_line[9:12])
        headers = {}
        for line in lines:
            name, _, value = line.partition(b":")
            headers[name.strip().lower()] = value.strip()
        data = data[head_end + 4:]
        if status < 200:
            continue
        if headers.get(b"transfer-encoding") == b"chunked":
            body = b""
            while True:
                size_end = data.find(b"\r\n")
                if size_end < 0:
                    return replies, False
                size = int(data[:size_end], 16)
                if len(data) < size_end + 2 + size + 2:
                    return replies, False
                body += data[size_end + 2:size_end + 2 + size]
                data = data[size_end + 2 + size + 2:]
                if size == 0:
                    break
        else:
            length = int(headers[b"content-length"])  # the server always frames its replies
            if len(data) < length:
                return replies, False
            body, data = data[:length], data[length:]
        replies.append(Reply(status, headers, body))
    return replies, True


def exchange(address: tuple[str, int], data: bytes, *, half_close: bool) -> bytes:
    """Send ``data`` on a fresh connection; what comes back, read until the server closes the connection.

    Without ``half_close`` the client first waits up to ``ANSWER_WAIT`` for a whole answer (a
    request still incomplete gets none), then half-closes. Once half-closed, the server must
    close within ``TIMEOUT``: a ``TimeoutError`` here is a hang.
    """
    received = b""
    with socket.create_connection(address, timeout=TIMEOUT) as sock:
        try:
            sock.sendall(data)
        except ConnectionError:  # the server answered and closed before reading it all (a 4xx): fine
            half_close = True
        if not half_close:
            sock.settimeout(ANSWER_WAIT)
            try:
                while not (parse_replies(received)[0]) and (chunk := sock.recv(65536)):
                    received += chunk
            except TimeoutError:
                pass
            sock.settimeout(TIMEOUT)
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # already reset by the server
            pass
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass
    return received


def check_error_format(target: bytes, reply: Reply) -> None:
    """A 4xx: JSON in its route's format when it has a body; otherwise h11 refused the request (and closes)."""
    if not reply.body:
        assert reply.headers.get(b"connection") == b"close", reply
        return
    body = json.loads(reply.body)
    if b"/v1/messages" in unquote_to_bytes(target.partition(b"?")[0]):
        assert body["type"] == "error" and isinstance(body["error"]["message"], str), (target[:100], body)
    else:
        assert isinstance(body["error"]["message"], str) and body["error"]["type"], (target[:100], body)


def health_answers(address: tuple[str, int]) -> bool:
    """``GET /health`` on a fresh connection answers 200 within the socket's timeout."""
    replies, _ = parse_replies(exchange(address, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", half_close=False))
    return [reply.status for reply in replies] == [200]


@pytest.fixture(scope="module")
def live_proxy(tokenizer: Any) -> Iterator[tuple[str, int]]:
    with proxy_in_thread(tokenizer, ProxyConfig.of(port=0), seed=5) as url:
        host, port = url.rsplit("//", 1)[1].rsplit(":", 1)
        yield host, int(port)


def turn(address: tuple[str, int], session: str) -> httpx.Response:
    return httpx.post(f"http://{address[0]}:{address[1]}/v1/chat/completions", content=BODY, timeout=60,
                      headers={"content-type": "application/json", "x-session-id": session})


def describe(address: tuple[str, int], session: str) -> Any:
    return httpx.get(f"http://{address[0]}:{address[1]}/session/{session}", timeout=60).json()


def test_raw_requests_never_get_a_5xx_nor_hang_and_the_server_still_serves(live_proxy: tuple[str, int]) -> None:
    assert turn(live_proxy, "bystander").status_code == 200
    before = describe(live_proxy, "bystander")
    statuses: dict[int, int] = {}

    @settings(max_examples=120, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(generated=raw_requests(), half_close=st.booleans())
    def one(generated: tuple[bytes, bytes], half_close: bool) -> None:
        request, target = generated
        received = exchange(live_proxy, request, half_close=half_close)
        replies, whole = parse_replies(received)
        assert whole, (request[:300], received[-300:])  # nothing cut short: every answer is framed
        for number, reply in enumerate(replies):
            statuses[reply.status] = statuses.get(reply.status, 0) + 1
            assert reply.status < 500, (request[:300], reply)
            if reply.status >= 400 and number == 0:
                check_error_format(target, reply)
        assert health_answers(live_proxy), request[:300]  # the server was not stopped by it

    one()
    assert statuses.get(200, 0) >= 10 and statuses.get(400, 0) >= 10, statuses  # the cases reached the routes
    assert describe(live_proxy, "bystander") == before  # nothing recorded was touched
    assert turn(live_proxy, "bystander").status_code == 200  # a real turn still succeeds, and is recorded
    steps = describe(live_proxy, "bystander")
    assert steps["steps"] == before["steps"] + 1, steps


def test_heads_that_trickle_in_or_never_finish_hold_nobody_up(live_proxy: tuple[str, int]) -> None:
    """Slowloris: 50 connections each holding a partial head; a trickled request; meanwhile others are served."""
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    partial = [socket.create_connection(live_proxy, timeout=TIMEOUT) for _ in range(50)]
    try:
        for number, sock in enumerate(partial):
            sock.sendall(head[: 10 + number])
        trickled = socket.create_connection(live_proxy, timeout=TIMEOUT)
        with trickled:
            request = head + b"X-Session-Id: trickle\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
            for start in range(0, len(request), 7):
                trickled.sendall(request[start:start + 7])
                if start == 70:  # halfway through the head: the server keeps serving everyone else
                    assert health_answers(live_proxy)
                    assert turn(live_proxy, "while-trickling").status_code == 200
            received = b""
            while not parse_replies(received)[0]:
                chunk = trickled.recv(65536)
                assert chunk, received
                received += chunk
        replies, _ = parse_replies(received)
        assert [reply.status for reply in replies] == [200]
        assert json.loads(replies[0].body)["choices"][0]["message"]["role"] == "assistant"
        # A held connection finishes its head at last, and is answered like any other.
        partial[0].sendall(head[10:] + b"Content-Length: 1\r\n\r\n{")
        replies, _ = parse_replies(partial[0].recv(65536))
        assert [reply.status for reply in replies] == [400]
        assert json.loads(replies[0].body)["error"]["type"]
    finally:
        for sock in partial:
            sock.close()
    assert health_answers(live_proxy)


def test_pipelined_requests_are_answered_in_order_and_a_bad_one_ends_the_connection(
    live_proxy: tuple[str, int]
) -> None:
    anthropic = b'{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}'
    pipelined = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Session-Id: pipe\r\nContent-Length: %d\r\n\r\n%s"
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
        b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nX-Session-Id: pipe-a\r\nContent-Length: 1\r\n\r\n{"
        b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nX-Session-Id: pipe-a\r\nContent-Length: %d\r\n\r\n%s"
        b"NOT HTTP\r\n\r\n"
        b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    ) % (len(BODY), BODY, len(anthropic), anthropic)
    with socket.create_connection(live_proxy, timeout=TIMEOUT) as sock:
        sock.sendall(pipelined)
        received = b""
        while chunk := sock.recv(65536):  # the bad request ends the connection: read to its close
            received += chunk
    replies, whole = parse_replies(received)
    assert whole
    assert [reply.status for reply in replies] == [200, 200, 400, 200, 400], received[-500:]
    assert json.loads(replies[0].body)["object"] == "chat.completion"
    assert json.loads(replies[1].body)["status"] == "ok"
    assert json.loads(replies[2].body)["type"] == "error"  # Anthropic's format on /v1/messages
    assert json.loads(replies[3].body)["type"] == "message"
    assert replies[4].body == b"" and replies[4].headers[b"connection"] == b"close"
    assert describe(live_proxy, "pipe")["steps"] == 1 and describe(live_proxy, "pipe-a")["steps"] == 1
