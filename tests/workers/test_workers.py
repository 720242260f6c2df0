"""``actorproxy run --workers 2``: real processes on port 0.

Every request here opens a new TCP connection, so the kernel (``SO_REUSEPORT``) puts about
half of them on the worker that does not own their session: what the tests check is that
each session's turns are nevertheless recorded by its owner, in one segment, and that the
trainer's routes act on and report both workers.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from _workers import WORKERS, run_workers
from _workers import client as _client

from actorproxy.workers.routing import owner


async def _turn(client: httpx.AsyncClient, session: str, history: list[dict[str, Any]], text: str) -> None:
    history.append({"role": "user", "content": text})
    reply = await client.post("/v1/chat/completions", headers={"X-Session-Id": session},
                              json={"messages": history, "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    history.append(reply.json()["choices"][0]["message"])


def _sessions() -> list[str]:
    """Six sessions, three owned by each worker."""
    by_worker: dict[int, list[str]] = {0: [], 1: []}
    for i in range(100):
        session = f"sticky-{i}"
        if len(by_worker[owner(session, WORKERS)]) < 3:
            by_worker[owner(session, WORKERS)].append(session)
    return by_worker[0] + by_worker[1]


def _chat_requests(metrics: str) -> dict[str, float]:
    found = re.findall(r'actorproxy_requests_total\{worker="(\d)",method="POST",route="/v1/chat/completions",'
                       r'status="200"\} (\S+)', metrics)
    return {worker: float(value) for worker, value in found}


async def test_sessions_stay_with_their_worker_and_the_trainer_reads_both(tmp_path: Path) -> None:
    sessions = _sessions()
    async with run_workers(tmp_path) as proxy, _client(proxy) as client:
        histories: dict[str, list[dict[str, Any]]] = {s: [] for s in sessions}
        for turn in range(4):
            for session in sessions:
                await _turn(client, session, histories[session], f"turn {turn} of {session}")
        # The body names the session (no header): routed by the body.
        body_only = await client.post("/v1/chat/completions", json={
            "session_id": sessions[0], "max_tokens": 4,
            "messages": [*histories[sessions[0]], {"role": "user", "content": "by the body"}]})
        assert body_only.status_code == 200, body_only.text
        metrics = (await client.get("/metrics")).text
        assert _chat_requests(metrics) == {"0": 12.0 + 1, "1": 12.0}  # each worker served its own sessions' turns
        for session in sessions:
            finalized = await client.post("/session/finalize", json={"session_id": session, "reward": 1.0})
            assert finalized.json()["segments"] == 1, finalized.text
        read = (await client.post("/trajectory/read", json={"include_steps": True})).json()
        assert sorted(segment["parent_traj_id"] for segment in read["data"]) == sorted(sessions)
        steps = sorted(step["step_index"] for step in read["steps"] if step["session_id"] == sessions[0])
        assert steps == [0, 1, 2, 3, 4]
        one = (await client.post("/trajectory/read", json={"session_id": sessions[-1]})).json()
        assert [segment["trajectory_id"] for segment in one["data"]] == [f"{sessions[-1]}#0"]
        stats = (await client.get("/trajectory/stats")).json()
        assert (stats["workers"], stats["segments"], stats["steps"]) == (2, 6, 25)
        refused = await client.post("/init_trajectory", json={})  # the gateway needs one worker
        assert refused.status_code == 404 and refused.json()["error"]["code"] == "not_served_with_workers"


async def test_a_pause_is_acknowledged_by_both_workers(tmp_path: Path) -> None:
    sessions = _sessions()
    one_each = [sessions[0], sessions[-1]]
    async with run_workers(tmp_path) as proxy, _client(proxy) as client:
        paused = await client.post("/v1/rollout/pause", json={"mode": "abort"})
        assert paused.status_code == 200 and paused.json()["status"] == "paused"
        done: list[str] = []

        async def turn(session: str) -> None:
            await _turn(client, session, [], "while paused")
            done.append(session)

        async with trio.open_nursery() as nursery:
            for session in one_each:
                nursery.start_soon(turn, session)
            with trio.fail_after(30):  # both workers hold their turn: each is paused
                while (state := (await client.get("/v1/rollout/pause_state")).json())["waiting"] < 2:
                    pass
            assert state["state"] == "paused" and state["workers"] == 2 and done == []
            resumed = (await client.post("/v1/rollout/resume", json={"weight_version": "7"})).json()
            assert resumed["woken"] == 2 and resumed["weight_version"] == "7"
        assert sorted(done) == sorted(one_each)
        state = (await client.get("/v1/rollout/pause_state")).json()
        assert (state["state"], state["weight_version"]) == ("running", "7")


async def test_a_crashed_worker_is_restarted_and_the_other_serves_meanwhile(tmp_path: Path) -> None:
    sessions = _sessions()
    ours, theirs = sessions[0], sessions[-1]  # owned by worker 0 and by worker 1
    async with run_workers(tmp_path) as proxy, _client(proxy) as client:
        history: dict[str, list[dict[str, Any]]] = {ours: [], theirs: []}
        await client.post("/v1/rollout/resume", json={"weight_version": "5"})
        await _turn(client, ours, history[ours], "before")
        await _turn(client, theirs, history[theirs], "before")
        with trio.fail_after(30):  # both steps are in the journals (committed within ~50 ms)
            while (await client.get("/trajectory/stats")).json()["journal_steps"] < 2:
                pass
        os.kill(proxy.worker_pid(1), signal.SIGKILL)
        await proxy.wait_log(r"worker 1 exited with code -9")
        # Worker 0 goes on serving its sessions, whichever worker's port the connection lands on.
        for _ in range(4):
            await _turn(client, ours, history[ours], "meanwhile")
        down = await client.get("/trajectory/stats")
        assert down.status_code in (200, 503)  # 503 worker_unavailable until it is back: never a partial answer
        if down.status_code == 503:
            assert down.json()["error"]["code"] == "worker_unavailable"
        await proxy.wait_log(r"worker 1 serving", count=2)
        state = (await client.get("/v1/rollout/pause_state")).json()
        assert (state["weight_version"], state["workers"]) == ("5", 2)  # the restarted worker took the version
        await _turn(client, theirs, history[theirs], "after")
        stats = (await client.get("/trajectory/stats")).json()
        assert stats["recovered_steps"] == 1  # its journaled step came back
        proxy.process.send_signal(signal.SIGTERM)
        with trio.fail_after(60):
            while not proxy.eof:
                await proxy.changed.wait()
        assert proxy.process.wait() == 0


async def _exited(pid: int) -> None:
    """Wait for the process ``pid`` (not a child of ours) to exit."""
    fd = os.pidfd_open(pid)
    try:
        await trio.lowlevel.wait_readable(fd)
    finally:
        os.close(fd)


async def test_a_killed_supervisors_workers_drain_and_remove_its_directory(tmp_path: Path) -> None:
    sessions = _sessions()
    ours, theirs = sessions[0], sessions[-1]  # owned by worker 0 and by worker 1
    async with run_workers(tmp_path) as proxy, _client(proxy) as client:
        for session in (ours, theirs):
            await _turn(client, session, [], "before the supervisor is killed")
        pids = [proxy.worker_pid(index) for index in range(WORKERS)]
        # python -m actorproxy.workers.child DIR INDEX ...
        directory = trio.Path((await trio.Path(f"/proc/{pids[0]}/cmdline").read_bytes()).split(b"\0")[3].decode())
        assert await (directory / "config.pickle").exists()  # the settings, secrets included
        proxy.process.kill()
        await proxy.wait_log(r"the supervisor is gone: this worker drains and exits", count=WORKERS)
        with trio.fail_after(60):
            for pid in pids:
                await _exited(pid)
        assert not await directory.exists()
    # Each worker finalized its open session into its store as it drained.
    async with run_workers(tmp_path) as proxy, _client(proxy) as client:
        read = (await client.post("/trajectory/read", json={})).json()
        assert sorted(segment["parent_traj_id"] for segment in read["data"]) == sorted([ours, theirs])
        assert {segment["boundary_reason"] for segment in read["data"]} == {"shutdown"}


@pytest.mark.parametrize("store", ["memory", "ray"])
def test_a_store_the_workers_cannot_share_is_refused_at_start(tmp_path: Path, store: str) -> None:
    result = subprocess.run([sys.executable, "-m", "actorproxy", "run", "--workers", "2", "--store", store,
                             "--port", "0"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2
    assert f"--store {store} cannot be shared by several workers" in result.stderr


def test_abort_all_with_several_workers_is_refused_at_start(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "actorproxy", "run", "--workers", "2", "--store", "sqlite",
                             "--engine-abort-all", "--port", "0"], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == 2
    assert "one worker's abort_all would stop the other workers' generations" in result.stderr


def test_workers_is_in_the_help() -> None:
    result = subprocess.run([sys.executable, "-m", "actorproxy", "run", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert "--workers N" in result.stdout


def test_a_worker_that_cannot_start_stops_the_run(tmp_path: Path) -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    result = subprocess.run([sys.executable, "-m", "actorproxy", "run", "--workers", "2", "--store", "sqlite",
                             "--port", "0", "--data-dir", str(tmp_path), "--backend", "sglang", "--backend-url",
                             f"http://127.0.0.1:{port}", "--engine-startup-timeout", "1"],
                            capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "the inference engine did not answer within 1 s" in result.stderr
    assert "could not start (exit code 2" in result.stderr


def test_the_dressage_dialect_with_several_workers_is_refused_at_start(tmp_path: Path) -> None:
    """Its batch read hands out prompt groups whole; several workers would each hand out their own part of one."""
    result = subprocess.run([sys.executable, "-m", "actorproxy", "run", "--workers", "2", "--store", "sqlite",
                             "--api-dialect", "dressage", "--port", "0"], capture_output=True, text=True,
                            timeout=120, cwd=tmp_path)
    assert result.returncode == 2
    assert "the Dressage dialect's batch read hands out prompt groups whole" in result.stderr


async def test_a_leased_drain_is_acknowledged_through_whichever_worker_the_ack_lands_on(tmp_path: Path) -> None:
    """The lease names the worker that keeps it (the one the drain landed on, for the whole store; the session's
    owner, for one session), and each acknowledgement, on a new connection, lands on either worker."""
    ours, theirs = _sessions()[0], _sessions()[-1]  # owned by worker 0 and by worker 1
    async with run_workers(tmp_path) as proxy, _client(proxy) as client:
        for session in (ours, theirs):
            await _turn(client, session, [], "hi")
            assert (await client.post("/session/finalize", json={"session_id": session})).is_success
        leased = (await client.post("/trajectory/read", json={"drain": True, "lease": 60})).json()
        assert sorted(s["parent_traj_id"] for s in leased["data"]) == sorted([ours, theirs])
        assert re.fullmatch(r"w[01]\.\S+", leased["lease"]["id"]), leased["lease"]
        assert (await client.post("/trajectory/read", json={"drain": True})).json()["data"] == []
        acked = await client.post("/trajectory/ack", json={"lease": leased["lease"]["id"]})
        assert acked.json() == {"lease": leased["lease"]["id"], "status": "deleted"}, acked.text
        assert (await client.get("/trajectory/stats")).json()["segments"] == 0
        await _turn(client, theirs, [], "again")
        assert (await client.post("/session/finalize", json={"session_id": theirs})).is_success
        one = (await client.post("/trajectory/read", json={"session_id": theirs, "drain": True, "lease": 60})).json()
        assert [s["parent_traj_id"] for s in one["data"]] == [theirs] and one["lease"]["id"].startswith("w1.")
        for repeated in (False, True, True, True):  # (on either worker: sent on to worker 1 from worker 0)
            acked = await client.post("/trajectory/ack", json={"lease": one["lease"]["id"]})
            assert acked.status_code == 200, acked.text  # (sent again: answered as the first, by worker 1)
            assert acked.json() == {"lease": one["lease"]["id"], "status": "deleted",
                                    **({"repeated": True} if repeated else {})}, acked.text
        assert (await client.get("/trajectory/stats")).json()["segments"] == 0
