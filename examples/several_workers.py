"""Several worker processes on one port: ``actorproxy run --workers 2``.

Starts the proxy with two workers (simulated engine, SQLite store under a temporary
--data-dir), runs eight three-turn sessions with a new connection for every request (so
the kernel puts about half of them on the worker that does not own their session: the
connection is handed to the owner), pauses and resumes both workers with one call each,
reads every session's segment with one read, prints which worker served which session
(``/metrics`` labels each worker's counts), and stops the proxy with SIGTERM (both
workers drain; exit 0).

    python examples/several_workers.py [--workers N] [--sessions N]
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import tempfile
from pathlib import Path

import httpx
from shared import start_proxy


def start(data_dir: str, log: Path, workers: int) -> tuple[subprocess.Popen[bytes], str]:
    """``actorproxy run --workers N`` on a free port; its URL once every worker serves."""
    flags = ["--workers", str(workers), "--store", "sqlite", "--data-dir", data_dir, "--sim-token-interval", "0.001"]
    return start_proxy(flags, log, timeout=90, ready=r"serving on (http://\S+) with")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        proc, url = start(str(Path(scratch) / "data"), Path(scratch) / "proxy.log", args.workers)
        # No keep-alive: every request is a new connection, and the kernel picks its worker.
        with httpx.Client(base_url=url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as http:
            sessions = [f"rollout-{i}" for i in range(args.sessions)]
            histories: dict[str, list[dict[str, str]]] = {s: [] for s in sessions}
            for turn in range(3):
                for session in sessions:
                    history = histories[session]
                    history.append({"role": "user", "content": f"turn {turn}"})
                    reply = http.post("/v1/chat/completions", headers={"X-Session-Id": session},
                                      json={"messages": history, "max_tokens": 8})
                    reply.raise_for_status()
                    history.append(reply.json()["choices"][0]["message"])
            paused = http.post("/v1/rollout/pause").json()  # answered once every worker has paused
            print(f"pause: {paused['status']} on {paused['workers']} workers")
            resumed = http.post("/v1/rollout/resume", json={"weight_version": "1"}).json()
            print(f"resume: weight version {resumed['weight_version']} on {resumed['workers']} workers")
            for session in sessions:
                http.post("/session/finalize", json={"session_id": session, "reward": 1.0}).raise_for_status()
            segments = http.post("/trajectory/read", json={"drain": True}).json()["data"]
            for segment in sorted(segments, key=lambda s: s["trajectory_id"]):
                print(f"segment {segment['trajectory_id']}: {len(segment['token_ids'])} tokens, "
                      f"{sum(segment['loss_mask'])} trained")
            served = re.findall(r'actorproxy_requests_total\{worker="(\d+)",method="POST",'
                                r'route="/v1/chat/completions",status="200"\} (\S+)', http.get("/metrics").text)
            print("turns served per worker: " + ", ".join(f"worker {w}: {float(n):.0f}" for w, n in served))
            print(f"{len(segments)} segments of {len(sessions)} sessions, one each")
        proc.send_signal(signal.SIGTERM)
        print(f"the proxy exited with {proc.wait(timeout=90)}")


if __name__ == "__main__":
    main()
