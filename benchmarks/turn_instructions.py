"""Instructions the proxy spends on a short non-streaming turn (at concurrency 1 by default), counted by callgrind.

    python benchmarks/turn_instructions.py [--turns 200] [--warmup 30] [--session-turns 10]
    python benchmarks/turn_instructions.py --strace      # syscalls per turn instead (strace -c -f)

``overhead.py``'s c = 1 load, over real HTTP, one turn after another (``--concurrency N``: N clients): the
engine stub (``engine_stub.py``, its own process, not traced) answers every turn with the canned 16-token
reply; the proxy (``actorproxy run --backend sglang``) runs under ``valgrind --tool=callgrind
--instr-atstart=no``; this script is the client, one keep-alive connection per client, sessions of
``--session-turns`` turns (the reply and a new user message appended each turn: every session asks the
same questions, as ``overhead.py``'s do; with ``--unique`` each session's questions name it, so no new
message repeats another session's). After ``--warmup`` turns the count is switched on (``callgrind_control
-i on``), ``--turns`` turns run, and it is switched off: the figure is the instructions of that window over
its turns, so start-up and the first turns' one-off work are not counted.
With ``--strace`` the proxy runs without valgrind and ``strace -c -f -p PID`` (every
thread) is attached for the same window instead: the syscalls of those turns, by name,
with each count over the turns.

Use the same arguments for the runs compared: the proxy is the checkout on ``PYTHONPATH``,
so old code is measured by running this script with ``PYTHONPATH`` at an old worktree.
``--keep FILE`` keeps the callgrind output (for ``callgrind_annotate``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from load_client import Http, session_start
from overhead import REPLY, canned
from processes import engine_stub, free_port, running, wait_ready
from relay_instructions import counted


async def turns(url: str, count: int, session_turns: int, tag: str, unique: bool = False) -> None:
    """``count`` turns, one at a time, on one connection, in sessions of ``session_turns`` turns.

    ``unique``: each session's questions name it, so no two sessions send the same new message.
    """
    host, port = url.removeprefix("http://").rsplit(":", 1)
    http = Http(host, int(port))
    done = 0
    session = 0
    try:
        while done < count:
            sid = f"{tag}-{session}"
            session += 1
            messages = session_start(sid)
            for turn in range(min(session_turns, count - done)):
                body = json.dumps({"model": "m", "messages": messages, "max_tokens": 16}).encode()
                status, data, _ = await http.request("POST", "/v1/chat/completions", body, {"X-Session-Id": sid})
                if status != 200:
                    raise RuntimeError(f"turn {done + 1}: HTTP {status}: {data[:300]!r}")
                done += 1
                messages.append({"role": "assistant", "content": json.loads(data)["choices"][0]["message"]["content"]})
                about = f" of session {sid}" if unique else ""
                messages.append({"role": "user", "content": f"Question {turn + 1}{about}: and 7 times 8?"})
    finally:
        await http.close()


async def clients(url: str, count: int, session_turns: int, tag: str, concurrency: int, unique: bool = False) -> None:
    """``count`` turns in all, from ``concurrency`` clients at once (each its own connection and sessions)."""
    share = [count // concurrency + (i < count % concurrency) for i in range(concurrency)]
    await asyncio.gather(*(turns(url, n, session_turns, f"{tag}{i}", unique) for i, n in enumerate(share)))


def per_turn(summary: str, count: int) -> str:
    """``strace -c``'s table, with a column of calls per turn."""
    lines = []
    for line in summary.splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[3].isdigit():
            lines.append(f"{int(fields[3]) / count:>9.2f} a turn  {fields[-1]}")
    return f"syscalls over {count} turns (every thread):\n" + "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--session-turns", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=1, help="clients at once (each its own connection)")
    parser.add_argument("--unique", action="store_true",
                        help="each session's questions name it: no new message repeats another session's")
    parser.add_argument("--strace", action="store_true", help="count syscalls (strace -c -f) instead")
    parser.add_argument("--keep", type=Path, help="copy the callgrind output here")
    parser.add_argument("--proxy-flag", action="append", default=[], help="an extra flag for actorproxy run")
    args = parser.parse_args()
    with engine_stub(canned(REPLY, 16)) as stub, tempfile.TemporaryDirectory(prefix="actorproxy-turns-") as tmp:
        out = Path(tmp) / ("strace.out" if args.strace else "callgrind.out")
        port = free_port()
        tool = [] if args.strace else ["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                       f"--callgrind-out-file={out}"]
        command = [*tool, sys.executable, "-m", "actorproxy", "run", "--port", str(port), "--backend", "sglang",
                   "--backend-url", stub.url, "--log-level", "WARNING", "--data-dir", str(Path(tmp) / "data"),
                   "--max-sessions", "1000000", "--max-steps-per-session", "1000", *args.proxy_flag]
        with running(command, stderr=subprocess.DEVNULL, cwd=tmp) as proxy:  # (not a checkout: see processes.proxy)
            url = f"http://127.0.0.1:{port}"
            wait_ready(url + "/health", proxy, timeout=600)
            asyncio.run(clients(url, args.warmup, args.session_turns, "warm", args.concurrency, args.unique))
            if args.strace:
                tracer = subprocess.Popen(["strace", "-c", "-f", "-o", str(out), "-p", str(proxy.pid)],
                                          stderr=subprocess.PIPE, text=True)
                assert tracer.stderr is not None
                tracer.stderr.readline()  # "strace: Process PID attached": tracing from here
            else:
                subprocess.run(["callgrind_control", "-i", "on", str(proxy.pid)], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            asyncio.run(clients(url, args.turns, args.session_turns, "count", args.concurrency, args.unique))
            if args.strace:
                tracer.send_signal(signal.SIGINT)  # detaches and writes the summary
                tracer.wait(30)
            else:
                subprocess.run(["callgrind_control", "-i", "off", str(proxy.pid)], check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if args.strace:
            print(per_turn(out.read_text(), args.turns), flush=True)
            return
        instructions = counted(out)  # (written as the proxy exits)
        if args.keep:
            shutil.copy(out, args.keep)
    print(f"c = {args.concurrency}, non-streaming, sessions of {args.session_turns} turns"
          f"{', questions unique to each session' if args.unique else ''}: "
          f"{instructions:,} instructions over {args.turns} turns = {instructions / max(args.turns, 1):,.0f} a turn",
          flush=True)


if __name__ == "__main__":
    main()
