from __future__ import annotations

import gc
import json
from typing import Any

import trio
import trio.testing

from actorproxy.serve import RunningProxy


def _garbage_of_actorproxy() -> list[str]:
    names = []
    for o in gc.garbage:
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
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        await turn(messages)
        gc.collect()
        left = _garbage_of_actorproxy()
        total = len(gc.garbage)
        kinds = sorted(type(o).__name__ for o in gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    await stream.aclose()
    assert left == [] and total == 0, (left, total, kinds)
