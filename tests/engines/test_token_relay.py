"""Tokens relayed straight from the engine's read record and stream exactly what their events would.

``StreamedGeneration.relay`` hands each read's plain tokens to the turn without a
``TokenDelta`` or an iteration each; anything else falls back to the events. Two runs of
the same scripted turns, one relaying and one with the relay off (every token an event),
must leave the same steps (ids, logprobs, weight versions, finish, output) and write the
same SSE frames to the agent, in every engine's stream shape. Below them, the decoder's run
of a read is what its events merge to, for random streams cut into random reads (versions
changing, spans, bursts, a finish).
"""

from __future__ import annotations

import json
import random
from collections import deque
from typing import Any

import orjson
import pytest
from _util import SIM_ENGINES
from test_engine_path import TOOL_REPLY, stack
from trio.testing import MockClock

from actorproxy.engines.base import GenerateFinish, GenerationEvent, TokenDelta
from actorproxy.engines.deltas import take_merged
from actorproxy.engines.sglang.protocol import SGLangStreamParser
from actorproxy.engines.streaming import StreamedGeneration

REASONED = "<think>\nFirst this, then that.\n</think>\n\nThe answer, with some words: é, 漢字, 🙂 and more words."

#: What a step's record may differ in between two runs: ids, clocks and the engine's own request id.
_RUN_FIELDS = {"step_id", "rid", "created_at", "started_at", "finished_at", "first_token_at", "session_id",
               "segment_id", "timings", "request_id", "engine_request_id"}


def _steps(data: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in step.items() if k not in _RUN_FIELDS and not k.endswith("_at")} for step in data["steps"]]


def _frames(text: str) -> list[Any]:
    """The SSE frames' JSON, without what names the reply (its id, creation time)."""
    frames = []
    for block in text.split("\n\n"):
        if not block.startswith("data: "):
            continue
        if block == "data: [DONE]":
            frames.append("[DONE]")
            continue
        chunk = json.loads(block[6:])
        frames.append({k: v for k, v in chunk.items() if k not in ("id", "created")})
    return frames


async def _turns(tokenizer: Any, kind: str, settings: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    """Three streamed turns of one session (a tool call, a reasoned answer, a long plain one): their frames, steps."""
    async with stack(tokenizer, kind, **settings) as (proxy, [sim], client):
        sim.engine.script(TOOL_REPLY, REASONED, "word, " * 150)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Go."}]
        frames = []
        for _ in range(3):
            body = {"messages": messages, "stream": True, "logprobs": True}
            response = await client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "s"})
            frames.append(_frames(response.text))
            messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "And?"}]
        await client.post("/session/finalize", json={"session_id": "s"})
        read = await client.post("/trajectory/read", json={"session_id": "s", "include_steps": True})
        return frames, _steps(read.json())


@pytest.mark.parametrize(("kind", "settings"), SIM_ENGINES)
async def test_relayed_tokens_record_and_stream_what_their_events_do(
    tokenizer: Any, kind: str, settings: dict[str, Any], monkeypatch: pytest.MonkeyPatch, autojump_clock: MockClock
) -> None:
    relayed: list[int] = []
    relay = StreamedGeneration._relay

    async def counted(self: Any, take: Any) -> None:
        def counting(ids: list[int], logprobs: list[float], version: str) -> Any:
            relayed.append(len(ids))
            return take(ids, logprobs, version)

        await relay(self, counting)

    monkeypatch.setattr(StreamedGeneration, "_relay", counted)
    fast = await _turns(tokenizer, kind, settings)
    assert sum(relayed) > 150  # most tokens came straight from the reads
    monkeypatch.setattr(StreamedGeneration, "relay", lambda self, take: None)
    relayed.clear()
    general = await _turns(tokenizer, kind, settings)
    assert relayed == []
    assert fast[1] == general[1]  # the records
    assert fast[0] == general[0]  # the frames
    assert [frames[-2]["choices"][0]["finish_reason"] for frames in fast[0]] == ["tool_calls", "stop", "stop"]
    assert len(fast[1][2]["output_ids"]) > 150


