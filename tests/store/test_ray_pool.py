"""--store ray: the data pool's rules (no Ray needed), then real proxies feeding one pool on a local Ray."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from _proxyproc import REPO, ProxyProcess

from actorproxy.store import ray_pool
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


def test_a_leased_fetch_is_gone_only_once_acknowledged_and_comes_back_first_if_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A trainer that died holding a batch (or whose ray.get timed out after the pool answered) gets it again."""
    clock = [1000.0]
    monkeypatch.setattr(ray_pool.time, "monotonic", lambda: clock[0])

    async def scenario() -> None:
        pool = DataPool()
        await pool.put([_payload("a#0", "g1"), _payload("b#0", "g2"), _payload("c#0", "g3")], "p1")
        first = await pool.fetch_batch(1, 1, 0.0, lease=30)
        assert [g["instance_id"] for g in first["groups"]] == ["g1"] and first["lease"]["seconds"] == 30
        released = await pool.fetch_batch(1, 1, 0.0, lease=30)
        assert [g["instance_id"] for g in released["groups"]] == ["g2"]
        assert pool.stats()["open_leases"] == 2 and pool.stats()["pending_groups"] == 1
        assert pool.acknowledge(released["lease"]["id"], release=True)  # given back at once, first
        assert [g["instance_id"] for g in await pool.fetch_batch(1, 1, 0.0)] == ["g2"]
        clock[0] += 31  # the first trainer died: its lease ended
        assert [g["instance_id"] for g in await pool.fetch_batch(5, 1, 0.0)] == ["g1", "g3"]
        late = pool.acknowledge(first["lease"]["id"])  # too late: handed out again already, and told so
        assert not late and (late.status, late.repeated) == ("expired", True)
        used = await pool.fetch_batch(1, 1, 0.0, lease=30)
        assert used["groups"] == [] and pool.acknowledge(used["lease"]["id"])
        stats = pool.stats()
        assert (stats["open_leases"], stats["leases_released"], stats["leases_expired"]) == (0, 1, 1)
        with pytest.raises(ValueError):
            await pool.fetch_batch(1, 1, 0.0, lease=0)

    asyncio.run(scenario())


