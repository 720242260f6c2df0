"""--store ray: the data pool's rules (no Ray needed), then real proxies feeding one pool on a local Ray."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from _proxyproc import ProxyProcess

from actorproxy.store.ray_pool import DataPool

# The tier installs or starts something big: `-m "not heavy"` leaves it out (README.md).
pytestmark = [pytest.mark.heavy, pytest.mark.ray]

HI = [{"role": "user", "content": "hi"}]


def _payload(trajectory_id: str, instance_id: str | None, reason: str = "finalize") -> dict[str, Any]:
    session = trajectory_id.rpartition("#")[0]
    meta = {"trajectory_id": trajectory_id, "parent_traj_id": session, "instance_id": instance_id,
            "boundary_reason": reason}
    return {"meta": meta, "arrays": [b"", b"", b"", b""]}


def test_pool_hands_out_complete_groups_fifo_dedups_and_counts_drops() -> None:
    async def scenario() -> None:
        pool = DataPool(max_pending_groups=2)
        # g1: two rollouts, one of them in two segments (a mid-session boundary, then finalize).
        assert await pool.put([_payload("a#0", "g1", "history_rewrite"), _payload("b#0", "g1")], "p1") == 2
        assert await pool.fetch_batch(1, 2, 0.0) == []  # rollout a is not finished yet
        assert await pool.put([_payload("a#1", "g1"), _payload("a#1", "g1")], "p2") == 1  # a resend is dropped
        assert await pool.put([_payload("c#0", "g2")], "p1") == 1
        (group,) = await pool.fetch_batch(2, 2, 0.0)  # g2 is not complete: only g1
        assert group["instance_id"] == "g1" and sorted(group["rollouts"]) == ["a", "b"]
        assert [s["meta"]["trajectory_id"] for s in group["segments"] if s["meta"]["parent_traj_id"] == "a"] == [
            "a#0", "a#1"]
        await pool.put([_payload("d#0", "g3"), _payload("e#0", "g4")], "p1")  # three groups pending: g2 dropped
        stats = pool.stats()
        assert stats["dropped_groups"] == 1 and stats["dropped_segments"] == 1 and stats["duplicates"] == 1
        assert stats["pending_groups"] == 2 and stats["sources"] == {"p1": 5, "p2": 1}
        assert [g["instance_id"] for g in await pool.fetch_batch(5, 1, 0.0)] == ["g3", "g4"]  # FIFO

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    ray = pytest.importorskip("ray")
    repo = str(Path(__file__).resolve().parent.parent)
    context = ray.init(num_cpus=1, namespace="actorproxy-test", include_dashboard=False, log_to_driver=False,
                       runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([repo, os.environ.get(
                           "PYTHONPATH", "")])}})
    yield context.address_info["gcs_address"]
    ray.shutdown()


async def _finished_rollout(http: httpx.AsyncClient, session: str, instance: str, *, finalize: bool) -> None:
    body = {"messages": HI, "max_tokens": 8}
    reply = await http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": session,
                                                                         "X-Instance-Id": instance})
    assert reply.status_code == 200, reply.text
    if finalize:
        done = await http.post("/session/finalize", json={"session_id": session, "instance_id": instance})
        assert done.status_code == 200


async def test_two_proxies_feed_one_pool_and_a_restarted_proxy_loses_nothing(
    ray_cluster: str, tmp_path: Path
) -> None:
    from actorproxy.ray import connect

    def proxy(name: str) -> ProxyProcess:
        return ProxyProcess(tmp_path / f"{name}.log", "--store", "ray", "--ray-address", ray_cluster,
                            "--ray-namespace", "actorproxy-test", "--data-pool", "pool-test",
                            "--data-dir", str(tmp_path / name.rstrip("2")), "--sim-token-interval", "0.001")

    a, b = proxy("a"), proxy("b")
    restarted: ProxyProcess | None = None
    try:
        url_a, url_b = await a.started(), await b.started()
        async with httpx.AsyncClient(base_url=url_a, timeout=60) as on_a, httpx.AsyncClient(
            base_url=url_b, timeout=60
        ) as on_b:
            for i in range(2):  # g1 on both proxies, finalized
                await _finished_rollout(on_a, f"a{i}", "g1", finalize=True)
                await _finished_rollout(on_b, f"b{i}", "g1", finalize=True)
            for i in range(2, 4):  # g2: open on A (journaled), finalized on B
                await _finished_rollout(on_a, f"a{i}", "g2", finalize=False)
                await _finished_rollout(on_b, f"b{i}", "g2", finalize=True)
            # Polled (bounded): the journal commits in proxy A's writer thread within ~50 ms of a
            # step's end, and /trajectory/stats is the only sign of it another process can see.
            with trio.fail_after(10):
                while (await on_a.get("/trajectory/stats")).json()["journal_steps"] < 2:  # noqa: ASYNC110
                    await trio.sleep(0.02)
        a.kill()  # mid-run: A's open sessions exist only in its journal
        restarted = proxy("a2")
        await restarted.started()  # recovers a2, a3 as "recovered" segments and sends them
        pool = connect("pool-test", "actorproxy-test")
        groups = await trio.to_thread.run_sync(lambda: pool.fetch_batch(2, 4, timeout_s=120))
        stats = await trio.to_thread.run_sync(pool.stats)
    finally:
        for process in (a, b, restarted):
            if process is not None:
                process.kill()
    assert [g.instance_id for g in groups] == ["g1", "g2"], stats
    assert sorted(groups[1].rollouts) == ["a2", "a3", "b2", "b3"]
    reasons = {s["trajectory_id"]: s["boundary_reason"] for g in groups for s in g.segments}
    assert reasons["a2#0"] == reasons["a3#0"] == "recovered" and reasons["b2#0"] == "finalize"
    assert all(len(s["token_ids"]) == len(s["loss_mask"]) > 0 for g in groups for s in g.segments)
    assert stats["segments_received"] == 8 and len(stats["sources"]) >= 2 and stats["dropped_groups"] == 0
