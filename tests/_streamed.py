"""The output parser fed a reply in chunks, and what it streamed joined back (for the parser tests)."""

from __future__ import annotations

import json
from typing import Any

from actorproxy.core.parser import OutputDelta, OutputParser


def run(
    tokenizer: Any, text: str, sizes: list[int] | None = None, **kwargs: Any
) -> tuple[OutputParser, list[OutputDelta]]:
    """Feed ``text`` (plus the end-of-turn token) in chunks of ``sizes`` (default: one id at a time)."""
    ids = tokenizer.encode(text).tolist() + [tokenizer.eot_token_id]
    parser = OutputParser(tokenizer, tool_call_id=lambda i: f"call_{i}", **kwargs)
    deltas: list[OutputDelta] = []
    at = 0
    for size in sizes or [1] * len(ids):
        deltas.append(parser.feed(ids[at : at + size]))
        at += size
    deltas.append(parser.feed(ids[at:]))
    deltas.append(parser.finish())
    return parser, deltas


def streamed(deltas: list[OutputDelta]) -> tuple[str, str, dict[int, tuple[str | None, str | None, str]]]:
    """Concatenated reasoning, content and, per call index, (id, name, arguments)."""
    calls: dict[int, tuple[str | None, str | None, str]] = {}
    for delta in deltas:
        for piece in delta.tool_calls:
            if piece.id is not None:
                assert piece.index not in calls, "a call is announced once"
                calls[piece.index] = (piece.id, piece.name, piece.arguments)
            else:
                cid, name, args = calls[piece.index]
                calls[piece.index] = (cid, name, args + piece.arguments)
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas), calls


def assert_stream_matches_output(parser: OutputParser, deltas: list[OutputDelta]) -> None:
    """The streamed pieces add up to the parser's output, a malformed call included (it was never streamed)."""
    reasoning, content, calls = streamed(deltas)
    out = parser.output
    assert (reasoning, content) == (out.reasoning, out.content)
    final = {int(c.id.removeprefix("call_")): (c.id, c.name, c.arguments) for c in out.tool_calls}
    assert calls == final
    for call in final.values():
        assert json.loads(call[2]) == out.tool_calls[[c.id for c in out.tool_calls].index(call[0])].parsed
