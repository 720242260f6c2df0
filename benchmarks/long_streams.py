"""Long generations at GPU pace: what relaying a streamed token costs the proxy, over real HTTP.

    python benchmarks/long_streams.py                       # short default: 16 streams x 2,000 tokens
    python benchmarks/long_streams.py --tokens 2000 16000 --streams 16 256 1000 --interval 0.01 0.02 \\
        --burst 1 8 --shape sglang-incremental sglang-cumulative vllm llamacpp
    PATH=$PATH:/tmp/litellm/bin python benchmarks/long_streams.py --streams 16 --interval 0.01 \\
        --targets actorproxy litellm --litellm-timeout 60    # LiteLLM's proxy beside the engine and actorproxy
    python benchmarks/long_streams.py --streams 256 --interval 0.02 --decode-steps   # one decoding step clock

Three processes per row, so that no one's CPU is another's: the engine (``actorproxy sim
--reply-tokens T --token-interval I --stream-interval B``: every reply is ``T`` tokens of the
word `` so`` then the end-of-turn token, a token every ``I`` seconds per stream, streamed in
bursts of ``B``; with ``--decode-steps`` the engine decodes in steps, as a GPU engine batching
every running request: all streams' tokens come out together every ``I``, not each stream on the
phase of its own start), the proxy (``actorproxy run --backend ...`` in front of it) and the ``N``
streaming clients (this script with ``--clients``, plain asyncio sockets, one connection each).
A row runs the clients against the engine's own streaming API (``direct``: SGLang's
``/generate``, vLLM's ``/v1/completions``, llama.cpp's ``/completion``, each asked for the
sampled ids and logprobs as the proxy asks for them), then against each of ``--targets``:
``actorproxy`` (``/v1/chat/completions``, ``stream: true``) and ``litellm``, LiteLLM's proxy
(one worker, started as ``overhead.py`` starts it), only when the ``litellm`` command is on
``PATH`` (it is not a dependency: docs/performance.md says how to install it beside the
project); without it the LiteLLM rows are skipped with a printed line.

The engine stand-in paces its replies on its engine-native routes only (it has no chat
endpoint), so LiteLLM relays the one of them that is OpenAI's API: vLLM's streamed
``/v1/completions`` with a token-id prompt. Its clients send LiteLLM's ``/v1/completions``
(model ``text-completion-openai/sim``) the direct vLLM clients' body; LiteLLM forwards it,
``logprobs`` and ``return_token_ids`` included, to the stand-in's ``/v1/completions`` and relays
each event as an OpenAI ``text_completion`` chunk of the text alone (it drops the logprobs and
token ids it received). So LiteLLM's row is a pass-through of the
same paced events, with no chat template, tokenization or recording: less work per token than
the proxy does, whatever the row's ``--shape``. LiteLLM saturates far below the proxy (a
fraction of 256 paced streams): ``--litellm-timeout`` bounds its runs on their own.

The clients count tokens by counting the word in the text they receive (exact: the word is
one token in the built-in qwen3 vocabulary). Per row:

- ``tok/s``: tokens received per second, from the first token of any stream to the last;
- ``done``: streams that received all ``T`` tokens and the end of the stream;
- ``proxy µs/tok``: the CPU time of the row's proxy (actorproxy or LiteLLM: the process and its
  live child processes, user + system, every thread, from ``/proc``: far less sensitive to a
  loaded machine than wall time) while every stream is streaming, per token received
  meanwhile; ``proxy %``, ``engine %``, ``clients %``: the CPU each process used in that
  window (an engine or clients near 100 % is the bottleneck, not the proxy); ``of it sys``: the
  part of ``proxy µs/tok`` spent in the kernel (system time, from ``/proc/<pid>/stat`` in 10 ms
  ticks): the sockets' receives and sends, one of each a token for a token that arrives alone,
  which no change to the proxy's own code removes;
- ``delay p50/p99``: how late each token arrives behind its stream's own pace, in ms: token
  ``n`` of a stream is due ``(ceil(n/B) - 1) * B * I`` after the stream's first token (the
  first burst sets the origin, so time to first token is not counted). The direct row is the
  engine's and the clients' own lateness; the proxy row minus it is what the hop adds.

Runs are bounded: a row ends when every stream ended or after ``--timeout`` seconds
(``--litellm-timeout`` for LiteLLM's) of waiting for every stream's first token and as many
again for the streams to end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from load_client import tree_cpu_seconds, tree_system_seconds
from overhead import end_run, loadavg
from processes import LITELLM_KEY, litellm_installed, litellm_proxy, proxy, sim_engine

SHAPES = {  # shape: (proxy --backend, extra sim flags, the engine's own streaming API)
    "sglang-incremental": ("sglang", ["--incremental-streaming-output"], "sglang"),
    "sglang-cumulative": ("sglang", [], "sglang-cumulative"),
    "vllm": ("vllm", [], "vllm"),
    "llamacpp": ("llamacpp", [], "llamacpp"),
}
PROMPT = list(range(1000, 1032))  # the direct clients' token-id prompt
LITELLM_MODEL = "text-completion-openai/sim"  # LiteLLM's OpenAI text-completion provider: the sim's /v1/completions


#: Where a chat stream's logprobs begin: every token's entry comes on its last chunk, after the text.
_LISTED = b'"logprobs":{"content":['


def words(data: bytes) -> int:
    """The word's occurrences in raw JSON events: after a space, or first in a string."""
    return data.count(b" so") + data.count(b'"so')


