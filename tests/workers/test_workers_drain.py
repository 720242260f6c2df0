"""A drain of the whole store across workers deletes, on every worker, only what reached the trainer.

The fanning worker asks every worker's private socket with a hold token: each answers in full and
deletes nothing; the merged reply goes out but for its last byte, then every worker is settled
(deleted if it went out, let go of if not), then that byte (``workers/holds.py``). Before, each
worker deleted its part once its answer reached the fanning worker: a trainer whose connection
broke during the merged reply lost it all. Two workers here are two runtimes in this process, each
serving its private Unix socket as a worker does; the public side is the fan-out in front of worker 0.
"""

from __future__ import annotations

import math
import socket
import tracemalloc
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import orjson
import pytest
import trio
from _asgi import open_client, request_body
from _util import run_turn
from trio.testing import MockClock, wait_all_tasks_blocked

from actorproxy.config import ProxyConfig
from actorproxy.runtime.holds import Holds
from actorproxy.runtime.runtime import Runtime, open_runtime
from actorproxy.serve import asgi_of
from actorproxy.server.app import create_app
from actorproxy.server.http_server import HTTPServer
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.workers import fanout, merge
from actorproxy.workers.fanout import SETTLE_PATH, FanOut, ask, control_path, lease_prefix
from actorproxy.workers.holds import HOLD_SECONDS, HoldMetrics, PrivateApp, worker_holds

HI = [{"role": "user", "content": "hi"}]
DRAIN = {"drain": True, "include_steps": True}


@attrs.define
class Workers:
    runtimes: list[Runtime]
    holds: list[Holds]
    publics: list[Any]  # the fan-out in front of each worker's app, as its public socket serves it
    directory: str

    @property
    def public(self) -> Any:
        return self.publics[0]


async def _finalized(runtime: Runtime, *sessions: str) -> None:
    for name in sessions:
        await run_turn(runtime, name, HI)
        await runtime.finalize(name)


def _config(tmp_path: Path, index: int) -> ProxyConfig:
    return ProxyConfig.of(port=0, store_kind="sqlite", data_dir=str(tmp_path / f"worker-{index}"))


async def _serve_private(nursery: trio.Nursery, app: Any, directory: str, index: int, stop: trio.Event) -> None:
    unix = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await unix.bind(control_path(directory, index))
    await nursery.start(partial(HTTPServer(app).serve, "", 0, sock=unix, shutdown_trigger=stop.wait))


@asynccontextmanager
async def two_workers(tmp_path: Path, tokenizer: Any, *, other: Any = None) -> AsyncIterator[Workers]:
    """Two workers, session "a" finalized on worker 0 and "b" on worker 1 (``other``: worker 1's private app
    instead, a fake)."""
    directory = str(tmp_path)
    stop = trio.Event()
    async with AsyncExitStack() as stack:
        runtimes, holds = [], []
        for index in range(1 if other is not None else 2):
            engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.001))
            runtime = await stack.enter_async_context(open_runtime(_config(tmp_path, index), backend=engine,
                                                                   tokenizer=tokenizer))
            await _finalized(runtime, "ab"[index])
            runtimes.append(runtime)
            holds.append(worker_holds(runtime))
        metrics = [HoldMetrics(h) for h in holds]  # worker 0's: its private app's, and its fan-out's
        async with trio.open_nursery() as nursery:
            for index, runtime in enumerate(runtimes):
                nursery.start_soon(holds[index].run)
                app = asgi_of(create_app(runtime, collectors=[metrics[index]]))
                await _serve_private(nursery, PrivateApp(app, holds[index]), directory, index, stop)
            if other is not None:
                await _serve_private(nursery, other, directory, 1, stop)
            publics = []
            for index, runtime in enumerate(runtimes):
                runtime.leases.prefix = lease_prefix(index)
                publics.append(FanOut(asgi_of(create_app(runtime, collectors=[metrics[index]])), 2, directory,
                                      index=index, leases=runtime.leases, metrics=metrics[index]))
            yield Workers(runtimes, holds, publics, directory)
            stop.set()
            nursery.cancel_scope.cancel()


def _sessions(body: dict[str, Any]) -> list[str]:
    return sorted(s["trajectory_id"] for s in body["data"])


