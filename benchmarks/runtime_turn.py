"""The runtime's own CPU per short non-streaming turn, without HTTP and without an engine client.

    python benchmarks/runtime_turn.py [--turns 3000] [--concurrency 1] [--store sqlite|memory] [--calls]
                                      [--protocol chat|responses|anthropic]
    python benchmarks/runtime_turn.py --gc-stats --garbage 100 --profile /tmp/turns.prof

The sessions of ``overhead.py``'s load (10 turns each, a system prompt, the reply and a
short user message appended every turn) run in this process through
:func:`~actorproxy.server.turns.serve_turn`: the body parsed from its JSON bytes (a chat
completion's; with ``--protocol``, the same conversation as a Responses body's ``input``,
stored as the SDK's default is, or an Anthropic Messages body), the
turn run on the runtime (registry, session actor, planning, rendering and tokenizing,
the generation, recording, the store's journal), the reply rendered to JSON. The engine
answers at once from memory with the canned 16-token reply in one token delta
(``tito_scaling.InstantEngine``; the engine client merges the deltas it reads at once),
so what is measured is the part of a turn that is neither the ingress's socket work
nor the engine client's (``overhead.py`` measures the whole). Run it with ``PYTHONPATH=.``
from a worktree to measure that tree.

Per turn: process CPU (every thread: the store's writer, the offload threads),
scheduler batches and task steps (a Trio instrument), thread hand-offs
(``trio.to_thread.run_sync`` calls), and with ``--calls`` the Python function calls
(a ``sys.setprofile`` counter on the Trio thread; it slows the run down, so the CPU
figure of that run is not comparable), and the time spent in the cycle collector. Each
figure is the median of ``--repeat`` runs. ``--gc-stats``, ``--garbage N`` (what N more
turns leave in reference cycles, by type) and ``--profile FILE`` (a cProfile of the
measured turns) say where it goes.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import json
import statistics
import sys
import tempfile
import time
import types
from typing import Any

import trio
import trio.abc
from load_client import session_start
from tito_scaling import InstantEngine

from actorproxy.config import ProxyConfig
from actorproxy.protocols.anthropic import AnthropicFormat
from actorproxy.protocols.format import TurnFormat
from actorproxy.protocols.openai_chat import OpenAIChatFormat
from actorproxy.protocols.responses_format import ResponsesFormat
from actorproxy.runtime.runtime import open_runtime
from actorproxy.server.turns import serve_turn
from actorproxy.tokenization import load_tokenizer

REPLY = "The answer is forty-two: six times seven, as anyone with a calculator can check."


class Rounds(trio.abc.Instrument):
    """Counts scheduler batches (one ``epoll_wait`` each) and task steps."""

    def __init__(self) -> None:
        self.batches = 0
        self.steps = 0

    def before_io_wait(self, timeout: float) -> None:
        self.batches += 1

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.steps += 1


class Collector:
    """A ``gc.callbacks`` hook: time spent in the cycle collector, by generation."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.by_generation = [[0, 0, 0.0] for _ in range(3)]
        self._start = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        spent = time.perf_counter() - self._start
        self.seconds += spent
        counts = self.by_generation[info["generation"]]
        counts[0] += 1
        counts[1] += info["collected"]
        counts[2] = round(counts[2] + spent * 1000, 1)


