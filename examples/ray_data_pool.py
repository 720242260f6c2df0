"""Many proxies, one trainer: two ``actorproxy run --store ray`` replicas feed one Ray data pool.

Starts a local Ray (the trainer's process is its driver), creates the data pool,
starts two proxy replicas (simulated engine, each with its own ``--data-dir``)
that send every committed segment to the pool, and runs 3 prompt groups of 4
rollouts each, the rollouts of a group spread over both replicas. The trainer's
loop then takes complete groups from the pool with ``fetch_batch`` and prints
them. On a real cluster the replicas run on the rollout nodes with
``--ray-address HEAD:6379`` and the trainer calls ``connect()`` the same way.

    pip install 'actorproxy[ray]'
    python examples/ray_data_pool.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

import httpx
from shared import start_proxy

REPO = Path(__file__).resolve().parent.parent
POOL, NAMESPACE = "rollouts", "actorproxy-example"
GROUPS, ROLLOUTS = 3, 4


def start_replica(ray_address: str, data_dir: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``actorproxy run --store ray`` on a free port; its URL once it serves."""
    flags = ["--store", "ray", "--ray-address", ray_address, "--ray-namespace", NAMESPACE, "--data-pool", POOL,
             "--data-dir", str(data_dir), "--sim-token-interval", "0.001"]
    return start_proxy(flags, log, timeout=120)


def rollout(http: httpx.Client, session: str, group: str, reward: float) -> None:
    """An agent's rollout: two turns, then finalize with its reward and prompt group."""
    headers = {"X-Session-Id": session, "X-Instance-Id": group}
    messages = [{"role": "user", "content": f"solve task {group}"}]
    for _ in range(2):
        reply = http.post("/v1/chat/completions", headers=headers, json={"messages": messages, "max_tokens": 16})
        reply.raise_for_status()
        messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": "check your answer"}]
    http.post("/session/finalize", json={"session_id": session, "reward": reward, "instance_id": group}
              ).raise_for_status()


def main() -> None:
    import ray

    from actorproxy.ray import connect

    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(num_cpus=1, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False,
                       runtime_env={"env_vars": {"PYTHONPATH": pythonpath}})
    address: str = ray.get_runtime_context().gcs_address
    pool = connect(POOL, NAMESPACE)  # the trainer creates the pool (detached); the replicas find it by name
    replicas: list[subprocess.Popen[bytes]] = []
    try:
        with tempfile.TemporaryDirectory() as scratch:
            urls = []
            for k in range(2):
                proc, url = start_replica(address, Path(scratch) / f"replica-{k}", Path(scratch) / f"replica-{k}.log")
                replicas.append(proc)
                urls.append(url)
            clients = [httpx.Client(base_url=url, timeout=60) for url in urls]
            for g in range(GROUPS):
                for r in range(ROLLOUTS):  # a group's rollouts on both replicas
                    rollout(clients[r % 2], f"g{g}-r{r}", f"g{g}", reward=r / ROLLOUTS)
            for client in clients:
                client.close()

            # The trainer's loop: complete prompt groups, oldest first. Leased: a batch is gone from the pool only
            # once acknowledged (a trainer that dies first, or whose call times out, gets it again after 300 s).
            trained = 0
            while trained < GROUPS:
                batch = pool.fetch_leased(groups=1, rollouts_per_group=ROLLOUTS, timeout_s=60, lease=300)
                for group in batch.groups:
                    rewards = sorted(s["reward"] for s in group.segments)
                    tokens = sum(len(s["token_ids"]) for s in group.segments)
                    print(f"group {group.instance_id}: {len(group.rollouts)} rollouts, {len(group.segments)} "
                          f"segments, {tokens} tokens, rewards {rewards}")
                    trained += 1
                acked = pool.acknowledge(batch.lease_id)  # trained on: now it leaves the pool
                assert acked.status == "deleted", acked  # (sent again after a timeout, it answers the same)
            stats = pool.stats()
            print(f"pool: {stats['segments_received']} segments received from {len(stats['sources'])} replicas, "
                  f"{stats['groups_fetched']} groups fetched, {stats['pending_groups']} pending, "
                  f"{stats['dropped_groups']} dropped, {stats['open_leases']} leases open")
            for proc in replicas:  # graceful: drain, flush, hand the rest to the pool, exit 0
                proc.send_signal(signal.SIGTERM)
            print("replicas exited with", [proc.wait(timeout=120) for proc in replicas])
    finally:
        for proc in replicas:
            if proc.poll() is None:
                proc.kill()
        ray.shutdown()


if __name__ == "__main__":
    main()
