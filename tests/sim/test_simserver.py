"""The simulated engine served over real HTTP: SGLang, vLLM and llama.cpp wire formats, faults."""

from __future__ import annotations

import base64
import io
import json
import logging
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest
import trio
from _asgi import open_sim_client
from _asgi import open_sim_server as open_real_sim
from trio.testing import MockClock

from actorproxy.cli import build_parser, sim_settings_from_args
from actorproxy.config import EngineSettings
from actorproxy.runtime.backends import sim_config
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.sim.server import RunningSim, SimServerSettings, open_sim_server, served_engine
from actorproxy.tokenization.tokenizer import ChatTokenizer

LONG = list(range(1000, 1400))  # a scripted output long enough to interrupt
INTERVAL = 0.001
Sim = tuple[RunningSim, httpx.AsyncClient]


@asynccontextmanager
async def serve(
    tokenizer: ChatTokenizer, *, interval: float = INTERVAL, seed: int = 5, **settings: Any
) -> AsyncIterator[tuple[RunningSim, httpx.AsyncClient]]:
    """The simulator's app in-process: under the tests' MockClock each token comes at an exact time."""
    engine = SimEngine(tokenizer, SimConfig(seed=seed, token_interval=interval, weight_version="default"))
    config = SimServerSettings(port=0, **({"enable_return_routed_experts": True} | settings))
    async with open_sim_client(engine, config) as pair:
        yield pair


@pytest.fixture
async def sim(tokenizer: ChatTokenizer) -> AsyncIterator[tuple[RunningSim, httpx.AsyncClient]]:
    async with serve(tokenizer) as pair:
        yield pair


@pytest.fixture
def prompt(tokenizer: ChatTokenizer) -> list[int]:
    return list(tokenizer.encode(tokenizer.render([{"role": "user", "content": "Tell me something."}])))


async def until(predicate: Callable[[], bool]) -> None:
    """Wait until ``predicate`` holds, checked four times per token interval of virtual time.

    The state changes in the server's tasks, which offer no event; under MockClock this
    returns at an exact time, before the next token comes (so what follows is exact too).
    """
    with trio.fail_after(1000 * INTERVAL):
        while not predicate():  # noqa: ASYNC110
            await trio.sleep(INTERVAL / 4)


def emitted(running: RunningSim, rid: str) -> int:
    """Tokens the engine emitted for ``rid`` so far (0 before it started)."""
    try:
        return len(running.engine.stats(rid).token_ids)
    except KeyError:
        return 0


