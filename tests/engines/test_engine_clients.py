"""The SGLang, vLLM and llama.cpp clients against scripted HTTP engines.

The engines are httpx-style handlers served on port 0 by the proxy's own server
(``tests/_handler_server.py``), whose bodies are async generators, so streams arrive
event by event over real sockets and a test can abort or cancel mid-stream; payloads are
shaped like the real servers' (see ``docs/protocols.md``). The tests at the end run the
clients against ``actorproxy sim`` over real HTTP when that server is available.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson
import pytest
import trio
import trio.testing
from _handler_server import UNREACHABLE, start

from actorproxy.engines.base import (
    BackendError,
    GenerateFinish,
    GenerateRequest,
    Generation,
    GenerationEvent,
    SamplingParams,
    TokenDelta,
    WeightVersionSpan,
)
from actorproxy.engines.connection import EngineOptions
from actorproxy.engines.errors import backend_error
from actorproxy.engines.llamacpp.client import LlamaCppBackend
from actorproxy.engines.sglang.client import SGLangBackend
from actorproxy.engines.sglang.protocol import SGLangStreamParser
from actorproxy.engines.vllm.client import VLLMBackend
from actorproxy.engines.vllm.protocol import npy_to_int32_b64
from actorproxy.http.errors import ConnectError, ConnectTimeout, ProtocolError, ReadTimeout, TransportError
from actorproxy.http.sse import SSEParser

PROMPT = array("i", [151644, 872, 198])
EOT = 151645

def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def stream(*chunks: bytes, tail: Callable[[], Awaitable[list[bytes]]] | None = None) -> AsyncIterator[bytes]:
    async def body() -> AsyncIterator[bytes]:
        for chunk in chunks:
            await trio.lowlevel.checkpoint()
            yield chunk
        if tail is not None:
            for chunk in await tail():
                yield chunk

    return body()


class Engine:
    """A scripted engine: routes paths to handlers and records every request."""

    def __init__(self, routes: dict[str, Callable[[httpx.Request, Any], Any]]) -> None:
        self.routes = routes
        self.calls: list[tuple[str, Any, httpx.Headers]] = []
        self.closed = 0  # streamed bodies the client closed before their end (hung up)
        self.url: str | None = None

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        raw = await request.aread()
        body = json.loads(raw) if raw else None
        self.calls.append((request.url.path, body, request.headers))
        route = self.routes.get(request.url.path)
        if route is None:
            return httpx.Response(404, json={"detail": "Not Found"})
        result = route(request, body)
        if isinstance(result, Awaitable):
            result = await result
        if isinstance(result, httpx.Response):
            return result
        return httpx.Response(200, stream=_Body(self, result), headers={"content-type": "text/event-stream"})


    def bodies(self, path: str) -> list[Any]:
        return [body for p, body, _ in self.calls if p == path]

    async def serve(self, nursery: trio.Nursery) -> str:
        """This engine on a real server on port 0 (once, for the test's lifetime); its URL."""
        if self.url is None:
            self.url = await start(nursery, self)
        return self.url


class _Body(httpx.AsyncByteStream):
    """A streamed body that notices the client closing it (the engine seeing a disconnect)."""

    def __init__(self, engine: Engine, chunks: AsyncIterator[bytes]) -> None:
        self.engine, self.chunks = engine, chunks
        self.ended = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.chunks:
            yield chunk
        self.ended = True

    async def aclose(self) -> None:
        self.engine.closed += not self.ended
        await self.chunks.aclose()  # type: ignore[attr-defined]


def request(max_new_tokens: int = 16, **kw: Any) -> GenerateRequest:
    sampling = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(EOT,), **kw)
    return GenerateRequest(PROMPT, sampling, routing_key="session-1")


async def collect(gen: Generation) -> tuple[list[TokenDelta], GenerateFinish]:
    deltas: list[TokenDelta] = []
    finishes: list[GenerateFinish] = []
    async for event in gen:
        (finishes if isinstance(event, GenerateFinish) else deltas).append(event)  # type: ignore[arg-type]
    assert len(finishes) == 1
    return deltas, finishes[0]


def flat(deltas: list[TokenDelta]) -> tuple[list[int], list[float], list[str]]:
    ids = [t for d in deltas for t in d.token_ids]
    lps = [lp for d in deltas for lp in d.logprobs]
    versions = [d.weight_version for d in deltas for _ in d.token_ids]
    return ids, lps, versions


async def run(backend: Any, req: GenerateRequest) -> tuple[list[TokenDelta], GenerateFinish]:
    async with backend.open_generation(req) as gen:
        return await collect(gen)


async def run_aborted(backend: Any, req: GenerateRequest) -> list[GenerationEvent]:
    """Every event of a generation aborted at its first event (the finish last)."""
    events: list[GenerationEvent] = []
    async with backend.open_generation(req) as gen:
        async for event in gen:
            events.append(event)
            if len(events) == 1:
                await gen.abort()
    return events


async def run_aborted_at(backend: Any, req: GenerateRequest, tokens: int,
                         *, aborts: int = 1) -> tuple[list[int], GenerationEvent | None]:
    """The ids and the finish of a generation aborted (``aborts`` times over) once ``tokens`` ids came."""
    received: list[int] = []
    finish = None
    async with backend.open_generation(req) as gen:
        async for event in gen:
            if not isinstance(event, TokenDelta):
                finish = event
                continue
            before = len(received)
            received.extend(event.token_ids)
            if before < tokens <= len(received):
                for _ in range(aborts):
                    await gen.abort()
    return received, finish


# -- SSE ------------------------------------------------------------------------


def test_sse_parser_splits_events_across_chunks() -> None:
    parser = SSEParser()
    raw = b': ping\r\ndata: {"a": 1}\r\n\r\nevent: x\ndata: 2\ndata: 3\n\ndata: [DONE]'
    events = [e for i in range(len(raw)) for e in parser.feed(raw[i : i + 1])] + parser.close()
    assert [(e.event, e.data) for e in events] == [("message", b'{"a": 1}'), ("x", b"2\n3"), ("message", b"[DONE]")]


