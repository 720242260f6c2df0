"""Hostile input at the edge (issue 11): each finding a test, over a real hypercorn socket.

Every bad request gets a 4xx in its route's own format (OpenAI ``{"error":
{...}}``, Anthropic ``{"type": "error", ...}``), and a kept-alive connection
keeps answering after it.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from actorproxy.serve import RunningProxy
from actorproxy.sim import SimConfig, SimEngine

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
HELLO = [{"role": "user", "content": "hello"}]
ANTHROPIC = {"model": "m", "max_tokens": 20, "messages": HELLO}


@pytest.fixture
async def engine(tokenizer: Any) -> SimEngine:
    """This module's engine (conftest's ``proxy`` and ``http`` serve it)."""
    return SimEngine(tokenizer, SimConfig(seed=3, token_interval=0.0))


def assert_error(response: httpx.Response, status: int, path: str) -> dict[str, Any]:
    """The response is ``status`` with a body in ``path``'s error format; the error object."""
    assert response.status_code == status, (path, response.status_code, response.text[:300])
    body = response.json()
    if "/v1/messages" in path:
        assert body["type"] == "error" and body["error"]["message"], body
    else:
        assert body["error"]["message"] and body["error"]["type"], body
    return dict(body["error"])


#: Every route that reads a JSON body.
JSON_ROUTES = [CHAT, MESSAGES, "/v1/messages/count_tokens", "/v1/responses", "/session/finalize",
               "/trajectory/read", "/v1/rollout/pause", "/v1/rollout/resume", "/session/open"]


async def test_deep_json_is_a_400_on_every_route(http: httpx.AsyncClient) -> None:
    """Finding 3: nesting past Python's recursion limit was a RecursionError and a 500."""
    for depth in (150, 5000):
        deep = b"[" * depth + b"]" * depth
        wrapped = b'{"messages": ' + deep + b"}"
        for path in JSON_ROUTES:
            for body in (deep, wrapped):
                response = await http.post(path, content=body, headers={"content-type": "application/json"})
                assert_error(response, 400, path)


async def test_huge_numbers_are_a_400(http: httpx.AsyncClient) -> None:
    """Finding 3: a 400-digit integer for reward, temperature or top_p was an OverflowError and a 500."""
    huge = "1" + "0" * 400
    await http.post(CHAT, json={"messages": HELLO}, headers={"X-Session-Id": "n"})
    cases = [("/session/finalize", f'{{"session_id": "n", "reward": {huge}}}'),
             ("/session/finalize", f'{{"session_id": "n", "reward": -{huge}}}'),
             (CHAT, f'{{"messages": [{{"role": "user", "content": "x"}}], "temperature": {huge}}}'),
             (CHAT, f'{{"messages": [{{"role": "user", "content": "x"}}], "top_p": {huge}}}'),
             (CHAT, f'{{"messages": [{{"role": "user", "content": "x"}}], "max_tokens": {huge}}}'),
             (MESSAGES, json.dumps(ANTHROPIC)[:-1] + f', "temperature": {huge}}}'),
             (MESSAGES, json.dumps(ANTHROPIC)[:-1] + ', "top_p": 1e400}')]
    for path, body in cases:
        response = await http.post(path, content=body.encode(), headers={"X-Session-Id": "n"})
        assert_error(response, 400, path)
    # 20 digits: valid JSON, out of range.
    response = await http.post(CHAT, json={"messages": HELLO, "temperature": 10**20}, headers={"X-Session-Id": "n"})
    assert assert_error(response, 400, CHAT)["param"] == "temperature"