def events(text: str) -> list[Any]:
    frames = [block[len("data: ") :] for block in text.split("\n\n") if block.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [json.loads(frame) for frame in frames[:-1]]


async def stream_events(http: httpx.AsyncClient, path: str, body: dict[str, Any]) -> AsyncIterator[Any]:
    async with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                yield line[6:] if line[6:] == "[DONE]" else json.loads(line[6:])


# -- SGLang ----------------------------------------------------------------------------


async def test_sglang_generate_matches_the_engine(sim: Sim, prompt: list[int], autojump_clock: MockClock) -> None:
    running, http = sim
    tok = running.engine.tokenizer
    body = {"rid": "a" * 32, "input_ids": prompt, "return_logprob": True, "sampling_params": {"max_new_tokens": 256}}
    data = (await http.post("/generate", json=body)).json()
    stats = running.engine.stats("a" * 32)
    meta = data["meta_info"]
    assert data["output_ids"] == list(stats.token_ids) and data["output_ids"][-1] == tok.eot_token_id
    pairs = zip(stats.logprobs, stats.token_ids, strict=True)
    assert meta["output_token_logprobs"] == [[lp, i, None] for lp, i in pairs]
    assert meta["finish_reason"] == {"type": "stop", "matched": tok.eot_token_id}
    assert (meta["id"], meta["prompt_tokens"]) == ("a" * 32, len(prompt))
    assert meta["completion_tokens"] == len(stats.token_ids)
    assert meta["weight_version"] == "default" and meta["input_token_logprobs"] == []
    assert data["text"] == tok.decode(stats.token_ids[:-1])  # special tokens skipped, stop token trimmed
    # SGLang's server default for max_new_tokens is 128.
    running.engine.script(LONG)
    data = (await http.post("/generate", json={"input_ids": prompt})).json()
    assert data["meta_info"]["finish_reason"] == {"type": "length", "length": 128} and len(data["output_ids"]) == 128


async def test_sglang_cumulative_and_incremental_streams_agree(
    tokenizer: ChatTokenizer, prompt: list[int], autojump_clock: MockClock
) -> None:
    body = {"input_ids": prompt, "stream": True, "return_logprob": True, "sampling_params": {"max_new_tokens": 64}}
    outputs = []
    for incremental in (False, True):
        async with serve(tokenizer, incremental_streaming_output=incremental) as (running, http):
            frames = events((await http.post("/generate", json=body)).text)
            stats = running.engine.stats(frames[0]["meta_info"]["id"])
        assert all(f["meta_info"]["finish_reason"] is None for f in frames[:-1])
        assert frames[-1]["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        if incremental:
            ids = [i for f in frames for i in f["output_ids"]]
            lps = [e[0] for f in frames for e in f["meta_info"]["output_token_logprobs"]]
            text = "".join(f["text"] for f in frames)
        else:
            for before, after in zip(frames, frames[1:], strict=False):
                assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
            for frame in frames:  # every event holds every id and logprob entry so far
                entries, n = frame["meta_info"]["output_token_logprobs"], len(frame["output_ids"])
                assert entries == [[lp, i, None] for lp, i in zip(stats.logprobs[:n], stats.token_ids[:n], strict=True)]
            ids, text = frames[-1]["output_ids"], frames[-1]["text"]
            lps = [e[0] for e in frames[-1]["meta_info"]["output_token_logprobs"]]
        assert len(frames) == len(ids)  # one event per token, the finish rides on the last
        assert ids == list(stats.token_ids) and lps == list(stats.logprobs)
        outputs.append((ids, lps, text))
    assert outputs[0] == outputs[1]


async def test_sglang_abort_by_rid_prefix_mid_stream(
    sim: Sim, prompt: list[int]
, autojump_clock: MockClock) -> None:
    running, http = sim
    running.engine.script(LONG, LONG)
    parent, child = "f" * 32, "f" * 32 + "-child"
    got: dict[str, list[Any]] = {parent: [], child: []}

    async def consume(rid: str) -> None:
        body = {"rid": rid, "input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 400}}
        async for frame in stream_events(http, "/generate", body):
            got[rid].append(frame)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume, parent)
        nursery.start_soon(consume, child)
        await until(lambda: len(got[parent]) >= 3 and len(got[child]) >= 1)
        # Not a running rid: SGLang ignores it (the prefix match happens only for a known rid).
        assert (await http.post("/abort_request", json={"rid": "f" * 8})).status_code == 200
        assert not running.engine.stats(parent).aborted and not running.engine.stats(child).aborted
        response = await http.post("/abort_request", json={"rid": parent})
        assert response.status_code == 200 and response.content == b""
    for rid in (parent, child):
        frames, stats = got[rid][:-1], running.engine.stats(rid)
        assert got[rid][-1] == "[DONE]"
        assert frames[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        # Both were aborted at 3 ms, when each had made its third token (exact under MockClock).
        assert frames[-1]["output_ids"] == list(stats.token_ids) and len(stats.token_ids) == 3
        assert stats.aborted and stats.finish_reason == "abort"


async def test_sglang_non_streaming_abort_answers_200_with_partial_output(
    sim: Sim, prompt: list[int]
, autojump_clock: MockClock) -> None:
    running, http = sim
    running.engine.script(LONG)
    result: list[httpx.Response] = []

    async def generate() -> None:
        body = {"rid": "b" * 32, "input_ids": prompt, "sampling_params": {"max_new_tokens": 400}}
        result.append(await http.post("/generate", json=body))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(generate)
        await until(lambda: emitted(running, "b" * 32) > 2)
        await http.post("/abort_request", json={"rid": "", "abort_all": True})
    data = result[0].json()
    assert result[0].status_code == 200 and data["meta_info"]["finish_reason"]["type"] == "abort"
    assert data["output_ids"] == list(running.engine.stats("b" * 32).token_ids) == LONG[:3]


async def test_prompt_logprobs_sglang_and_vllm(sim: Sim, prompt: list[int], autojump_clock: MockClock) -> None:
    running, http = sim
    expected = await running.engine.prompt_logprobs(prompt)
    body = {"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0}
    meta = (await http.post("/generate", json=body | {"sampling_params": {"max_new_tokens": 2}})).json()["meta_info"]
    assert meta["input_token_logprobs"] == [[lp, i, None] for lp, i in zip(expected, prompt, strict=True)]
    assert meta["input_token_logprobs"][0][0] is None
    body = {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0}
    choice = (await http.post("/v1/completions", json=body)).json()["choices"][0]
    assert choice["prompt_logprobs"][0] is None
    for entry, token, lp in zip(choice["prompt_logprobs"][1:], prompt[1:], expected[1:], strict=True):
        text = running.engine.tokenizer.decode([token])
        assert entry == {str(token): {"logprob": lp, "rank": 1, "decoded_token": text}}
    streamed = await http.post("/v1/completions", json=body | {"stream": True, "prompt_logprobs": 1})
    assert streamed.status_code == 400 and "stream" in streamed.json()["error"]["message"]


# -- vLLM ------------------------------------------------------------------------------


async def test_vllm_generate_non_streaming_and_streaming(
    sim: Sim, prompt: list[int]
, autojump_clock: MockClock) -> None:
    running, http = sim
    body = {"request_id": "r1", "token_ids": prompt, "sampling_params": {"max_tokens": 64, "logprobs": 0}}
    data = (await http.post("/inference/v1/generate", json=body)).json()
    stats = running.engine.stats("r1")
    choice = data["choices"][0]
    assert data["request_id"] == "generate-tokens-r1"
    assert choice["token_ids"] == list(stats.token_ids) and choice["finish_reason"] == "stop"
    content = choice["logprobs"]["content"]
    assert [(e["token_id"], e["logprob"]) for e in content] == list(zip(stats.token_ids, stats.logprobs, strict=True))
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": len(stats.token_ids)}]
    assert data["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(stats.token_ids),
                             "total_tokens": len(prompt) + len(stats.token_ids)}
    body |= {"request_id": "r2", "stream": True, "stream_options": {"include_usage": True}}
    chunks = events((await http.post("/inference/v1/generate", json=body)).text)
    *token_chunks, usage = chunks
    assert [i for c in token_chunks for i in c["choices"][0]["token_ids"]] == list(stats.token_ids)
    assert all(c["choices"][0]["finish_reason"] is None for c in token_chunks[:-1])
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert token_chunks[-1]["choices"][0]["weight_versions"]
    # A plain token's chunk as vLLM 0.32 writes it: its nulls, the entry's rank, the sampled token alone listed.
    first = token_chunks[0]
    assert (first["usage"], first["output_mode"]) == (None, "tokens")
    assert {k: first["choices"][0][k] for k in ("stop_reason", "routed_experts", "sampling_mask", "weight_versions")} \
        == dict.fromkeys(("stop_reason", "routed_experts", "sampling_mask", "weight_versions"))
    [entry] = first["choices"][0]["logprobs"]["content"]
    assert set(entry) == {"token_id", "logprob", "rank", "top_logprobs"}
    assert entry["top_logprobs"] == [{key: entry[key] for key in ("token_id", "logprob", "rank")}]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(stats.token_ids)


async def test_vllm_completions_fallback(sim: Sim, prompt: list[int], autojump_clock: MockClock) -> None:
    running, http = sim
    running.engine.script(LONG)
    body = {"prompt": prompt, "logprobs": 0, "return_token_ids": True, "request_id": "c1"}
    data = (await http.post("/v1/completions", json=body)).json()
    choice, stats = data["choices"][0], running.engine.stats("c1")
    assert data["id"] == "cmpl-c1" and data["object"] == "text_completion"
    assert choice["token_ids"] == LONG[:16] == list(stats.token_ids)  # vLLM's default max_tokens is 16
    assert choice["finish_reason"] == "length" and choice["prompt_token_ids"] == prompt
    assert choice["logprobs"]["token_logprobs"] == list(stats.logprobs)
    stream = body | {"stream": True, "request_id": "c2", "max_tokens": 256}
    chunks = events((await http.post("/v1/completions", json=stream)).text)
    firsts = [c["choices"][0] for c in chunks]
    assert firsts[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in firsts[1:])
    ids = [i for c in firsts for i in c["token_ids"]]
    assert ids == list(running.engine.stats("c2").token_ids) and firsts[-1]["finish_reason"] == "stop"
    assert "".join(c["text"] for c in firsts) == running.engine.tokenizer.decode(ids[:-1])


async def test_vllm_without_generate_endpoint(
    tokenizer: ChatTokenizer, prompt: list[int], autojump_clock: MockClock
) -> None:
    async with serve(tokenizer, vllm_generate_endpoint=False) as (_, http):
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 4}}
        assert (await http.post("/inference/v1/generate", json=body)).status_code == 403  # as vLLM 0.32
        response = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
        assert response.status_code == 200 and len(response.json()["choices"][0]["text"]) > 0


async def test_vllm_abort_pause_and_resume(sim: Sim, prompt: list[int], autojump_clock: MockClock) -> None:
    running, http = sim
    running.engine.script(LONG, LONG)
    got: dict[str, list[Any]] = {"v1": [], "v2": []}

    async def consume(rid: str) -> None:
        body = {"request_id": rid, "token_ids": prompt, "stream": True, "sampling_params": {"max_tokens": 300}}
        async for frame in stream_events(http, "/inference/v1/generate", body):
            got[rid].append(frame)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume, "v1")
        await until(lambda: len(got["v1"]) >= 2)
        # mode=keep freezes the running request and holds new ones until /resume.
        assert (await http.post("/pause", params={"mode": "keep"})).json() == {"status": "paused"}
        assert (await http.get("/is_paused")).json() == {"is_paused": True} and running.engine.paused
        nursery.start_soon(consume, "v2")
        await until(lambda: "v2" in running.state.records)
        assert running.state.records["v2"].status == "waiting" and "v2" not in running.engine._history
        assert (await http.post("/resume")).json() == {"status": "resumed"}
        await until(lambda: len(got["v2"]) >= 1)
        await http.post("/inference/v1/abort_requests", json={"request_ids": ["generate-tokens-v1", "v2"]})
    for rid in ("v1", "v2"):
        chunks, stats = got[rid][:-1], running.engine.stats(rid)
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort" and stats.aborted
        assert [i for c in chunks for i in c["choices"][0]["token_ids"]] == list(stats.token_ids)
        assert len(stats.token_ids) == {"v1": 3, "v2": 1}[rid]  # 2 before the pause, 1 after it


# -- llama.cpp ----------------------------------------------------------------------------


async def test_llamacpp_completion(sim: Sim, prompt: list[int], autojump_clock: MockClock) -> None:
    running, http = sim
    tok = running.engine.tokenizer
    body = {"prompt": prompt, "n_predict": 256, "n_probs": 1, "return_tokens": True, "cache_prompt": True,
            "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}
    response = await http.post("/completion", json=body)
    data, stats = response.json(), running.engine.stats(response.headers["X-Sim-Rid"])
    assert data["tokens"] == list(stats.token_ids) and data["stop"] is True and data["stop_type"] == "eos"
    assert data["content"] == tok.decode(stats.token_ids[:-1])  # the EOG token renders empty
    assert [p["logprob"] for p in data["completion_probabilities"]] == list(stats.logprobs)
    assert [p["id"] for p in data["completion_probabilities"]] == list(stats.token_ids)
    response = await http.post("/completion", json=body | {"stream": True, "n_predict": 5})
    lines = [json.loads(b[6:]) for b in response.text.split("\n\n") if b.startswith("data: ")]
    assert "[DONE]" not in response.text and [line["stop"] for line in lines] == [False] * 5 + [True]
    assert lines[-1]["stop_type"] == "limit" and [line["tokens"][0] for line in lines[:-1]] == list(stats.token_ids[:5])


async def test_llamacpp_reports_the_ignore_eos_it_runs_with(tokenizer: ChatTokenizer, prompt: list[int],
                                                              autojump_clock: MockClock) -> None:
    """``generation_settings.ignore_eos`` is the request's, else the server's own setting, as llama-server says."""
    for server, asked, runs in ((False, None, False), (False, True, True), (True, None, True)):
        engine = SimEngine(tokenizer, SimConfig(token_interval=INTERVAL, ignore_eos=server))
        async with open_sim_client(engine, SimServerSettings(port=0)) as (_, http):
            body = {"prompt": prompt, "n_predict": 4} | ({} if asked is None else {"ignore_eos": asked})
            data = (await http.post("/completion", json=body)).json()
        assert data["generation_settings"]["ignore_eos"] is runs, (server, asked)


async def test_a_minimum_above_the_budget_is_refused_as_each_engine_words_it(sim: Sim, prompt: list[int]) -> None:
    """vLLM's and SGLang's sampling checks: ``min_tokens`` (``min_new_tokens``) above the budget is a 400."""
    _, http = sim
    sglang = await http.post("/generate", json={"input_ids": prompt,
                                                "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 5}})
    vllm = await http.post("/inference/v1/generate", json={"token_ids": prompt,
                                                           "sampling_params": {"max_tokens": 4, "min_tokens": 5}})
    completions = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "min_tokens": 5})
    assert [r.status_code for r in (sglang, vllm, completions)] == [400, 400, 400]
    assert sglang.json()["error"]["message"] == "min_new_tokens must be in [0, max_new_tokens(4)], got 5."
    assert vllm.json()["error"]["message"] == completions.json()["error"]["message"] == (
        "min_tokens must be less than or equal to max_tokens=4, got 5.")
    fits = await http.post("/generate", json={"input_ids": prompt,
                                              "sampling_params": {"max_new_tokens": 4, "min_new_tokens": 4}})
    assert fits.status_code == 200, fits.text


# -- faults ---------------------------------------------------------------------------------


async def test_fault_http_500_and_unhealthy(sim: Sim, prompt: list[int], autojump_clock: MockClock) -> None:
    running, http = sim
    running.faults.fail_next_requests(2)
    small = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}}
    first = await http.post("/generate", json=small)
    second = await http.post("/inference/v1/generate", json={"token_ids": prompt, "sampling_params": {"max_tokens": 2}})
    third = await http.post("/generate", json=small)
    assert (first.status_code, second.status_code, third.status_code) == (500, 500, 200)
    assert "error" in first.json() and second.json()["error"]["code"] == 500
    assert (await http.get("/health")).status_code == 200
    assert (await http.post("/sim/faults", json={"unhealthy": True, "fail_next": 1})).json()["fail_next"] == 1
    assert (await http.get("/health")).status_code == 503
    assert (await http.post("/generate", json=small)).status_code == 500
    await http.post("/sim/faults", json={"clear": True})
    assert (await http.get("/health")).status_code == 200
    bad = await http.post("/sim/faults", json={"explode": True})
    assert bad.status_code == 400


