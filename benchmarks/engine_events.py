"""The engine client's CPU per SGLang stream event, without I/O: de-chunking and the stream decoder.

    python benchmarks/engine_events.py [--rounds 5] [--turns 2000]

Two shapes of a 16-token generation, as ``engine_stub.py`` writes them (chunked SSE with
logprobs), each read the way ``StreamedGeneration`` reads it (the body decoder de-chunking
into the stream decoder's buffer, ``SGLangStreamParser.read``, merged deltas):

* ``cumulative, one read``: SGLang's default shape, every event arriving in one read (a
  non-streaming turn against a zero-delay engine);
* ``incremental, a read per event``: one event per read, as a proxy that keeps up with a
  paced engine reads them (``pause_latency.py``'s streams).

Prints the best of ``--rounds`` rounds, in process CPU time, per generation and per event.
Then the CPU of opening an engine connection (``HTTP11Client._connect``, 500 at once to
a local listener that closes them, as the abort calls of a pause do), accepting included.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import orjson
import trio

from actorproxy.engines.base import GenerationEvent
from actorproxy.engines.deltas import take_merged
from actorproxy.engines.sglang.protocol import SGLangStreamParser
from actorproxy.http.client import HTTP11Client
from actorproxy.http.h1 import BodyDecoder

IDS = [9707, 0, 358, 1079, 1667, 311, 1492, 498, 3351, 13, 2585, 646, 358, 7789, 30, 151645]


def meta(n: int, ids: list[int], finished: bool) -> dict[str, Any]:
    return {"id": "rid", "finish_reason": {"type": "stop", "matched": IDS[-1]} if finished else None,
            "prompt_tokens": 30, "completion_tokens": n, "cached_tokens": 0, "weight_version": "default",
            "output_token_logprobs": [[-0.5, i, None] for i in ids]}


def chunked(events: list[bytes]) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(e) + 8, b"data: " + e + b"\n\n") for e in events)


CUMULATIVE = chunked([orjson.dumps({"text": "x" * n, "output_ids": IDS[:n], "meta_info": meta(n, IDS[:n], n == 16)})
                      for n in range(1, 17)] + [b"[DONE]"]) + b"0\r\n\r\n"
INCREMENTAL = [chunked([orjson.dumps({"text": "", "output_ids": [IDS[n - 1]],
                                     "meta_info": meta(n, [IDS[n - 1]], n == 16)})]) for n in range(1, 17)]


def read(pieces: list[bytes]) -> list[GenerationEvent]:
    body = BodyDecoder(keep_alive=True, chunked=True)
    parser = SGLangStreamParser(stop_token_ids=[IDS[-1]])
    pending: deque[GenerationEvent] = deque()
    out: list[GenerationEvent] = []
    for piece in pieces:
        body.decode(bytearray(piece), parser.buffer)
        events: list[GenerationEvent] = []
        parser.read(events)
        pending.extend(events)
        while pending:
            out.append(take_merged(pending))
    return out


def best(run: Callable[[], object], rounds: int, turns: int) -> float:
    run()
    times = []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(turns):
            run()
        times.append((time.process_time() - start) / turns)
    return min(times)


async def _connect(client: HTTP11Client, opened: list[Any]) -> None:
    opened.append(await client._connect())


async def connections(rounds: int, at_once: int = 500) -> float:
    listener = trio.socket.socket()
    await listener.bind(("127.0.0.1", 0))
    listener.listen(2 * at_once)

    async def refuse() -> None:
        while True:
            sock, _ = await listener.accept()
            sock.close()

    client = HTTP11Client(f"http://127.0.0.1:{listener.getsockname()[1]}")
    times = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(refuse)
        for _ in range(rounds):
            start = time.process_time()
            opened: list[Any] = []

            async with trio.open_nursery() as batch:
                for _ in range(at_once):
                    batch.start_soon(_connect, client, opened)
            for conn in opened:
                conn.close()
            times.append((time.process_time() - start) / at_once)
        nursery.cancel_scope.cancel()
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--turns", type=int, default=2000)
    args = parser.parse_args()
    for name, pieces in (("cumulative, one read", [CUMULATIVE]), ("incremental, a read per event", INCREMENTAL)):
        seconds = best(functools.partial(read, pieces), args.rounds, args.turns)
        print(f"{name:<30} {seconds * 1e6:7.1f} µs per generation, {seconds * 1e6 / 16:5.2f} µs per event")
    print(f"{'an engine connection':<30} {trio.run(connections, args.rounds) * 1e6:7.1f} µs")


if __name__ == "__main__":
    main()
