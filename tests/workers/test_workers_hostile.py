"""``actorproxy run --workers 2`` against hostile and careless clients: real processes on port 0.

What the router of a worker reads to find a request's owner (its head, and for some its
body) comes from anyone who reaches the port, before any check: it must never take a
worker down, never hold a connection it cannot serve, never read more than the single
process would, and find the session exactly where the app will.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import trio
from _workers import Proxy, run_workers
from _workers import client as new_connections

from actorproxy.workers.routing import owner

HELLO = [{"role": "user", "content": "hello"}]


def _of(worker: int, prefix: str) -> str:
    return next(f"{prefix}{i}" for i in range(100) if owner(f"{prefix}{i}", 2) == worker)


def _assert_alive(proxy: Proxy, pids: list[int]) -> None:
    """No worker exited or was restarted: the same pids serve, and the supervisor logged no exit."""
    assert "exited with code" not in proxy.log, proxy.log[-3000:]
    assert [proxy.worker_pid(0), proxy.worker_pid(1)] == pids


def _error_of(path: str, answer: Any) -> dict[str, Any]:
    body = answer.json()
    if "/v1/messages" in path:
        assert body["type"] == "error", body
    assert isinstance(body["error"]["message"], str) and body["error"]["type"], body
    return dict(body["error"])


async def test_deep_json_naming_no_session_in_its_head_is_a_400_and_no_worker_exits(tmp_path: Path) -> None:
    """Finding 1: the router decoded the body to find its owner; 3,000 levels raised RecursionError: worker gone."""
    deep = b"[" * 3000 + b"]" * 3000
    bodies = [deep, b'{"session_id": ' + deep + b"}", b'{"x": ' * 3000 + b"1" + b"}" * 3000]
    paths = ["/session/finalize", "/trajectory/read", "/v1/chat/completions", "/v1/messages", "/v1/responses"]
    async with run_workers(tmp_path) as proxy, new_connections(proxy) as client:
        pids = [proxy.worker_pid(0), proxy.worker_pid(1)]
        for _ in range(4):  # each on a new connection: both workers get some of each
            for path in paths:
                for body in bodies:
                    answer = await client.post(path, content=body, headers={"content-type": "application/json"})
                    assert answer.status_code == 400, (path, answer.text[:300])
                    _error_of(path, answer)
        health = await client.get("/health")
        assert health.status_code == 200 and "missing_workers" not in health.json()
        _assert_alive(proxy, pids)


async def test_a_turn_over_128_kib_naming_its_session_only_in_its_body_is_answered(tmp_path: Path) -> None:
    """Finding 4: the router waited for the whole body, the connection's reader stopped at 64 KiB: no answer."""
    async with run_workers(tmp_path) as proxy, new_connections(proxy) as client:
        for session in [_of(0, "big"), _of(1, "big")] * 2:
            body = {"session_id": session, "messages": HELLO, "max_tokens": 2, "user": "u" * 200_000}  # 200 KB
            with trio.fail_after(60):
                answer = await client.post("/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text[:300]
        listed = (await client.get("/sessions")).json()["data"]
        assert sorted((row["session_id"], row["steps"]) for row in listed) == sorted(
            [(_of(0, "big"), 2), (_of(1, "big"), 2)])  # each session on one worker: its owner


def _peak_rss(pid: int) -> int:
    """The process's peak resident memory so far (``VmHWM``), in bytes."""
    with open(f"/proc/{pid}/status") as status:
        return int(re.search(r"VmHWM:\s+(\d+) kB", status.read()).group(1)) * 1024  # type: ignore[union-attr]


async def test_a_control_routes_body_is_not_read_before_the_single_process_checks(tmp_path: Path) -> None:
    """Finding 5: the fan-out read a control route's whole body before any check, then copied it per worker."""
    big = b"{" + b" " * (100 << 20) + b"}"  # 100 MiB
    async with run_workers(tmp_path, "--admin-token", "secret") as proxy, new_connections(proxy) as client:
        pids = [proxy.worker_pid(0), proxy.worker_pid(1)]
        before = [_peak_rss(pid) for pid in pids]
        for _ in range(2):
            refused = await client.post("/health", content=big)  # no POST on /health
            assert refused.status_code == 405, refused.text[:300]
            unauthorized = await client.post("/trajectory/read", content=big)  # no admin token
            assert unauthorized.status_code == 401 and _error_of("/", unauthorized)["code"] == "admin_token_required"
            assert (await client.request("GET", "/trajectory/stats", content=b"{}x")).status_code == 401
        grown = [_peak_rss(pid) - was for pid, was in zip(pids, before, strict=True)]
        assert max(grown) < 32 << 20, grown  # nothing near the body's size was held
        token = {"authorization": "Bearer secret"}
        assert (await client.post("/trajectory/read", json={}, headers=token)).status_code == 200
        _assert_alive(proxy, pids)


async def _raw(proxy: Proxy, head: bytes, body: bytes) -> tuple[int, bytes]:
    """One request as raw bytes on a new connection (``connection: close``): its status and body."""
    host, port = proxy.url.rsplit("//", 1)[1].rsplit(":", 1)
    stream = await trio.open_tcp_stream(host, int(port))
    async with stream:
        await stream.send_all(head + b"connection: close\r\ncontent-length: %d\r\n\r\n" % len(body) + body)
        received = b""
        with trio.fail_after(60):
            while data := await stream.receive_some(65536):
                received += data
    status_line, _, rest = received.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


async def test_the_router_and_the_app_find_the_same_session(tmp_path: Path) -> None:
    """Finding 6: an absolute-form target, a ``//sess/...`` path and an empty first ``X-Session-Id``.

    Each names session A to the app while the router read session B (another worker's): A was
    then served live by two workers. Every request names A to both now, whichever form.
    """
    chat = json.dumps({"messages": HELLO, "max_tokens": 2}).encode()
    for a_worker in (0, 1):
        a, b = _of(a_worker, "a"), _of(1 - a_worker, "b")
        forms = [
            (b"POST http://h/sess/%s/v1/chat/completions HTTP/1.1\r\nhost: h\r\nx-session-id: %s\r\n", chat),
            (b"POST //sess/%s/v1/chat/completions HTTP/1.1\r\nhost: h\r\nx-session-id: %s\r\n", chat),
            (b"POST /v1/chat/completions HTTP/1.1\r\nhost: h\r\nx-session-id: \r\nx-session-id: %s\r\n",
             json.dumps({"session_id": a, "messages": HELLO, "max_tokens": 2}).encode()),
        ]
        (tmp_path / a).mkdir()
        async with run_workers(tmp_path / a) as proxy, new_connections(proxy) as client:
            sent = 0
            for _ in range(3):
                for head, body in forms:
                    names = (a.encode(), b.encode()) if head.count(b"%s") == 2 else (b.encode(),)
                    status, answer = await _raw(proxy, head % names, body)
                    assert status == 200, answer[:300]
                    ours = await client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2},
                                             headers={"x-session-id": a})
                    assert ours.status_code == 200
                    sent += 2
            listed = (await client.get("/sessions")).json()["data"]
            assert [(row["session_id"], row["steps"]) for row in listed] == [(a, sent)], listed


async def test_a_session_key_minted_by_one_worker_opens_its_session_on_every_worker(tmp_path: Path) -> None:
    """Without --session-key-secret or --admin-token each process drew its own secret: a key minted by one
    worker (POST /session/open lands on either) was refused (401) by the other."""
    async with run_workers(tmp_path, "--agent-auth", "session-key") as proxy, new_connections(proxy) as client:
        for number in range(6):
            opened = (await client.post("/session/open", json={"session_id": f"keyed-{number}"})).json()
            for _ in range(2):  # new connections: either worker gets the turn first
                answer = await client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2},
                                           headers={"authorization": f"Bearer {opened['api_key']}"})
                assert answer.status_code == 200, answer.text[:300]