# -- the decoder: a read's run against its events merged -------------------------------------------------------


def _sglang_events(rnd: random.Random) -> list[bytes]:
    """A random incremental SGLang stream: bursts, versions that change, now and then spans, then a finish."""
    events, sent, version = [], 0, "v1"
    for _ in range(rnd.randint(1, 30)):
        n = rnd.choice([0, 1, 1, 1, 2, 3])
        if rnd.random() < 0.1:
            version = f"v{rnd.randint(1, 3)}"
        ids = [rnd.randint(10, 500) for _ in range(n)]
        meta: dict[str, Any] = {
            "output_token_logprobs": [[-rnd.random(), t, None] for t in ids],
            "completion_tokens": sent + n,
            "weight_version": version,
        }
        if n and rnd.random() < 0.1:
            meta["weight_versions"] = [{"version": "v9", "start": sent, "end": sent + 1},
                                       {"version": version, "start": sent + 1, "end": sent + n}]
        sent += n
        events.append(orjson.dumps({"output_ids": ids, "meta_info": meta}))
    finish = {"output_ids": [], "meta_info": {"output_token_logprobs": [], "completion_tokens": sent,
                                              "finish_reason": {"type": "length", "length": sent}}}
    events.append(orjson.dumps(finish))
    return events


def _tokens(events: list[GenerationEvent]) -> tuple[list[tuple[Any, ...]], list[GenerationEvent]]:
    deltas = [(tuple(e.token_ids), tuple(e.logprobs), e.weight_version) for e in events if type(e) is TokenDelta]
    return deltas, [e for e in events if type(e) is not TokenDelta]


def _read_general(reads: list[bytes]) -> list[GenerationEvent]:
    parser, merged = SGLangStreamParser(), []
    for i, data in enumerate(reads):
        parser.buffer += data
        out: list[GenerationEvent] = []
        parser.read(out, at_end=i == len(reads) - 1)
        pending = deque(out)
        while pending:
            merged.append(take_merged(pending))
    return merged


def _read_relaying(reads: list[bytes]) -> list[GenerationEvent]:
    """What ``StreamedGeneration._decode`` and ``_relay`` make of each read: a run (as a delta), or its events."""
    parser, merged = SGLangStreamParser(), []
    for i, data in enumerate(reads):
        parser.buffer += data
        out: list[GenerationEvent] = []
        parser.relaying = True
        parser.read(out, at_end=i == len(reads) - 1)
        parser.relaying = False
        parser.run_into(out)
        pending = deque(out)
        while pending:
            merged.append(take_merged(pending))
    return merged


def test_a_reads_run_is_what_its_events_merge_to() -> None:
    rnd = random.Random(3)
    for _ in range(400):
        events = _sglang_events(rnd)
        stream = b"".join(b"data: " + e + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        cuts = sorted(rnd.sample(range(1, len(stream)), min(len(stream) - 1, rnd.randint(0, 8))))
        reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        general, relaying = _read_general(reads), _read_relaying(reads)
        assert _tokens(relaying) == _tokens(general)
        assert relaying == general
        assert type(general[-1]) is GenerateFinish


def test_a_read_of_plain_tokens_while_relaying_makes_no_event() -> None:
    parser = SGLangStreamParser()
    parser.relaying = True
    plain = [b'{"output_ids": [%d], "meta_info": {"output_token_logprobs": [[-0.5, %d, null]], '
             b'"completion_tokens": %d, "weight_version": "v1"}}' % (t, t, n + 1) for n, t in enumerate((7, 8, 9))]
    parser.buffer += b"".join(b"data: " + e + b"\n\n" for e in plain)
    out: list[GenerationEvent] = []
    parser.read(out)
    assert out == []
    assert (parser.run_ids, parser.run_logprobs, parser.run_version) == ([7, 8, 9], [-0.5] * 3, "v1")