def hanging_up(app: Any, gone: trio.Event) -> Any:
    """``app`` served to a trainer that takes the reply's head and hangs up once ``gone`` is set, before the
    body: the server's next write fails, as a socket's does once its peer is gone (its read timed out)."""

    async def served(scope: Any, receive: Any, send: Any) -> None:
        async def write(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.body" and message.get("body"):
                await gone.wait()
                raise OSError("the client hung up")
            await send(message)

        await app(scope, receive, write)

    return served


async def test_a_trainer_that_hangs_up_mid_drain_finds_every_workers_data_in_the_next_one(
        tmp_path: Path, tokenizer: Any) -> None:
    gone = trio.Event()
    async with two_workers(tmp_path, tokenizer) as workers:
        async with open_client(hanging_up(workers.public, gone)) as http:
            async with http.stream("POST", "/trajectory/read", json=DRAIN) as reply:
                assert reply.status_code == 200
                gone.set()
            await wait_all_tasks_blocked()
        assert [len(h) for h in workers.holds] == [0, 0]  # let go of at once, not left to expire
        async with open_client(workers.public) as http:
            again = (await http.post("/trajectory/read", json=DRAIN)).json()
            assert _sessions(again) == ["a#0", "b#0"] and len(again["steps"]) == 2
            assert (await http.post("/trajectory/read", json=DRAIN)).json() == {"data": [], "steps": []}


async def test_a_trainer_gone_before_the_merged_reply_over_a_real_socket_loses_nothing(
        tmp_path: Path, tokenizer: Any) -> None:
    """Over the server itself: the trainer's read times out (it resets its connection) while the workers answer.
    The server's writes into the closed connection return silently; the fan-out asks it (``send_now``'s probe)
    before it settles, and every worker lets go."""
    release, served = trio.Event(), trio.Event()
    async with two_workers(tmp_path, tokenizer) as workers, trio.open_nursery() as nursery:
        stop = trio.Event()
        url = await nursery.start(partial(HTTPServer(_gated(release, served, workers.public)).serve, "127.0.0.1", 0,
                                          shutdown_trigger=stop.wait))
        host, port = url.removeprefix("http://").split(":")
        trainer = await trio.open_tcp_stream(host, int(port))
        body = orjson.dumps(DRAIN)
        await trainer.send_all(b"POST /trajectory/read HTTP/1.1\r\nhost: p\r\ncontent-type: application/json\r\n"
                               b"content-length: %d\r\n\r\n%s" % (len(body), body))
        await wait_all_tasks_blocked()  # the request waits for the gate
        trainer.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        await trainer.aclose()  # a reset, as a client whose read timed out may send
        await wait_all_tasks_blocked()  # the server saw it
        release.set()
        await served.wait()
        assert [len(h) for h in workers.holds] == [0, 0]
        async with open_client(workers.public) as http:
            assert _sessions((await http.post("/trajectory/read", json=DRAIN)).json()) == ["a#0", "b#0"]
        stop.set()


def _gated(release: trio.Event, served: trio.Event, app: Any) -> Any:
    """``app``, its requests served only once ``release`` is set (the body read first), ``served`` set after."""

    async def gated(scope: Any, receive: Any, send: Any) -> None:
        body = await request_body(receive)
        await release.wait()
        given = False

        async def replay() -> dict[str, Any]:
            nonlocal given
            if given:
                return await receive()
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            await app(scope, replay, send)
        finally:
            served.set()

    return gated


async def test_a_completed_drain_deletes_on_every_worker(tmp_path: Path, tokenizer: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(merge, "SPOOL_BYTES", 64)  # each answer's arrays spooled to a file, read back in pieces
    monkeypatch.setattr(merge, "PIECE_BYTES", 100)
    async with two_workers(tmp_path, tokenizer) as workers:
        async with open_client(workers.public) as http:
            drained = await http.post("/trajectory/read", json=DRAIN)
            assert drained.text.endswith("]}") and _sessions(drained.json()) == ["a#0", "b#0"]
            assert len(drained.json()["steps"]) == 2
        for runtime in workers.runtimes:
            stats = await runtime.store_stats()
            assert (stats["segments"], stats["steps"], stats["sessions"]) == (0, 0, 0)
        assert [len(h) for h in workers.holds] == [0, 0]


def _failing_deletes(settles: list[dict[str, Any]]) -> Any:
    """A worker's private app that answers a read with "z#0" and every settle with a failed delete (noted)."""

    async def failing(scope: Any, receive: Any, send: Any) -> None:
        body = await request_body(receive)
        if scope["path"] == SETTLE_PATH:
            settles.append(orjson.loads(body))
            status, answer = 507, b'{"error": {"message": "disk I/O error", "code": "store_failed"}}'
        else:
            status, answer = 200, b'{"data": [{"trajectory_id": "z#0"}], "steps": []}'
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": answer})

    return failing


async def test_a_worker_that_cannot_delete_is_named_and_its_data_comes_again(tmp_path: Path, tokenizer: Any) -> None:
    """Worker 1 answers its part and then fails its delete (its disk, or it died): the reply says so, what it
    answered stays there for a later drain, and worker 0's part is deleted (at least once, never lost)."""
    settles: list[dict[str, Any]] = []
    async with two_workers(tmp_path, tokenizer, other=_failing_deletes(settles)) as workers:
        async with open_client(workers.public) as http:
            drained = (await http.post("/trajectory/read", json={"drain": True})).json()
        assert _sessions(drained) == ["a#0", "z#0"] and drained["unsettled_workers"] == [1]
        assert [s["delivered"] for s in settles] == [True]
        assert (await workers.runtimes[0].read()).data == []
        scraped = await ask(workers.directory, 0, "GET", b"/metrics", [], b"")
        assert b"\nactorproxy_drain_settles_failed_total 1.0\n" in scraped.body


async def test_an_acknowledged_lease_names_a_worker_that_cannot_delete(tmp_path: Path, tokenizer: Any) -> None:
    """As a plain drain's reply does: worker 1 fails its delete, so the acknowledgement says so, and what it answered
    comes again; nothing was settled before the acknowledgement."""
    settles: list[dict[str, Any]] = []
    async with two_workers(tmp_path, tokenizer, other=_failing_deletes(settles)) as workers:
        async with open_client(workers.public) as http:
            leased = (await http.post("/trajectory/read", json={"drain": True, "lease": 60})).json()
            assert _sessions(leased) == ["a#0", "z#0"] and settles == []
            acked = (await http.post("/trajectory/ack", json={"lease": leased["lease"]["id"]})).json()
            again = (await http.post("/trajectory/ack", json={"lease": leased["lease"]["id"]})).json()
        assert acked == {"lease": leased["lease"]["id"], "status": "deleted", "unsettled_workers": [1]}
        assert again == {**acked, "repeated": True}  # (the workers are not settled again)
        assert [s["delivered"] for s in settles] == [True] and (await workers.runtimes[0].read()).data == []


async def test_an_acknowledgement_sent_on_waits_for_the_settles_there(tmp_path: Path, tokenizer: Any,
                                                                      autojump_clock: MockClock) -> None:
    """Worker 1 answers a forwarded acknowledgement only once its own settles are done (each may take up to
    SETTLE_TIMEOUT): worker 0 waits for that answer, rather than calling a deleted lease unavailable."""
    asked, answer = trio.Event(), trio.Event()

    async def settling(scope: Any, receive: Any, send: Any) -> None:
        await request_body(receive)
        asked.set()
        await answer.wait()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"lease": "w1.x", "status": "deleted"}'})

    async with two_workers(tmp_path, tokenizer, other=settling) as workers:
        autojump_clock.autojump_threshold, autojump_clock.rate = math.inf, 1.0  # (real sockets: leaps by hand)
        async with open_client(workers.public) as http, trio.open_nursery() as nursery:
            acked: list[httpx.Response] = []

            async def acknowledge() -> None:
                acked.append(await http.post("/trajectory/ack", json={"lease": "w1.x"}))

            nursery.start_soon(acknowledge)
            await asked.wait()
            autojump_clock.jump(fanout.SETTLE_TIMEOUT * 2)
            await wait_all_tasks_blocked()
            answer.set()
        assert acked[0].status_code == 200 and acked[0].json() == {"lease": "w1.x", "status": "deleted"}


def _read_answer(pieces: list[bytes], *, settles: list[dict[str, Any]] | None = None) -> Any:
    """A worker's private app that answers a read with ``pieces``, one body message each (a settle: 404, noted)."""

    async def answering(scope: Any, receive: Any, send: Any) -> None:
        body = await request_body(receive)
        if scope["path"] == SETTLE_PATH:
            if settles is not None:
                settles.append(orjson.loads(body))
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b'{"error": {"code": "unknown_hold"}}'})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i, piece in enumerate(pieces):
            await send({"type": "http.response.body", "body": piece, "more_body": i < len(pieces) - 1})

    return answering


