"""What a client can hold of the HTTP server, on the real server (issue 28 §15, §16).

A response decided from the head (a 413 from ``Content-Length``, a ``GET``) goes out
at once, whatever the body does; a body that comes slower than the minimum rate
after the grace period gets a 408 in the caller's format. The clock is Trio's
MockClock (it jumps when every task waits), so times are exact and nothing sleeps.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from actorproxy import ProxyConfig, open_proxy
from actorproxy.http.server import ConnectionLimits
from actorproxy.serve import RunningProxy

GRACE, RATE = ConnectionLimits().body_grace, ConnectionLimits().body_min_rate


async def _connect(proxy: RunningProxy) -> trio.SocketStream:
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


async def _response(stream: trio.SocketStream) -> tuple[int, dict[str, str], bytes]:
    """One response (Content-Length framed): status, headers, body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        assert chunk, data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        body += await stream.receive_some(65536)
    return int(lines[0].split()[1]), headers, body


async def _closed(stream: trio.SocketStream) -> bool:
    try:
        return await stream.receive_some(65536) == b""
    except trio.BrokenResourceError:
        return True


@pytest.mark.parametrize(("head", "status"), [
    (b"GET /health HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\n", 200),
    (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 104857600\r\n\r\n", 413),
    (b"POST /sess/a/v1/messages HTTP/1.1\r\nhost: x\r\ncontent-length: 104857600\r\n\r\n", 413),
    (b"POST /session/finalize HTTP/1.1\r\nhost: x\r\ncontent-length: 104857600\r\n\r\n", 413),
    (b"POST /no/such/route HTTP/1.1\r\nhost: x\r\ncontent-length: 104857600\r\n\r\n", 404),
])
async def test_what_the_head_decides_is_answered_at_once(autojump_clock: Any, proxy: RunningProxy, head: bytes,
                                                         status: int) -> None:
    """A body promised and never sent delayed even these answers 60 s (§15)."""
    async with await _connect(proxy) as stream:
        await stream.send_all(head)
        start = trio.current_time()
        got, headers, _ = await _response(stream)
        assert (got, trio.current_time() - start) == (status, 0)
        if status != 200:  # a body too big to read after the answer: the connection ends with it
            assert headers.get("connection") == "close"
            assert await _closed(stream)
        else:  # the body might still come (and be dropped): the connection waits for it as long as the bound says
            assert await _closed(stream)
            assert trio.current_time() - start == pytest.approx(GRACE)


async def test_an_answer_before_a_100_continue_closes_the_connection(autojump_clock: Any, engine: Any,
                                                                     tokenizer: Any) -> None:
    """A client that waits for ``100 Continue`` may never send the body: what it sends next is no body.

    The turn lane refuses a call without the API key before it asks for the body (no 100 goes out).
    """
    async with open_proxy(ProxyConfig.of(port=0, api_key="k"), backend=engine, tokenizer=tokenizer) as running:
        async with await _connect(running) as stream:
            await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
                                  b"content-length: 20\r\n\r\n")
            start = trio.current_time()
            status, headers, _ = await _response(stream)
            assert (status, headers.get("connection"), trio.current_time() - start) == (401, "close", 0)
            assert await _closed(stream)


async def test_a_body_that_stops_gets_a_408_after_the_grace(autojump_clock: Any, proxy: RunningProxy) -> None:
    """A body cut short held the connection for 600 s (§16): now the grace, then 408 in the caller's format."""
    for path, anthropic in ((b"/v1/chat/completions", False), (b"/v1/messages", True), (b"/session/finalize", False)):
        async with await _connect(proxy) as stream:
            await stream.send_all(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                                  b"x-session-id: s\r\ncontent-length: 5000\r\n\r\n{\"messages\": " % path)
            start = trio.current_time()
            status, headers, body = await _response(stream)
            assert (status, trio.current_time() - start) == (408, GRACE)
            assert headers["connection"] == "close"
            error = json.loads(body)
            if anthropic:
                assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
            else:
                assert error["error"]["code"] == "request_timeout"
            assert "bytes/s" in (error["error"]["message"])
            assert await _closed(stream)
    # The turn routes answer it themselves: counted and logged as a 408, not as a client that went away.
    async with httpx.AsyncClient(base_url=proxy.url) as http:
        metrics = (await http.get("/metrics")).text
    assert 'actorproxy_requests_total{method="POST",route="/v1/chat/completions",status="408"} 1.0' in metrics
    assert 'actorproxy_requests_total{method="POST",route="/v1/messages",status="408"} 1.0' in metrics
    assert 'actorproxy_requests_total{method="POST",route="/session/finalize",status="408"} 1.0' in metrics
    assert 'status="499"' not in metrics


async def test_a_trickling_body_is_given_up_when_its_rate_falls_under_the_bound(
        autojump_clock: Any, proxy: RunningProxy) -> None:
    """A byte every few seconds keeps no connection: after the grace the average rate must hold."""
    async with await _connect(proxy) as stream:
        await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-session-id: s\r\n"
                              b"content-length: 1000000\r\n\r\n")
        start = trio.current_time()
        sent = 0
        async with trio.open_nursery() as nursery:
            async def trickle() -> None:
                nonlocal sent
                while True:
                    await stream.send_all(b" " * 4096)
                    sent += 4096
                    await trio.sleep(4)  # 1 KiB/s: a quarter of the bound
            nursery.start_soon(trickle)
            status, _, _ = await _response(stream)
            nursery.cancel_scope.cancel()
        assert status == 408
        # Given up when the bytes that came no longer kept up with the rate, past the grace.
        assert trio.current_time() - start == pytest.approx(max(GRACE, sent / RATE))


async def test_a_slow_but_steady_body_is_taken(autojump_clock: Any, proxy: RunningProxy) -> None:
    """A body above the minimum rate may take longer than the grace: it is served."""
    content = json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}], "max_tokens": 2}).encode()
    async with await _connect(proxy) as stream:
        await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                              b"x-session-id: steady\r\ncontent-length: %d\r\n\r\n" % len(content))
        start = trio.current_time()
        piece = int(RATE * 1.5)  # 1.5 times the bound, a piece a second
        for at in range(0, len(content), piece):
            await stream.send_all(content[at:at + piece])
            await trio.sleep(1)
        status, _, _ = await _response(stream)
        assert status == 200
        assert trio.current_time() - start > GRACE