async def test_lone_surrogates_are_a_400_and_a_drain_delivers_everything(http: httpx.AsyncClient) -> None:
    """Finding 2: a lone surrogate was accepted, and a later drain answered 500 after deleting data."""
    bystander = await http.post(CHAT, json={"messages": HELLO}, headers={"X-Session-Id": "bystander"})
    assert bystander.status_code == 200
    await http.post("/session/finalize", json={"session_id": "bystander"})
    bad = '"\\udc80"'
    cases = [(CHAT, f'{{"model": {bad}, "messages": [{{"role": "user", "content": "hi"}}]}}'),
             (CHAT, f'{{"messages": [{{"role": "user", "content": "hi", "name": {bad}}}]}}'),
             (CHAT, f'{{"messages": [{{"role": "user", "content": "hi", "extra": {bad}}}]}}'),
             (CHAT, f'{{"messages": [{{"role": "user", "content": {bad}}}]}}'),
             (MESSAGES, f'{{"model": {bad}, "max_tokens": 5, "messages": [{{"role": "user", "content": "hi"}}]}}'),
             ("/session/finalize", f'{{"session_id": {bad}}}'),
             ("/trajectory/read", f'{{"session_id": {bad}}}')]
    for path, body in cases:
        response = await http.post(path, content=body.encode(), headers={"X-Session-Id": "s"})
        assert_error(response, 400, path)
    # Raw invalid UTF-8 too.
    response = await http.post(CHAT, content=b'{"messages": [{"role": "user", "content": "\xff"}]}',
                               headers={"X-Session-Id": "s"})
    assert_error(response, 400, CHAT)
    drained = await http.post("/trajectory/read", json={"drain": True, "include_steps": True})
    assert drained.status_code == 200
    assert [s["parent_traj_id"] for s in drained.json()["data"]] == ["bystander"]


async def test_message_fields_are_typed_at_the_edge(http: httpx.AsyncClient) -> None:
    """Finding 1 (the edge half): a non-string ``name`` or ``tool_call_id`` crashed the session actor."""
    first = await http.post(CHAT, json={"messages": HELLO}, headers={"X-Session-Id": "s1"})
    assert first.status_code == 200
    other_system = {"role": "system", "content": "You are someone else."}
    for field, value, where in (("name", {}, "messages[1].name"), ("tool_call_id", [1], "messages[1].tool_call_id")):
        body = {"messages": [other_system, {"role": "user", "content": "hi", field: value}]}
        error = assert_error(await http.post(CHAT, json=body, headers={"X-Session-Id": "s1"}), 400, CHAT)
        assert error["param"] == where, error
    # The session and the process are fine.
    again = await http.post(CHAT, json={"messages": HELLO}, headers={"X-Session-Id": "s2"})
    assert again.status_code == 200


async def test_get_on_a_post_only_route_is_a_405(http: httpx.AsyncClient) -> None:
    """Finding 10: ``GET /session/finalize`` was taken for a session named "finalize" (404)."""
    for path in ("/session/finalize", "/session/open"):
        response = await http.get(path)
        assert_error(response, 405, path)
        assert response.headers["allow"].split(", ").count("POST") == 1
    # A session that really is called so can still be described where no route is in the way.
    assert (await http.get("/session/no-such-session")).status_code == 404


async def _exchange(stream: trio.SocketStream, request: bytes, buffer: bytearray) -> int:
    """Send one request and read its response (Content-Length framed); its status."""
    await stream.send_all(request)
    while b"\r\n\r\n" not in buffer:
        data = await stream.receive_some(65536)
        assert data, "the server closed the kept-alive connection"
        buffer += data
    head, _, _ = bytes(buffer).partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    length = next(int(line.split(b":")[1]) for line in lines if line.lower().startswith(b"content-length:"))
    assert b"connection: close" not in head.lower()
    needed = len(head) + 4 + length
    while len(buffer) < needed:
        data = await stream.receive_some(65536)
        assert data, "the server closed the connection mid-response"
        buffer += data
    del buffer[:needed]
    return int(lines[0].split()[1])