async def test_an_answer_that_is_not_a_reads_is_a_502_and_drains_nothing(tmp_path: Path, tokenizer: Any) -> None:
    """Worker 1's answer starts as a read's and, pieces later, is not one: the trainer gets a 502 (no reply begun),
    no worker is settled as delivered, and worker 0's part comes in the next drain."""
    settles: list[dict[str, Any]] = []
    pieces = [b'{"data":[', *(b'{"trajectory_id": "z#%d"},' % i for i in range(3)), b'{"trajectory_id": "z#3"}]',
              b',"success":true}']
    async with two_workers(tmp_path, tokenizer, other=_read_answer(pieces, settles=settles)) as workers:
        async with open_client(workers.public) as http:
            refused = await http.post("/trajectory/read", json=DRAIN)
            assert refused.status_code == 502 and refused.json()["error"]["code"] == "worker_answer_invalid"
            await wait_all_tasks_blocked()  # (the settles follow the reply)
            assert [s["delivered"] for s in settles] == [False] and len(workers.holds[0]) == 0
            assert _sessions((await http.post("/trajectory/read", json={"session_id": "a", "drain": True})).json()) \
                == ["a#0"]


async def test_a_reply_that_fails_once_begun_is_cut_and_deletes_nothing(tmp_path: Path, tokenizer: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Reading the spools back fails after the reply began (their disk): the trainer sees the reply cut, never a
    whole-looking one, and no worker is settled as delivered: the next drain has it all."""

    def failing(spools: list[merge.ReadSpool], lead: bytes = b"") -> Any:
        yield b'{"data":['
        raise OSError("the spool's disk failed")

    monkeypatch.setattr(fanout, "read_reply", failing)
    async with two_workers(tmp_path, tokenizer) as workers:
        async with open_client(workers.public) as http:
            with pytest.raises(httpx.RemoteProtocolError):
                await http.post("/trajectory/read", json=DRAIN)
            await wait_all_tasks_blocked()
            assert [len(h) for h in workers.holds] == [0, 0]
            monkeypatch.undo()
            assert _sessions((await http.post("/trajectory/read", json=DRAIN)).json()) == ["a#0", "b#0"]


async def test_the_fanning_worker_holds_no_whole_answer(tmp_path: Path, tokenizer: Any) -> None:
    """A read of 25 MB from worker 1 goes through the fanning worker in pieces: its allocations peak far below the
    answer's size (before, each answer was received whole and spliced from memory: twice its size at the peak)."""
    element = b'{"trajectory_id": "z#0", "token_ids": [' + b",".join([b"151643"] * 2000) + b"]}"
    pieces = [b'{"data":[' + element, *([b"," + element] * 1800), b"]}"]
    size = sum(map(len, pieces))
    scope = {"type": "http", "method": "POST", "path": "/trajectory/read", "raw_path": b"/trajectory/read",
             "query_string": b"", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1)}
    received = 0

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def taken(message: dict[str, Any]) -> None:  # a trainer that takes each piece as it comes
        nonlocal received
        received += len(message.get("body", b""))

    async with two_workers(tmp_path, tokenizer, other=_read_answer(pieces)) as workers:
        tracemalloc.start()
        try:
            await workers.public(scope, receive, taken)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert size > 25_000_000 and received > size
    assert peak < size / 4, f"{peak / 1e6:.1f} MB allocated at the peak for an answer of {size / 1e6:.1f} MB"