async def test_fault_dropped_connection(sim: Sim, prompt: list[int], autojump_clock: MockClock) -> None:
    running, http = sim
    running.engine.script(LONG)
    running.faults.drop_next_stream(after_tokens=3)
    frames: list[Any] = []
    body = {"rid": "d" * 32, "input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 400}}
    with pytest.raises(httpx.RemoteProtocolError):
        async for frame in stream_events(http, "/generate", body):
            frames.append(frame)
    assert [f["output_ids"] for f in frames] == [LONG[:1], LONG[:2], LONG[:3]]
    record, stats = running.state.records["d" * 32], running.engine.stats("d" * 32)
    assert record.status == "dropped" and record.sent_tokens == 3
    assert stats.cancelled and stats.token_ids[:3] == tuple(LONG[:3])
    # The fault fired once: the next stream is whole.
    frames = events((await http.post("/generate", json=body | {"rid": "e" * 32})).text)
    assert frames[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert running.state.records["e" * 32].status == "finished"


async def test_fault_stall(sim: Sim, prompt: list[int], autojump_clock: MockClock) -> None:
    running, http = sim
    running.engine.script([5, 6, 7, 8], [5, 6, 7, 8])
    got: list[Any] = []

    async def consume() -> None:
        body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 10}}
        async for frame in stream_events(http, "/generate", body):
            got.append(frame)

    running.faults.stall()  # until cleared
    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume)
        await until(lambda: running.engine.running == 1)
        assert got == [] and (await http.get("/sim/faults")).json()["stalled"] is True
        running.faults.clear_stall()
    assert got[-2]["output_ids"] == [5, 6, 7, 8] and got[-1] == "[DONE]"
    # A timed stall ends by itself.
    await http.post("/sim/faults", json={"stall_seconds": 0.05})
    stalled_at = trio.current_time()
    with trio.fail_after(1):  # virtual time: a bound should the stall never end
        data = (await http.post("/generate", json={"input_ids": prompt})).json()
    assert data["output_ids"] == [5, 6, 7, 8] and not running.faults.stalled
    # The 50 ms stall, then the four tokens one interval apart.
    assert trio.current_time() - stalled_at == pytest.approx(0.05 + 4 * INTERVAL)


