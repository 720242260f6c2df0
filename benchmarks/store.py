"""The trajectory stores compared over real HTTP: memory, SQLite and a Ray data pool.

    python benchmarks/store.py                         # 64 sessions at a time, 2 million tokens per store
    python benchmarks/store.py --quick                 # 200 000 tokens per store, no Ray
    python benchmarks/store.py --stores sqlite --tokens 1000000

Three processes per store: the zero-delay engine stub (``engine_stub.py``, canned
16-token replies over SGLang's ``/generate``), ``actorproxy run --backend sglang --store
<kind>`` in front of it, and the load generator (this file with ``--load``: keep-alive
HTTP/1.1 on asyncio, ``load_client.Http``). The generator runs ``--concurrency``
sessions at a time, each ``--turns`` non-streamed turns over a long prompt (unique per
session) then ``POST /session/finalize``, until the store holds ``--tokens`` tokens (each
session's segment and its steps: twice the segment's tokens). One warm-up session per
worker is drained first; then nothing is drained: the store ends up holding every token.

Printed per store: turns/s; the proxy's CPU time per turn (the robust figure on a shared
machine); finalize latency p50/p99 (for SQLite and Ray it includes the commit: finalize
answers once its segment is durable); the p50 and p99 turn latency, and the proxy's CPU
time per turn, while the store held 10-20%, 45-55% and 90-100% of the tokens (a turn
must not slow down as the store fills; the CPU figure is the one a busy machine does not
blur); the proxy's RSS at the start, half way and at the end (the memory store keeps
every token in RAM by design; SQLite and Ray must not). Ray needs ``pip install
'actorproxy[ray]'``; a local Ray (``num_cpus=1``) is started for it and the pool's count of
received segments is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from load_client import Http, cpu_seconds
from overhead import REPLY, canned, end_run, loadavg
from processes import engine_stub, proxy

# -- the load generator (its own process) ----------------------------------------------------

#: Shares of the target store size where the proxy's CPU clock is read (CPU per turn as the store fills).
#: The first window starts at 10%: before, the workers still run in step (all first turns, then all second ones).
MARKS = (0.1, 0.2, 0.45, 0.55, 0.9)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def load(args: argparse.Namespace) -> dict[str, Any]:
    host, _, port = args.load.removeprefix("http://").partition(":")
    target = args.tokens
    stored = 0  # tokens in the store (finalized segments and their steps)
    turns: list[tuple[int, float]] = []  # (store size when the turn started, latency ms)
    finalize_ms: list[float] = []
    rss: dict[str, float] = {}
    marks: dict[float, tuple[float, int]] = {}  # share of the target -> (proxy CPU seconds, turns so far)
    errors: list[str] = []
    words = " ".join(f"w{i}" for i in range(args.prompt_words))

    async def session(http: Http, name: str, record: bool) -> bool:
        """One session: its turns, then finalize. False on an error (recorded)."""
        nonlocal stored
        headers = {"X-Session-Id": name}
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"{name}: {words}"}]
        size = 0
        for _ in range(args.turns):
            before = stored
            status, data, seconds = await http.request(
                "POST", "/v1/chat/completions", json.dumps({"model": "m", "messages": messages, "max_tokens": 32}
                                                           ).encode(), headers)
            if status != 200:
                errors.append(f"turn {status}: {data[:300]!r}")
                return False
            if record:
                turns.append((before, seconds * 1000))
            body = json.loads(data)
            size = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
            messages += [body["choices"][0]["message"], {"role": "user", "content": "go on"}]
        start = time.perf_counter()
        status, data, _ = await http.request("POST", "/session/finalize", json.dumps({"session_id": name}).encode())
        if status != 200:
            errors.append(f"finalize {status}: {data[:300]!r}")
            return False
        if record:
            finalize_ms.append((time.perf_counter() - start) * 1000)
            # The store keeps the segment and the session's steps (their fragments and outputs: the same tokens).
            stored += 2 * size
            if "half" not in rss and stored >= target // 2:
                rss["half"] = rss_mb(args.pid)
            for mark in MARKS:  # the proxy's CPU clock as the store passes each mark
                if mark not in marks and stored >= mark * target:
                    marks[mark] = (cpu_seconds(args.pid), len(turns))
        return True

    async def worker(w: int, record: bool) -> None:
        http = Http(host, int(port))
        n = 0
        try:
            while len(errors) < 10 and await session(http, f"{'s' if record else 'warm'}{w}-{n}", record):
                n += 1
                if not record or stored >= target:
                    return
        finally:
            await http.close()

    # Warm up (one session per worker), then empty the store: the measured fill starts from 0 tokens.
    await asyncio.gather(*(worker(w, False) for w in range(args.concurrency)))
    drain = Http(host, int(port))
    status, data, _ = await drain.request("POST", "/trajectory/read", json.dumps({"drain": True}).encode())
    await drain.close()
    if status != 200:
        raise SystemExit(f"draining the warm-up sessions failed: {status} {data[:300]!r}")
    rss["start"] = rss_mb(args.pid)
    cpu = cpu_seconds(args.pid)
    marks[0.0] = (cpu, 0)
    start = time.perf_counter()
    await asyncio.gather(*(worker(w, True) for w in range(args.concurrency)))
    elapsed = time.perf_counter() - start
    cpu = cpu_seconds(args.pid) - cpu
    rss["end"] = rss_mb(args.pid)
    marks[1.0] = (cpu_seconds(args.pid), len(turns))

    def cpu_per_turn(a: float, b: float) -> float:
        (cpu_a, turns_a), (cpu_b, turns_b) = marks[a], marks[b]
        return 1000 * (cpu_b - cpu_a) / max(turns_b - turns_a, 1)
    by_tenth: dict[str, list[float]] = {"first": [], "middle": [], "last": []}
    for before, ms in turns:
        share = before / target
        if 0.1 <= share < 0.2:
            by_tenth["first"].append(ms)
        elif 0.45 <= share < 0.55:
            by_tenth["middle"].append(ms)
        elif share >= 0.9:
            by_tenth["last"].append(ms)
    return {
        "turns": len(turns),
        "sessions": len(finalize_ms),
        "tokens": stored,
        "seconds": elapsed,
        "turns_per_s": len(turns) / elapsed,
        "cpu_ms_per_turn": 1000 * cpu / max(len(turns), 1),
        "finalize_p50_ms": pct(finalize_ms, 0.5),
        "finalize_p99_ms": pct(finalize_ms, 0.99),
        "turn_ms": {k: {"p50": pct(v, 0.5), "p99": pct(v, 0.99), "n": len(v)} for k, v in by_tenth.items()},
        "cpu_ms_per_turn_at": {"first": cpu_per_turn(0.1, 0.2), "middle": cpu_per_turn(0.45, 0.55),
                               "last": cpu_per_turn(0.9, 1.0)},
        "rss_mb": rss,
        "errors": errors,
    }


# -- the driver --------------------------------------------------------------------------


def run_store(kind: str, args: argparse.Namespace, stub_url: str, scratch: Path, ray_address: str | None
              ) -> dict[str, Any]:
    flags = ["--store", kind, "--data-dir", str(scratch / kind), "--max-sessions", "100000",
             "--store-max-tokens", str(10 * args.tokens)]
    if kind == "ray":
        flags += ["--ray-address", str(ray_address), "--data-pool", "bench-pool", "--ray-namespace", "bench"]
    with proxy("sglang", stub_url, *flags) as server:
        out = scratch / f"{kind}.json"
        command = [sys.executable, __file__, "--load", server.url, "--pid", str(server.pid), "--out", str(out),
                   "--concurrency", str(args.concurrency), "--turns", str(args.turns), "--tokens", str(args.tokens),
                   "--prompt-words", str(args.prompt_words)]
        subprocess.run(command, check=True)
        result: dict[str, Any] = json.loads(out.read_text())
        stats = httpx.get(server.url + "/trajectory/stats", timeout=60).json()
        result["store_tokens"] = stats["tokens"]
        if kind == "ray":
            result["store_tokens"] += _pool_tokens(stats, deadline=time.monotonic() + 120)
    result["store"] = kind
    return result


def _pool_tokens(stats: dict[str, Any], deadline: float) -> int:
    """Tokens of the segments the data pool received (waits until the forwarder has sent them all)."""
    from actorproxy.ray import connect

    pool = connect("bench-pool", "bench")
    while time.monotonic() < deadline and pool.stats()["segments_received"] < stats["segments_stored"]:
        time.sleep(0.5)
    batch = pool.fetch_batch(10**9, 1, 0)
    return sum(len(s["token_ids"]) for group in batch for s in group.segments)


def median(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the runs (errors: all of them)."""
    first = results[0]
    out: dict[str, Any] = {}
    for key, value in first.items():
        if isinstance(value, dict):
            out[key] = median([r[key] for r in results])
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in results if key in r)
        else:
            out[key] = value
    if "errors" in first:
        out["errors"] = [e for r in results for e in r["errors"]]
    return out


