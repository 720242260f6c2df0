"""The vLLM client decides what a server has from what the server says: its ``/openapi.json``, a 403/404/405.

vLLM 0.32 on its default flags lists no ``/inference/v1/generate`` and answers it 403 ("Scale-out
endpoints are disabled"); without ``VLLM_SERVER_DEV_MODE=1`` it has no pause, resume, abort or
version routes. ``actorproxy sim`` imitates both (``vllm_generate_endpoint``, ``vllm_dev_mode``) on
a real port; the scripted engines of ``test_engine_clients`` play servers without a route list.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import trio
from test_engine_clients import DONE, EOT, IDS, LPS, PROMPT, USAGE, Engine, flat, request, run, stream, vc

from actorproxy.engines.base import BackendError, GenerateFinish
from actorproxy.engines.vllm.client import VLLMBackend
from actorproxy.sim.server import RunningSim, SimServerSettings, open_sim_server, served_engine
from actorproxy.sim.vllm_routes import SCALE_OUT_DISABLED
from actorproxy.tokenization.tokenizer import ChatTokenizer

LONG = [1000 + i for i in range(1000)] + [EOT]
DEFAULT_FLAGS = {"vllm_generate_endpoint": False, "vllm_dev_mode": False}
CLIENT_LOG = "actorproxy.engines.vllm.client"


@asynccontextmanager
async def vllm(tokenizer: ChatTokenizer, **flags: Any) -> AsyncIterator[tuple[RunningSim, VLLMBackend]]:
    settings = SimServerSettings(port=0, engine=served_engine(token_interval=0.002), **flags)
    async with open_sim_server(settings, tokenizer=tokenizer) as running:
        backend = VLLMBackend(running.url)
        try:
            yield running, backend
        finally:
            await backend.aclose()


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == CLIENT_LOG]


async def test_sim_imitates_vllm_032_default_flags(tokenizer: ChatTokenizer) -> None:
    async with vllm(tokenizer, **DEFAULT_FLAGS) as (running, _), httpx.AsyncClient(base_url=running.url) as http:
        paths = set((await http.get("/openapi.json")).json()["paths"])
        assert "/v1/completions" in paths and "/inference/v1/generate" not in paths and "/pause" not in paths
        for path in ("/inference/v1/generate", "/inference/v1/abort_requests"):
            answer = await http.post(path, json={"token_ids": list(PROMPT), "sampling_params": {}})
            assert answer.status_code == 403 and answer.json()["error"]["message"] == SCALE_OUT_DISABLED
        for path in ("/pause", "/resume", "/abort_requests", "/update_weight_version"):
            assert (await http.post(path, json={})).status_code == 404
        assert (await http.get("/weight_info")).status_code == 404


async def test_default_vllm_serves_through_completions(
    tokenizer: ChatTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, CLIENT_LOG)
    async with vllm(tokenizer, **DEFAULT_FLAGS) as (running, backend):
        info = await backend.model_info()  # start-up: the route list is read, the API chosen
        assert backend.api == "completions" and info.weight_version == "default"
        running.engine.script([11, 22, 33, EOT], [11, 22, EOT])
        for expected in ([11, 22, 33, EOT], [11, 22, EOT]):
            req = request(seed=3)
            deltas, finish = await run(backend, req)
            assert flat(deltas)[:2] == (expected, list(running.engine.stats(req.rid).logprobs))
            assert (finish.reason, finish.matched_stop) == ("stop", EOT)
        said = messages(caplog)
        chosen = [m for m in said if "generating through" in m]
        assert chosen == [f"vLLM {running.url}: generating through /v1/completions with return_token_ids "
                          "(/openapi.json does not list /inference/v1/generate; start vLLM with "
                          "--enable-scale-out for the tokens route)"]
        assert sum("runs without dev mode" in m for m in said) == 1


async def test_without_dev_mode_pause_is_refused_and_versions_stay_in_the_proxy(
    tokenizer: ChatTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    async with vllm(tokenizer, **DEFAULT_FLAGS) as (running, backend):
        await backend.model_info()
        for call in (backend.pause("abort"), backend.resume()):
            with pytest.raises(BackendError) as info:
                await call
            assert "VLLM_SERVER_DEV_MODE=1" in str(info.value) and info.value.status == 501
        await backend.update_weight_version("7")
        await backend.update_weight_version("8")
        assert sum("/update_weight_version" in m for m in messages(caplog) if "has no" in m) == 1
        running.engine.script([11, 22, EOT])
        deltas, _ = await run(backend, request())
        assert set(flat(deltas)[2]) == {"8"}  # the version the proxy was given, not the engine's "default"
        assert (await backend.model_info()).weight_version == "8"


async def test_without_any_abort_route_an_abort_closes_the_stream(
    tokenizer: ChatTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    async with vllm(tokenizer, **DEFAULT_FLAGS) as (running, backend):
        await backend.model_info()
        running.engine.script(LONG)
        for _ in range(2):
            events: list[Any] = []
            async with backend.open_generation(request(max_new_tokens=1000)) as gen:
                async for event in gen:
                    events.append(event)
                    if len(events) == 2:
                        await gen.abort()
            assert isinstance(events[-1], GenerateFinish) and events[-1].reason == "abort"
        assert running.state.abort_calls == 0 and backend.abort_calls == 0  # nothing sent to refusing routes
        assert sum("has no abort route" in m for m in messages(caplog)) == 1


async def test_dev_mode_scale_out_server_uses_the_tokens_route(
    tokenizer: ChatTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, CLIENT_LOG)
    async with vllm(tokenizer) as (running, backend):
        await backend.model_info()
        assert backend.api == "generate"
        await backend.update_weight_version("5")
        running.engine.script([11, EOT])
        deltas, finish = await run(backend, request())
        assert flat(deltas)[0] == [11, EOT] and finish.weight_version == "5"
        await backend.pause("keep")
        await backend.resume()
        assert [m for m in messages(caplog) if "generating through" in m] == [
            f"vLLM {running.url}: generating through /inference/v1/generate "
            "(/openapi.json lists /inference/v1/generate)"
        ]
        assert not [m for m in messages(caplog) if "dev mode" in m]


def refused(request: httpx.Request, body: Any) -> httpx.Response:
    error = {"message": SCALE_OUT_DISABLED, "type": "PermissionDeniedError", "param": None, "code": 403}
    return httpx.Response(403, json={"error": error})


def completions(request: httpx.Request, body: Any) -> Any:
    return stream(vc(IDS[:3], LPS[:3]), vc(IDS[3:], LPS[3:], finish="stop", stop_reason=EOT), USAGE, DONE)


@pytest.mark.parametrize(
    ("openapi", "reason"),
    [
        (httpx.Response(404, json={"detail": "Not Found"}), "/inference/v1/generate answered 403"),
        (httpx.Response(200, json={"paths": {"/inference/v1/generate": {}, "/v1/completions": {}}}),
         "/inference/v1/generate answered 403 although /openapi.json lists it"),
    ],
    ids=["no-route-list", "listed-but-refused"],
)
async def test_a_403_on_the_tokens_route_means_completions(
    openapi: httpx.Response, reason: str, caplog: pytest.LogCaptureFixture, nursery: trio.Nursery
) -> None:
    caplog.set_level(logging.INFO, CLIENT_LOG)
    engine = Engine({
        "/openapi.json": lambda r, b: openapi,
        "/inference/v1/generate": refused,
        "/v1/completions": completions,
        "/v1/models": lambda r, b: httpx.Response(200, json={"data": [{"id": "qwen", "max_model_len": 8192}]}),
    })
    url = await engine.serve(nursery)
    backend = VLLMBackend(url)
    for _ in range(3):
        deltas, finish = await run(backend, request())
        assert flat(deltas)[:2] == (IDS, LPS) and finish.reason == "stop"
    paths = [p for p, _, _ in engine.calls]
    assert paths.count("/inference/v1/generate") == 1 and paths.count("/openapi.json") == 1
    chosen = [m for m in messages(caplog) if "generating through" in m]
    assert chosen[-1] == (f"vLLM {url}: generating through /v1/completions with return_token_ids ({reason}; "
                          "start vLLM with --enable-scale-out for the tokens route)")
    assert len(chosen) == (2 if "lists it" in reason else 1)  # a change of mind is logged too


async def test_other_errors_on_the_tokens_route_fail_the_turn_and_ask_again(nursery: trio.Nursery) -> None:
    engine = Engine({
        "/inference/v1/generate": lambda r, b: httpx.Response(500, json={"error": {"message": "boom"}}),
        "/v1/completions": completions,
    })
    backend = VLLMBackend(await engine.serve(nursery))
    for _ in range(2):
        with pytest.raises(BackendError):
            await run(backend, request())
    assert backend.api is None
    assert [p for p, _, _ in engine.calls].count("/inference/v1/generate") == 2
