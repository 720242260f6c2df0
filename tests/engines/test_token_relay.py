"""Tokens relayed straight from the engine's read record and stream exactly what their events would.

``StreamedGeneration.relay`` hands each read's plain tokens to the turn without a
``TokenDelta`` or an iteration each; anything else falls back to the events. Two runs of
the same scripted turns, one relaying and one with the relay off (every token an event),
must leave the same steps (ids, logprobs, weight versions, finish, output) and write the
same SSE frames to the agent, in every engine's stream shape. Below them, the decoder's run
of a read is what its events merge to, for random streams cut into random reads (versions
changing, spans, bursts, a finish). Last, the relay hub (``http/sockets.py: RelayHub``) that
reads a relaying stream's socket for its parked task: several streams on it at once (one to
its finish, one with back-pressure, one stopped, one cancelled mid-run), and a frame it began
that the agent's full socket leaves for the session's task to finish.
"""

from __future__ import annotations

import json
import random
import socket
from collections import deque
from typing import Any

import orjson
import pytest
import trio
from _util import SIM_ENGINES
from test_engine_clients import EOT, SIM_CASES, request, sim_backend
from test_engine_path import TOOL_REPLY, stack
from trio.testing import MockClock

from actorproxy.engines.base import GenerateFinish, GenerationEvent, TokenDelta
from actorproxy.engines.deltas import take_merged
from actorproxy.engines.sglang.protocol import SGLangStreamParser
from actorproxy.engines.streaming import StreamedGeneration
from actorproxy.http.server import ServerConnection
from actorproxy.http.sockets import relay_hub

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

    async def counted(self: Any, take: Any, ended: Any) -> None:
        def counting(ids: list[int], logprobs: list[float], version: str) -> Any:
            relayed.append(len(ids))
            return take(ids, logprobs, version)

        await relay(self, counting, ended)

    monkeypatch.setattr(StreamedGeneration, "_relay", counted)
    fast = await _turns(tokenizer, kind, settings)
    assert sum(relayed) > 150  # most tokens came straight from the reads
    monkeypatch.setattr(StreamedGeneration, "relay", lambda self, take, ended: None)
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


# -- the relay hub: several streams parked on one hub at once ----------------------------------------------------

#: Each stream's scripted reply: 60 tokens, then the end of the turn.
HUB_REPLY = [2000 + i for i in range(60)] + [EOT]


