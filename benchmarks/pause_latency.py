"""Pause latency and tokens lost with N long streams in flight, everything over real HTTP.

    python benchmarks/pause_latency.py [--streams 100 1000] [--token-interval 0.1] [--repeat 3]

Three processes per run, so that no one's CPU is another's: the engine
(``engine_stub.py --token-interval``: SGLang's ``/generate``, one decoding step per
interval for every running generation, starting once all N are running as a rollout
batch does, replies as long as ``--max-tokens``; it counts per generation the tokens it
wrote and how the generation ended), the proxy
(``actorproxy run --backend sglang --partial-rollout``) and the N streaming chat clients
(this script with ``--clients``, plain asyncio sockets). This process is the trainer.

A run: start N streams; once every client has ``--tokens-before-pause`` text events and
both the engine and the proxy (``pause_state``) count N generations running, measure
``--steady`` seconds (one) of steady streaming (the CPU each process spends, and the proxy's per token
the engine streamed meanwhile: ``proxy µs/token``, meaningful while it keeps up), then time
``POST /v1/rollout/pause`` to its acknowledgment. Then every generation started from
then on is made to end at once with the end-of-turn token, ``/v1/rollout/resume`` lets
every turn finish, and each session's step is read: per session, the tokens the engine
wrote (over all attempts) must equal the tokens the proxy recorded (``lost``), and every
generation the pause stopped must have ended by an abort call (``abort``), none by a
closed connection (``cut``). Per run it also prints when the abort calls reached the engine
and when the engine wrote the last aborted stream's finish (the engine's clock, ms after
the pause): what is left of the acknowledgement is the proxy reading what came before.
Where in the engine's decoding interval the pause came decides most of its acknowledgement
(the aborted streams end at the engine's next step after their abort calls): each run says
it, and ``--phase 0 0.25 0.5 0.75`` asks for the pause at those fractions of an interval
after a step, run by run in turn (0: as a step's tokens reach the proxy; near 1: the abort
calls may come just after the next step, and the streams end one step later).

Goal (issue 12): at 1,000 streams, acknowledged within one token interval + 50 ms, 0 lost.

``--callgrind DIR`` runs the proxy under ``valgrind --tool=callgrind --instr-atstart=no``
and counts its instructions from just before the pause call to its answer
(``callgrind_control -i on`` / ``off``): deterministic where the clock is not, and per
stream, the figure for comparing two trees (run the script with ``PYTHONPATH`` at each).
Each run's output is kept as ``DIR/callgrind.pause.STREAMS.RUN.out``, to read per function
with ``callgrind_annotate --inclusive=yes``. Use fewer streams (100) and a slow pace so that
the proxy keeps up under valgrind, and keep out of the window what the clock decides: an
engine step before every abort call is written (each stream then brings one token more; the
pass takes 0.5-1.1 s under valgrind at 100 streams: ``--token-interval 2 --steady 0.1``,
the pause coming just after a step) and the engine health checks
(``--proxy-flag=--engine-health-interval=3600``). The acknowledgement times are then
valgrind's, not the proxy's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from load_client import TEXT, cpu_seconds
from overhead import REPLY, canned, end_run, loadavg
from processes import engine_stub, post_json, proxy
from relay_instructions import counted as instructions_in


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=600) as response:
        return json.loads(response.read())


def _py_spy(path: str | None, pid: int, settle: float = 1.0) -> subprocess.Popen[bytes] | None:
    """A sampling profile of ``pid`` into ``path`` (raw py-spy output; py-spy on PATH), ``settle`` s after it starts."""
    if not path:
        return None
    command = ["py-spy", "record", "-r", "500", "-f", "raw", "-o", path, "--nonblocking", "-p", str(pid)]
    spy = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(settle)
    return spy


def _stop(spy: subprocess.Popen[bytes] | None) -> None:
    if spy is not None:
        spy.send_signal(signal.SIGINT)
        spy.wait()


def _wait_for_phase(step_at: float, interval: float, phase: float) -> None:
    """Sleep until ``phase`` of a decoding interval after one of the engine's steps (the next such moment at
    least 10 ms away): the engine stub steps every ``interval`` from ``step_at`` (``time.monotonic``)."""
    now = time.monotonic()
    at = step_at + phase * interval
    at += max(0, math.ceil((now + 0.010 - at) / interval)) * interval
    time.sleep(at - now)


def _count(pid: int, on: bool) -> None:
    """Switch callgrind's count in the proxy ``pid`` on or off."""
    subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(pid)], check=True,
                   stdout=subprocess.DEVNULL)