# -- SGLang ---------------------------------------------------------------------

IDS = [151667, 1234, 88, EOT]
LPS = [-0.5, -0.25, -1.0, -0.125]


def sg(ids: list[int], lps: list[float], *, finish: Any = None, legacy: bool = False, **meta: Any) -> bytes:
    info: dict[str, Any] = {
        "id": "rid",
        "finish_reason": finish,
        "prompt_tokens": 3,
        "cached_tokens": 2,
        "weight_version": "step-1",
        "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, lps, strict=True)],
        **meta,
    }
    payload: dict[str, Any] = {"text": "", "meta_info": info}
    if not legacy:
        payload["output_ids"] = ids
    return sse(payload)


STOP = {"type": "stop", "matched": EOT}


def counted(n: int, count: bool) -> dict[str, Any]:
    """``completion_tokens`` (SGLang's cumulative count), or nothing (older builds)."""
    return {"completion_tokens": n} if count else {}


def cumulative(legacy: bool = False, count: bool = True) -> list[bytes]:
    cuts = [1, 3, 4]
    return [
        sg(
            IDS[:n],
            LPS[:n],
            finish=STOP if n == 4 else None,
            legacy=legacy,
            **counted(n, count),
        )
        for n in cuts
    ]


def incremental(count: bool = True) -> list[bytes]:
    parts = [(0, 1), (1, 3), (3, 4)]
    return [
        sg(IDS[a:b], LPS[a:b], finish=STOP if b == 4 else None, **counted(b, count))
        for a, b in parts
    ]


@pytest.mark.parametrize(
    "events",
    [cumulative(), cumulative(legacy=True), cumulative(count=False), incremental(), incremental(count=False)],
    ids=["cumulative", "legacy-no-output-ids", "cumulative-no-count", "incremental", "incremental-no-count"],
)
async def test_sglang_stream_shapes(events: list[bytes], nursery: trio.Nursery) -> None:
    engine = Engine({"/generate": lambda r, b: stream(*events, DONE)})
    backend = SGLangBackend(await engine.serve(nursery))
    deltas, finish = await run(backend, request())
    ids, lps, versions = flat(deltas)
    assert (ids, lps, versions) == (IDS, LPS, ["step-1"] * 4)
    assert finish == GenerateFinish("stop", matched_stop=EOT, weight_version="step-1", prompt_tokens=3, cached_tokens=2)