async def test_client_disconnect_aborts_and_is_recorded(
    sim: Sim, prompt: list[int]
, autojump_clock: MockClock) -> None:
    running, http = sim
    running.engine.script(LONG)
    body = {"rid": "c" * 32, "input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 400}}
    count = 0
    async for _ in stream_events(http, "/generate", body):
        count += 1
        if count == 2:
            break  # leaves the stream: httpx closes the connection
    await until(lambda: running.state.records["c" * 32].status == "disconnected")
    stats = running.engine.stats("c" * 32)
    # The server noticed the hang-up before the next token was due: exactly the two read.
    assert stats.cancelled and not stats.aborted and stats.finish_reason == "abort" and len(stats.token_ids) == 2
    listed = (await http.get(f"/sim/requests/{'c' * 32}")).json()
    assert listed["status"] == "disconnected" and listed["cancelled"] is True


# -- pause, weights, routed experts, routing ------------------------------------------------------


async def test_sglang_pause_modes_and_weight_version_on_tokens(
    sim: Sim, prompt: list[int]
, autojump_clock: MockClock) -> None:
    running, http = sim
    running.engine.script(LONG, LONG, LONG)
    got: list[Any] = []

    async def consume(rid: str) -> None:
        body = {"rid": rid, "input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 400}}
        async for frame in stream_events(http, "/generate", body):
            got.append(frame)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(consume, "1" * 32)
        await until(lambda: len(got) >= 2)
        # in_place: the running request freezes; new weights apply to the tokens after /continue.
        await http.post("/pause_generation", json={"mode": "in_place"})
        update = await http.post("/update_weight_version", json={"new_version": "step-1"})
        assert update.json()["success"] is True
        assert (await http.get("/get_weight_version")).json() == {"weight_version": "step-1"}
        await http.post("/continue_generation")
    meta = got[-2]["meta_info"]
    versions = meta["weight_versions"]
    # Paused after the second token: the other 398 carry the new version.
    assert versions == [{"version": "default", "start": 0, "end": 2}, {"version": "step-1", "start": 2, "end": 400}]
    assert meta["weight_version"] == "step-1" and meta["finish_reason"]["type"] == "length"
    # abort mode: running requests end with abort, new ones wait for /continue_generation.
    results: list[Any] = []

    async def generate(rid: str) -> None:
        body = {"rid": rid, "input_ids": prompt, "sampling_params": {"max_new_tokens": 400}}
        results.append((await http.post("/generate", json=body)).json())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(generate, "2" * 32)
        await until(lambda: running.engine.running == 1)
        await http.post("/pause_generation", json={"mode": "abort"})
        nursery.start_soon(generate, "3" * 32)
        await until(lambda: len(results) == 1 and "3" * 32 in running.state.records)
        assert results[0]["meta_info"]["finish_reason"]["type"] == "abort" and results[0]["output_ids"] == []
        assert running.state.records["3" * 32].status == "waiting"
        await http.post("/continue_generation")
    assert results[1]["output_ids"] == LONG[:400] and results[1]["meta_info"]["weight_version"] == "step-1"


async def test_routed_experts(sim: Sim, prompt: list[int], autojump_clock: MockClock) -> None:
    running, http = sim
    cfg = running.engine.config
    body = {"input_ids": prompt, "return_routed_experts": True, "sampling_params": {"max_new_tokens": 8}}
    data = (await http.post("/generate", json=body)).json()
    raw = base64.b64decode(data["meta_info"]["routed_experts"])
    rows = len(prompt) + len(data["output_ids"]) - 1
    values = struct.unpack(f"<{len(raw) // 4}i", raw)
    assert len(values) == rows * cfg.num_layers * cfg.moe_topk and all(0 <= v < cfg.num_experts for v in values)
    numpy = pytest.importorskip("numpy")
    choice = (await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8})).json()["choices"][0]
    array = numpy.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
    assert array.shape == (rows, cfg.num_layers, cfg.moe_topk) and array.dtype == numpy.int32
    assert array.reshape(-1).tolist() == list(values)  # same prompt, same output, same routing


