"""The fuzz tier in every process mode and every auth mode (issue 28): no 5xx, and every process alive.

The cases are the route fuzz's (test_fuzz_routes.py: generated bodies, headers and paths
on every route), the gateway fuzz's (test_gateway_fuzz.py) and the raw HTTP/1.1 ones
(test_http_raw_fuzz.py: hostile request lines, headers and framings), drawn once,
derandomized (CI sees the same cases every run). Each mode is a real ``actorproxy run``
on port 0, the single process and ``--workers 2``, each with no auth, ``--admin-token``,
``--agent-auth session-key`` and ``--api-key``: 3,200 requests to each (25,600 in all), over
8 kept-alive connections at once (a new one every few requests, and after every
answer that closes one, so that both workers receive some and connections are handed
over) and fresh connections for the raw cases. Credentials vary per request: none, the
fuzz's own wrong ones, or the mode's right ones (so the routes behind them are reached).

Every answer must be below 500 and, if an error with a body, in its route's format; a
request framed well must get an answer, on a connection that stays open unless the answer
says ``connection: close``. (With several workers the Claw-R1 gateway routes are refused
``404 not_served_with_workers``, docs/workers.md.) At the end every process is the one
that started (a worker restart is a failure: the supervisor logs none, and the pids are
the same), ``/health`` answers, a real turn is
served, and no connection or route failed in the log.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import test_fuzz_routes
import test_gateway_fuzz
import trio
from _workers import Proxy, run_workers
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_http_raw_fuzz import check_error_format, exchange, parse_replies, raw_requests

#: Requests sent to each mode (8 modes: 25,600 in all).
PER_MODE = 3200
#: Kept-alive connections sending at once, per mode.
LANES = 8
#: Seconds a request framed well may wait for its answer (a turn takes milliseconds; a pause waits for none).
ANSWER_WITHIN = 20
#: Requests a kept-alive connection sends before it is replaced by a new one (at most).
PER_CONNECTION = 12
#: Distinct generated cases of each kind (each sent to every mode; the route cases several times, with other
#: credentials and on other connections).
ROUTE_CASES, GATEWAY_CASES, RAW_CASES = 400, 100, 100
ADMIN, API_KEY = "fuzz-admin", "fuzz-api-key"
AUTH_FLAGS = {
    "none": (),
    "admin-token": ("--admin-token", ADMIN),
    "session-key": ("--agent-auth", "session-key"),
    "api-key": ("--api-key", API_KEY),
}
MODES = [(workers, auth) for workers in (1, 2) for auth in AUTH_FLAGS]
#: The sessions the route fuzz names (headers, URL mounts, bodies): a session key is minted for each.
SESSIONS = ["fz", "fz2", "fz-url", "traj-1", "x", "by-stander"]
#: Log lines that mean a connection or a request failed inside the proxy (each would be a bug).
FAILURES = ("exited with code", "Traceback", "could not route", "failed; it is closed", "error in the ASGI app")

Case = tuple[str, bytes, bytes]  # kind ("route", "gateway", "raw"), the request's target, the request's bytes


def _drawn(strategy: st.SearchStrategy[Any], count: int) -> list[Any]:
    """``count`` examples of ``strategy`` (fewer if it has no more), the same every run."""
    found: list[Any] = []

    @settings(max_examples=count, derandomize=True, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(example: Any) -> None:
        found.append(example)

    collect()
    return found


def _frame(method: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes | None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), b"host: fuzz", *(name + b": " + value for name, value in headers)]
    if body is not None:
        lines.append(b"content-length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


@pytest.fixture(scope="module")
def cases() -> list[Case]:
    """The generated cases of every fuzz, as bytes (a route case's credentials are set per request)."""
    drawn: list[Case] = []
    for method, path, headers, body in _drawn(test_fuzz_routes.requests(), ROUTE_CASES):
        encoded = [(name.lower().encode(), value.encode()) for name, value in headers.items()]
        drawn.append(("route", path.encode(), _frame(method, path, encoded, body if method != "GET" else None)))
    for method, path, body in _drawn(test_gateway_fuzz.requests(), GATEWAY_CASES):
        drawn.append(("gateway", path.encode(), _frame(method, path, [], body if method != "GET" else None)))
    for request, target in _drawn(raw_requests(), RAW_CASES):
        drawn.append(("raw", target, request))
    return drawn


class Run:
    """One mode's run: what was sent, what came back wrong."""

    def __init__(self, proxy: Proxy, workers: int, credentials: Callable[[random.Random], bytes | None]) -> None:
        self.proxy, self.workers = proxy, workers
        host, port = proxy.url.rsplit("//", 1)[1].rsplit(":", 1)
        self.address = (host, int(port))
        self.credentials = credentials
        self.sent = 0
        self.statuses: dict[int, int] = {}
        self.failures: list[str] = []

    def check(self, target: bytes, request: bytes, replies: list[Any]) -> None:
        for number, reply in enumerate(replies):
            self.statuses[reply.status] = self.statuses.get(reply.status, 0) + 1
            if reply.status >= 500:
                self.failures.append(f"{reply.status} for {request[:300]!r}: {reply.body[:300]!r}")
            elif reply.status >= 400 and number == 0:
                try:
                    check_error_format(target, reply)
                except (AssertionError, ValueError, KeyError, TypeError) as exc:
                    self.failures.append(f"error format for {request[:300]!r}: {reply.body[:300]!r} ({exc!r})")

    async def lane(self, requests: list[Case], seed: int) -> None:
        """Send ``requests`` over kept-alive connections, one after the other, each answer read and checked."""
        rng = random.Random(seed)
        stream: trio.SocketStream | None = None
        left = 0
        previous = b""
        for _kind, target, request in requests:
            if stream is None or left == 0:
                if stream is not None:
                    await stream.aclose()
                stream, left = await trio.open_tcp_stream(*self.address), rng.randint(1, PER_CONNECTION)
                previous = b"(a new connection)"
            left -= 1
            head, _, body = request.partition(b"\r\n\r\n")
            credential = self.credentials(rng)
            if credential is not None:
                head = b"\r\n".join(line for line in head.split(b"\r\n") if not line.startswith(b"authorization:"))
                head += b"\r\nauthorization: " + credential
            request = head + b"\r\n\r\n" + body
            self.sent += 1
            received, replies, closed = b"", [], False
            try:
                with trio.move_on_after(ANSWER_WITHIN) as waited:
                    await stream.send_all(request)
                    while not replies:
                        data = await stream.receive_some(65536)
                        if not data:
                            closed = True
                            break
                        received += data
                        replies = parse_replies(received)[0]
            except trio.BrokenResourceError as exc:
                closed = True
                self.failures.append(f"{exc} to {request[:300]!r} after {previous[:200]!r}")
            else:
                if waited.cancelled_caught:
                    closed = True
                    self.failures.append(f"no answer within {ANSWER_WITHIN} s to {request[:300]!r}")
                elif not replies:
                    self.failures.append(f"no answer to {request[:300]!r} after {previous[:200]!r}")
            previous = request
            self.check(target, request, replies)
            if closed or any(reply.headers.get(b"connection") == b"close" for reply in replies):
                await stream.aclose()
                stream = None
            if replies and replies[0].status == 200 and target.endswith(b"/v1/rollout/pause"):
                await self.resume()
        if stream is not None:
            await stream.aclose()

    async def resume(self) -> None:
        """Undo a pause a case asked for (the other lanes' turns wait meanwhile)."""
        request = _frame("POST", "/v1/rollout/resume", [(b"authorization", b"Bearer " + ADMIN.encode()),
                                                        (b"content-type", b"application/json")], b"{}")
        received = await trio.to_thread.run_sync(partial(exchange, self.address, request, half_close=True))
        assert [reply.status for reply in parse_replies(received)[0]] == [200], received[:300]

    async def raw(self, requests: list[Case]) -> None:
        """Each raw case on a fresh connection, half-closed after it is sent; every answer read to the close."""
        for _kind, target, request in requests:
            self.sent += 1
            with trio.fail_after(60):
                received = await trio.to_thread.run_sync(partial(exchange, self.address, request, half_close=True))
            replies, whole = parse_replies(received)
            if not whole:
                self.failures.append(f"an answer cut short for {request[:300]!r}: {received[-300:]!r}")
            self.check(target, request, replies)


def _credentials(auth: str, keys: dict[str, bytes]) -> Callable[[random.Random], bytes | None]:
    """Per request: none added (the case's own, if any), or the mode's right credential."""
    right = {"none": [], "admin-token": [b"Bearer " + ADMIN.encode()], "api-key": [b"Bearer " + API_KEY.encode()],
             "session-key": [b"Bearer " + key for key in keys.values()]}[auth]

    def choose(rng: random.Random) -> bytes | None:
        return rng.choice(right) if right and rng.random() < 0.5 else None

    return choose


async def _session_keys(run: Run) -> dict[str, bytes]:
    keys = {}
    for session in SESSIONS:
        request = _frame("POST", "/session/open", [(b"content-type", b"application/json")],
                         b'{"session_id": "%s"}' % session.encode())
        received = await trio.to_thread.run_sync(partial(exchange, run.address, request, half_close=True))
        (reply,), _ = parse_replies(received)
        keys[session] = reply.body.split(b'"api_key":"')[1].split(b'"')[0]
    return keys


def _worker_pids(proxy: Proxy, workers: int) -> list[int]:
    return [proxy.worker_pid(index) for index in range(workers)] if workers > 1 else [proxy.process.pid]


@pytest.mark.parametrize(("workers", "auth"), MODES)
async def test_the_fuzz_tier_gets_no_5xx_and_no_process_ends(tmp_path: Path, cases: list[Case], workers: int,
                                                               auth: str) -> None:
    flags = AUTH_FLAGS[auth]
    async with run_workers(tmp_path, *flags, workers=workers) as proxy:
        pids = _worker_pids(proxy, workers)
        run = Run(proxy, workers, lambda _rng: None)
        keys = await _session_keys(run) if auth == "session-key" else {}
        run.credentials = _credentials(auth, keys)
        rng = random.Random(f"{workers}-{auth}")
        raw = [case for case in cases if case[0] == "raw"]
        framed = [case for case in cases if case[0] != "raw"]
        plan = [rng.choice(framed) for _ in range(PER_MODE - len(raw))]
        with trio.fail_after(600):  # a hang guard only: the count is fixed
            async with trio.open_nursery() as nursery:
                for lane in range(LANES):
                    nursery.start_soon(run.lane, plan[lane::LANES], lane)
                nursery.start_soon(run.raw, raw)
        assert run.sent == PER_MODE
        kinds = Counter(failure.split(" for ")[0].split(" to ")[0][:60] for failure in run.failures)
        assert not run.failures, (kinds, run.failures[:8])
        assert run.statuses.get(200, 0) > PER_MODE // 20 and run.statuses.get(400, 0) > PER_MODE // 10, run.statuses
        # Every process is the one that started, and still serves.
        admin = [(b"authorization", b"Bearer " + ADMIN.encode())] if auth == "admin-token" else []
        health = parse_replies(await trio.to_thread.run_sync(
            partial(exchange, run.address, _frame("GET", "/health", admin, None), half_close=True)))[0]
        assert [reply.status for reply in health] == [200] and b"missing_workers" not in health[0].body
        agent = {"none": [], "admin-token": admin, "api-key": [(b"authorization", b"Bearer " + API_KEY.encode())],
                 "session-key": [(b"authorization", b"Bearer " + keys.get("fz", b""))]}[auth]
        turn = _frame("POST", "/v1/chat/completions", [*agent, (b"x-session-id", b"fz")],
                      b'{"messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4}')
        served = parse_replies(await trio.to_thread.run_sync(partial(exchange, run.address, turn, half_close=True)))[0]
        assert [reply.status for reply in served] == [200], served
        assert proxy.process.poll() is None and _worker_pids(proxy, workers) == pids
        failed = [line for line in proxy.log.splitlines() if any(mark in line for mark in FAILURES)]
        assert not failed, failed[:10]