@pytest.mark.parametrize("case", list(SIM_CASES))
async def test_streams_relayed_through_one_hub_finish_pause_for_back_pressure_stop_and_leave_when_cancelled(
    case: str, tokenizer: Any
) -> None:
    """Four streams relaying at once on a plain socket each: their tokens are taken in the run's relay hub's task
    (not the session's), with every stream parked at once. One reads to its finish; one answers ``take`` with
    back-pressure every 7 tokens (awaited in its own task, then on); one answers ``False`` after 12 (its relay
    returns); one is cancelled after 10 (from the hub's task, in the middle of a run): it is out of the hub at
    once and ``take`` never hears of it again. The others lose nothing."""
    async with sim_backend(tokenizer, case) as (running, backend):
        running.engine.script(*[HUB_REPLY] * 4)
        await backend.model_info()
        hub = relay_hub()
        assert hub is not None
        taken: dict[str, list[int]] = {"finish": [], "pressure": [], "stop": [], "cancel": []}
        in_hub: dict[str, int] = dict.fromkeys(taken, 0)
        tasks: dict[str, trio.lowlevel.Task] = {}
        parked_at_once = 0
        pressure_tasks: list[trio.lowlevel.Task] = []
        finishes: dict[str, GenerateFinish | None] = {}
        cancel_scope = trio.CancelScope()
        parked_after_cancel: list[int] = []

        def taker(name: str) -> Any:
            def take(ids: list[int], logprobs: list[float], version: str) -> Any:
                nonlocal parked_at_once
                assert len(ids) == len(logprobs) and version
                taken[name] += ids
                if trio.lowlevel.current_task() is not tasks[name]:
                    in_hub[name] += len(ids)
                parked_at_once = max(parked_at_once, hub.parked)
                if name == "pressure" and len(taken[name]) % 7 == 0:
                    async def later() -> bool:
                        pressure_tasks.append(trio.lowlevel.current_task())
                        await trio.sleep(0.001)
                        return True
                    return later()
                if name == "stop" and len(taken[name]) >= 12:
                    return False
                if name == "cancel" and len(taken[name]) >= 10:
                    before = hub.parked
                    cancel_scope.cancel()  # (in the hub's task, while this stream's task is parked)
                    parked_after_cancel.append(before - hub.parked)
                return True
            return take

        async def one(name: str) -> None:
            tasks[name] = trio.lowlevel.current_task()
            take = taker(name)
            finish = None
            async with backend.open_generation(request(max_new_tokens=100)) as generation:
                async for event in generation:  # as TurnGeneration._stream reads it
                    if isinstance(event, GenerateFinish):
                        finish = event
                        continue
                    go = take(list(event.token_ids), list(event.logprobs), event.weight_version)
                    if go is not True and (isinstance(go, bool) or not await go):
                        break
                    if (relaying := generation.relay(take)) is not None:
                        await relaying
                        if name == "stop" and len(taken[name]) >= 12:
                            break
            finishes[name] = finish

        async with trio.open_nursery() as nursery:
            for name in ("finish", "pressure", "stop"):
                nursery.start_soon(one, name)

            async def cancelled() -> None:
                with cancel_scope:
                    await one("cancel")

            nursery.start_soon(cancelled)
        for name in ("finish", "pressure"):
            assert taken[name] == HUB_REPLY
            finish = finishes[name]
            assert finish is not None and finish.reason == "stop"
        assert taken["stop"][:12] == HUB_REPLY[:12] and len(taken["stop"]) < len(HUB_REPLY)
        assert taken["cancel"] == HUB_REPLY[:len(taken["cancel"])] and 10 <= len(taken["cancel"]) < len(HUB_REPLY)
        assert "cancel" not in finishes  # cancelled: it never got to the end of its block
        assert parked_after_cancel[0] == 1  # out of the hub the moment it was cancelled
        assert len(parked_after_cancel) == 1  # and never given another token
        assert parked_at_once >= 3  # several streams parked on the one hub at once
        assert all(in_hub[name] >= len(taken[name]) - 12 for name in taken)  # most tokens taken in the hub's task
        assert pressure_tasks and all(task is tasks["pressure"] for task in pressure_tasks)
        assert hub.parked == 0


async def test_a_relayed_stream_whose_agent_reads_slowly_waits_in_its_own_task_and_loses_nothing(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent stops reading: a frame the hub began to write (in its task) is finished by the session's task,
    which waits on the agent's socket (back-pressure); once the agent reads, it gets every token in order."""
    began: list[trio.lowlevel.Task] = []
    finished: list[trio.lowlevel.Task] = []
    full = trio.Event()
    write_now, write_rest = ServerConnection.write_now, ServerConnection._write_rest

    def counted_now(self: ServerConnection, data: bytes) -> Any:
        rest = write_now(self, data)
        if rest is not None:
            began.append(trio.lowlevel.current_task())
        return rest

    async def counted_rest(self: ServerConnection, data: bytes, sent: int) -> None:
        finished.append(trio.lowlevel.current_task())
        full.set()
        await write_rest(self, data, sent)

    monkeypatch.setattr(ServerConnection, "write_now", counted_now)
    monkeypatch.setattr(ServerConnection, "_write_rest", counted_rest)
    tokens = 3000
    async with stack(tokenizer, "sglang", incremental_streaming_output=True) as (proxy, [sim], _):
        sim.engine.script("word " * tokens)
        host, port = proxy.url.removeprefix("http://").rsplit(":", 1)
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # (before connecting: a small window)
        await sock.connect((host, int(port)))
        agent = trio.SocketStream(sock)
        body = b'{"messages":[{"role":"user","content":"talk"}],"max_tokens":%d,"stream":true}' % (tokens + 10)
        await agent.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Session-Id: slow\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        with trio.fail_after(30):
            await full.wait()  # nothing read yet: the agent's socket is full
            data = b""
            while not data.endswith(b"0\r\n\r\n"):  # the chunked body's end
                chunk = await agent.receive_some(65536)
                assert chunk, data
                data += chunk
        await agent.aclose()
    text = "".join(choice["delta"].get("content") or "" for line in data.split(b"\n")
                   if line.strip().startswith(b"data: {") for choice in json.loads(line.strip()[6:])["choices"])
    assert text.split() == ["word"] * tokens
    assert began and finished and began[0] is not finished[0]  # begun in the hub's task, ended in the session's
