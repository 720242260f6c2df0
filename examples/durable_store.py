"""The durable store: kill the proxy with SIGKILL, restart it, and find every completed step.

Starts ``actorproxy run`` (SQLite store under a temporary --data-dir, simulated
engine), runs three sessions (two finalized, one left open), kills the process
with SIGKILL, starts it again on the same directory and reads everything back:
the finalized segments unchanged, the open session rebuilt as a ``recovered``
segment. Then it stops the proxy with SIGTERM (a graceful drain, exit 0).

    python examples/durable_store.py [--data-dir DIR]
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
from shared import start_proxy


def start(data_dir: str, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``actorproxy run`` on a free port; its URL once it serves."""
    return start_proxy(["--store", "sqlite", "--data-dir", data_dir, "--sim-token-interval", "0.001"], log, timeout=60)


def turn(http: httpx.Client, session: str, text: str) -> None:
    reply = http.post("/v1/chat/completions", headers={"X-Session-Id": session},
                      json={"messages": [{"role": "user", "content": text}], "max_tokens": 16})
    reply.raise_for_status()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None, help="where the SQLite store lives (default: a temporary dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        data_dir = args.data_dir or str(Path(scratch) / "data")
        proc, url = start(data_dir, Path(scratch) / "first.log")
        with httpx.Client(base_url=url, timeout=60) as http:
            for session in ("done-1", "done-2", "open-1"):
                turn(http, session, f"hello from {session}")
            for session in ("done-1", "done-2"):  # answered once the segment is committed
                http.post("/session/finalize", json={"session_id": session, "reward": 1.0}).raise_for_status()
            before = http.post("/trajectory/read", json={}).json()["data"]
            deadline = time.monotonic() + 10
            while http.get("/trajectory/stats").json()["journal_steps"] < 1:  # committed within ~50 ms
                assert time.monotonic() < deadline, "the journal was not committed"
                time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)  # no shutdown at all: the open session is only in the journal
        proc.wait()
        print(f"killed the proxy with {len(before)} finalized segments and one open session")

        proc, url = start(data_dir, Path(scratch) / "second.log")
        with httpx.Client(base_url=url, timeout=60) as http:
            stats = http.get("/trajectory/stats").json()
            data = http.post("/trajectory/read", json={"include_steps": True, "drain": True}).json()
        for segment in data["data"]:
            print(f"segment {segment['trajectory_id']}: {segment['num_tokens']} tokens, "
                  f"boundary_reason={segment['boundary_reason']}")
        print(f"recovered {stats['recovered_steps']} step(s) in {stats['recovered_segments']} segment(s)")
        again = {s["trajectory_id"]: s for s in data["data"]}
        assert all(again[s["trajectory_id"]] == s for s in before), "a finalized segment changed"
        assert again["open-1#0"]["boundary_reason"] == "recovered" and len(data["steps"]) == 3
        proc.send_signal(signal.SIGTERM)  # graceful: drain, finalize open sessions, close the database
        print(f"SIGTERM: the proxy exited with {proc.wait(timeout=60)}")


if __name__ == "__main__":
    main()