async def test_a_leased_read_of_one_session_is_acknowledged_on_another_worker(tmp_path: Path,
                                                                              tokenizer: Any) -> None:
    """Session "b" is worker 1's: its leased drain is made there, and its id names worker 1, so an acknowledgement
    that reaches worker 0 is sent on to worker 1 (its answer relayed as it is)."""
    async with two_workers(tmp_path, tokenizer) as workers:
        async with open_client(workers.publics[1]) as owner, open_client(workers.public) as other:
            leased = (await owner.post("/trajectory/read", json={"session_id": "b", "drain": True, "lease": 60})).json()
            assert _sessions(leased) == ["b#0"] and leased["lease"]["id"].startswith("w1.")
            assert len(workers.runtimes[1].leases) == 1
            assert (await owner.post("/trajectory/read", json={"session_id": "b", "drain": True})).json()["data"] == []
            for unknown in ("w1.nothing", "w2.x", "w.x", "nothing", "w0." + leased["lease"]["id"][3:]):
                missing = await other.post("/trajectory/ack", json={"lease": unknown})
                assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_lease", unknown
            assert (await other.post("/trajectory/ack", json={"lease": 1})).status_code == 400
            acked = await other.post("/trajectory/ack", json={"lease": leased["lease"]["id"]})
            assert acked.status_code == 200, acked.text
            assert acked.json() == {"lease": leased["lease"]["id"], "status": "deleted"}
        assert (await workers.runtimes[1].store_stats())["segments"] == 0
        assert [len(r.leases) for r in workers.runtimes] == [0, 0]