def test_an_acknowledgement_sent_again_answers_as_the_first_did(monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer whose ray.get of its acknowledgement timed out sends it again: it learns how the lease ended, and
    nothing changes (a release after a delete gives nothing back, a delete after a release deletes nothing)."""
    monkeypatch.setattr(ray_pool, "REMEMBERED", 2, raising=False)

    async def scenario() -> None:
        pool = DataPool()
        await pool.put([_payload("a#0", "g1"), _payload("b#0", "g2")], "p1")
        used = (await pool.fetch_batch(1, 1, 0.0, lease=30))["lease"]["id"]
        given = (await pool.fetch_batch(1, 1, 0.0, lease=30))["lease"]["id"]
        first = pool.acknowledge(used)
        assert first and (first.lease, first.status, first.repeated) == (used, "deleted", False)
        for release in (False, True):
            again = pool.acknowledge(used, release=release)
            assert again and (again.status, again.repeated, again.at) == ("deleted", True, first.at)
        assert pool.acknowledge(given, release=True).status == "released"
        acked = pool.acknowledge(given)
        assert acked and (acked.status, acked.repeated) == ("released", True)
        assert [g["instance_id"] for g in await pool.fetch_batch(5, 1, 0.0)] == ["g2"]  # given back, once
        assert pool.stats()["leases_released"] == 1
        unknown = pool.acknowledge("never-made")
        assert not unknown and unknown.status == "unknown"
        third = (await pool.fetch_batch(1, 1, 0.0, lease=30))["lease"]["id"]
        assert pool.acknowledge(third).status == "deleted"
        assert pool.acknowledge(used).status == "unknown"  # the oldest of more than REMEMBERED is forgotten
        assert pool.acknowledge(given).status == "released"

    asyncio.run(scenario())


async def _g1_leased(seconds: float) -> tuple[DataPool, dict[str, Any]]:
    """A pool whose one group, g1 (rollout a), a leased fetch took."""
    pool = DataPool()
    await pool.put([_payload("a#0", "g1")], "p1")
    leased = await pool.fetch_batch(1, 1, 0.0, lease=seconds)
    assert [g["instance_id"] for g in leased["groups"]] == ["g1"]
    return pool, leased


def test_a_fetch_waiting_for_groups_gets_those_of_a_lease_that_ends_meanwhile() -> None:
    async def scenario() -> None:
        pool, _ = await _g1_leased(1)
        again = await pool.fetch_batch(1, 1, 10.0)  # (real time: the lease ends after 1 s, not the 10 s wait)
        assert [g["instance_id"] for g in again] == ["g1"] and pool.stats()["leases_expired"] == 1

    asyncio.run(scenario())


def test_a_given_back_lease_keeps_its_segments_beside_those_its_rollout_got_meanwhile() -> None:
    """Its rollout went on while the batch was out (a segment after its last one): both are handed out again."""
    async def scenario() -> None:
        pool, leased = await _g1_leased(30)
        await pool.put([_payload("a#1", "g1")], "p1")
        assert pool.acknowledge(leased["lease"]["id"], release=True)
        assert pool.stats()["pending_segments"] == 2
        again = await pool.fetch_batch(1, 1, 0.0)
        assert [s["meta"]["trajectory_id"] for s in again[0]["segments"]] == ["a#0", "a#1"]

    asyncio.run(scenario())


def test_fetches_waiting_together_take_no_more_leases_than_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each passed the bound as it began to wait: the one that would go past it once the groups came takes none."""
    monkeypatch.setattr(ray_pool, "MAX_LEASES", 2)

    async def scenario() -> None:
        pool = DataPool()
        waiting = [asyncio.create_task(pool.fetch_batch(1, 1, 5.0, lease=30)) for _ in range(3)]
        await asyncio.sleep(0)
        await pool.put([_payload(f"{name}#0", f"g{name}") for name in "abc"], "p1")
        done = await asyncio.gather(*waiting, return_exceptions=True)
        assert sorted(type(d).__name__ for d in done) == ["RuntimeError", "dict", "dict"]
        assert pool.stats()["open_leases"] == 2 and pool.stats()["pending_groups"] == 1

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    ray = pytest.importorskip("ray")
    repo = str(Path(__file__).resolve().parents[2])
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


#: A stand-in for Claw-R1's DataPool: a sync actor with its producer methods and parameter names.
CLAW_R1_STYLE_POOL = '''
"""Claw-R1's DataPool's producer calls (AgentR1/Claw-R1 @ 4e1dec6, data_pool.py), recording what arrives."""

import threading
from typing import Any


class ClawR1StylePool:
    """Records what arrives."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, Any]] = []
        self.completed: list[tuple[str, float | None, str]] = []
        self.done = threading.Event()

    def submit_steps(self, steps: list[Any], channel: str = "train") -> None:
        self.steps += [(channel, step) for step in steps]

    def complete_trajectory(self, trajectory_uid: str, reward: float | None = None, channel: str = "train") -> bool:
        # Whether the trajectory's steps were in first (an async actor, as theirs is, may run calls out of order).
        self.completed.append((trajectory_uid, reward, channel, any(s.trajectory_uid == trajectory_uid
                                                                    for _, s in self.steps)))
        if len(self.completed) == 2:
            self.done.set()
        return True

    def fetch_batch(self, batch_size: int, n_rollouts: int | None = None, channel: str = "train") -> Any:
        return None

    def received(self) -> list[Any]:
        assert self.done.wait(60)
        return [[(c, s.trajectory_uid, s.prompt_ids, s.response_ids, s.rollout_log_probs, s.is_last, s.reward)
                 for c, s in self.steps], self.completed]

'''


async def test_claw_r1s_own_pool_gets_its_steps_and_completions(ray_cluster: str, tmp_path: Path) -> None:
    """--data-pool-name naming Claw-R1's DataPool: segments go in as its steps, on their channels."""
    import ray

    # Their pool's class is importable where it runs and not in the proxy's process (as in their trainer): a
    # module of its own, on the actor's path only. The proxy then sees its methods as (**kwargs).
    (tmp_path / "clawr1_style_pool.py").write_text(CLAW_R1_STYLE_POOL)
    sys.path.insert(0, str(tmp_path))
    try:
        from clawr1_style_pool import ClawR1StylePool  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(tmp_path))
    path = os.pathsep.join([str(tmp_path), str(REPO)])
    pool = ray.remote(ClawR1StylePool).options(name="claw-pool", namespace="actorproxy-test", max_concurrency=4,
                                               runtime_env={"env_vars": {"PYTHONPATH": path}}).remote()
    proxy = ProxyProcess(tmp_path / "p.log", "--store", "ray", "--ray-address", ray_cluster, "--ray-namespace",
                         "actorproxy-test", "--data-pool", "claw-pool", "--data-dir", str(tmp_path / "d"),
                         "--sim-token-interval", "0.001")
    try:
        async with httpx.AsyncClient(base_url=await proxy.started(), timeout=60) as http:
            generated = []
            for uid, channel in (("t-train", None), ("t-val", "val")):
                prompt = [151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198]
                gen = (await http.post("/generate", json={"prompt_ids": prompt, "sampling_params": {
                    "logprobs": True, "max_tokens": 6}})).json()
                generated.append(gen)
                step = {"trajectory_uid": uid, "prompt_uid": "p", "prompt_ids": prompt, "step_index": 0,
                        "response_ids": gen["token_ids"], "rollout_log_probs": gen["log_probs"], "is_last": True,
                        "reward": 1.0, "metadata": None}
                reply = await http.post("/submit_steps", json={"steps": [step]},
                                        params={"channel": channel} if channel else None)
                assert reply.status_code == 200, reply.text
        steps, completed = await trio.to_thread.run_sync(lambda: ray.get(pool.received.remote(), timeout=60))
    finally:
        proxy.kill()
    assert sorted(completed) == [("t-train", 1.0, "train", True), ("t-val", 1.0, "val", True)]
    by_uid = {uid: (channel, response, logprobs, last, reward) for channel, uid, _, response, logprobs, last, reward
              in steps}
    assert by_uid["t-train"] == ("train", generated[0]["token_ids"], pytest.approx(generated[0]["log_probs"]), True,
                                 1.0)
    assert by_uid["t-val"][0] == "val" and len(steps) == 2
