"""A trainer that dies holding a batch loses nothing: the leased drain.

Starts ``actorproxy run`` (the default SQLite store, simulated engine) and records three
finalized sessions. A first trainer process takes them with a leased drain
(``ProxyClient.leased_drain``: nothing leaves the store until the trainer acknowledges it), then
is killed with SIGKILL before it acknowledges. Meanwhile no other drain gets that data; once the
lease ends, the next trainer's drain has all three sessions, and its acknowledgement removes them.

    python examples/leased_drain.py [--lease SECONDS]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import trio
from shared import start_proxy

from actorproxy import ProxyClient


async def record(url: str) -> None:
    async with ProxyClient(url) as client:
        for session in ("rollout-1", "rollout-2", "rollout-3"):
            body = {"messages": [{"role": "user", "content": f"hello from {session}"}], "max_tokens": 8}
            await client.chat_completions(body, session_id=session)
            await client.finalize_session(session, reward=1.0)


async def crashing_trainer(url: str, lease: float) -> None:
    """Takes the batch, prints it, and dies before it acknowledges (run as its own process)."""
    async with ProxyClient(url) as client, client.leased_drain(lease=lease) as batch:
        print(f"first trainer: got {len(batch['data'])} segments under lease {batch['lease']['id'][:8]}…, "
              "then SIGKILL", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


async def next_trainer(url: str, lease: float) -> None:
    async with ProxyClient(url) as client:
        meanwhile = await client.read_trajectory(drain=True)
        print(f"another drain while the lease runs: {len(meanwhile['data'])} segments")
        assert meanwhile["data"] == [], "a leased batch went to another drain"
        await trio.sleep(lease + 0.5)
        async with client.leased_drain(lease=lease) as batch:
            names = sorted(s["trajectory_id"] for s in batch["data"])
            print(f"next trainer, after the lease ended: {names}")
            assert names == ["rollout-1#0", "rollout-2#0", "rollout-3#0"], names
        # acknowledged when the block ended: gone from the store
        left = (await client.stats())["segments"]
        print(f"acknowledged: {left} segments left in the store")
        assert left == 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lease", type=float, default=2.0, help="seconds a drain's batch waits for its ack")
    parser.add_argument("--crash", metavar="URL", help=argparse.SUPPRESS)  # the first trainer's own process
    args = parser.parse_args()
    if args.crash:
        trio.run(crashing_trainer, args.crash, args.lease)
        return
    with tempfile.TemporaryDirectory() as scratch:
        proc, url = start_proxy(["--data-dir", str(Path(scratch) / "data"), "--sim-token-interval", "0.001"],
                                Path(scratch) / "proxy.log", timeout=60)
        try:
            trio.run(record, url)
            first = subprocess.run([sys.executable, __file__, "--crash", url, "--lease", str(args.lease)],
                                   capture_output=True, text=True, timeout=60)
            print(first.stdout, end="")
            assert first.returncode == -signal.SIGKILL, first.stderr
            trio.run(next_trainer, url, args.lease)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
