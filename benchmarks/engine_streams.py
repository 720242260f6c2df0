"""The engine client alone, over real HTTP: CPU per streamed token of reading paced engine streams.

    python benchmarks/engine_streams.py [--streams 16] [--tokens 2000] [--interval 0.01] [--burst 1]
        [--shape sglang-incremental sglang-cumulative vllm llamacpp]

``long_streams.py`` measures the whole proxy; this measures only its engine side: the
engine (``actorproxy sim``, in its own process, a token every ``--interval`` seconds per
stream, in bursts of ``--burst``) and, in this process, ``--streams`` generations opened
on the engine's client (``Backend.open_generation``) and iterated to their finish, as
the session actor iterates them (nothing else: no recording, no parsing, no agent).

Prints this process's CPU time (user + system) per token while the streams run, and the
tokens read. Run it under ``valgrind --tool=callgrind`` for instructions per token (the
engine runs in a process of its own, not traced); use few streams and a slow pace there,
so the reader keeps up under valgrind, and the same arguments for the runs compared.
"""

from __future__ import annotations

import argparse
import time
from array import array

import trio
from processes import sim_engine

from actorproxy.engines.base import Backend, GenerateRequest, SamplingParams, TokenDelta
from actorproxy.engines.connection import EngineOptions
from actorproxy.engines.factory import make_engine_client

SHAPES = {  # shape: (engine kind, extra sim flags)
    "sglang-incremental": ("sglang", ["--incremental-streaming-output"]),
    "sglang-cumulative": ("sglang", []),
    "vllm": ("vllm", []),
    "llamacpp": ("llamacpp", []),
}
PROMPT = array("i", range(1000, 1032))


async def read_streams(backend: Backend, streams: int, tokens: int) -> tuple[int, float]:
    counts = [0] * streams

    async def one(i: int) -> None:
        request = GenerateRequest(PROMPT, SamplingParams(max_new_tokens=tokens + 1, stop_token_ids=(151645,)))
        async with backend.open_generation(request) as generation:
            async for event in generation:
                if type(event) is TokenDelta:
                    counts[i] += len(event.token_ids)

    await backend.model_info()
    start = time.process_time()
    async with trio.open_nursery() as nursery:
        for i in range(streams):
            nursery.start_soon(one, i)
    return sum(counts), time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--interval", type=float, default=0.01)
    parser.add_argument("--burst", type=int, default=1)
    parser.add_argument("--shape", nargs="+", default=["sglang-incremental"], choices=sorted(SHAPES))
    args = parser.parse_args()
    for shape in args.shape:
        kind, flags = SHAPES[shape]
        with sim_engine("--reply-tokens", str(args.tokens), "--token-interval", str(args.interval),
                        "--stream-interval", str(args.burst), "--record-capacity", "1", *flags) as engine:
            backend = make_engine_client(kind, engine.url, EngineOptions())
            read, cpu = trio.run(read_streams, backend, args.streams, args.tokens)
        print(f"{shape:<20} {args.streams} streams x {args.tokens} tokens, {args.interval * 1000:g} ms, "
              f"burst {args.burst}: {read} tokens, {cpu * 1e6 / max(read, 1):.1f} µs CPU a token", flush=True)


if __name__ == "__main__":
    main()