@pytest.mark.parametrize("versions", [["v1"] * 6, ["v1", "v1", "v1", "v2", "v2", "v2"], ["v1", "v2"] * 3])
async def test_sglang_cumulative_events_read_together_are_decoded_only_where_needed(
    versions: list[str], monkeypatch: pytest.MonkeyPatch, nursery: trio.Nursery
) -> None:
    """Events that arrive in one read (SGLang's own bytes, orjson): one the last repeats whole is not decoded.

    The tokens, logprobs and each token's version are the engine's either way: an event whose
    version differs from the last one's is decoded (its tokens are stamped with it).
    """
    ids, lps = [11, 12, 13, 14, 15, EOT], [-0.5, -0.25, -1.0, -0.125, -2.0, -0.75]

    def event(n: int) -> bytes:
        meta = {"id": "rid", "finish_reason": STOP if n == 6 else None, "prompt_tokens": 3, "cached_tokens": 2,
                "weight_version": versions[n - 1], "completion_tokens": n,
                "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids[:n], lps[:n], strict=True)]}
        return b"data: " + orjson.dumps({"text": "x" * n, "output_ids": ids[:n], "meta_info": meta}) + b"\n\n"

    decoded: list[int] = []
    decode = SGLangStreamParser.decode_span
    monkeypatch.setattr(SGLangStreamParser, "decode_span", lambda self, raw, start, stop: decoded.append(
        stop - start) or decode(self, raw, start, stop))  # type: ignore[func-returns-value]
    engine = Engine({"/generate": lambda r, b: stream(b"".join(event(n) for n in range(1, 7)) + DONE)})
    deltas, finish = await run(SGLangBackend(await engine.serve(nursery)), request())
    assert flat(deltas) == (ids, lps, versions)  # each token stamped with the version of the event it came in
    assert finish.reason == "stop" and finish.weight_version == versions[-1]
    # Always the first two (the second tells the stream is cumulative) and the last; between them only an
    # event whose version is not the next one's.
    assert len(decoded) == 3 + sum(versions[i] != versions[i + 1] for i in range(2, 5))


async def test_sglang_incremental_delta_that_repeats_history(nursery: trio.Nursery) -> None:
    # Deltas [5] then [5, 5]: only the completion count tells them from cumulative events.
    events = [sg([5], [-1.0], completion_tokens=1), sg([5, 5], [-2.0, -3.0], completion_tokens=3, finish=STOP)]
    engine = Engine({"/generate": lambda r, b: stream(*events, DONE)})
    deltas, _ = await run(SGLangBackend(await engine.serve(nursery)), request())
    assert flat(deltas)[:2] == ([5, 5, 5], [-1.0, -2.0, -3.0])


async def test_sglang_incremental_tokens_past_the_count_must_repeat_the_last_ones(nursery: trio.Nursery) -> None:
    # Deltas [1, 2], then [3, 4] with a count of 3: the 4 is not a repeat of what came before.
    events = [sg([1, 2], [-1.0, -2.0], completion_tokens=2), sg([3, 4], [-3.0, -4.0], completion_tokens=3, finish=STOP)]
    engine = Engine({"/generate": lambda r, b: stream(*events, DONE)})
    with pytest.raises(BackendError, match="repeat nothing delivered"):
        await run(SGLangBackend(await engine.serve(nursery)), request())


async def test_sglang_request_body_and_headers(nursery: trio.Nursery) -> None:
    engine = Engine({"/generate": lambda r, b: stream(*cumulative(), DONE)})
    backend = SGLangBackend(await engine.serve(nursery), EngineOptions(routed_experts=True))
    req = GenerateRequest(
        PROMPT,
        SamplingParams(max_new_tokens=7, temperature=0.5, top_k=20, seed=3, stop_token_ids=(EOT,)),
        routing_key="k1",
        return_routed_experts=True,
    )
    await run(backend, req)
    (path, body, headers) = engine.calls[0]
    assert path == "/generate" and headers["x-smg-routing-key"] == "k1"
    assert body["rid"] == req.rid and body["input_ids"] == list(PROMPT) and body["stream"] is True
    assert (body["return_logprob"], body["logprob_start_len"], body["top_logprobs_num"]) == (True, -1, 0)
    assert body["return_routed_experts"] is True
    sp = body["sampling_params"]
    assert sp["max_new_tokens"] == 7 and sp["temperature"] == 0.5 and sp["top_k"] == 20
    assert sp["sampling_seed"] == 3 and sp["stop_token_ids"] == [EOT]
    assert (sp["skip_special_tokens"], sp["no_stop_trim"], sp["ignore_eos"]) == (False, True, False)


async def test_sglang_weight_version_spans_stamp_each_token(nursery: trio.Nursery) -> None:
    spans = [{"version": "v1", "start": 0, "end": 2}, {"version": "v2", "start": 2, "end": 4}]
    events = [
        sg(IDS[:1], LPS[:1], completion_tokens=1, weight_version="v1"),
        sg(IDS, LPS, completion_tokens=4, weight_version="v2", weight_versions=spans, finish=STOP),
    ]
    engine = Engine({"/generate": lambda r, b: stream(*events, DONE)})
    deltas, finish = await run(SGLangBackend(await engine.serve(nursery)), request())
    # (The two events may arrive in one read or two: each token's stamp is the same either way.)
    stamps = [(t, d.weight_version) for d in deltas for t in d.token_ids]
    assert stamps == [(IDS[0], "v1"), (IDS[1], "v1"), (IDS[2], "v2"), (IDS[3], "v2")]
    assert finish.weight_version == "v2"
    assert finish.weight_versions == (WeightVersionSpan("v1", 0, 2), WeightVersionSpan("v2", 2, 4))


TOO_LONG = "The input (9 tokens) is longer than the model's context length (8 tokens)."
ABORT_400 = {"type": "abort", "message": "too long", "status_code": 400}
ABORT_500 = {"type": "abort", "message": "engine failed", "status_code": 500, "err_type": None}  # (sent with tokens)
BAD_LOGPROBS = {"output_ids": IDS[:2], "meta_info": {"output_token_logprobs": [[-1.0, IDS[0], None]]}}


@pytest.mark.parametrize(
    ("route", "status", "text"),
    [
        (lambda r, b: stream(sg(IDS[:1], LPS[:1]), sse({"error": {"message": "boom"}})), 502, "boom"),
        (lambda r, b: stream(sse({"error": {"message": TOO_LONG}})), 400, "context length"),
        (lambda r, b: httpx.Response(500, json={"object": "error", "message": "internal oops"}), 502, "internal oops"),
        (lambda r, b: httpx.Response(400, json={"error": {"message": "bad input_ids"}}), 400, "bad input_ids"),
        (lambda r, b: stream(sg(IDS[:1], LPS[:1])), 502, "without a finish"),
        (lambda r, b: stream(sg(IDS[:1], LPS[:1]), DONE), 502, "without a finish"),
        (lambda r, b: stream(sg([], [], finish=ABORT_400)), 400, "too long"),
        (lambda r, b: stream(sse(BAD_LOGPROBS)), 502, "logprob"),
        (lambda r, b: stream(b"data: {not json\n\n"), 502, "malformed"),
        (lambda r, b: stream(sg(IDS[:1], LPS[:1]), sg(IDS[1:3], LPS[1:3], finish=ABORT_500)), 502, "engine failed"),
        (lambda r, b: stream(sg(IDS[:3], LPS[:3], finish=ABORT_500)), 502, "engine failed"),
    ],
    ids=["mid-stream-error", "prompt-too-long", "http-500", "http-400", "no-finish", "done-no-finish",
         "abort-400", "logprob-mismatch", "bad-json", "failed-with-tokens", "first-event-failed-with-tokens"],
)
async def test_sglang_errors(route: Any, status: int, text: str, nursery: trio.Nursery) -> None:
    engine = Engine({"/generate": route})
    backend = SGLangBackend(await engine.serve(nursery))
    seen: list[int] = []
    with pytest.raises(BackendError, match=text) as info:
        async with backend.open_generation(request()) as gen:
            async for event in gen:
                if isinstance(event, TokenDelta):
                    seen.extend(event.token_ids)
    assert info.value.status == status
    if text == "boom":
        assert seen == IDS[:1]  # tokens before the failure are still delivered
    if text == "engine failed":  # and those the failing event brings (the engine sampled and sent them)
        assert seen == IDS[:3]


async def test_transport_failures_map_to_502_and_504(nursery: trio.Nursery, autojump_clock: Any) -> None:
    # Refused: nothing listens (502, the engine unreachable).
    with pytest.raises(BackendError) as info:
        await run(SGLangBackend(UNREACHABLE), request())
    assert (info.value.status, info.value.unreachable) == (502, True)

    # The stream stops midway and nothing more comes: the read times out (504, not unreachable).
    async def stalled() -> AsyncIterator[bytes]:
        yield sg(IDS[:1], LPS[:1])
        await trio.sleep_forever()

    engine = Engine({"/generate": lambda r, b: stalled(), "/abort_request": lambda r, b: httpx.Response(200)})
    backend = SGLangBackend(await engine.serve(nursery), EngineOptions(read_timeout=5.0))
    with pytest.raises(BackendError) as info:
        await run(backend, request())
    assert (info.value.status, info.value.unreachable) == (504, False)
    await backend.aclose()


def test_each_transport_failure_has_its_status_in_the_one_table() -> None:
    cases = [(ConnectTimeout("connect timed out"), 504, True), (ReadTimeout("read timed out"), 504, False),
             (ConnectError("refused"), 502, True), (ProtocolError("bad chunk size"), 502, False),
             (TransportError("dropped"), 502, False)]
    for exc, status, unreachable in cases:
        error = backend_error("engine", exc)
        assert (error.status, error.unreachable) == (status, unreachable) and str(exc) in str(error)


class AbortableSGLang:
    """Emits two tokens, then waits for /abort_request and ends with the abort finish."""

    def __init__(self, incremental: bool = False) -> None:
        self.aborted = trio.Event()
        self.incremental = incremental
        self.engine = Engine({"/generate": self.generate, "/abort_request": self.abort})

    def generate(self, request: httpx.Request, body: Any) -> AsyncIterator[bytes]:
        async def tail() -> list[bytes]:
            await self.aborted.wait()
            ids = IDS[2:3] if self.incremental else IDS[:3]
            lps = LPS[2:3] if self.incremental else LPS[:3]
            return [sg(ids, lps, completion_tokens=3, finish={"type": "abort", "message": "Aborted"}), DONE]

        first = [sg(IDS[:1], LPS[:1], completion_tokens=1), sg(IDS[1:2] if self.incremental else IDS[:2],
                                                               LPS[1:2] if self.incremental else LPS[:2],
                                                               completion_tokens=2)]
        return stream(*first, tail=tail)

    def abort(self, request: httpx.Request, body: Any) -> httpx.Response:
        self.aborted.set()
        return httpx.Response(200)


@pytest.mark.parametrize("incremental", [False, True])
async def test_sglang_acknowledged_abort_delivers_every_token(incremental: bool, nursery: trio.Nursery) -> None:
    fake = AbortableSGLang(incremental)
    backend = SGLangBackend(await fake.engine.serve(nursery))
    req = request()
    received, finish = await run_aborted_at(backend, req, 2, aborts=2)  # a second abort is idempotent
    assert received == IDS[:3]  # the token sampled while the abort travelled is kept
    assert finish is not None and finish.reason == "abort" and finish.message == "Aborted"
    assert fake.engine.bodies("/abort_request") == [{"rid": req.rid, "abort_all": False}]


async def test_sglang_leaving_early_aborts_the_rid_and_closes_the_stream(nursery: trio.Nursery) -> None:
    fake = AbortableSGLang()
    backend = SGLangBackend(await fake.engine.serve(nursery))
    req = request()
    with trio.CancelScope() as scope:
        async with backend.open_generation(req) as gen:
            async for _ in gen:
                scope.cancel()
                await trio.lowlevel.checkpoint()
    assert scope.cancelled_caught
    assert fake.engine.bodies("/abort_request") == [{"rid": req.rid, "abort_all": False}]
    await trio.testing.wait_all_tasks_blocked()  # the engine's side sees the hang-up (or the end)
    assert fake.engine.closed == 1


async def test_sglang_cleanup_is_bounded_when_the_abort_hangs(autojump_clock: Any, nursery: trio.Nursery) -> None:
    async def hang(request: httpx.Request, body: Any) -> httpx.Response:
        await trio.sleep_forever()
        raise AssertionError

    engine = Engine({"/generate": lambda r, b: stream(sg(IDS[:1], LPS[:1]), tail=hang_tail), "/abort_request": hang})
    backend = SGLangBackend(await engine.serve(nursery), EngineOptions(abort_grace=2.0))
    start = trio.current_time()
    async with backend.open_generation(request()) as gen:
        async for _ in gen:
            break
    assert trio.current_time() - start == pytest.approx(2.0)


async def hang_tail() -> list[bytes]:
    await trio.sleep_forever()
    raise AssertionError


async def test_sglang_abort_that_fails_cuts_the_stream(nursery: trio.Nursery) -> None:
    engine = Engine({
        "/generate": lambda r, b: stream(sg(IDS[:1], LPS[:1], completion_tokens=1), tail=hang_tail),
        "/abort_request": lambda r, b: httpx.Response(500),
    })
    events = await run_aborted(SGLangBackend(await engine.serve(nursery)), request())
    assert isinstance(events[-1], GenerateFinish) and events[-1].reason == "abort"
    assert flat([e for e in events if isinstance(e, TokenDelta)])[0] == IDS[:1]


async def test_sglang_abort_before_the_first_event_is_sent_again(nursery: trio.Nursery) -> None:
    # The engine may not know the rid yet when the first abort lands: the client repeats
    # it once the first event shows the request exists.
    fake = AbortableSGLang()
    backend = SGLangBackend(await fake.engine.serve(nursery))
    gen = backend.open_generation(request())
    await gen.abort()  # before entering: sent on entry
    async with gen:
        deltas, finish = await collect(gen)
    assert flat(deltas)[0] == IDS[:3] and finish.reason == "abort"
    assert len(fake.engine.bodies("/abort_request")) == 2


async def test_sglang_cancelled_before_headers_still_aborts(autojump_clock: Any, nursery: trio.Nursery) -> None:
    async def slow(request: httpx.Request, body: Any) -> httpx.Response:
        await trio.sleep_forever()
        raise AssertionError

    engine = Engine({"/generate": slow, "/abort_request": lambda r, b: httpx.Response(200)})
    backend = SGLangBackend(await engine.serve(nursery))
    req = request()
    with trio.move_on_after(5):
        async with backend.open_generation(req):
            raise AssertionError("never entered")
    assert engine.bodies("/abort_request") == [{"rid": req.rid, "abort_all": False}]


async def test_sglang_model_info_prompt_logprobs_and_helpers(nursery: trio.Nursery) -> None:
    def generate(request: httpx.Request, body: Any) -> httpx.Response:
        entries = [[None, 151644, None], [-2.5, 872, None], [-0.75, 198, None]]
        return httpx.Response(200, json={"output_ids": [], "meta_info": {"input_token_logprobs": entries}})

    engine = Engine({
        # An older build: no /model_info (404), and a model info without the version.
        "/get_model_info": lambda r, b: httpx.Response(200, json={"model_path": "Qwen/Qwen3-8B"}),
        "/get_weight_version": lambda r, b: httpx.Response(200, json={"weight_version": "step-9"}),
        "/v1/models": lambda r, b: httpx.Response(200, json={"data": [{"id": "q", "max_model_len": 4096}]}),
        "/generate": generate,
        "/health": lambda r, b: httpx.Response(200),
        "/pause_generation": lambda r, b: httpx.Response(200, json={"status": "ok"}),
        "/continue_generation": lambda r, b: httpx.Response(200, json={"status": "ok"}),
        "/update_weight_version": lambda r, b: httpx.Response(200, json={"success": True}),
    })
    backend = SGLangBackend(await engine.serve(nursery))
    info = await backend.model_info()
    assert (info.model_id, info.max_model_len, info.weight_version) == ("Qwen/Qwen3-8B", 4096, "step-9")
    await backend.model_info()
    assert [path for path, _, _ in engine.calls].count("/model_info") == 1  # asked once: the choice is kept
    assert await backend.prompt_logprobs(PROMPT) == [None, -2.5, -0.75]
    body = engine.bodies("/generate")[0]
    assert body["sampling_params"]["max_new_tokens"] == 0 and body["logprob_start_len"] == 0
    assert await backend.health() is True
    await backend.pause("retract")
    await backend.continue_generation()
    await backend.update_weight_version("step-10")
    assert engine.bodies("/pause_generation") == [{"mode": "retract"}]
    assert engine.bodies("/update_weight_version") == [{"new_version": "step-10", "abort_all_requests": False}]
    # No answer at all is not an answer of "unhealthy": the pool tells the two apart.
    with pytest.raises(BackendError, match="health: cannot connect"):
        await SGLangBackend("http://127.0.0.1:9", EngineOptions(connect_timeout=0.5)).health()


# -- vLLM -----------------------------------------------------------------------


def vg(ids: list[int], lps: list[float], *, finish: str | None = None, old: bool = False, **extra: Any) -> bytes:
    pairs = zip(ids, lps, strict=True)
    content = [({"token": f"token_id:{t}"} if old else {"token_id": t}) | {"logprob": lp} for t, lp in pairs]
    choice = {"index": 0, "token_ids": ids, "logprobs": {"content": content}, "finish_reason": finish, **extra}
    return sse({"request_id": "generate-tokens-x", "choices": [choice]})


def vc(ids: list[int], lps: list[float], *, finish: str | None = None, stop_reason: Any = None) -> bytes:
    logprobs = {"tokens": [f"token_id:{t}" for t in ids], "token_logprobs": lps, "text_offset": [], "top_logprobs": []}
    choice = {"index": 0, "text": "", "token_ids": ids, "logprobs": logprobs, "finish_reason": finish,
              "stop_reason": stop_reason}
    return sse({"id": "cmpl-x", "object": "text_completion", "model": "m", "choices": [choice]})


USAGE = sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4,
                                      "prompt_tokens_details": {"cached_tokens": 1}}})


