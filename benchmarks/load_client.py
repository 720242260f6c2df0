"""The load generator of ``overhead.py``, in its own process: chat sessions over keep-alive HTTP/1.1.

    python benchmarks/load_client.py URL --concurrency 64 [--stream] [--duration 5] --watch proxy=PID ...
    python benchmarks/load_client.py URL --long-session 200 --tool-output-words 36 --watch proxy=PID ...

It prints one JSON object. Throughput mode: ``concurrency`` workers, each running sessions of
``--session-turns`` turns back to back on its own connection (the assistant's reply and a new
user message appended each turn, the session named by ``X-Session-Id``; with
``--connection-per-session`` each session on a new connection, as an agent process opens
its own); after ``--warmup`` seconds, and once every worker has completed a turn, it
measures for ``--duration`` seconds: turns completed, latency of each (the whole reply, or
the first text chunk when streaming), the latency of the first turns of the sessions that
started in the window apart (``first_p50_ms``, ``first_p99_ms``), and the CPU time the
watched processes spent meanwhile. Worker ``w``'s first session is cut short to
``1 + w % session_turns`` turns, so that new sessions start spread over the window, not
all together every ``session_turns`` turns. Long-session mode: one
session of tool-calling turns, each adding a tool output of ``--tool-output-words`` words,
with the CPU time of each turn.

CPU time is the process-wide CPU clock of each watched pid (``clock_gettime`` on
``CPUCLOCK_SCHED(pid)``: the sum of ``utime + stime`` of ``/proc/<pid>/stat`` over all its
threads, at nanosecond resolution instead of 10 ms ticks), plus that of its live child
processes (``actorproxy run --workers N``: the supervisor and its workers).

A hand-written HTTP/1.1 client on asyncio rather than httpx: the generator's own CPU per
request must stay well below the proxy's, on the same two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from typing import Any

TEXT = re.compile(rb'"(?:content|reasoning_content)": ?"(?!")')
TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


def tree_cpu_seconds(pid: int) -> float:
    """CPU time of process ``pid`` and of its live child processes (the workers of ``actorproxy run --workers N``)."""
    return cpu_seconds(pid) + sum(cpu_seconds(child) for child in _children(pid))


def tree_system_seconds(pid: int) -> float:
    """The kernel's share of :func:`tree_cpu_seconds`: system time of ``pid`` and its live children,
    from ``/proc/<pid>/stat`` (clock ticks: 10 ms each, so read it over seconds, not milliseconds)."""
    return system_seconds(pid) + sum(system_seconds(child) for child in _children(pid))


def system_seconds(pid: int) -> float:
    """System (kernel) CPU time of process ``pid``, every thread, dead ones included; 0 if it is gone."""
    try:
        return _stat_seconds(pid)[1]
    except OSError:
        return 0.0


def _children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: list[int] = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                found += [int(child) for child in f.read().split()]
        except OSError:
            continue
    return found


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread, dead ones included) of process ``pid``."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    except OSError:  # not Linux: the tick counts of /proc/<pid>/stat
        return sum(_stat_seconds(pid))


def _stat_seconds(pid: int) -> tuple[float, float]:
    """User and system CPU time of process ``pid`` from ``/proc/<pid>/stat`` (clock ticks); ``OSError`` if gone."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


