from __future__ import annotations

import json
import types
from typing import Any

import trio
import trio.testing
from _util import garbage_found

from actorproxy.serve import RunningProxy


def _garbage_of_actorproxy(garbage: list[object]) -> list[str]:
    names = []
    for o in garbage:
        owner = getattr(o, "__self__", None) if type(o).__name__ == "method" else o
        if type(owner).__module__.startswith("actorproxy"):
            names.append(type(owner).__name__ + (".method" if owner is not o else ""))
    return sorted(set(names))


async def test_a_served_turn_is_freed_by_reference_counting(proxy: RunningProxy) -> None:
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))

    async def turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
        body = json.dumps({"model": "m", "messages": messages, "max_tokens": 8, "session_id": "s"}).encode()
        await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                              b"content-length: %d\r\n\r\n%s" % (len(body), body))
        data = b""
        while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + int(
                data.split(b"content-length: ")[1].split(b"\r\n")[0]):
            data += await stream.receive_some()
        await trio.testing.wait_all_tasks_blocked()
        return json.loads(data.split(b"\r\n\r\n", 1)[1])

    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    first = await turn(messages)
    messages += [first["choices"][0]["message"], {"role": "user", "content": "more"}]
    with garbage_found() as garbage:
        await turn(messages)
    left = _garbage_of_actorproxy(garbage)
    total = len(garbage)
    kinds = sorted(type(o).__name__ for o in garbage)
    await stream.aclose()
    assert left == [] and total == 0, (left, total, kinds)


_IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 4096}}
#: Refusals of every kind, on every route family: each must leave nothing for the cyclic collector (issue 28 §3:
#: a refused 20 MB body was held by a traceback cycle until the collector ran, +20 MB per request).
_REFUSED = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [_IMAGE]}]}),
    ("/s/p/v1/chat/completions", {"messages": [{"role": "user", "content": [_IMAGE]}]}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": 9}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web"}]}),
    ("/v1/chat/completions", "{not json"),
    ("/v1/chat/completions", "[" * 200 + "]" * 200),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": "A" * 4096}}]}]}),
    ("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
                      "temperature": 9}),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}),
    ("/v1/responses", {"input": "x", "temperature": 9}),
    ("/generate", {"input_ids": "x"}),
    ("/session/finalize", {"session_id": 5}),
    ("/trajectory/read", {"limit": "x"}),
    ("/nowhere", {}),
]


def _werkzeug_matcher(o: Any) -> bool:
    """Part of the recursive closure werkzeug's URL matcher makes per match: a few cells, sets and
    strings, never the request (the rule's methods and the path)."""
    if isinstance(o, types.FunctionType):
        return o.__module__ == "werkzeug.routing.matcher"
    return isinstance(o, types.CellType | tuple | set)


async def test_a_refused_request_is_freed_by_reference_counting(proxy: RunningProxy) -> None:
    host, port = proxy.url.removeprefix("http://").rsplit(":", 1)

    async def refused(path: str, value: Any) -> int:
        body = value.encode() if isinstance(value, str) else json.dumps(value).encode()
        async with await trio.open_tcp_stream(host, int(port)) as stream:
            head = b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            await stream.send_all(head % (path.encode(), len(body)) + b"connection: close\r\n\r\n" + body)
            data = b""
            while chunk := await stream.receive_some():
                data += chunk
        await trio.testing.wait_all_tasks_blocked()
        return int(data.split(b" ", 2)[1])

    for path, value in _REFUSED:  # each code path once first: what it caches on first use is no garbage
        await refused(path, value)
    failures = []
    for path, value in _REFUSED:
        with garbage_found() as garbage:
            status = await refused(path, value)
        left = [o for o in garbage if not _werkzeug_matcher(o)]
        kinds = sorted({type(o).__name__ for o in left})
        total = len(left)
        assert 400 <= status < 500, (path, status)
        if total:
            failures.append((path, value if isinstance(value, str) else list(value)[:3], total, kinds))
    assert failures == [], "\n".join(map(str, failures))