@pytest.mark.parametrize("old", [False, True], ids=["token_id", "token-string"])
async def test_vllm_generate_api(old: bool, nursery: trio.Nursery) -> None:
    spans = [{"version": "v7", "start": 0, "end": 4}]
    events = [vg(IDS[:2], LPS[:2], old=old), vg(IDS[2:], LPS[2:], finish="stop", weight_versions=spans), USAGE, DONE]
    engine = Engine({"/inference/v1/generate": lambda r, b: stream(*events)})
    backend = VLLMBackend(await engine.serve(nursery))
    req = request(seed=5)
    deltas, finish = await run(backend, req)
    assert flat(deltas)[:2] == (IDS, LPS)
    assert finish == GenerateFinish("stop", matched_stop=EOT, weight_version="v7", prompt_tokens=3, cached_tokens=1,
                                    weight_versions=(WeightVersionSpan("v7", 0, 4),))
    assert backend.api == "generate" and backend.last_version == "v7"
    (_, body, headers) = engine.calls[1]  # after /openapi.json (404 here: the route is tried)
    assert body["token_ids"] == list(PROMPT) and body["request_id"] == req.rid and headers["x-request-id"] == req.rid
    sp = body["sampling_params"]
    assert (sp["max_tokens"], sp["logprobs"], sp["seed"], sp["skip_special_tokens"]) == (16, 0, 5, False)
    assert sp["stop_token_ids"] == [EOT]


