"""Does memory return after drains? RSS over many turns with a drain every few thousand (issue 33).

    python benchmarks/memory_drains.py [--turns 100000] [--drain-every 4000] [--store sqlite|memory]

The sessions of ``overhead.py``'s load (``--session-turns`` turns each, a system prompt, the
reply and a short user message appended every turn; ``--unique`` makes every user message
distinct, so that the body memo fills) run in this process through
:func:`~actorproxy.server.turns.serve_turn`, as in ``runtime_turn.py`` (the engine answers
at once from memory; no HTTP: a hundred thousand turns take minutes, not an hour). Each
session is finalized after its last turn; every ``--drain-every`` turns the trainer's drain
(``/trajectory/read`` with ``drain`` and ``include_steps``, its reply's parts taken one by one as
the route sends them) empties the store. Printed at each
drain: the process's RSS (anonymous and file-backed), the live sessions and stored segments
left (both 0). The figure: RSS at the end over RSS after the first 10,000 turns (the
target is within 10%).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from typing import Any

import trio
from load_client import session_start
from tito_scaling import InstantEngine

from actorproxy.config import ProxyConfig
from actorproxy.protocols.openai_chat import OpenAIChatFormat
from actorproxy.runtime import freed_memory
from actorproxy.runtime.runtime import open_runtime
from actorproxy.server.turns import serve_turn
from actorproxy.store.base import ReadQuery
from actorproxy.tokenization import load_tokenizer

REPLY = "The answer is forty-two: six times seven, as anyone with a calculator can check."


def rss_mib() -> float:
    """Resident memory of this process (anonymous and file-backed pages), MiB."""
    kib = 0
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):
                kib += int(line.split()[1])
    return kib / 1024


async def run(args: argparse.Namespace, data_dir: str) -> list[tuple[int, float]]:
    tok = load_tokenizer(None)
    ids = tok.encode(REPLY).tolist()[:15] + [tok.eot_token_id]
    config = ProxyConfig.of(port=0, max_sessions=1_000_000, max_steps_per_session=1000,
                            store_kind=args.store, data_dir=data_dir)
    fmt = OpenAIChatFormat(tok)
    points: list[tuple[int, float]] = []
    async with open_runtime(config, backend=InstantEngine([ids]), tokenizer=tok) as runtime:
        runtime.after_drain.append(fmt.age)  # as the app does for each route
        done = 0
        next_session = 0

        async def session() -> None:
            nonlocal done, next_session
            sid = f"s-{next_session}"
            next_session += 1
            messages: list[dict[str, Any]] = session_start(sid)
            for turn in range(args.session_turns):
                body = json.dumps({"model": "m", "messages": messages, "max_tokens": 64}).encode()
                answer = await serve_turn(runtime, fmt, fmt.load(body), {"X-Session-Id": sid}, url_session=None,
                                          url_instance=None, confined_to=None)
                assert isinstance(answer, bytes)
                reply = json.loads(answer)["choices"][0]["message"]["content"]
                messages.append({"role": "assistant", "content": reply})
                question = f"Question {turn + 1} of {sid}" if args.unique else f"Question {turn + 1}"
                messages.append({"role": "user", "content": question + ": and 7 times 8?"})
                done += 1
            await runtime.finalize(sid)

        while done < args.turns:
            target = min(args.turns, done + args.drain_every)
            while done < target:
                async with trio.open_nursery() as nursery:
                    for _ in range(args.concurrency):
                        nursery.start_soon(session)
            reply = await runtime.read_reply(ReadQuery(drain=True, include_steps=True))
            async for _ in reply:  # as /trajectory/read sends it: each part let go of once sent
                pass
            stats = await runtime.store_stats()
            live = (await runtime.census())["active_sessions"]
            points.append((done, rss_mib()))
            print(f"  {done:>7} turns  RSS {points[-1][1]:7.1f} MiB  live sessions {live}  "
                  f"stored segments {stats['segments']}", flush=True)
    return points


def main(args: argparse.Namespace) -> None:
    freed_memory.limit_heaps()  # as the command line does first
    with open("/proc/loadavg") as f:
        print(f"load average {' '.join(f.read().split()[:3])}; {args.turns} turns, a drain every "
              f"{args.drain_every}, store {args.store}, c={args.concurrency}")
    cpu0 = time.process_time()
    with tempfile.TemporaryDirectory(prefix="actorproxy-memory-drains-") as data_dir:
        points = trio.run(run, args, data_dir)
    first = next((rss for turns, rss in points if turns >= 10_000), points[0][1])
    print(f"RSS after 10,000 turns {first:.1f} MiB, at the end {points[-1][1]:.1f} MiB: "
          f"x{points[-1][1] / first:.3f}; CPU {time.process_time() - cpu0:.0f} s")


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=100_000)
    parser.add_argument("--drain-every", type=int, default=4000, help="turns between drains")
    parser.add_argument("--session-turns", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=8, help="sessions at a time")
    parser.add_argument("--store", choices=["sqlite", "memory"], default="sqlite")
    parser.add_argument("--unique", action="store_true", help="every user message distinct (the memo fills)")
    return parser


if __name__ == "__main__":
    main(arguments().parse_args())