def one_run(args: argparse.Namespace, streams: int, run: int) -> dict[str, Any]:
    capacity = str(streams + 10)
    interval = args.token_interval
    out = None if args.callgrind is None else (args.callgrind / f"callgrind.pause.{streams}.{run}.out").absolute()
    under = [] if out is None else ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                    f"--callgrind-out-file={out}"]
    with (
        engine_stub(canned(REPLY), "--token-interval", str(interval), "--start-together", str(streams)) as stub,
        proxy("sglang", stub.url, "--partial-rollout", "--max-sessions", capacity,
              "--engine-max-concurrency", capacity, *args.proxy_flag, under=under) as server,
    ):
        command = [sys.executable, str(Path(__file__)), "--clients", server.url, "--streams", str(streams),
                   "--tokens-before-pause", str(args.tokens_before_pause), "--max-tokens", str(args.max_tokens)]
        clients = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        try:
            assert clients.stdout is not None
            ready = clients.stdout.readline()
            if not ready.startswith("READY"):
                raise RuntimeError(f"the clients did not get their streams going: {ready!r}")
            # Every stream is mid-generation: the engine and the proxy agree.
            running = [g for g in get_json(stub.url + "/stub/generations")["generations"] if g["state"] == "running"]
            in_flight = get_json(server.url + "/v1/rollout/pause_state")["in_flight"]
            if len(running) != streams or in_flight != streams:
                raise RuntimeError(f"not all {streams} streams in flight: engine {len(running)}, proxy {in_flight}")
            pids = {"proxy": server.pid, "engine": stub.pid, "clients": clients.pid}
            spy = _py_spy(args.py_spy_steady, server.pid)  # the steady window below (not its CPU figures)
            cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
            tokens0 = sum(g["tokens"] for g in get_json(stub.url + "/stub/generations")["generations"])
            time.sleep(args.steady)
            cpu1 = {k: cpu_seconds(p) for k, p in pids.items()}
            tokens1 = sum(g["tokens"] for g in get_json(stub.url + "/stub/generations")["generations"])
            _stop(spy)
            spy = _py_spy(args.py_spy, server.pid, 0.3)  # around the pause (from 0.3 s before it)
            phase = None if not args.phase else args.phase[run % len(args.phase)]
            if phase is not None:
                _wait_for_phase(get_json(stub.url + "/stub/generations")["step_at"], interval, phase)
            if out is not None:
                _count(server.pid, True)  # (before the clocks are read: callgrind_control takes a while)
            before = cpu_seconds(server.pid)
            paused_at = time.monotonic()  # the engine stub's clock (the same on one machine)
            t0 = time.perf_counter()
            ack = post_json(server.url + "/v1/rollout/pause", {"mode": "abort"}, timeout=600)
            ack_ms = (time.perf_counter() - t0) * 1000
            pause_cpu = (cpu_seconds(server.pid) - before) * 1000
            if out is not None:
                _count(server.pid, False)
            _stop(spy)
            engine = get_json(stub.url + "/stub/generations")
            post_json(stub.url + "/stub/pace", {"max_new_tokens": 1})
            post_json(server.url + "/v1/rollout/resume", {"weight_version": "1"})
            clients.wait(300)
        finally:
            if clients.poll() is None:
                clients.kill()
                clients.wait()
        ended = Counter(g["state"] for g in engine["generations"])
        produced: Counter[str] = Counter()
        for g in get_json(stub.url + "/stub/generations")["generations"]:
            produced[g["key"]] += g["tokens"]
        lost = recorded = 0
        for i in range(streams):
            sid = f"s{i}"
            post_json(server.url + "/session/finalize", {"session_id": sid})
            data = post_json(server.url + "/trajectory/read", {"session_id": sid, "include_steps": True})
            got = sum(len(step["output_ids"]) for step in data["steps"])
            recorded += got
            lost += abs(produced[sid] - got)
    # (callgrind writes its count as the proxy exits, above)
    instructions = None if out is None else instructions_in(out) / streams
    aborted = [g for g in engine["generations"] if g["abort_at"] is not None]
    arrived = sorted((g["abort_at"] - paused_at) * 1000 for g in aborted)
    ends = sorted(((g["ended_at"] or paused_at) - paused_at) * 1000 for g in aborted)
    stopped = ends[-1] if ends else 0.0
    return {
        "ack_ms": ack_ms,
        # When the abort calls reached the engine, and when it wrote the last aborted stream's finish (ms after
        # the pause was asked): the rest of the acknowledgement is the proxy reading what came before.
        "aborts_in_ms": [arrived[0], arrived[len(arrived) // 2], arrived[-1]] if arrived else [],
        "engine_stopped_ms": stopped, "engine_first_stop_ms": ends[0] if ends else 0.0, "phase": phase,
        # Where in the engine's decoding step the pause came (ms after the step before it began).
        "after_step_ms": ((paused_at - step_at) % interval) * 1000 if (step_at := engine["step_at"]) else None,
        "aborted": ack["aborted"], "partial_tokens": ack["partial_tokens"],
        "engine_aborted": ended["abort"], "engine_cut": ended["cut"], "engine_still_running": ended["running"],
        "abort_calls": engine["abort_calls"], "produced": sum(produced.values()), "recorded": recorded, "lost": lost,
        "pause_cpu_ms": pause_cpu, "instructions_a_stream": instructions,
        # The proxy's CPU per token the engine streamed meanwhile: what a streamed token costs
        # it, as long as it keeps up (below 100 % it does; above, tokens pile up in the sockets).
        "proxy_us_per_token": (cpu1["proxy"] - cpu0["proxy"]) * 1e6 / max(1, tokens1 - tokens0),
        **{f"{k}_cpu_pct": (cpu1[k] - cpu0[k]) * 100 / args.steady for k in pids},
    }


# -- the clients' process ----------------------------------------------------------


async def run_clients(args: argparse.Namespace) -> None:
    host, port = args.clients.removeprefix("http://").rstrip("/").rsplit(":", 1)
    streams = args.streams[0]
    received = [0] * streams
    ready = asyncio.Event()
    going = 0

    async def stream(i: int) -> None:
        nonlocal going
        body = json.dumps({"messages": [{"role": "user", "content": f"Story {i}, please."}], "stream": True,
                           "max_tokens": args.max_tokens}).encode()
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"X-Session-Id: s{i}\r\nConnection: close\r\nContent-Length: {len(body)}\r\n\r\n".encode()
                     + body)
        tail = b""
        while data := await reader.read(65536):
            # text events: a split event is counted once its second half arrives
            received[i] += len(TEXT.findall(tail + data)) - len(TEXT.findall(tail))
            if b"data: [DONE]" in tail + data:
                break  # the server may keep the connection open
            tail = data[-24:]
            if received[i] >= args.tokens_before_pause and i not in counted:
                counted.add(i)
                going += 1
                if going == streams:
                    ready.set()
        writer.close()

    counted: set[int] = set()
    tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
    try:
        await asyncio.wait_for(ready.wait(), 300)
    except TimeoutError:
        stalled = [i for i in range(streams) if i not in counted]
        print(f"STALLED {len(stalled)} streams below {args.tokens_before_pause} text events: {stalled[:5]}",
              flush=True)
        raise
    print("READY", flush=True)
    await asyncio.gather(*tasks)


# -- the trainer -------------------------------------------------------------------


def main(args: argparse.Namespace) -> None:
    print(f"load average before: {loadavg()}; token interval {args.token_interval * 1000:.0f} ms, "
          f"goal {args.token_interval * 1000 + 50:.0f} ms", flush=True)
    print(f"{'streams':>7} {'ack p50':>8} {'ack p99':>8} {'aborted':>8} {'cut':>4} {'calls':>6} {'produced':>9} "
          f"{'recorded':>9} {'lost':>5} {'proxy %':>8} {'engine %':>9} {'clients %':>9} {'pause CPU ms':>12} "
          f"{'proxy µs/token':>14}",
          flush=True)
    if args.callgrind is not None:
        args.callgrind.mkdir(parents=True, exist_ok=True)
    results: dict[int, list[dict[str, Any]]] = {}
    for streams in args.streams:
        runs = results[streams] = [one_run(args, streams, run) for run in range(args.repeat)]
        acks = sorted(r["ack_ms"] for r in runs)
        p99 = acks[min(len(acks) - 1, int(0.99 * len(acks)))]

        def med(key: str, rows: list[dict[str, Any]] = runs) -> float:
            return float(statistics.median(r[key] for r in rows))

        print(f"{streams:>7} {statistics.median(acks):>8.0f} {p99:>8.0f} {med('aborted'):>8.0f} "
              f"{sum(r['engine_cut'] for r in runs):>4} {med('abort_calls'):>6.0f} {med('produced'):>9.0f} "
              f"{med('recorded'):>9.0f} {max(r['lost'] for r in runs):>5} {med('proxy_cpu_pct'):>8.0f} "
              f"{med('engine_cpu_pct'):>9.0f} {med('clients_cpu_pct'):>9.0f} {med('pause_cpu_ms'):>12.0f} "
              f"{med('proxy_us_per_token'):>14.0f}",
              flush=True)
        for r in runs:
            if r["aborts_in_ms"]:
                first, mid, last = r["aborts_in_ms"]
                came = "" if r["after_step_ms"] is None else f" (asked {r['after_step_ms']:.0f} ms after a step)"
                print(f"    ack {r['ack_ms']:.0f} ms{came}: the abort calls reached the engine "
                      f"{first:.0f}-{last:.0f} ms after the pause (median {mid:.0f}), its aborted streams ended at "
                      f"{r['engine_first_stop_ms']:.0f}-{r['engine_stopped_ms']:.0f} ms", flush=True)
            if r["instructions_a_stream"] is not None:
                print(f"    callgrind: {r['instructions_a_stream']:,.0f} instructions a stream from the pause call "
                      f"to its answer", flush=True)
        for r in runs:
            if r["engine_still_running"] or r["aborted"] != streams or r["engine_aborted"] != streams:
                print(f"    a run did not stop every stream by its abort: {r}", flush=True)
    end_run(results, args.json)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--token-interval", type=float, default=0.1, help="seconds per engine decoding step")
    parser.add_argument("--tokens-before-pause", type=int, default=3, help="text events each client must have")
    parser.add_argument("--max-tokens", type=int, default=20000, help="long enough that no reply ends by itself")
    parser.add_argument("--repeat", type=int, default=1, help="runs per row (ack: median and p99 over them)")
    parser.add_argument("--steady", type=float, default=1.0, metavar="SECONDS",
                        help="the steady streaming measured before the pause (CPU %%, µs per token)")
    parser.add_argument("--phase", type=float, nargs="+", metavar="FRACTION",
                        help="ask for the pause this fraction of a token interval after an engine step, run by run "
                             "in turn (0: just after a step; default: whenever the steady window ends)")
    parser.add_argument("--proxy-flag", action="append", default=[], help="an extra `actorproxy run` argument")
    parser.add_argument("--json", help="also write every run's figures to this file")
    parser.add_argument("--py-spy", metavar="FILE", help="profile the proxy around the pause (raw py-spy output)")
    parser.add_argument("--py-spy-steady", metavar="FILE", help="profile the proxy's steady streaming (1 s)")
    parser.add_argument("--callgrind", type=Path, metavar="DIR",
                        help="count the proxy's instructions in the pause under callgrind; keep the outputs in DIR")
    parser.add_argument("--clients", metavar="PROXY_URL", help=argparse.SUPPRESS)  # the clients' process
    parsed = parser.parse_args()
    if parsed.clients:
        asyncio.run(run_clients(parsed))
    else:
        main(parsed)