def print_table(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    print(f"\nmedian of {args.repeat} run(s); {args.concurrency} concurrent sessions, {args.turns} turns each, "
          f"~{args.prompt_words * 4} prompt tokens; {args.tokens:,} tokens stored per store (segments + steps)")
    print(f"{'store':7} {'turns':>6} {'turns/s':>8} {'CPU ms/turn':>11} {'finalize p50':>12} {'p99':>8} "
          f"{'RSS MB start/half/end':>22} {'tokens kept':>12} {'err':>4}")
    for r in rows:
        rss = r["rss_mb"]
        memory = f"{rss['start']:.0f} / {rss.get('half', float('nan')):.0f} / {rss['end']:.0f}"
        print(f"{r['store']:7} {r['turns']:>6} {r['turns_per_s']:>8.1f} {r['cpu_ms_per_turn']:>11.2f} "
              f"{r['finalize_p50_ms']:>9.1f} ms {r['finalize_p99_ms']:>5.0f} ms {memory:>22} "
              f"{r['store_tokens']:>12,} {len(r['errors']):>4}")
        for error in r["errors"][:3]:
            print(f"    error: {error}")
    print("\nas the store fills (10-20% | 45-55% | 90-100% of the tokens): turn latency p50 / p99, proxy CPU per turn")
    for r in rows:
        t, c = r["turn_ms"], r["cpu_ms_per_turn_at"]
        fill = " | ".join(f"{t[k]['p50']:6.1f} / {t[k]['p99']:6.1f} ms, {c[k]:5.2f} CPU ms" for k in
                          ("first", "middle", "last"))
        print(f"{r['store']:7} {fill}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stores", nargs="+", default=None, choices=["memory", "sqlite", "ray"],
                        help="default: memory sqlite ray (without ray under --quick)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--turns", type=int, default=2, help="turns per session before finalize")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens to store: segments and steps (default 2 000 000)")
    parser.add_argument("--prompt-words", type=int, default=250,
                        help="words of each session's first prompt (~4 tokens each)")
    parser.add_argument("--quick", action="store_true", help="200 000 tokens, memory and sqlite")
    parser.add_argument("--repeat", type=int, default=1, help="runs per store (interleaved); figures are medians")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument("--load", help=argparse.SUPPRESS)
    parser.add_argument("--pid", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.tokens = args.tokens or (200_000 if args.quick else 2_000_000)
    if args.load:  # the load generator process
        Path(args.out).write_text(json.dumps(asyncio.run(load(args))))
        return
    stores = args.stores or (["memory", "sqlite"] if args.quick else ["memory", "sqlite", "ray"])
    print(f"load average before: {loadavg()} ({os.cpu_count()} cores)", flush=True)
    ray_address = None
    if "ray" in stores:
        import ray

        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, namespace="bench",
                               runtime_env={"env_vars": {"PYTHONPATH": os.environ.get("PYTHONPATH", "")}}
                               )
        ray_address = ray.get_runtime_context().gcs_address
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in stores}
    with engine_stub(canned(REPLY, 16)) as stub:
        for r in range(args.repeat):  # interleaved: a load spike from elsewhere hits every store alike
            for kind in stores:
                with tempfile.TemporaryDirectory() as tmp:
                    runs[kind].append(run_store(kind, args, stub.url, Path(tmp), ray_address))
                print(f"{kind} run {r + 1}: {runs[kind][-1]['turns_per_s']:.1f} turns/s, load average {loadavg()}",
                      flush=True)
    rows = [median(results) for results in runs.values()]
    print_table(args, rows)
    end_run(rows, args.json)
    if "ray" in stores:
        import ray

        ray.shutdown()


if __name__ == "__main__":
    main()