async def test_routed_experts_need_the_server_flag(
    tokenizer: ChatTokenizer, prompt: list[int], autojump_clock: MockClock
) -> None:
    async with serve(tokenizer, enable_return_routed_experts=False) as (_, http):
        body = {"input_ids": prompt, "return_routed_experts": True}
        response = await http.post("/generate", json=body)
        assert response.status_code == 400 and "enable-return-routed-experts" in response.json()["error"]["message"]
        choice = (await http.post("/v1/completions", json={"prompt": prompt})).json()["choices"][0]
        assert choice["routed_experts"] is None


async def test_routing_key_header_reaches_the_engine(
    sim: Sim, prompt: list[int]
, autojump_clock: MockClock) -> None:
    running, http = sim
    running.engine.script([7, 8, 9], routing_key="session-1")
    headers = {"X-SMG-Routing-Key": "session-1"}
    data = (await http.post("/generate", json={"rid": "k" * 32, "input_ids": prompt}, headers=headers)).json()
    assert data["output_ids"] == [7, 8, 9] and running.engine.stats("k" * 32).routing_key == "session-1"


async def test_info_routes(sim: Sim, autojump_clock: MockClock) -> None:
    running, http = sim
    info = (await http.get("/get_model_info")).json()
    assert info["model_path"] == "actorproxy-sim" and info["is_generation"] is True
    assert info["tokenizer_path"] == running.engine.tokenizer.name and info["weight_version"] == "default"
    models = (await http.get("/v1/models")).json()
    assert models["data"][0]["max_model_len"] == running.engine.config.max_model_len
    await http.post("/update_weight_version", json={"new_version": "v9"})
    assert (await http.get("/weight_info")).json() == {"weight_version": "v9"}