async def _leased(http: httpx.AsyncClient, seconds: float) -> dict[str, Any]:
    """A leased drain of the whole store: both workers' sessions, held for its lease on both."""
    leased = await http.post("/trajectory/read", json={**DRAIN, "lease": seconds})
    assert leased.status_code == 200, leased.text
    assert leased.text.startswith('{"lease":{') and _sessions(leased.json()) == ["a#0", "b#0"]
    assert leased.json()["lease"]["id"].startswith("w0.") and leased.json()["lease"]["seconds"] == seconds
    assert len(leased.json()["steps"]) == 2
    assert (await http.post("/trajectory/read", json=DRAIN)).json() == {"data": [], "steps": []}
    return dict(leased.json()["lease"])


async def _leased_one(http: httpx.AsyncClient) -> None:
    leased = await http.post("/trajectory/read", json={**DRAIN, "lease": 60})
    assert _sessions(leased.json()) == ["c#0"]


async def _stored(workers: Workers) -> list[int]:
    return [(await runtime.store_stats())["segments"] for runtime in workers.runtimes]


async def test_a_leased_drain_of_the_whole_store_is_deleted_on_every_worker_once_acknowledged_anywhere(
        tmp_path: Path, tokenizer: Any) -> None:
    """The lease is the fanning worker's (worker 0); each worker holds its part meanwhile; the acknowledgement
    reaches worker 1's public app, which sends it on to worker 0, which settles both."""
    async with two_workers(tmp_path, tokenizer) as workers:
        async with open_client(workers.public) as http, open_client(workers.publics[1]) as other:
            lease = await _leased(http, 60)
            assert await _stored(workers) == [1, 1] and [len(h) for h in workers.holds] == [1, 1]
            assert [len(r.leases) for r in workers.runtimes] == [1, 0]
            acked = await other.post("/trajectory/ack", json={"lease": lease["id"]})
            assert acked.status_code == 200, acked.text
            assert acked.json() == {"lease": lease["id"], "status": "deleted"}
            assert await _stored(workers) == [0, 0] and [len(h) for h in workers.holds] == [0, 0]
            for client, body in ((other, {"lease": lease["id"]}), (http, {"lease": lease["id"], "release": True})):
                again = await client.post("/trajectory/ack", json=body)  # (its answer lost: sent again, anywhere)
                assert again.status_code == 200, again.text
                assert again.json() == {"lease": lease["id"], "status": "deleted", "repeated": True}
            await _finalized(workers.runtimes[1], "c")
            workers.runtimes[0].leases.limit = 1  # bounded as one process's: another waits for the first
            await _leased_one(http)
            full = await http.post("/trajectory/read", json={**DRAIN, "lease": 60})
            assert full.status_code == 429 and full.json()["error"]["code"] == "too_many_leases", full.text
            assert [len(h) for h in workers.holds] == [1, 1] and await _stored(workers) == [0, 1]  # (the first's)