class Http:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None
                      ) -> tuple[int, bytes, float]:
        """(status, body, seconds to the first chunk carrying reply text, else to the whole body)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n{extra}\r\n")
        start = time.perf_counter()
        self.writer.write(head.encode("latin-1") + body)
        status_line, *lines = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        length, chunked, close = None, False, False
        for line in lines:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value:
                chunked = True
            elif name == "connection" and value == "close":
                close = True
        first: float | None = None
        if chunked:
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    break
                chunk = (await self.reader.readexactly(size + 2))[:-2]
                if first is None and TEXT.search(chunk):
                    first = time.perf_counter() - start
                parts.append(chunk)
            data = b"".join(parts)
        elif length is not None:
            data = await self.reader.readexactly(length)
        else:
            data = await self.reader.read()
            close = True
        if close:
            await self.close()
        return status, data, first if first is not None else time.perf_counter() - start

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.reader = self.writer = None


def watch(pids: dict[str, int]) -> dict[str, float]:
    return {name: tree_cpu_seconds(pid) for name, pid in pids.items()}


async def stub_connections(http: Http | None) -> int | None:
    if http is None:
        return None
    _, data, _ = await http.request("GET", "/stub/stats")
    return int(json.loads(data)["connections"])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def session_start(sid: str) -> list[dict[str, Any]]:
    """A benchmark session's first messages (each later turn adds the reply and one question)."""
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": f"Question 0 of session {sid}: what is 6 times 7?"},
    ]


async def throughput(args: argparse.Namespace, host: str, port: int, pids: dict[str, int],
                     stub: Http | None) -> dict[str, Any]:
    window: dict[str, float] = {"start": float("inf"), "end": float("inf")}
    latencies: list[float] = []
    first_latencies: list[float] = []  # of the turns that opened a session
    errors: list[str] = []
    stop = asyncio.Event()
    completed = 0
    headers = {k.strip(): v.strip() for k, v in (h.split(":", 1) for h in args.header)}

    async def worker(w: int) -> None:
        nonlocal completed
        http = Http(host, port)
        n = 0
        try:
            while not stop.is_set():
                sid = f"{args.tag}-{w}-{n}"
                # The first session of each worker is cut short: later sessions start spread over time.
                turns = args.session_turns if n else 1 + w % args.session_turns
                n += 1
                if args.connection_per_session:
                    await http.close()
                messages: list[dict[str, Any]] = session_start(sid)
                for turn in range(turns):
                    if stop.is_set():
                        return
                    body = json.dumps({"model": args.model, "messages": messages, "max_tokens": args.max_tokens,
                                       "stream": args.stream}).encode()
                    status, data, latency = await http.request("POST", args.path, body,
                                                               {"X-Session-Id": sid, **headers})
                    ended = time.perf_counter()
                    if status != 200:
                        errors.append(f"{status}: {data[:200]!r}")
                        await asyncio.sleep(0.01)  # back off instead of spinning on errors
                        break
                    warmed.add(w)
                    if len(warmed) == args.concurrency:
                        all_warm.set()
                    if window["start"] <= ended <= window["end"]:  # turns that end in the window
                        completed += 1
                        latencies.append(latency)
                        if turn == 0:
                            first_latencies.append(latency)
                    reply = args.reply_text if args.stream else json.loads(data)["choices"][0]["message"]["content"]
                    messages.append({"role": "assistant", "content": reply})
                    messages.append({"role": "user", "content": f"Question {turn + 1}: and 7 times 8?"})
        finally:
            await http.close()

    warmed: set[int] = set()  # workers that have completed a turn
    all_warm = asyncio.Event()
    tasks = [asyncio.create_task(worker(w)) for w in range(args.concurrency)]
    await asyncio.sleep(args.warmup)
    # At high concurrency on a loaded machine a first turn can take longer than the warm-up:
    # the window would then measure sessions being set up, not turns. Wait for every worker.
    try:
        await asyncio.wait_for(all_warm.wait(), 120)
    except TimeoutError:
        pass  # measured anyway; overhead.py flags a row with too few turns
    me = os.getpid()
    conns0 = await stub_connections(stub)
    cpu0 = watch({**pids, "client": me})
    window["start"] = time.perf_counter()
    await asyncio.sleep(args.duration)
    window["end"] = time.perf_counter()
    cpu1 = watch({**pids, "client": me})
    conns1 = await stub_connections(stub)
    stop.set()
    done, pending = await asyncio.wait(tasks, timeout=30)
    for task in pending:
        task.cancel()
    for task in done:
        if task.exception() is not None:
            errors.append(repr(task.exception()))
    turns = max(completed, 1)
    return {
        "turns": completed, "turns_per_s": completed / args.duration,
        "p50_ms": percentile(latencies, 0.5) * 1000, "p99_ms": percentile(latencies, 0.99) * 1000,
        "first_turns": len(first_latencies), "first_p50_ms": percentile(first_latencies, 0.5) * 1000,
        "first_p99_ms": percentile(first_latencies, 0.99) * 1000,
        "cpu_ms_per_turn": {k: (cpu1[k] - cpu0[k]) * 1000 / turns for k in cpu0},
        "engine_connections_per_turn": None if conns0 is None or conns1 is None else (conns1 - conns0) / turns,
        "errors": len(errors), "first_error": errors[0] if errors else None,
    }