def run_clients(target: str, url: str, args: argparse.Namespace, streams: int, tokens: int, interval: float,
                burst: int, watch: dict[str, int], timeout: float | None = None) -> dict[str, Any]:
    """Run the clients' process against ``url``; the CPU of ``watch`` while every stream streams."""
    command = [sys.executable, str(Path(__file__)), "--clients", url, "--target", target, "--streams", str(streams),
               "--tokens", str(tokens), "--interval", str(interval), "--burst", str(burst),
               "--timeout", str(args.timeout if timeout is None else timeout), "--top-logprobs", str(args.top_logprobs)]
    clients = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    pids = watch | {"clients": clients.pid}
    try:
        assert clients.stdout is not None
        line = clients.stdout.readline()  # every stream has its first token
        if not line.startswith("STREAMING"):
            raise RuntimeError(f"the clients did not get their streams going: {line!r}")
        sys0 = tree_system_seconds(watch["proxy"]) if "proxy" in watch else 0.0
        cpu0, t0, tok0 = {k: tree_cpu_seconds(p) for k, p in pids.items()}, time.monotonic(), int(line.split()[1])
        line = clients.stdout.readline()  # the last stream ended (or the timeout)
        cpu1, t1 = {k: tree_cpu_seconds(p) for k, p in pids.items()}, time.monotonic()
        sys1 = tree_system_seconds(watch["proxy"]) if "proxy" in watch else 0.0
        if not line.startswith("ENDING"):
            raise RuntimeError(f"the clients ended badly: {line!r}")
        tok1 = int(line.split()[1])
        result: dict[str, Any] = json.loads(clients.stdout.readline())
        clients.wait(60)
    finally:
        if clients.poll() is None:
            clients.kill()
            clients.wait()
    window = max(t1 - t0, 1e-9)
    result["window_s"] = window
    result["window_tokens"] = tok1 - tok0
    for k in pids:
        result[f"{k}_cpu_pct"] = (cpu1[k] - cpu0[k]) * 100 / window
    if "proxy" in watch:
        result["proxy_us_per_token"] = (cpu1["proxy"] - cpu0["proxy"]) * 1e6 / max(1, tok1 - tok0)
        result["proxy_sys_us_per_token"] = (sys1 - sys0) * 1e6 / max(1, tok1 - tok0)
    return result