async def test_vllm_falls_back_to_completions_once(nursery: trio.Nursery) -> None:
    events = [vc(IDS[:3], LPS[:3]), vc(IDS[3:], LPS[3:], finish="stop", stop_reason=EOT), USAGE, DONE]
    engine = Engine({
        "/v1/completions": lambda r, b: stream(*events),
        "/v1/models": lambda r, b: httpx.Response(200, json={"data": [{"id": "qwen", "max_model_len": 8192}]}),
    })
    backend = VLLMBackend(await engine.serve(nursery))
    for _ in range(2):
        deltas, finish = await run(backend, request())
        assert flat(deltas)[:2] == (IDS, LPS) and finish.reason == "stop" and finish.matched_stop == EOT
    assert [p for p, _, _ in engine.calls].count("/inference/v1/generate") == 1  # detected once
    body = engine.bodies("/v1/completions")[0]
    assert body["model"] == "qwen" and body["prompt"] == list(PROMPT) and body["return_token_ids"] is True
    assert (body["max_tokens"], body["logprobs"], body["stream_options"]) == (16, 0, {"include_usage": True})


@pytest.mark.parametrize(
    ("events", "reason", "message"),
    [
        ([vg(IDS[:2], LPS[:2]), DONE], "abort", "the stream ended without a finish reason"),
        ([vg(IDS[:2], LPS[:2], finish="length"), DONE], "length", ""),
        ([vg(IDS[:2], LPS[:2], finish="abort"), USAGE, DONE], "abort", "aborted"),
    ],
)
async def test_vllm_finish_reasons(events: list[bytes], reason: str, message: str, nursery: trio.Nursery) -> None:
    engine = Engine({"/inference/v1/generate": lambda r, b: stream(*events)})
    _, finish = await run(VLLMBackend(await engine.serve(nursery), EngineOptions(api="generate")), request())
    assert (finish.reason, finish.message) == (reason, message)