async def long_session(args: argparse.Namespace, host: str, port: int, pids: dict[str, int],
                       stub: Http | None) -> dict[str, Any]:
    http = Http(host, port)
    proxy = pids["proxy"]
    words = args.tool_output_words
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Read every module and summarise the code base. Context: "
         + " ".join(f"line{j}_of_task = compute({j})" for j in range(words))},
    ]
    cpu: list[float] = []
    sizes: list[int] = []
    prompt_tokens = 0
    sid = f"{args.tag}-long"
    try:
        for i in range(args.long_session):
            body = json.dumps({"model": args.model, "messages": messages, "tools": [TOOL], "max_tokens": 64}).encode()
            before = tree_cpu_seconds(proxy)
            status, data, _ = await http.request("POST", args.path, body, {"X-Session-Id": sid})
            cpu.append(tree_cpu_seconds(proxy) - before)
            sizes.append(len(body))
            if status != 200:
                raise RuntimeError(f"turn {i + 1}: HTTP {status}: {data[:300]!r}")
            reply = json.loads(data)
            prompt_tokens = reply["usage"]["prompt_tokens"]
            message = reply["choices"][0]["message"]
            call = message["tool_calls"][0]
            messages.append({"role": "assistant", "content": message.get("content") or "", "tool_calls": [call]})
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": " ".join(f"line{j}_of_{i} = compute({j})" for j in range(words))})
    finally:
        await http.close()
    return {"cpu_ms": [c * 1000 for c in cpu], "request_bytes": sizes, "prompt_tokens": prompt_tokens}


async def main(args: argparse.Namespace) -> None:
    host, port = args.url.removeprefix("http://").rstrip("/").rsplit(":", 1)
    pids = {name: int(pid) for name, pid in (w.split("=") for w in args.watch)}
    stub = None
    if args.stub_url:
        stub_host, stub_port = args.stub_url.removeprefix("http://").rstrip("/").rsplit(":", 1)
        stub = Http(stub_host, int(stub_port))
    try:
        if args.long_session:
            result = await long_session(args, host, int(port), pids, stub)
        else:
            result = await throughput(args, host, int(port), pids, stub)
    finally:
        if stub is not None:
            await stub.close()
    print(json.dumps(result), flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("--path", default="/v1/chat/completions")
    parser.add_argument("--model", default="actorproxy")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of each throughput turn")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--session-turns", type=int, default=10)
    parser.add_argument("--connection-per-session", action="store_true",
                        help="open a new connection for each session (an agent process per session)")
    parser.add_argument("--reply-text", default="", help="the assistant text to echo back after a streamed turn")
    parser.add_argument("--tag", default="s", help="session id prefix (unique per run)")
    parser.add_argument("--watch", action="append", default=[], metavar="NAME=PID")
    parser.add_argument("--stub-url", help="the engine stub, for its connection count")
    parser.add_argument("--header", action="append", default=[], metavar="NAME: VALUE",
                        help="an extra request header (e.g. a gateway's Authorization)")
    parser.add_argument("--long-session", type=int, default=0, metavar="TURNS")
    parser.add_argument("--tool-output-words", type=int, default=36)
    return parser.parse_args(argv)


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