async def test_bad_requests_get_400_json(sim: Sim, prompt: list[int], autojump_clock: MockClock) -> None:
    _, http = sim
    cases = [
        ("/generate", {"sampling_params": {"max_new_tokens": 3}}, "input_ids"),
        ("/generate", {"text": "hello"}, "token-in only"),
        ("/generate", {"input_ids": [1, "x"]}, "token ids"),
        ("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ("/generate", {"input_ids": prompt, "sampling_params": {"stop": ["\n"]}}, "stop strings"),
        ("/inference/v1/generate", {"token_ids": prompt, "sampling_params": {"temperature": "hot"}}, "temperature"),
        ("/v1/completions", {"prompt": "hello"}, "token-in only"),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 0}, "max_tokens"),
        ("/completion", {"prompt": []}, "prompt"),
        ("/generate", {"input_ids": [0] * 40000}, "context length"),
    ]
    for path, body, words in cases:
        response = await http.post(path, json=body)
        assert response.status_code == 400, (path, body)
        assert words in json.dumps(response.json()), (path, response.json())
    # SGLang reports a stream's engine errors in the stream.
    frames = events((await http.post("/generate", json={"input_ids": [0] * 40000, "stream": True})).text)
    assert "context length" in frames[-1]["error"]["message"]
    for path in ("/generate", "/inference/v1/generate", "/completion"):
        response = await http.post(path, content=b"{not json")
        assert response.status_code == 400 and "not valid JSON" in json.dumps(response.json())