class Calls:
    """A ``sys.setprofile`` hook counting Python function calls."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self.count += 1


async def run(args: argparse.Namespace, data_dir: str) -> dict[str, float]:
    tok = load_tokenizer(None)
    ids = tok.encode(REPLY).tolist()[:15] + [tok.eot_token_id]
    reply_text = tok.decode(ids[:-1])
    store = {"store_kind": args.store, "data_dir": data_dir}
    config = ProxyConfig.of(port=0, max_sessions=1_000_000, max_steps_per_session=1000, **store)
    fmt: TurnFormat[Any] = PROTOCOLS[args.protocol][0](tok)
    body_of, reply_of = PROTOCOLS[args.protocol][1:]
    handoffs = 0
    real_run_sync = trio.to_thread.run_sync

    async def counted(*a: Any, **k: Any) -> Any:
        nonlocal handoffs
        handoffs += 1
        return await real_run_sync(*a, **k)

    async with open_runtime(config, backend=InstantEngine([ids]), tokenizer=tok) as runtime:
        done = 0
        measuring = False

        async def worker(w: int, turns: int) -> None:
            nonlocal done
            n = 0
            while done < turns:
                sid = f"s-{w}-{n}"
                n += 1
                messages: list[dict[str, Any]] = session_start(sid)
                headers = {"X-Session-Id": sid}
                for turn in range(args.session_turns):
                    body = json.dumps(body_of(messages)).encode()
                    answer = await serve_turn(runtime, fmt, fmt.load(body), headers, url_session=None,
                                              url_instance=None, confined_to=None)
                    assert isinstance(answer, bytes)
                    if measuring:
                        done += 1
                    content = reply_of(json.loads(answer))
                    assert content == reply_text, content
                    messages.append({"role": "assistant", "content": content})
                    messages.append({"role": "user", "content": f"Question {turn + 1}: and 7 times 8?"})
                    if done >= turns:
                        return

        async def load(turns: int) -> None:
            async with trio.open_nursery() as nursery:
                for w in range(args.concurrency):
                    nursery.start_soon(worker, w, turns)

        measuring = True
        await load(max(200, args.turns // 5))  # warm-up: caches, threads, the template probe
        done = 0
        rounds, calls, collector = Rounds(), Calls(), Collector()
        trio.lowlevel.add_instrument(rounds)
        trio.to_thread.run_sync = counted  # type: ignore[assignment]
        gc.callbacks.append(collector)
        profile = cProfile.Profile() if args.profile else None
        if args.calls:
            sys.setprofile(calls)
        if profile is not None:
            profile.enable()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        try:
            await load(args.turns)
        finally:
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            if profile is not None:
                profile.disable()
                profile.dump_stats(args.profile)
            sys.setprofile(None)
            gc.callbacks.remove(collector)
            trio.to_thread.run_sync = real_run_sync
            trio.lowlevel.remove_instrument(rounds)
        turns = done
        if args.gc_stats:
            print(f"collections by generation (count, objects collected, ms): {collector.by_generation}; "
                  f"{len(gc.get_objects())} objects tracked")
        if args.garbage:
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            done = 0
            await load(args.garbage)
            gc.collect()
            gc.set_debug(0)
            garbage, gc.garbage[:] = list(gc.garbage), []
            kinds = collections.Counter(type(o).__qualname__ for o in garbage)
            methods = collections.Counter(f"{type(o.__self__).__qualname__}.{o.__func__.__name__}"
                                          for o in garbage if isinstance(o, types.MethodType))
            print(f"left to the cycle collector by {args.garbage} turns: {sum(kinds.values())} objects, "
                  f"{kinds.most_common(12)}; bound methods among them: {dict(methods)}")
    return {
        "cpu_ms_per_turn": cpu * 1000 / turns, "turns_per_s": turns / wall,
        "batches_per_turn": rounds.batches / turns, "task_steps_per_turn": rounds.steps / turns,
        "handoffs_per_turn": handoffs / turns, "gc_ms_per_turn": collector.seconds * 1000 / turns,
        "calls_per_turn": calls.count / turns,
    }


def _anthropic(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "m", "system": messages[0]["content"], "messages": messages[1:], "max_tokens": 64}


#: Each protocol's format, its body for a conversation, and the reply's text.
PROTOCOLS: dict[str, tuple[Any, Any, Any]] = {
    "chat": (OpenAIChatFormat, lambda messages: {"model": "m", "messages": messages, "max_tokens": 64},
             lambda reply: reply["choices"][0]["message"]["content"]),
    "responses": (ResponsesFormat, lambda messages: {"model": "m", "input": messages, "max_output_tokens": 64},
                  lambda reply: reply["output"][-1]["content"][0]["text"]),
    "anthropic": (lambda tok: AnthropicFormat(), _anthropic, lambda reply: reply["content"][-1]["text"]),
}


def main(args: argparse.Namespace) -> None:
    results = []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="actorproxy-runtime-turn-") as data_dir:
            results.append(trio.run(run, args, data_dir))
    merged = {k: statistics.median(r[k] for r in results) for k in results[0]}
    print(f"{args.protocol} c={args.concurrency} store={args.store} turns={args.turns} (median of {args.repeat})")
    for key, value in merged.items():
        if key != "calls_per_turn" or args.calls:
            print(f"  {key:<22} {value:10.3f}")


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--store", choices=["sqlite", "memory"], default="sqlite")
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="chat", help="the agent format of the body")
    parser.add_argument("--turns", type=int, default=3000, help="turns measured per run (after a warm-up)")
    parser.add_argument("--concurrency", type=int, default=1, help="sessions at a time")
    parser.add_argument("--session-turns", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--calls", action="store_true", help="count Python calls (slow: ignore that run's CPU)")
    parser.add_argument("--gc-stats", action="store_true", help="collections by generation in the measured turns")
    parser.add_argument("--garbage", type=int, default=0, metavar="N",
                        help="then list what N more turns leave to the cycle collector (reference cycles)")
    parser.add_argument("--profile", help="write a cProfile of the measured turns to this file")
    return parser


if __name__ == "__main__":
    main(arguments().parse_args())
