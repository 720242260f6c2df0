"""The workers' router and fan-out ask the app's own admission step (``server/admission.py``), as the app does.

In one process: the router and the fan-out, given an :class:`Admission`, leave a request it
refuses to the app where the request landed (no body read, nothing handed over or sent to the
other workers). As real processes: a table of requests the admission step refuses, sent to the
single process and to ``--workers 2`` on new connections (so that each lands on either worker,
and on a worker that does not own the session it names), gets the same status and body in both.
"""

from __future__ import annotations

import json
import zlib
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio
from _workers import client, run_workers

from actorproxy.server.admission import Admission
from actorproxy.server.auth import AccessPolicy
from actorproxy.server.http_server import HTTPServer
from actorproxy.workers.fanout import FanOut
from actorproxy.workers.handoff import Router

ADMIN = "admission-admin"


async def _here(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"here " + scope["path"].encode()})


def _of_worker(worker: int) -> str:
    return next(f"s{i}" for i in range(100) if zlib.crc32(f"s{i}".encode()) % 2 == worker)


async def test_a_request_the_admission_step_refuses_is_left_to_the_app_where_it_landed(tmp_path: Path) -> None:
    """Worker 1 is not there: whatever the router handed over or the fan-out sent on would be a 503."""
    admission = Admission(AccessPolicy.build(admin_token=ADMIN, api_key="the-key"), max_body=100, body_timeout=5.0)
    server = HTTPServer(FanOut(_here, 2, str(tmp_path), admission), router=Router(0, 2, str(tmp_path), admission))
    admin = {"authorization": f"Bearer {ADMIN}"}
    theirs = {"session_id": _of_worker(1), "pad": "x" * 200}  # over the admission step's body limit
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(server.serve, "127.0.0.1", 0, shutdown_trigger=stop.wait))
        async with httpx.AsyncClient(base_url=url) as http:
            with trio.fail_after(20):
                for path, headers, body in [
                    ("/session/finalize", admin, theirs),  # too big for the step: not read by the router
                    ("/v1/rollout/pause", admin, theirs),  # too big: not read and fanned out
                    ("/session/finalize", {}, {"session_id": _of_worker(1)}),  # no admin token
                    ("/v1/rollout/pause", {}, {}),
                    ("/trajectory/ack", {}, {"lease": "w1.x"}),  # no admin token: not sent on to worker 1
                    ("/trajectory/ack", admin, {"lease": "w1.x", "pad": "x" * 200}),
                    ("/v1/chat/completions", {"x-api-key": "wrong"}, {"session_id": _of_worker(1)}),
                ]:
                    answer = await http.post(path, headers=headers, json=body)
                    assert (answer.status_code, answer.text) == (200, f"here {path}"), (path, headers)
                # Admitted: the router reads the body and hands the connection to worker 1 (not there: 503).
                sent_on = await http.post("/session/finalize", headers=admin, json={"session_id": _of_worker(1)})
                assert sent_on.status_code == 503
                for lease, status in (("w1.x", 503), ("w0.x", 200), ("x", 200)):  # sent on to worker 1, or not
                    acked = await http.post("/trajectory/ack", headers=admin, json={"lease": lease})
                    assert acked.status_code == status, (lease, acked.text)
        stop.set()


SECRET = "admission-keys"
KEYS = AccessPolicy.build(admin_token=ADMIN, agent_auth="session-key", session_key_secret=SECRET)
CHAT = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
#: (method, path, headers, JSON body): each refused by the admission step, in the route's format.
REFUSED: list[tuple[str, str, dict[str, str], Any]] = [
    *[case for s in ("s1", "s2") for case in [
        ("POST", "/v1/chat/completions", {}, {**CHAT, "session_id": s}),
        ("POST", "/v1/messages", {"x-api-key": "nope"}, {**CHAT, "session_id": s}),
        ("POST", "/v1/chat/completions", {"authorization": f"Bearer {KEYS.session_key('other')}"},
         {**CHAT, "session_id": s}),
        ("POST", f"/sess/{s}/v1/chat/completions", {"authorization": f"Bearer {KEYS.session_key('other')}"}, CHAT),
        ("POST", "/session/finalize", {}, {"session_id": s}),
        ("POST", "/session/finalize", {"authorization": f"Bearer {KEYS.session_key(s)}"}, {"session_id": s}),
        ("POST", "/trajectory/read", {}, {"session_id": s}),
    ]],
    ("POST", "/v1/rollout/pause", {}, {}),
    ("POST", "/trajectory/ack", {}, {"lease": "w1.x"}),
    ("POST", "/v1/rollout/resume", {"authorization": "Bearer wrong"}, {}),
    ("GET", "/v1/rollout/pause_state", {}, None),
    ("POST", "/trajectory/read", {"authorization": f"Bearer {KEYS.session_key('s1')}"}, {}),
    ("GET", "/trajectory/stats", {}, None),
    ("GET", "/sessions", {}, None),
    ("GET", "/metrics", {}, None),
]


async def _answers(proxy: Any) -> list[tuple[int, Any]]:
    answers = []
    async with client(proxy) as http:  # a new connection for every request
        for method, path, headers, body in REFUSED:
            for _ in range(3):  # on new connections: either worker receives it
                answer = await http.request(method, path, headers=headers,
                                            content=None if body is None else json.dumps(body).encode())
                answers.append((answer.status_code, answer.json()))
    return answers


async def test_what_the_admission_step_refuses_is_refused_alike_by_one_process_and_by_two_workers(
        tmp_path: Path) -> None:
    flags = ("--admin-token", ADMIN, "--agent-auth", "session-key",
             "--session-key-secret", SECRET)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    async with run_workers(tmp_path / "one", *flags, workers=1) as one:
        single = await _answers(one)
    async with run_workers(tmp_path / "two", *flags) as two:
        workers = await _answers(two)
    assert {status for status, _ in single} == {401}
    assert workers == single