def one_row(args: argparse.Namespace, shape: str, tokens: int, streams: int, interval: float,
            burst: int) -> list[dict[str, Any]]:
    backend, sim_flags, direct = SHAPES[shape]
    capacity = str(streams + 10)
    flags = ["--reply-tokens", str(tokens), "--token-interval", str(interval), "--stream-interval", str(burst),
             "--record-capacity", "1", *sim_flags, *(["--decode-steps"] if args.decode_steps else [])]
    rows = []
    with sim_engine(*flags) as engine:
        if not args.no_direct:
            r = run_clients(direct, engine.url, args, streams, tokens, interval, burst, {"engine": engine.pid})
            rows.append({"via": "direct"} | r)
        if "actorproxy" in args.targets:
            with proxy(backend, engine.url, "--max-sessions", capacity, "--engine-max-concurrency", capacity,
                       *args.proxy_flag) as server:
                r = run_clients("chat", server.url, args, streams, tokens, interval, burst,
                                {"proxy": server.pid, "engine": engine.pid})
                rows.append({"via": "actorproxy"} | r)
        if "litellm" in args.targets:
            with litellm_proxy(engine.url + "/v1", LITELLM_MODEL) as server:
                r = run_clients("litellm", server.url, args, streams, tokens, interval, burst,
                                {"proxy": server.pid, "engine": engine.pid}, args.litellm_timeout)
                rows.append({"via": "litellm"} | r)
    return rows


# -- the clients' process ----------------------------------------------------------


def _request(target: str, host: str, i: int, tokens: int, top: int = 0) -> bytes:
    """Stream ``i``'s request; ``top``: each token's likeliest alternatives asked for too (``--top-logprobs``)."""
    if target == "chat":
        path, extra = "/v1/chat/completions", f"X-Session-Id: long{i}\r\n"
        body: dict[str, Any] = {"messages": [{"role": "user", "content": f"Story {i}, please."}], "stream": True,
                                "max_tokens": tokens + 1}
        if top:
            body |= {"logprobs": True, "top_logprobs": top}
    else:
        extra = f"Authorization: Bearer {LITELLM_KEY}\r\n" if target == "litellm" else ""
        # Each asks for what the proxy asks of that engine: the sampled ids and their logprobs.
        if target.startswith("sglang"):
            path = "/generate"
            body = {"input_ids": PROMPT, "stream": True, "return_logprob": True,
                    "sampling_params": {"max_new_tokens": tokens + 1}, "top_logprobs_num": top}
        elif target in ("vllm", "litellm"):  # LiteLLM: the same body, to be forwarded to vLLM's route
            path, body = "/v1/completions", {"prompt": PROMPT, "stream": True, "max_tokens": tokens + 1,
                                             "logprobs": top, "return_token_ids": True}
            if target == "litellm":
                body["model"] = LITELLM_MODEL
        else:
            path, body = "/completion", {"prompt": PROMPT, "stream": True, "n_predict": tokens + 1,
                                         "n_probs": max(top, 1), "return_tokens": True}
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{extra}"
            f"Connection: close\r\nContent-Length: {len(raw)}\r\n\r\n").encode() + raw


class StreamFailed(Exception):
    """A stream's error event (LiteLLM's, the proxy's, the engine's): the stream ends there."""


def _text(target: str, event: bytes) -> str:
    data = json.loads(event)
    if "error" in data:
        raise StreamFailed(json.dumps(data["error"])[:300])
    if target in ("vllm", "litellm"):  # (LiteLLM's last event has a finish_reason and no text)
        return str(data["choices"][0].get("text") or "") if data.get("choices") else ""
    return str(data.get("content" if target == "llamacpp" else "text") or "")


class Delays:
    """A histogram of per-token lateness in 0.1 ms buckets (bounded memory at millions of tokens)."""

    def __init__(self) -> None:
        self.buckets: dict[int, int] = {}

    def add(self, seconds: float, count: int) -> None:
        key = max(0, int(seconds * 10_000))
        self.buckets[key] = self.buckets.get(key, 0) + count

    def percentile(self, q: float) -> float:
        total = sum(self.buckets.values())
        if not total:
            return math.nan
        rank, seen = q * (total - 1), 0
        for key in sorted(self.buckets):
            seen += self.buckets[key]
            if seen > rank:
                return key / 10  # ms
        return max(self.buckets) / 10