@pytest.mark.parametrize(
    "events",
    [
        [vg(IDS[:1], LPS[:1], finish="error")],
        [sse({"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}), DONE],
        [vg(IDS[:1], LPS[:1])],
    ],
    ids=["finish-error", "error-chunk", "no-finish"],
)
async def test_vllm_errors(events: list[bytes], nursery: trio.Nursery) -> None:
    engine = Engine({"/inference/v1/generate": lambda r, b: stream(*events)})
    with pytest.raises(BackendError) as info:
        await run(VLLMBackend(await engine.serve(nursery), EngineOptions(api="generate")), request())
    assert info.value.status == 502


async def test_vllm_acknowledged_abort_tries_both_abort_routes(nursery: trio.Nursery) -> None:
    aborted = trio.Event()

    async def tail() -> list[bytes]:
        await aborted.wait()
        return [vg(IDS[2:3], LPS[2:3], finish="abort"), DONE]

    def abort(request: httpx.Request, body: Any) -> httpx.Response:
        aborted.set()
        return httpx.Response(200, json={"status": "aborted"})

    engine = Engine({
        "/inference/v1/generate": lambda r, b: stream(vg(IDS[:1], LPS[:1]), vg(IDS[1:2], LPS[1:2]), tail=tail),
        "/abort_requests": abort,
    })
    backend = VLLMBackend(await engine.serve(nursery), EngineOptions(api="generate"))
    req = request()
    received: list[int] = []
    async with backend.open_generation(req) as gen:
        async for event in gen:
            if isinstance(event, TokenDelta):
                received.extend(event.token_ids)
                if len(received) == 2:
                    await gen.abort()
            else:
                assert event.reason == "abort"
    assert received == IDS[:3]
    assert [p for p, _, _ in engine.calls][1:] == ["/inference/v1/abort_requests", "/abort_requests"]
    assert f"generate-tokens-{req.rid}" in engine.bodies("/abort_requests")[0]["request_ids"]


async def test_vllm_without_abort_route_closes_the_stream(nursery: trio.Nursery) -> None:
    engine = Engine({"/inference/v1/generate": lambda r, b: stream(vg(IDS[:1], LPS[:1]), tail=hang_tail)})
    events = await run_aborted(VLLMBackend(await engine.serve(nursery), EngineOptions(api="generate")), request())
    assert isinstance(events[-1], GenerateFinish) and events[-1].reason == "abort"
    await trio.testing.wait_all_tasks_blocked()  # the engine's side sees the hang-up (or the end)
    assert engine.closed == 1


def npy(values: list[int], shape: tuple[int, ...], descr: str = "<u2") -> str:
    header = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode()
    header += b" " * (-(10 + len(header) + 1) % 64) + b"\n"
    fmt = {"<u2": "<%dH", "<i8": "<%dq", "|u1": "<%dB"}[descr] % len(values)
    raw = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + struct.pack(fmt, *values)
    return base64.b64encode(raw).decode()


@pytest.mark.parametrize("descr", ["<u2", "<i8", "|u1"])
def test_npy_routed_experts_become_raw_int32(descr: str) -> None:
    values = [1, 2, 3, 4, 5, 6]
    assert base64.b64decode(npy_to_int32_b64(npy(values, (3, 1, 2), descr))) == struct.pack("<6i", *values)


async def test_vllm_routed_experts_and_prompt_logprobs(nursery: trio.Nursery) -> None:
    last = {"index": 0, "token_ids": [], "logprobs": None, "finish_reason": "length",
            "routed_experts": npy([7, 8], (1, 1, 2))}
    events = [vc(IDS[:1], LPS[:1]), sse({"choices": [last]}), DONE]

    def completions(request: httpx.Request, body: Any) -> Any:
        if body["stream"]:
            return stream(*events)
        entries = [None, {"872": {"logprob": -1.5, "rank": 1}}, {"198": {"logprob": -0.5, "rank": 2}, "5": {}}]
        return httpx.Response(200, json={"choices": [{"index": 0, "text": "", "prompt_logprobs": entries}]})

    engine = Engine({"/v1/completions": completions, "/v1/models": lambda r, b: httpx.Response(500)})
    backend = VLLMBackend(await engine.serve(nursery), EngineOptions(api="completions"))
    req = GenerateRequest(PROMPT, SamplingParams(max_new_tokens=1), return_routed_experts=True)
    _, finish = await run(backend, req)
    assert finish.routed_experts is not None
    assert base64.b64decode(finish.routed_experts) == struct.pack("<2i", 7, 8)
    assert await backend.prompt_logprobs(PROMPT) == [None, -1.5, -0.5]
    assert engine.bodies("/v1/completions")[-1]["prompt_logprobs"] == 1
    assert "model" not in engine.bodies("/v1/completions")[0]  # /v1/models failed: omitted


# -- llama.cpp ------------------------------------------------------------------


def lc(token: int, lp: float, **extra: Any) -> bytes:
    entry = {"id": token, "token": "x", "bytes": [120], "logprob": lp, "top_logprobs": []}
    return sse({"content": "x", "tokens": [token], "stop": False, "completion_probabilities": [entry], **extra})


def lc_final(stop_type: str) -> bytes:
    return sse({"content": "", "tokens": [], "stop": True, "stop_type": stop_type, "tokens_cached": 9,
                "timings": {"cache_n": 2, "prompt_n": 1}})


async def test_llamacpp_stream_and_request_body(nursery: trio.Nursery) -> None:
    events = [lc(t, lp) for t, lp in zip(IDS, LPS, strict=True)] + [lc_final("eos")]
    engine = Engine({"/completion": lambda r, b: stream(*events)})
    # No stop ids: the engine's own end-of-generation stop is what ends it here.
    req = GenerateRequest(PROMPT, SamplingParams(max_new_tokens=16, seed=11))
    deltas, finish = await run(LlamaCppBackend(await engine.serve(nursery)), req)
    assert flat(deltas)[:2] == (IDS, LPS)
    assert finish == GenerateFinish("stop", EOT, weight_version="default", prompt_tokens=3, cached_tokens=2)
    body = engine.bodies("/completion")[0]
    assert body["prompt"] == list(PROMPT) and body["n_predict"] == 16 and body["seed"] == 11
    assert (body["top_k"], body["top_p"], body["min_p"], body["repeat_penalty"]) == (0, 1.0, 0.0, 1.0)
    assert (body["n_probs"], body["return_tokens"], body["stream"], body["cache_prompt"]) == (1, True, True, True)


async def test_llamacpp_enforces_stop_ids_and_limit_client_side(nursery: trio.Nursery) -> None:
    # The engine does not know EOT is a stop id and goes on; the client stops and hangs up.
    events = [lc(t, lp) for t, lp in zip(IDS, LPS, strict=True)] + [lc(9, -0.1), lc(10, -0.1)]
    engine = Engine({"/completion": lambda r, b: stream(*events, tail=hang_tail)})
    backend = LlamaCppBackend(await engine.serve(nursery))
    async with backend.open_generation(request()) as gen:
        deltas, finish = await collect(gen)
    await trio.testing.wait_all_tasks_blocked()  # the engine's side sees the hang-up (or the end)
    assert engine.closed == 1  # the next event was a token: hung up, which cancels it in llama.cpp
    assert flat(deltas)[0] == IDS and (finish.reason, finish.matched_stop) == ("stop", EOT)
    deltas, finish = await run(backend, request(max_new_tokens=2))
    assert flat(deltas)[0] == IDS[:2] and finish.reason == "length"


async def test_llamacpp_keeps_the_connection_when_the_engine_stops_with_the_client(nursery: trio.Nursery) -> None:
    # The stop id is also an end-of-generation token for the engine: its final event
    # follows, the stream is read to its end and the connection goes back to the pool.
    events = [lc(t, lp) for t, lp in zip(IDS, LPS, strict=True)] + [lc_final("eos")]
    engine = Engine({"/completion": lambda r, b: stream(*events)})
    deltas, finish = await run(LlamaCppBackend(await engine.serve(nursery)), request())
    assert flat(deltas)[0] == IDS and (finish.reason, finish.matched_stop) == ("stop", EOT)
    await trio.testing.wait_all_tasks_blocked()  # the engine's side sees the hang-up (or the end)
    assert engine.closed == 0


async def test_llamacpp_abort_closes_and_reports_what_arrived(nursery: trio.Nursery) -> None:
    engine = Engine({"/completion": lambda r, b: stream(lc(IDS[0], LPS[0]), tail=hang_tail)})
    events = await run_aborted(LlamaCppBackend(await engine.serve(nursery)), request())
    assert flat([e for e in events if isinstance(e, TokenDelta)])[0] == IDS[:1]
    assert isinstance(events[-1], GenerateFinish) and events[-1].reason == "abort"
    await trio.testing.wait_all_tasks_blocked()  # the engine's side sees the hang-up (or the end)
    assert engine.closed == 1


async def test_llamacpp_abort_from_another_task_interrupts_the_read(nursery: trio.Nursery) -> None:
    engine = Engine({"/completion": lambda r, b: stream(lc(IDS[0], LPS[0]), tail=hang_tail)})
    backend = LlamaCppBackend(await engine.serve(nursery))
    events: list[Any] = []
    async with backend.open_generation(request()) as gen:
        async with trio.open_nursery() as nursery:

            async def consume() -> None:
                async for event in gen:
                    events.append(event)

            nursery.start_soon(consume)
            await trio.testing.wait_all_tasks_blocked()
            assert len(events) == 1  # the consumer now waits on the stream
            await gen.abort()
    assert isinstance(events[-1], GenerateFinish) and events[-1].reason == "abort" and len(events) == 2


async def test_llamacpp_old_probs_format_and_errors(nursery: trio.Nursery) -> None:
    old = sse({"content": "a", "tokens": [5], "stop": False,
               "completion_probabilities": [{"content": "a", "probs": [{"tok_str": "a", "prob": 0.5}]}]})
    unknown = sse({"content": "b", "tokens": [6], "stop": False,
                   "completion_probabilities": [{"content": "b", "probs": [{"tok_str": "c", "prob": 0.9}]}]})
    engine = Engine({"/completion": lambda r, b: stream(old, unknown, lc_final("limit"))})
    deltas, finish = await run(LlamaCppBackend(await engine.serve(nursery)), request())
    _, lps, _ = flat(deltas)
    assert lps[0] == pytest.approx(math.log(0.5)) and math.isnan(lps[1]) and finish.reason == "length"
    for route, status in [
        (lambda r, b: httpx.Response(400, json={"error": {"code": 400, "message": "exceeds the context size"}}), 400),
        (lambda r, b: stream(lc(5, -1.0), sse({"error": {"code": 500, "message": "slot crashed"}})), 502),
        (lambda r, b: stream(b'error: {"code": 500, "message": "old style"}\n\n'), 502),
    ]:
        engine = Engine({"/completion": route})
        with pytest.raises(BackendError) as info:
            await run(LlamaCppBackend(await engine.serve(nursery)), request())
        assert info.value.status == status


# -- against `actorproxy sim` over real HTTP ------------------------------------

SIM_CASES: dict[str, tuple[dict[str, Any], Any]] = {
    "sglang": ({}, SGLangBackend),
    "sglang-incremental": ({"incremental_streaming_output": True}, SGLangBackend),
    "vllm-generate": ({}, VLLMBackend),
    "vllm-completions": ({"vllm_generate_endpoint": False}, VLLMBackend),
    "llamacpp": ({}, LlamaCppBackend),
}
LONG = [1000 + i for i in range(1000)] + [EOT]


@asynccontextmanager
async def sim_server(tokenizer: Any, **settings: Any) -> AsyncIterator[Any]:
    simserver = pytest.importorskip("actorproxy.sim.server")
    engine = simserver.served_engine(token_interval=0.002, **settings.pop("engine", {}))
    config = simserver.SimServerSettings(port=0, engine=engine, **settings)
    async with simserver.open_sim_server(config, tokenizer=tokenizer) as running:
        yield running


@asynccontextmanager
async def sim_backend(tokenizer: Any, case: str, options: EngineOptions | None = None,
                      **settings: Any) -> AsyncIterator[tuple[Any, Any]]:
    """A simulated engine served as ``case`` names it, and that protocol's client to it (closed on exit)."""
    protocol, make = SIM_CASES[case]
    async with sim_server(tokenizer, **protocol, **settings) as running:
        backend = make(running.url) if options is None else make(running.url, options)
        try:
            yield running, backend
        finally:
            await backend.aclose()


def engine_rid(running: Any, req: GenerateRequest) -> str:
    # llama.cpp has no request id on the wire: the simulator names the request itself.
    return req.rid if req.rid in running.state.records else next(reversed(running.state.records))


@pytest.mark.parametrize("case", list(SIM_CASES))
async def test_sim_exact_tokens_and_logprobs(case: str, tokenizer: Any) -> None:
    async with sim_backend(tokenizer, case) as (running, backend):
        running.engine.script([11, 22, 33, 44, EOT])
        req = request(seed=7)
        deltas, finish = await run(backend, req)
        stats = running.engine.stats(engine_rid(running, req))
        ids, lps, versions = flat(deltas)
        assert ids == list(stats.token_ids) == [11, 22, 33, 44, EOT]
        assert lps == list(stats.logprobs)
        assert set(versions) == {"default"}
        assert (finish.reason, finish.matched_stop) == ("stop", EOT)
        assert finish.prompt_tokens == len(PROMPT)
        info = await backend.model_info()
        assert info.model_id == "actorproxy-sim" and info.weight_version == "default"


@pytest.mark.parametrize("case", ["sglang", "sglang-incremental", "vllm-generate", "vllm-completions"])
async def test_sim_acknowledged_abort_loses_no_token(case: str, tokenizer: Any) -> None:
    async with sim_backend(tokenizer, case) as (running, backend):
        running.engine.script(LONG)
        req = request(max_new_tokens=1000)
        received, finish = await run_aborted_at(backend, req, 5)
        stats = running.engine.stats(req.rid)
        assert finish is not None and finish.reason == "abort"
        assert stats.aborted and stats.finish_reason == "abort"
        assert received == list(stats.token_ids) and 5 <= len(received) < len(LONG)


@pytest.mark.parametrize("case", list(SIM_CASES))
async def test_sim_leaving_early_stops_the_engine(case: str, tokenizer: Any) -> None:
    async with sim_backend(tokenizer, case) as (running, backend):
        running.engine.script(LONG)
        req = request(max_new_tokens=1000)
        async with backend.open_generation(req) as gen:
            async for _ in gen:
                break
        rid = engine_rid(running, req)
        if case == "llamacpp":
            # No abort call: the server stops when it notices the closed connection.
            with trio.fail_after(5):
                await running.state.wait_idle()
        # SGLang and vLLM: the abort sent on the way out has already stopped it.
        stats = running.engine.stats(rid)
        assert stats.finish_reason == "abort" and (stats.aborted or stats.cancelled)
        assert len(stats.token_ids) < len(LONG)


@pytest.mark.parametrize("case", ["sglang", "vllm-generate", "vllm-completions"])
async def test_sim_prompt_logprobs_and_errors(case: str, tokenizer: Any) -> None:
    async with sim_backend(tokenizer, case, engine={"max_model_len": 64}) as (running, backend):
        expected = await running.engine.prompt_logprobs(PROMPT)
        assert await backend.prompt_logprobs(PROMPT) == expected
        with pytest.raises(BackendError) as info:
            await run(backend, GenerateRequest(array("i", [5] * 100), SamplingParams(max_new_tokens=4)))
        assert info.value.status == 400 and "context length" in str(info.value)
        running.faults.fail_next_requests(1)
        with pytest.raises(BackendError) as info:
            await run(backend, request())
        assert info.value.status == 502
        running.faults.drop_next_stream(after_tokens=2)
        with pytest.raises(BackendError) as info:
            await run(backend, request())
        assert info.value.status == 502


@pytest.mark.parametrize("case", ["sglang", "vllm-generate", "llamacpp"])
async def test_sim_stalled_engine_times_out(case: str, tokenizer: Any) -> None:
    # The read timeout bounds the wait between tokens, so it also bounds the first token's: on a loaded
    # machine 0.2 s was sometimes less than the simulated engine took to start, and the test failed with
    # no token received. 1 s keeps the stall's timeout quick and the start well inside it.
    async with sim_backend(tokenizer, case, EngineOptions(read_timeout=1.0)) as (running, backend):
        running.engine.script(LONG)
        req = request(max_new_tokens=1000)
        received: list[int] = []
        with pytest.raises(BackendError) as info:
            async with backend.open_generation(req) as gen:
                async for event in gen:
                    if isinstance(event, TokenDelta):
                        received.extend(event.token_ids)
                        running.faults.stall()  # no token for longer than the read timeout
        assert info.value.status == 504 and len(received) >= 1
        running.faults.clear_stall()


async def test_sim_unreachable_engine() -> None:
    backend = SGLangBackend("http://127.0.0.1:9", EngineOptions(connect_timeout=1.0))
    with pytest.raises(BackendError) as info:
        await run(backend, request())
    assert info.value.status == 502
    await backend.aclose()
