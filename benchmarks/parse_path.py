"""The ingress's parse path per turn, per protocol: a body's bytes to the protocol-neutral ``ChatRequest``.

    python benchmarks/parse_path.py [--protocol chat|anthropic|responses] [--turns 50] [--sessions 4]
    valgrind --tool=callgrind --callgrind-out-file=/dev/null python benchmarks/parse_path.py --protocol chat
    python benchmarks/parse_path.py --calibrate        # only build the bodies: subtract its instructions

One agent session per ``--sessions``, each ``--turns`` turns long, interleaved as a
server sees them: every turn's body is the whole conversation so far (a coding agent's
shape: a system prompt, tool calls and their results, a new user message), and goes
through the protocol's ``TurnFormat.load`` (the message memo) and ``parse``, as the
turn lane calls them. Bodies are built before the measured loop; ``--calibrate``
builds them, runs a short warm-up session as the measured run does first (the
converter builds its structure functions on first use) and stops, so under
callgrind the parse path's instructions per turn are (run - calibrate) / (sessions
× turns). Run with ``PYTHONHASHSEED=0`` for repeatable counts.
Without callgrind it prints the CPU µs per turn (the median of ``--repeat`` runs).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import orjson

from actorproxy.protocols.anthropic import AnthropicFormat
from actorproxy.protocols.format import TurnFormat
from actorproxy.protocols.openai_chat import OpenAIChatFormat
from actorproxy.protocols.responses_format import ResponsesFormat

SYSTEM = "You are a coding agent. Read files before you change them; run the tests after each change. " * 8
PARAMETERS = {"type": "object", "properties": {"path": {"type": "string", "description": "a path"}},
              "required": ["path"]}
OUTPUT = "def f(x):\n    return x + 1\n" * 12


def _chat(session: int, turns: int) -> list[bytes]:
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": "does a thing",
                                               "parameters": PARAMETERS}} for i in range(8)]
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                      {"role": "user", "content": f"Fix the bug, session {session}."}]
    bodies = []
    for turn in range(turns):
        bodies.append(orjson.dumps({"model": "m", "messages": messages, "tools": tools, "temperature": 0.7,
                                    "max_tokens": 256, "stream": False}))
        call = {"id": f"call_{turn}", "type": "function",
                "function": {"name": "tool_1", "arguments": orjson.dumps({"path": f"src/m{turn}.py"}).decode()}}
        messages = [*messages, {"role": "assistant", "content": "", "reasoning_content": "Look.",
                                "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": f"call_{turn}", "content": OUTPUT + str(turn)}]
    return bodies


def _anthropic(session: int, turns: int) -> list[bytes]:
    tools = [{"name": f"tool_{i}", "description": "does a thing", "input_schema": PARAMETERS} for i in range(8)]
    system = [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]
    messages: list[dict[str, Any]] = [{"role": "user", "content": [
        {"type": "text", "text": f"Fix the bug, session {session}."}]}]
    bodies = []
    for turn in range(turns):
        bodies.append(orjson.dumps({"model": "m", "max_tokens": 256, "system": system, "tools": tools,
                                    "messages": messages, "temperature": 0.7}))
        messages = [*messages,
                    {"role": "assistant", "content": [
                        {"type": "thinking", "thinking": "Look.", "signature": "sig"},
                        {"type": "text", "text": "Reading."},
                        {"type": "tool_use", "id": f"toolu_{turn}", "name": "tool_1",
                         "input": {"path": f"src/m{turn}.py"}}]},
                    {"role": "user", "content": [
                        {"type": "tool_result", "tool_use_id": f"toolu_{turn}",
                         "content": [{"type": "text", "text": OUTPUT + str(turn)}]}]}]
    return bodies


def _responses(session: int, turns: int) -> list[bytes]:
    tools = [{"type": "function", "name": f"tool_{i}", "description": "does a thing", "parameters": PARAMETERS}
             for i in range(8)]
    items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": f"Fix the bug, session {session}."}]}]
    bodies = []
    for turn in range(turns):
        bodies.append(orjson.dumps({"model": "m", "instructions": SYSTEM, "tools": tools, "input": items,
                                    "store": False, "temperature": 0.7}))
        items = [*items,
                 {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Look."}]},
                 {"type": "function_call", "name": "tool_1", "call_id": f"call_{turn}",
                  "arguments": orjson.dumps({"path": f"src/m{turn}.py"}).decode()},
                 {"type": "function_call_output", "call_id": f"call_{turn}", "output": OUTPUT + str(turn)}]
    return bodies


PROTOCOLS: dict[str, tuple[Callable[[], TurnFormat[Any]], Callable[[int, int], list[bytes]]]] = {
    "chat": (OpenAIChatFormat, _chat),
    "anthropic": (AnthropicFormat, _anthropic),
    "responses": (ResponsesFormat, _responses),
}


def run(name: str, sessions: int, turns: int, calibrate: bool) -> float:
    """CPU seconds of the parse path for every turn of every session (0 when calibrating)."""
    make, build = PROTOCOLS[name]
    fmt = make()
    per_session = [build(s, turns) for s in range(sessions)]
    bodies = [per_session[s][t] for t in range(turns) for s in range(sessions)]
    for raw in build(sessions, 3):  # a warm-up session: the converter builds its hooks on first use
        fmt.parse(fmt.load(raw))
    if calibrate:
        return 0.0
    start = time.process_time()
    for raw in bodies:
        fmt.parse(fmt.load(raw))
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--protocol", choices=sorted(PROTOCOLS), default="chat")
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--calibrate", action="store_true", help="build the bodies only (callgrind's baseline)")
    args = parser.parse_args()
    seconds = [run(args.protocol, args.sessions, args.turns, args.calibrate) for _ in range(args.repeat)]
    per_turn = statistics.median(seconds) / (args.sessions * args.turns) * 1e6
    print(f"{args.protocol}: {per_turn:.1f} µs CPU per turn ({args.sessions} sessions × {args.turns} turns)")


if __name__ == "__main__":
    main()