async def clients_main(args: argparse.Namespace) -> None:
    host, port = args.clients.removeprefix("http://").rstrip("/").rsplit(":", 1)
    streams, tokens, interval, burst = args.streams[0], args.tokens[0], args.interval[0], args.burst[0]
    cumulative = args.target == "sglang-cumulative"
    pace = burst * interval
    delays = Delays()
    received = [0] * streams
    completed = 0
    first_any = last_any = 0.0
    started = 0
    all_started = asyncio.Event()

    async def stream(i: int) -> None:
        nonlocal completed, first_any, last_any, started
        reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 24)
        writer.write(_request(args.target, host, i, tokens, args.top_logprobs))
        origin = 0.0
        tail = b""
        ended = listing = False
        try:
            while data := await reader.read(1 << 20):
                now = time.monotonic()
                seen = tail + data
                if args.target != "chat":  # an engine's events also name the tokens in their logprobs: read the text
                    end = seen.rfind(b"\n\n")
                    # (an event may follow the response head or a chunk-size line: from its "data: {")
                    texts = [_text(args.target, event[event.find(b"data: {") + 6:])
                             for event in seen[:max(end, 0)].split(b"\n\n") if b"data: {" in event]
                    tail = seen[end + 2:] if end >= 0 else seen
                    if cumulative:  # the whole text so far in every event: the last one counts
                        new = texts[-1].count("so") - received[i] if texts else 0
                    else:
                        new = sum(text.count("so") for text in texts)
                else:
                    if b'data: {"error"' in seen:
                        raise StreamFailed(seen[seen.find(b'data: {"error"') + 6:][:300].decode(errors="replace"))
                    if listing:  # (the logprobs' entries spell the word too: not counted)
                        new = 0
                    elif (mark := seen.find(_LISTED)) >= 0:
                        listing = True
                        new = words(seen[:mark]) - words(tail)
                    else:
                        new = words(seen) - words(tail)
                    tail = seen[-len(_LISTED):]
                if b"[DONE]" in seen or b'"stop":true' in seen:
                    ended = True  # (llama.cpp ends with its "stop": true event, no [DONE])
                if new > 0:
                    if not received[i]:
                        origin = now
                        first_any = first_any or now
                        started += 1
                        if started == streams:
                            all_started.set()
                    # Token n is due (ceil(n / burst) - 1) * pace after the first one: count the new
                    # tokens' lateness, each against its own due time.
                    for n in range(received[i] + 1, received[i] + new + 1):
                        delays.add(now - origin - (math.ceil(n / burst) - 1) * pace, 1)
                    received[i] += new
                    last_any = now
                if ended and not cumulative or ended and b"[DONE]" in seen:
                    break
        finally:
            writer.close()
        if received[i] == tokens and ended:
            completed += 1

    tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
    everything = asyncio.gather(*tasks, return_exceptions=True)
    try:
        await asyncio.wait_for(all_started.wait(), args.timeout)
    except TimeoutError:
        pass
    print(f"STREAMING {sum(received)}", flush=True)
    try:
        errors = [e for e in await asyncio.wait_for(everything, args.timeout) if isinstance(e, BaseException)]
    except TimeoutError:
        errors = [TimeoutError("timeout")]
    print(f"ENDING {sum(received)}", flush=True)
    total = sum(received)
    print(json.dumps({
        "tokens": total, "completed": completed, "streams": streams, "errors": len(errors),
        "first_error": f"{type(errors[0]).__name__}: {errors[0]}" if errors else None,
        "tok_per_s": total / max(last_any - first_any, 1e-9),
        "delay_p50_ms": delays.percentile(0.5), "delay_p99_ms": delays.percentile(0.99),
    }), flush=True)


# -- the table ---------------------------------------------------------------------