def test_sim_cli_flags() -> None:
    args = build_parser().parse_args(
        ["sim", "--port", "31000", "--token-interval", "0.5", "--seed", "3", "--incremental-streaming-output",
         "--enable-return-routed-experts", "--weight-version", "w0", "--max-model-len", "4096"]
    )
    settings = sim_settings_from_args(args)
    engine = served_engine(token_interval=0.5, seed=3, weight_version="w0", max_model_len=4096)
    assert settings == SimServerSettings(port=31000, engine=engine, incremental_streaming_output=True,
                                         enable_return_routed_experts=True)
    assert sim_settings_from_args(build_parser().parse_args(["sim"])) == SimServerSettings()
    args = build_parser().parse_args(
        ["sim", "--reply-tokens", "2000", "--stream-interval", "4", "--decode-steps", "--model-path", "m"]
    )
    config = sim_settings_from_args(args).engine_config()
    assert (config.reply_tokens, config.stream_interval, config.decode_steps, config.model_id) == (2000, 4, True, "m")


def test_sim_engine_defaults_are_the_engines() -> None:
    """The server's engine settings are :class:`SimConfig`'s own (one default differs: SGLang's version label)."""
    assert SimServerSettings().engine == attrs.evolve(SimConfig(), weight_version="default")
    assert SimServerSettings(model_path="m").engine_config().model_id == "m"
    with pytest.raises(ValueError, match="model_path"):
        SimServerSettings(engine=served_engine(model_id="other"))


def test_the_proxys_built_in_engine_defaults_are_the_engines() -> None:
    """``actorproxy run --backend sim`` builds :class:`SimConfig`'s own defaults (one differs: a token every
    10 ms), and each ``--sim-*`` setting is the engine field of its name."""
    assert sim_config(EngineSettings()) == attrs.evolve(SimConfig(), token_interval=0.01)
    named = {name.removeprefix("sim_") for name in attrs.fields_dict(EngineSettings) if name.startswith("sim_")}
    assert named <= set(attrs.fields_dict(SimConfig))
    changed = EngineSettings(sim_token_interval=0.5, sim_decode_steps=True, sim_seed=3, sim_tool_call_probability=0.1,
                             sim_followup_tool_call_probability=0.2, sim_tool_calls='{"name": "t", "arguments": {}}')
    engine = sim_config(changed)
    assert engine.tool_calls == (("t", "{}"),)  # (given as JSON text)
    named.discard("tool_calls")
    assert {name: getattr(engine, name) for name in named} == {name: getattr(changed, "sim_" + name) for name in named}