async def test_a_bad_lease_on_a_drain_of_the_whole_store_is_a_400_and_drains_nothing(tmp_path: Path,
                                                                                       tokenizer: Any) -> None:
    async with two_workers(tmp_path, tokenizer) as workers:
        async with open_client(workers.public) as http:
            for lease in (0, 3601, "60", True, [60]):
                refused = await http.post("/trajectory/read", json={**DRAIN, "lease": lease})
                assert refused.status_code == 400, (lease, refused.text)
                assert refused.json()["error"]["param"] == "lease", refused.text
                assert await _stored(workers) == [1, 1] and [len(h) for h in workers.holds] == [0, 0]
        assert [len(r.leases) for r in workers.runtimes] == [0, 0]


async def test_a_released_leased_drain_of_the_whole_store_is_read_again(tmp_path: Path, tokenizer: Any) -> None:
    async with two_workers(tmp_path, tokenizer) as workers:
        async with open_client(workers.public) as http:
            lease = await _leased(http, 60)
            released = await http.post("/trajectory/ack", json={"lease": lease["id"], "release": True})
            assert released.json() == {"lease": lease["id"], "status": "released"}
            acked = await http.post("/trajectory/ack", json={"lease": lease["id"]})
            assert acked.json() == {"lease": lease["id"], "status": "released", "repeated": True}
            assert [len(h) for h in workers.holds] == [0, 0] and await _stored(workers) == [1, 1]
            assert _sessions((await http.post("/trajectory/read", json=DRAIN)).json()) == ["a#0", "b#0"]
        assert await _stored(workers) == [0, 0]


async def test_a_leased_drain_of_the_whole_store_not_acknowledged_is_given_back_on_every_worker(
        tmp_path: Path, tokenizer: Any, autojump_clock: MockClock) -> None:
    """The longest lease: the workers' parts stay held all of it (a plain drain's part is let go of after
    HOLD_SECONDS), and once it ended, every worker lets go and the next drain reads it all."""
    async with two_workers(tmp_path, tokenizer) as workers:
        # From here the clock runs as a wall clock does, and leaps by hand: the workers answer over real sockets
        # (and a thread's task looks blocked: jumping then would fire their timeouts).
        autojump_clock.autojump_threshold, autojump_clock.rate = math.inf, 1.0
        async with open_client(workers.public) as http, open_client(workers.publics[1]) as other:
            lease = await _leased(http, 3600)
            autojump_clock.jump(3590)
            await wait_all_tasks_blocked()
            assert [len(h) for h in workers.holds] == [1, 1] and len(workers.runtimes[0].leases) == 1
            assert (await http.post("/trajectory/read", json=DRAIN)).json() == {"data": [], "steps": []}
            autojump_clock.jump(10)
            await _until(lambda: [len(h) for h in workers.holds] == [0, 0])
            assert len(workers.runtimes[0].leases) == 0 and workers.runtimes[0].leases.expired == 1
            assert await _stored(workers) == [1, 1]
            for client in (http, other):  # (worker 1 sends it on to worker 0, and relays its answer)
                late = await client.post("/trajectory/ack", json={"lease": lease["id"]})
                assert late.status_code == 410 and late.json()["error"]["code"] == "lease_expired", late.text
            assert _sessions((await http.post("/trajectory/read", json=DRAIN)).json()) == ["a#0", "b#0"]
        assert await _stored(workers) == [0, 0]


async def _until(done: Any) -> None:
    """Let the other tasks run (their sockets' I/O included, which counts as blocked) until ``done()``."""
    for _ in range(100_000):
        if done():
            return
        await trio.lowlevel.checkpoint()
    raise AssertionError("not done")


async def test_the_public_socket_neither_holds_nor_settles(tmp_path: Path, tokenizer: Any) -> None:
    """A caller's hold header is not honoured (not forwarded by the fan-out, ignored by the app) and the
    settle route is the private socket's alone."""
    async with two_workers(tmp_path, tokenizer) as workers:
        token = {"x-actorproxy-hold": "mine"}
        async with open_client(workers.public) as http:
            settle = await http.post(SETTLE_PATH, json={"token": "mine", "delivered": False})
            assert settle.status_code == 404
            one = await http.post("/trajectory/read", json={"session_id": "a", "drain": True}, headers=token)
            assert _sessions(one.json()) == ["a#0"]
            assert (await workers.runtimes[0].read()).data == []  # deleted: the header meant nothing there
            assert _sessions((await http.post("/trajectory/read", json=DRAIN, headers=token)).json()) == ["b#0"]
        assert (await workers.runtimes[1].read()).data == []
        mine = await ask(workers.directory, 1, "POST", SETTLE_PATH.encode(), [],
                         b'{"token": "mine", "delivered": false}')
        assert mine.status == 404  # nothing was ever held under the caller's token


