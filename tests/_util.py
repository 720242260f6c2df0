"""Helpers shared by the runtime and end-to-end tests."""

from __future__ import annotations

import gc
import json
import logging
import queue
import socket
import threading
from array import array
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import Any, NamedTuple

import attrs
import httpx
import hypothesis.strategies as st
import pytest
import trio

from actorproxy import ProxyClient, open_proxy
from actorproxy.config import ProxyConfig
from actorproxy.core.messages import output_as_message
from actorproxy.core.requests import ChatRequest, Identity
from actorproxy.core.turn_events import TurnAccepted, TurnDelta, TurnDone, TurnFailed
from actorproxy.engines.base import Backend, GenerateRequest, Generation, ModelInfo
from actorproxy.errors import BadRequest
from actorproxy.runtime.runtime import Runtime, open_runtime
from actorproxy.schema.converter import CONVERTER
from actorproxy.sim import SimConfig, SimEngine

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
READ_TOOL = {
    "type": "function",
    "function": {
        "name": "read_file",
        "description": "Read a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
    },
}
#: :data:`WEATHER_TOOL` as an Anthropic Messages tool.
WEATHER_TOOL_ANTHROPIC = {
    "name": "get_weather",
    "description": WEATHER_TOOL["function"]["description"],  # type: ignore[index]
    "input_schema": WEATHER_TOOL["function"]["parameters"],  # type: ignore[index]
}

#: The simulated engine server in each protocol shape it serves: the backend kind, and SimServerSettings fields.
SIM_ENGINES = [
    pytest.param("sglang", {}, id="sglang"),
    pytest.param("sglang", {"incremental_streaming_output": True}, id="sglang-incremental"),
    pytest.param("vllm", {}, id="vllm-generate"),
    pytest.param("vllm", {"vllm_generate_endpoint": False}, id="vllm-completions"),
    pytest.param("llamacpp", {}, id="llamacpp"),
]


class ScriptedChat(NamedTuple):
    """A scripted tool-using turn pair: the reply that calls ``get_weather``, the answer after its result,
    that answer's text without the reasoning, the system prompt and the question."""

    reply: str
    answer: str
    answer_text: str
    system: str
    question: str


WEATHER_CHAT = ScriptedChat(
    reply="<think>\nThe user wants weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "days": 2}}\n</tool_call>',
    answer="<think>\nGot it.\n</think>\n\nIt is 18 °C and sunny in Zürich — enjoy! 🌞",
    answer_text="It is 18 °C and sunny in Zürich — enjoy! 🌞",
    system="You are a weather assistant.",
    question="Weather in Zürich?",
)
SEARCH_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string"}},
            "required": ["query"],
        },
    },
}


@attrs.define
class WrappingBackend:
    """A backend around ``inner`` (a simulated engine) that passes every call through: a test's own
    backend subclasses it and changes only what it tests."""

    inner: SimEngine
    kind: str = "sim"

    def open_generation(self, request: GenerateRequest) -> AbstractAsyncContextManager[Generation]:
        return self.inner.open_generation(request)

    async def model_info(self) -> ModelInfo:
        return await self.inner.model_info()

    async def prompt_logprobs(self, input_ids: array) -> list[float | None]:
        return await self.inner.prompt_logprobs(input_ids)

    async def aclose(self) -> None:
        await self.inner.aclose()


@attrs.define
class RecordingBackend(WrappingBackend):
    """Wraps a backend and remembers the exact prompt ids of every request, by rid."""

    prompts: dict[str, array] = attrs.field(factory=dict)

    def open_generation(self, request: GenerateRequest) -> AbstractAsyncContextManager[Generation]:
        self.prompts[request.rid] = array("i", request.input_ids)
        return self.inner.open_generation(request)


def runtime_over(backend: Backend, tokenizer: Any, **config: Any) -> AbstractAsyncContextManager[Runtime]:
    """A runtime (no HTTP) over ``backend``; ``config``: :class:`ProxyConfig` fields."""
    return open_runtime(ProxyConfig.of(port=0, **config), backend=backend, tokenizer=tokenizer)