async def test_a_kept_alive_connection_answers_after_404_and_405_with_unread_bodies(proxy: RunningProxy) -> None:
    """Finding 5: a route that answered before reading a big body left the connection to be closed
    (abortively) under the client's next request, which was never answered."""
    host, port = proxy.url.removeprefix("http://").split(":")
    big = json.dumps({"messages": [{"role": "user", "content": "hi " * 400_000}]}).encode()
    small = json.dumps({"messages": HELLO, "max_tokens": 4}).encode()

    def post(method: bytes, path: bytes, body: bytes, extra: bytes = b"") -> bytes:
        return (method + b" " + path + b" HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n" + extra
                + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    health = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
    sequence = [
        (post(b"POST", b"/no/such/route", big), 404),
        (health, 200),
        (post(b"PUT", CHAT.encode(), big), 405),
        (post(b"POST", CHAT.encode(), small, b"X-Session-Id: k\r\n"), 200),
        (post(b"POST", b"/v1/no-such", big), 404),
        (b"GET /nope HTTP/1.1\r\nHost: t\r\n\r\n", 404),
        (post(b"POST", b"/v1/rollout/nothing", big), 404),
        (health, 200),
    ] * 3
    stream = await trio.open_tcp_stream(host, int(port))
    buffer = bytearray()
    async with stream:
        with trio.fail_after(60):
            statuses = [await _exchange(stream, request, buffer) for request, _ in sequence]
    assert statuses == [status for _, status in sequence]


async def test_unused_message_fields_are_not_kept(http: httpx.AsyncClient) -> None:
    """Finding 6: fields no template reads were kept raw on every step, uncounted (10 × 20 MB → +180 MB).

    A recorded message keeps only what the chat template and the echo matching
    read, so what a session holds is bounded by what it was charged in tokens.
    """
    junk = "x" * 2_000_000
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief", "x_blob": junk},
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"pad": junk}}], "meta": junk},
    ]
    sid = {"X-Session-Id": "fat"}
    for turn in range(5):
        response = await http.post(CHAT, json={"messages": messages, "x_top": junk}, headers=sid)
        assert response.status_code == 200, response.text[:300]
        reply = response.json()["choices"][0]["message"]
        messages += [{**reply, "client_note": junk}, {"role": "user", "content": f"more {turn}", "x": junk}]
    assert (await http.post("/session/finalize", json={"session_id": "fat"})).status_code == 200
    read = await http.post("/trajectory/read", json={"session_id": "fat", "include_steps": True})
    assert read.status_code == 200
    # 5 turns sent ~30 MB of unused fields; what is kept is the conversation itself.
    assert len(read.content) < 200_000, len(read.content)
    [segment] = read.json()["data"]
    assert segment["num_steps"] == 5  # one segment: dropping the fields did not break the append-only match
    first = read.json()["steps"][0]["new_messages"]
    assert first[0] == {"role": "system", "content": "be brief"}
    assert first[1] == {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    assert all("client_note" not in m for step in read.json()["steps"] for m in step["new_messages"])


def test_a_template_that_reads_a_field_keeps_it() -> None:
    """Only fields no template can read go: a template naming one, or reading messages whole, keeps it."""
    from actorproxy.tokenization.message_fields import cut_message, template_message_fields

    message = {"role": "user", "content": "hi", "thinking": "t", "x_blob": "junk"}
    reads_thinking = "{% for m in messages %}{{ m.role }}{{ m.content }}{{ m.get('thinking', '') }}{% endfor %}"
    assert cut_message(message, template_message_fields(reads_thinking)) == {
        "role": "user", "content": "hi", "thinking": "t"}
    for whole in ("{% for m in messages %}{{ m | tojson }}{% endfor %}",
                  "{% for m in messages | reverse %}{% for k, v in m.items() %}{{ v }}{% endfor %}{% endfor %}",
                  "{% set last = messages[-1] %}{{ last }}",
                  "{% macro show(x) %}{{ x }}{% endmacro %}{% for m in messages %}{{ show(m) }}{% endfor %}"):
        fields = template_message_fields(whole)
        assert fields is None, whole
        assert cut_message(message, fields) == message
    plain = template_message_fields("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert cut_message(message, plain) == {"role": "user", "content": "hi"}