async def test_an_unsettled_hold_expires_and_is_read_again(tokenizer: Any, autojump_clock: MockClock) -> None:
    """A worker whose fanning worker died after its answer (no settle comes): what it held is let go of once
    ``HOLD_SECONDS`` passed, for the next drain; meanwhile no other drain reads it."""
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.001))
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer) as runtime:
        await _finalized(runtime, "a")
        # The clock moves by hand from here: a drain gives memory back in a thread, and a thread's task looks
        # blocked, so the clock would jump to the hold's expiry during it.
        autojump_clock.autojump_threshold = math.inf
        holds = worker_holds(runtime)
        app = PrivateApp(create_app(runtime, collectors=[HoldMetrics(holds)]), holds)
        async with trio.open_nursery() as nursery, open_client(app) as http:
            nursery.start_soon(holds.run)
            held = await http.post("/trajectory/read", json=DRAIN, headers={"x-actorproxy-hold": "t1"})
            assert _sessions(held.json()) == ["a#0"] and len(holds) == 1
            assert _holds_metrics((await http.get("/metrics")).text) == {"open": 1.0, "expired": 0.0}
            assert (await runtime.read(drain=True)).data == []  # held: no other drain reads it
            autojump_clock.jump(HOLD_SECONDS - 1)
            await wait_all_tasks_blocked()
            assert len(holds) == 1 and (await runtime.read(drain=True)).data == []
            autojump_clock.jump(1)
            await wait_all_tasks_blocked()
            assert len(holds) == 0 and holds.expired == 1
            assert _holds_metrics((await http.get("/metrics")).text) == {"open": 0.0, "expired": 1.0}
            again = await http.post("/trajectory/read", json=DRAIN)
            assert _sessions(again.json()) == ["a#0"]
            late = await http.post(SETTLE_PATH, json={"token": "t1", "delivered": True})
            assert late.status_code == 404 and late.json()["error"]["code"] == "unknown_hold"
            nursery.cancel_scope.cancel()


def _holds_metrics(text: str) -> dict[str, float]:
    """The holds' samples of a worker's /metrics text."""
    names = {"actorproxy_drain_holds_open": "open", "actorproxy_drain_holds_expired_total": "expired"}
    found = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            found[names[name]] = float(value)
    return found


async def test_holds_are_bounded_and_a_bad_token_or_settle_is_a_400(tokenizer: Any) -> None:
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.001))
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer) as runtime:
        await _finalized(runtime, "a")
        holds = worker_holds(runtime, limit=1)
        async with open_client(PrivateApp(create_app(runtime), holds)) as http:
            assert (await http.post("/trajectory/read", json=DRAIN, headers={"x-actorproxy-hold": "t1"})).is_success
            full = await http.post("/trajectory/read", json=DRAIN, headers={"x-actorproxy-hold": "t2"})
            assert full.status_code == 503 and full.json()["error"]["code"] == "too_many_holds"
            assert full.headers["retry-after"] == "1"
            bad = await http.post("/trajectory/read", json=DRAIN, headers={"x-actorproxy-hold": "x" * 65})
            assert bad.status_code == 400
            for seconds in ("0", "3601", "nan", "an hour"):  # a leased drain's part: 1 to LONGEST_LEASE seconds
                bad = await http.post("/trajectory/read", json=DRAIN, headers={"x-actorproxy-hold": "t3",
                                                                               "x-actorproxy-hold-lease": seconds})
                assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_hold", seconds
            for wrong in (b"[]", b"{", b'{"token": "t1"}', b'{"token": 1, "delivered": true}'):
                assert (await http.post(SETTLE_PATH, content=wrong)).status_code == 400
            settled = await http.post(SETTLE_PATH, json={"token": "t1", "delivered": True})
            assert settled.json() == {"settled": "deleted", "reads": 1}
        stats = await runtime.store_stats()
        assert (stats["segments"], stats["sessions"]) == (0, 0)