@asynccontextmanager
async def recording_runtime(
    tokenizer: Any, sim: SimConfig, **config: Any
) -> AsyncIterator[tuple[Runtime, SimEngine, RecordingBackend]]:
    """A runtime (no HTTP) over a simulated engine configured by ``sim``, whose prompts are recorded;
    ``config``: :class:`ProxyConfig` fields."""
    engine = SimEngine(tokenizer, sim)
    backend = RecordingBackend(engine)
    async with runtime_over(backend, tokenizer, **config) as runtime:
        yield runtime, engine, backend


async def finalized(
    runtime: Runtime, session: str
) -> tuple[dict[str, Any], list[dict[str, Any]], list[dict[str, Any]]]:
    """Finalize ``session``: the finalize reply, and the segments and steps stored under the session (its child
    sessions' too), as JSON values."""
    summary = CONVERTER.unstructure(await runtime.finalize(session))
    payload = CONVERTER.unstructure(await runtime.read(session_id=session, include_steps=True))
    return summary, payload["data"], payload["steps"]


async def finalized_at(url: str, session: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Finalize ``session`` through the trainer's routes of the proxy at ``url``: its stored segments and their
    steps, as the trainer reads them."""
    async with ProxyClient(url) as client:
        await client.finalize_session(session)
        payload = await client.read_trajectory(session_id=session, include_steps=True)
    return payload["data"], payload["steps"]


@attrs.frozen
class TurnResult:
    done: TurnDone | None
    error: Any
    deltas: list[Any]

    @property
    def message(self) -> dict[str, Any]:
        assert self.done is not None, self.error
        return output_as_message(self.done.output)


async def run_turn(
    runtime: Runtime,
    session_id: str,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    max_tokens: int | None = None,
    turn_id: str | None = None,
    enable_thinking: bool | None = None,
    client: str | None = None,
) -> TurnResult:
    """One turn through the runtime (no HTTP), collecting its events (``client``: who opens the session)."""
    request = ChatRequest(
        messages=messages, tools=tools or [], max_tokens=max_tokens, enable_thinking=enable_thinking
    )
    identity = Identity(session_id, turn_id=turn_id) if client is None else Identity(session_id, turn_id=turn_id,
                                                                                      client=client)
    return await run_request(runtime, request, identity)


async def run_request(runtime: Runtime, request: ChatRequest, identity: Identity) -> TurnResult:
    """One turn of a whole ``request`` through the runtime (no HTTP), collecting its events."""
    deltas: list[Any] = []
    async with await runtime.start_turn(request, identity) as events:
        async for event in events:
            match event:
                case TurnAccepted():
                    pass
                case TurnDelta():
                    deltas.append(event.delta)
                case TurnDone():
                    return TurnResult(event, None, deltas)
                case TurnFailed():
                    return TurnResult(None, event.error, deltas)
    raise AssertionError("turn ended without a result")


async def hang_up_after(http: httpx.AsyncClient, path: str, body: dict[str, Any], session: str, *, events: int = 5,
                        marker: str = "data: ") -> None:
    """Stream a turn of ``session`` to ``path`` and hang up once ``events`` lines starting with ``marker`` came."""
    async with http.stream("POST", path, json=body, headers={"X-Session-Id": session}) as response:
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith(marker)
            if seen >= events:
                return


def access_logged(request: pytest.FixtureRequest) -> trio.Event:
    """Set by the first line of the ``actorproxy.access`` log (a request ended), for the rest of the test."""
    logged = trio.Event()
    handler = logging.Handler()
    handler.emit = lambda _: logged.set()  # type: ignore[method-assign]
    logging.getLogger("actorproxy.access").addHandler(handler)
    request.addfinalizer(lambda: logging.getLogger("actorproxy.access").removeHandler(handler))
    return logged


async def stop_reading_after_the_head(url: str, path: str, body: dict[str, Any],
                                      headers: bytes = b"") -> trio.socket.SocketType:
    """POST ``body`` to ``path`` from a client that takes the answer's head (a 200) and reads no more, its connection
    left open (a hung process): the socket, for the caller to close. Its small receive buffer (4 KiB) makes the
    server's buffers fill sooner."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = trio.socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect((host, int(port)))
    data = json.dumps(body).encode()
    await sock.send(b"POST " + path.encode() + b" HTTP/1.1\r\nhost: p\r\ncontent-type: application/json\r\n"
                    + headers + b"content-length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    assert (await sock.recv(4096)).startswith(b"HTTP/1.1 200")
    return sock


def chat_chunks(text: str) -> list[dict[str, Any]]:
    """The chunks of a streamed chat completion (its ``data:`` frames before the closing ``[DONE]``)."""
    frames = [block[len("data: ") :] for block in text.split("\n\n") if block.startswith("data: ")]
    assert frames[-1] == "[DONE]", frames[-3:]
    return [json.loads(frame) for frame in frames[:-1]]


def assemble_chat_stream(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The reply an OpenAI client assembles from streamed chunks: content, reasoning, calls, finish, usage.

    A call is assembled from its pieces by index, its id and name first; the calls come in index order.
    """
    content, reasoning, finish, usage = "", "", None, None
    calls: list[dict[str, Any]] = []
    for chunk in chunks:
        assert "error" not in chunk, chunk
        usage = chunk.get("usage") or usage
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for piece in delta.get("tool_calls") or []:
                if piece.get("id"):
                    assert piece["index"] == len(calls), piece
                    calls.append({"id": piece["id"], "type": "function",
                                  "function": {"name": piece["function"]["name"], "arguments": ""}})
                calls[piece["index"]]["function"]["arguments"] += piece["function"].get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return {"content": content, "reasoning": reasoning, "calls": calls, "finish": finish, "usage": usage}


def nested(depth: int) -> Any:
    """A JSON value ``depth`` objects deep (for the bodies' nesting bound)."""
    value: Any = "x"
    for _ in range(depth):
        value = {"a": value}
    return value


async def start_reasons(http: httpx.AsyncClient, session: str) -> list[str]:
    """Finalize ``session`` and drain its segments: why each one started."""
    assert (await http.post("/session/finalize", json={"session_id": session})).status_code == 200
    data = (await http.post("/trajectory/read", json={"session_id": session, "drain": True})).json()["data"]
    return [segment["start_reason"] for segment in data]


def reserialise(message: dict[str, Any]) -> dict[str, Any]:
    """An agent's echo of our reply: arguments re-serialised, reasoning dropped, null content."""
    echo: dict[str, Any] = {"role": "assistant", "content": message.get("content") or None}
    if message.get("tool_calls"):
        echo["tool_calls"] = [
            {
                "id": call["id"],
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": json.dumps(
                        json.loads(call["function"]["arguments"]), indent=1, sort_keys=True
                    ),
                },
            }
            for call in message["tool_calls"]
        ]
    return echo


def check_segment_invariants(segment: dict[str, Any], steps: list[dict[str, Any]], prompts: dict[str, array]) -> None:
    """The TITO contract of one segment against its steps and the engine's prompts.

    Every sampled token appears exactly once, in order, with mask 1 and its
    logprob; every other token has mask 0, logprob 0.0 and version -1; each
    step's prompt (as the engine received it) is a prefix of the segment.
    """
    ids = segment["token_ids"]
    mask = segment["loss_mask"]
    logprobs = segment["logprobs"]
    versions = segment["versions"]
    assert len(ids) == len(mask) == len(logprobs) == len(versions)
    in_segment = [s for s in steps if s["in_segment"] and s["segment_index"] == segment["segment_index"]]
    assert [s["step_index"] for s in in_segment] == segment["step_indices"]
    sampled_positions: list[int] = []
    for step in in_segment:
        prompt = prompts[step["rid"]].tolist()
        start = step["prompt_tokens"]
        assert len(prompt) == start
        assert ids[:start] == prompt, f"step {step['step_index']}: prompt is not a prefix of the segment"
        out = step["output_ids"]
        assert ids[start : start + len(out)] == out
        assert logprobs[start : start + len(out)] == step["output_logprobs"]
        sampled_positions.extend(range(start, start + len(out)))
    assert sampled_positions == sorted(set(sampled_positions)), "a sampled token appears twice"
    assert [i for i, m in enumerate(mask) if m == 1] == sampled_positions
    for i, m in enumerate(mask):
        if m == 0:
            assert logprobs[i] == 0.0 and versions[i] == -1
        else:
            assert logprobs[i] <= 0.0 and versions[i] >= 0


@contextmanager
def garbage_found() -> Iterator[list[object]]:
    """The cyclic collector off in the block, then one collection: what it found is in the list given (kept by
    ``gc.DEBUG_SAVEALL``), everything else freed by reference counting as the block ran.

    No log record is made in the block: pytest keeps each one, and with it the errors it names (and what holds
    them), which would hide a cycle through an error.
    """
    found: list[object] = []
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    logging.disable(logging.CRITICAL)
    try:
        yield found
        gc.collect()
        found += gc.garbage
    finally:
        logging.disable(logging.NOTSET)
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@contextmanager
def proxy_in_thread(tokenizer: Any, config: Any, *, seed: int) -> Iterator[str]:
    """A proxy on its own Trio loop in a thread, for synchronous tests (hypothesis); yields its URL."""
    started: queue.Queue[tuple[str, trio.lowlevel.TrioToken, trio.Event]] = queue.Queue()

    async def serve() -> None:
        engine = SimEngine(tokenizer, SimConfig(seed=seed, token_interval=0.0))
        async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running:
            done = trio.Event()
            started.put((running.url, trio.lowlevel.current_trio_token(), done))
            await done.wait()

    thread = threading.Thread(target=trio.run, args=(serve,), daemon=True)
    thread.start()
    url, token, done = started.get(timeout=120)
    try:
        yield url
    finally:
        token.run_sync_soon(done.set)  # never blocks, even if that loop is stuck
        thread.join(timeout=60)
        assert not thread.is_alive(), "the proxy's thread did not stop within 60 s"


def decision(load: Any, parse: Any, raw: bytes) -> Any:
    """What a body's bytes come to through ``load`` then ``parse``: the call, or the error's words, param and code."""
    try:
        return parse(load(raw))
    except BadRequest as exc:
        return (str(exc), exc.param, exc.code)


def broken(draw: Any, raw: bytes, start: int = 0) -> bytes:
    """``raw`` as it is, or with a byte changed or inserted at or past ``start``, or cut short there (a draw)."""
    cut = draw(st.sampled_from(["none", "none", "byte", "insert", "truncate"]))
    if cut == "none" or not raw:
        return raw
    at = draw(st.integers(min(start, len(raw) - 1), len(raw) - 1))
    if cut == "byte":
        return raw[:at] + bytes([draw(st.integers(0, 255))]) + raw[at + 1 :]
    if cut == "insert":
        return raw[:at] + draw(st.sampled_from([b",", b"]", b"{", b'"', b"\\", b"\xff", b" ", b"0", b"1"])) + raw[at:]
    return raw[:at]


def sse_reference(stream: bytes) -> list[tuple[str, bytes]]:
    """The events (name, data) of a whole event stream, read as the WHATWG HTML spec's "event stream
    interpretation" reads it, line by line: a line ends in CRLF, LF or a lone CR; a blank line dispatches
    the event; a line starting with ``:`` is a comment; a field's value follows its first colon, one space
    dropped; ``data`` lines are joined by LF; ``event`` names the event (empty: ``message``); no ``data``:
    no event; one UTF-8 byte order mark (U+FEFF) at the stream's start is dropped (elsewhere it is a line's
    byte like any). And the proxy's two additions: an ``error`` field (older llama.cpp) is data naming the
    event ``error``; at the stream's end, a last event without its blank line still counts."""
    if stream.startswith(b"\xef\xbb\xbf"):
        stream = stream[3:]
    lines: list[bytes] = []
    start = i = 0
    while i < len(stream):
        if stream[i] in b"\r\n":
            lines.append(stream[start:i])
            if stream[i : i + 2] == b"\r\n":
                i += 1
            start = i + 1
        i += 1
    lines += [stream[start:], b""]  # (the last line, if it has no end; then the stream's end dispatches)
    events: list[tuple[str, bytes]] = []
    name, data = "", []
    for line in lines:
        if not line:
            if data:
                events.append((name or "message", b"\n".join(data)))
            name, data = "", []
        elif not line.startswith(b":"):
            field, colon, value = line.partition(b":")
            value = value[1:] if value.startswith(b" ") else value
            if field == b"data":
                data.append(value)
            elif field == b"event":
                name = value.decode("utf-8", errors="replace")
            elif field == b"error":
                name = "error"
                data.append(value)
    return events