async def test_reply_tokens_and_stream_interval(
    tokenizer: ChatTokenizer, prompt: list[int], autojump_clock: MockClock
) -> None:
    """``--reply-tokens 7 --stream-interval 3``: seven filler tokens and the end-of-turn token, streamed
    three a time (the finish rides on the last burst), on each token's own schedule."""
    engine = SimEngine(tokenizer, SimConfig(token_interval=INTERVAL, reply_tokens=7, stream_interval=3))
    async with open_sim_client(engine, SimServerSettings(port=0, incremental_streaming_output=True)) as (_, http):
        body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 100}}
        start = trio.current_time()
        frames, times = [], []
        async for frame in stream_events(http, "/generate", body):
            if frame == "[DONE]":
                break
            frames.append(frame)
            times.append(round((trio.current_time() - start) / INTERVAL))
        assert [len(f["output_ids"]) for f in frames] == [3, 3, 2] and times == [3, 6, 8]
        assert "".join(f["text"] for f in frames).split() == ["so"] * 7
        assert frames[-1]["meta_info"]["finish_reason"]["type"] == "stop"
        # max_tokens still cuts the reply (llama.cpp: one event a token, a burst in one write)
        body = {"prompt": prompt, "stream": True, "n_predict": 5}
        response = await http.post("/completion", json=body)
        lines = [json.loads(b[6:]) for b in response.text.split("\n\n") if b.startswith("data: ")]
        assert "".join(line["content"] for line in lines).split() == ["so"] * 5
        assert len(lines) == 6 and lines[-1]["stop_type"] == "limit"


async def test_served_over_a_real_socket_drops_and_shuts_down_whole(
    tokenizer: ChatTokenizer, prompt: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    """What ``actorproxy sim`` serves (:func:`open_sim_server`, a real port): an injected drop closes the
    connection mid-body and logs no error; a shutdown with a stream in flight aborts it, and the stream still
    ends whole (its abort event, then ``[DONE]``) before the server stops."""
    engine = SimEngine(tokenizer, SimConfig(token_interval=INTERVAL, weight_version="default"))
    engine.script(LONG, LONG)
    frames: list[Any] = []
    body = {"rid": "d" * 32, "input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 400}}
    async with httpx.AsyncClient(timeout=30) as http, trio.open_nursery() as nursery:
        async with open_sim_server(SimServerSettings(port=0), engine=engine) as running:
            running.faults.drop_next_stream(after_tokens=3)
            with pytest.raises(httpx.RemoteProtocolError):
                async for frame in stream_events(http, running.url + "/generate", body):
                    frames.append(frame)
            assert len(frames) == 3 and running.state.records["d" * 32].status == "dropped"
            frames.clear()
            two = trio.Event()

            async def consume() -> None:
                async for frame in stream_events(http, running.url + "/generate", body | {"rid": "e" * 32}):
                    frames.append(frame)
                    if len(frames) == 2:
                        two.set()

            nursery.start_soon(consume)
            await two.wait()
        assert running.state.records["e" * 32].status == "aborted"
    assert frames[-1] == "[DONE]" and frames[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(frames) < len(LONG)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/completion"])
async def test_a_stream_answers_its_head_at_once_over_a_socket(
    tokenizer: ChatTokenizer, prompt: list[int], path: str, autojump_clock: MockClock
) -> None:
    """Served over a socket, a streamed generation's head goes out when the stream starts, as the engines'
    servers send it, not with its first token (due only after a long prefill here); the events follow on
    their schedule, written straight to the socket."""
    engine = SimEngine(tokenizer, SimConfig(token_interval=INTERVAL, prefill_latency=10.0, weight_version="default"))
    engine.script([5, 6, 7])
    body = {"input_ids": prompt, "prompt": prompt, "stream": True, "max_tokens": 10, "return_token_ids": True}
    async with open_real_sim(engine) as running, httpx.AsyncClient(base_url=running.url, timeout=60) as http:
        start = trio.current_time()
        async with http.stream("POST", path, json=body) as response:
            assert response.status_code == 200 and trio.current_time() - start < 1.0
            text = (await response.aread()).decode()
        assert trio.current_time() - start == pytest.approx(10.0 + 3 * INTERVAL)
    frames = [json.loads(b[6:]) for b in text.split("\n\n") if b.startswith("data: {")]
    if path == "/generate":  # SGLang's events are cumulative
        assert [f["output_ids"] for f in frames] == [[5], [5, 6], [5, 6, 7]]
    else:
        ids = [i for f in frames for i in (f["tokens"] if "tokens" in f else f["choices"][0]["token_ids"])]
        assert ids == [5, 6, 7]