def main(args: argparse.Namespace) -> None:
    print(f"load average before: {loadavg()}", flush=True)
    if args.top_logprobs:
        print(f"each token's {args.top_logprobs} likeliest alternatives asked for too", flush=True)
    if "litellm" in args.targets and not litellm_installed():
        args.targets.remove("litellm")
    head = (f"{'shape':<18} {'tokens':>6} {'streams':>7} {'interval':>8} {'burst':>5} {'steps':>5} {'via':<10} "
            f"{'tok/s':>8} {'done':>9} {'proxy µs/tok':>12} {'of it sys':>9} {'delay p50':>9} {'p99 ms':>8} "
            f"{'proxy %':>7} {'engine %':>8} {'clients %':>9}")
    print(head, flush=True)
    every = []
    steps = "yes" if args.decode_steps else "no"
    for shape in args.shape:
        for tokens in args.tokens:
            for streams in args.streams:
                for interval in args.interval:
                    for burst in args.burst:
                        for r in one_row(args, shape, tokens, streams, interval, burst):
                            r |= {"shape": shape, "tokens_per_stream": tokens, "interval": interval, "burst": burst,
                                  "decode_steps": args.decode_steps, "top_logprobs": args.top_logprobs}
                            every.append(r)
                            us = f"{r['proxy_us_per_token']:.1f}" if "proxy_us_per_token" in r else "-"
                            sys_us = f"{r['proxy_sys_us_per_token']:.1f}" if "proxy_sys_us_per_token" in r else "-"
                            print(f"{shape:<18} {tokens:>6} {streams:>7} {interval * 1000:>6.0f}ms {burst:>5} "
                                  f"{steps:>5} {r['via']:<10} {r['tok_per_s']:>8.0f} {r['completed']:>4}/{streams:<4} "
                                  f"{us:>12} {sys_us:>9} {r['delay_p50_ms']:>9.1f} {r['delay_p99_ms']:>8.1f} "
                                  f"{r.get('proxy_cpu_pct', 0):>7.0f} {r['engine_cpu_pct']:>8.0f} "
                                  f"{r['clients_cpu_pct']:>9.0f}", flush=True)
                            if r["first_error"]:
                                print(f"    {r['errors']} errors, the first: {r['first_error']}", flush=True)
    end_run(every, args.json)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2000], help="tokens per reply")
    parser.add_argument("--streams", type=int, nargs="+", default=[16], help="concurrent streams")
    parser.add_argument("--interval", type=float, nargs="+", default=[0.01], help="seconds per token per stream")
    parser.add_argument("--burst", type=int, nargs="+", default=[1], help="tokens per streamed event")
    parser.add_argument("--shape", nargs="+", default=["sglang-incremental"], choices=sorted(SHAPES))
    parser.add_argument("--decode-steps", action="store_true",
                        help="the engine decodes in steps (`actorproxy sim --decode-steps`): every stream's tokens "
                             "come out together each interval, as from a GPU engine batching them (column `steps`)")
    parser.add_argument("--no-direct", action="store_true", help="skip the engine-direct baseline")
    parser.add_argument("--top-logprobs", type=int, default=0, metavar="K",
                        help="ask for each token's K likeliest alternatives too (OpenAI's top_logprobs)")
    parser.add_argument("--targets", nargs="+", default=["actorproxy"], choices=["actorproxy", "litellm"],
                        help="besides the direct engine (default: actorproxy; litellm when the `litellm` command "
                             "is on PATH, else skipped with a printed line)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take at most")
    parser.add_argument("--litellm-timeout", type=float, default=None,
                        help="seconds a LiteLLM run may take at most (default: --timeout)")
    parser.add_argument("--proxy-flag", action="append", default=[], help="an extra `actorproxy run` argument")
    parser.add_argument("--json", help="also write every row's figures to this file")
    parser.add_argument("--clients", metavar="URL", help=argparse.SUPPRESS)  # the clients' process
    parser.add_argument("--target", default="chat", help=argparse.SUPPRESS)
    parsed = parser.parse_args()
    if parsed.litellm_timeout is None:
        parsed.litellm_timeout = parsed.timeout
    if parsed.clients:
        asyncio.run(clients_main(parsed))
    else:
        main(parsed)
