"""Per-turn proxy CPU time over one long session: does the work depend on the history?

    python benchmarks/tito_scaling.py [--turns 200] [--tool-output-words 36]

One session of N tool-calling turns (about 100k tokens of context at 200 turns with the
default 36 words of tool output per turn; 180 words give about 520k)
runs through the runtime with an engine that answers instantly from a script,
so the CPU time measured per turn is the proxy's own: planning the turn
(append-only check), rendering and tokenizing the new fragment, recording and
parsing the output. The goal: turn 200 costs no more than 1.5x turn 1. This
leaves out HTTP and JSON; ``overhead.py`` runs the same session over HTTP.
Figures are the median of ``--repeat`` runs per reported turn.

A second table gives the CPU time of the finalize that closes the segment, in
each build mode: ``concat`` stitches ids; ``--verify-tito`` and ``last_step``
render and tokenize the whole conversation once (and are opt-in for that reason).
"""

from __future__ import annotations

import argparse
import statistics
import time
from array import array
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from actorproxy.config import ProxyConfig
from actorproxy.core.requests import ChatRequest, Identity
from actorproxy.core.turn_events import TurnDone
from actorproxy.engines.base import GenerateFinish, GenerateRequest, ModelInfo, TokenDelta
from actorproxy.runtime.runtime import open_runtime
from actorproxy.schema.converter import CONVERTER
from actorproxy.tokenization import load_tokenizer

TOOL = {"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


class InstantEngine:
    """Answers every request at once with the next scripted ids (no sleeping, almost no CPU)."""

    kind = "sim"

    def __init__(self, outputs: list[list[int]]) -> None:
        self._outputs = outputs
        self._next = 0

    @asynccontextmanager
    async def open_generation(self, request: GenerateRequest) -> AsyncIterator[Any]:
        ids = self._outputs[self._next % len(self._outputs)]
        self._next += 1
        events: list[Any] = [TokenDelta(tuple(ids), tuple([-0.5] * len(ids)), "0"),
                             GenerateFinish("stop", matched_stop=ids[-1], prompt_tokens=len(request.input_ids))]
        yield _Replay(request.rid, events)

    async def model_info(self) -> ModelInfo:
        return ModelInfo("instant", 10_000_000, "0")

    async def prompt_logprobs(self, input_ids: array[int]) -> list[float | None]:
        return [None] + [-0.5] * (len(input_ids) - 1)

    async def aclose(self) -> None:
        pass


class _Replay:
    def __init__(self, rid: str, events: list[Any]) -> None:
        self.rid = rid
        self._events = iter(events)

    def __aiter__(self) -> _Replay:
        return self

    async def __anext__(self) -> Any:
        try:
            return next(self._events)
        except StopIteration:
            raise StopAsyncIteration from None

    async def abort(self) -> None:
        pass

    def abort_soon(self, batch: Any = None) -> None:
        pass


async def one_session(turns: int, words: int, **settings: Any) -> tuple[list[float], int, float]:
    tok = load_tokenizer(None)
    outputs = []
    for i in range(turns):
        text = (f"<think>\nI should read file {i}.\n</think>\n\n<tool_call>\n"
                f'{{"name": "read_file", "arguments": {{"path": "src/module_{i}.py"}}}}\n</tool_call>')
        outputs.append(tok.encode(text).tolist() + [tok.eot_token_id])
    engine = InstantEngine(outputs)
    config = ProxyConfig.of(port=0, max_steps_per_session=turns + 1, context_window=10_000_000, **settings)
    cpu: list[float] = []
    async with open_runtime(config, backend=engine, tokenizer=tok) as runtime:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are a coding agent."},
            # The first turn carries as much new text as every later one (a tool output),
            # so turn costs compare like with like: only the history differs.
            {"role": "user", "content": "Read every module and summarise the code base. Context: "
             + " ".join(f"line{j}_of_task = compute({j})" for j in range(words))},
        ]
        prompt_tokens = 0
        for i in range(turns):
            start = time.process_time()
            stream = await runtime.start_turn(ChatRequest(messages=messages, tools=[TOOL]), Identity("long"))
            done: TurnDone | None = None
            async with stream:
                async for event in stream:
                    if isinstance(event, TurnDone):
                        done = event
            cpu.append(time.process_time() - start)
            assert done is not None and done.output.tool_calls, done
            prompt_tokens = done.prompt_tokens
            call = done.output.tool_calls[0]
            messages.append({"role": "assistant", "content": "", "tool_calls": [call.to_openai()]})
            body = " ".join(f"line{j}_of_{i} = compute({j})" for j in range(words))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": body})
        start = time.process_time()
        await runtime.finalize("long")
        finalize_cpu = time.process_time() - start
        data = CONVERTER.unstructure(await runtime.read(session_id="long"))
        assert len(data["data"]) == 1, "the session split: the benchmark would not measure one segment"
        verify = data["data"][0]["metadata"].get("verify")
        assert verify is None or verify["unexpected"] == 0, verify
    return cpu, prompt_tokens, finalize_cpu


async def main(args: argparse.Namespace) -> None:
    runs = [await one_session(args.turns, args.tool_output_words) for _ in range(args.repeat)]
    report = sorted({1, 50, 100, args.turns} & set(range(1, args.turns + 1)))
    first = statistics.median(r[0][0] for r in runs)
    print(f"session: {args.turns} turns, final prompt {runs[0][1]} tokens")
    print(f"{'turn':>6} {'proxy CPU ms (median)':>22} {'x turn 1':>9}")
    for turn in report:
        value = statistics.median(r[0][turn - 1] for r in runs)
        print(f"{turn:>6} {value * 1000:>22.2f} {value / first:>9.2f}")
    modes: list[tuple[str, dict[str, Any]]] = [
        ("concat", {}), ("concat --verify-tito", {"verify_tito": True}),
        ("last_step", {"trajectory_build_mode": "last_step"}),
    ]
    print(f"\n{'build mode at finalize':<24} {'finalize CPU ms (median)':>25}")
    for name, settings in modes:
        finals = [r[2] for r in runs] if not settings else [
            (await one_session(args.turns, args.tool_output_words, **settings))[2] for _ in range(args.repeat)
        ]
        print(f"{name:<24} {statistics.median(finals) * 1000:>25.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--tool-output-words", type=int, default=36)
    parser.add_argument("--repeat", type=int, default=3)
    trio.run(main, parser.parse_args())
