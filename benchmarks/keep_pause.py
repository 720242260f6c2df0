"""The keep pause against abort + partial rollout, on a real vLLM: ack time, resume to next token, prompt tokens.

    python benchmarks/keep_pause.py                  # 4 streams, 3 runs per mode (~4 minutes with vLLM's start)
    python benchmarks/keep_pause.py --streams 8 --repeat 5

A dev-mode vLLM (``VLLM_SERVER_DEV_MODE=1 --enable-scale-out``, ``scripts/vllm/install.sh``) serves the
tiny random Qwen3; ``actorproxy run --backend vllm --partial-rollout --engine-pause`` is in front of it.
Per run: ``--streams`` streamed turns of ``--tokens`` tokens each, greedy; once every stream has
received ``--after`` pieces, ``POST /v1/rollout/pause`` with the mode, then ``/v1/rollout/resume``
with a new weight version. Measured:

* ack ms: the pause call, sent to answered (abort: every generation stopped and recorded, the
  engine paused; keep: the engine froze them);
* resume to next token ms: from the resume call's answer to the next piece on each stream
  (median over the streams; abort: the partial rollout's new request, prefill included);
* prompt tokens: what vLLM's ``vllm:prompt_tokens_total`` grew by over the run, over the streams'
  prompts (1.00: each prompt taken once; abort re-sends prompt + partial reply);
* the steps: every reply has ``--tokens`` tokens, and its preemptions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

import httpx
from processes import proxy, vllm_engine


def counter(http: httpx.Client, url: str, name: str) -> float:
    for line in http.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise RuntimeError(f"vLLM reports no {name}")


class Stream(threading.Thread):
    """One streamed turn: the time each piece arrived."""

    def __init__(self, url: str, session: str, tokens: int, after: int) -> None:
        super().__init__(daemon=True)
        self.url, self.session, self.tokens = url, session, tokens
        self.arrivals: list[float] = []
        self.started = threading.Event()
        self.after = after
        self.error: str | None = None

    def run(self) -> None:
        body = {"messages": [{"role": "user", "content": f"Count, {self.session}."}], "temperature": 0.0,
                "stream": True, "max_tokens": self.tokens}
        try:
            with httpx.Client(timeout=600) as http, http.stream(
                "POST", f"{self.url}/v1/chat/completions", json=body, headers={"X-Session-Id": self.session}
            ) as got:
                for line in got.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error = str(event["error"])
                    elif any(c["delta"].get("content") for c in event["choices"]):
                        self.arrivals.append(time.perf_counter())
                        if len(self.arrivals) >= self.after:
                            self.started.set()
        finally:
            self.started.set()


def one_run(args: argparse.Namespace, engine: str, target: str, mode: str, run: int) -> dict[str, Any]:
    with httpx.Client(timeout=600) as http:
        prompts_before = counter(http, engine, "vllm:prompt_tokens_total")
        streams = [Stream(target, f"{mode}-{run}-{i}-{time.time_ns()}", args.tokens, args.after)
                   for i in range(args.streams)]
        for stream in streams:
            stream.start()
        for stream in streams:
            stream.started.wait(600)
        sent = time.perf_counter()
        paused = http.post(f"{target}/v1/rollout/pause", json={"mode": mode}).json()
        ack = time.perf_counter() - sent
        time.sleep(args.hold)  # the trainer's weight update
        resumed = http.post(f"{target}/v1/rollout/resume", json={"weight_version": str(run + 1)})
        at = time.perf_counter()
        assert resumed.status_code == 200, resumed.text
        for stream in streams:
            stream.join(600)
        next_token = [next((t for t in s.arrivals if t > at), float("nan")) - at for s in streams]
        prompts = 0
        preemptions = []
        for stream in streams:
            assert stream.error is None, stream.error
            http.post(f"{target}/session/finalize", json={"session_id": stream.session})
            read = http.post(f"{target}/trajectory/read", json={"session_id": stream.session, "include_steps": True})
            (step,) = read.json()["steps"]
            assert len(step["output_ids"]) == args.tokens, (mode, len(step["output_ids"]))
            prompts += step["prompt_tokens"]
            preemptions.append(step["preemptions"])
        grown = counter(http, engine, "vllm:prompt_tokens_total") - prompts_before
    return {"ack_ms": ack * 1000, "next_token_ms": statistics.median(next_token) * 1000,
            "prompt_ratio": grown / prompts, "aborted": paused["aborted"], "preemptions": max(preemptions)}


def main(args: argparse.Namespace) -> None:
    with vllm_engine("dev") as engine, proxy("vllm", engine.url, "--partial-rollout", "--engine-pause") as target:
        print(f"vLLM (dev mode, --enable-scale-out) at {engine.url}; {args.streams} streams of {args.tokens} tokens, "
              f"paused after {args.after} pieces, held {args.hold} s", flush=True)
        print(f"{'mode':<6} {'ack ms':>8} {'resume→token ms':>16} {'prompt tokens ×':>16} {'aborted':>8} "
              f"{'preemptions':>12}", flush=True)
        report = {}
        for mode in ("abort", "keep"):
            runs = [one_run(args, engine.url, target.url, mode, r) for r in range(args.repeat)]
            row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            report[mode] = row
            print(f"{mode:<6} {row['ack_ms']:>8.1f} {row['next_token_ms']:>16.1f} {row['prompt_ratio']:>16.2f} "
                  f"{row['aborted']:>8.0f} {row['preemptions']:>12.0f}", flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=400, help="max_tokens of each stream")
    parser.add_argument("--after", type=int, default=20, help="pieces each stream receives before the pause")
    parser.add_argument("--hold", type=float, default=0.5, help="seconds between the pause's answer and the resume")
    parser.add_argument("--repeat", type=int, default=3, help="runs per mode (medians)")
    parser.add_argument("--json", help="also write the figures to this file")
    main(parser.parse_args())
