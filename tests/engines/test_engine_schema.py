"""One schema per engine: what the clients send is what the simulated routes read, and a body
either refuses names the field in that engine's own error shape."""

from __future__ import annotations

from array import array
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from quart_trio import QuartTrio

from actorproxy.engines.base import SamplingParams
from actorproxy.engines.connection import json_body
from actorproxy.engines.llamacpp import protocol as llamacpp
from actorproxy.engines.sglang import protocol as sglang
from actorproxy.engines.vllm import protocol as vllm
from actorproxy.schema.converter import CONVERTER, TokenIds, structure
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.sim.server import SimServerSettings, create_sim_app
from actorproxy.tokenization.tokenizer import ChatTokenizer

IDS = array("i", [151644, 872, 198, 9707])
SAMPLING = SamplingParams(max_new_tokens=7, temperature=0.5, top_k=20, seed=3, stop_token_ids=(151645,))


def over_the_wire(body: object, cls: type[Any]) -> Any:
    """What the simulated server reads of what a client sends: unstructure, JSON, structure."""
    return structure(orjson.loads(json_body(CONVERTER.unstructure(body))), cls)


@pytest.mark.parametrize(
    "sent",
    [
        sglang.GenerateReqInput(
            rid="a" * 32, input_ids=TokenIds(IDS), stream=True, return_logprob=True, return_routed_experts=True,
            sampling_params=sglang.SGLangSamplingParams.of(SAMPLING),
        ),
        vllm.GenerateTokensRequest(
            token_ids=TokenIds(IDS), request_id="r", stream=True, stream_options=vllm.StreamOptions(True),
            sampling_params=vllm.SamplingFields.of(SAMPLING),
        ),
        vllm.CompletionRequest.of_tokens(IDS, SAMPLING, rid="r", model="m"),
        vllm.CompletionRequest.of_tokens(IDS, SAMPLING, rid="r", model=None, stream=False, prompt_logprobs=1),
        llamacpp.CompletionRequest.of(IDS, SAMPLING),
        sglang.ParseFunctionCallReq("x", "qwen25", [sglang.Tool(sglang.Function("f", None, {"type": "object"}))]),
    ],
    ids=lambda body: type(body).__name__,
)
def test_what_a_client_sends_the_simulator_reads_back(sent: object) -> None:
    assert over_the_wire(sent, type(sent)) == sent


def test_token_ids_stay_an_array_until_the_json_writer() -> None:
    body = CONVERTER.unstructure(llamacpp.CompletionRequest.of(IDS, SAMPLING))
    assert body["prompt"] is IDS  # written whole by json_body, never a list of Python ints
    # Fields some servers do not know are left out until asked for.
    generate = CONVERTER.unstructure(sglang.GenerateReqInput(input_ids=TokenIds(IDS)))
    assert "text" not in generate and "return_routed_experts" not in generate
    assert "sampling_seed" not in CONVERTER.unstructure(sglang.SGLangSamplingParams())


@pytest.fixture
async def app(tokenizer: ChatTokenizer) -> AsyncIterator[QuartTrio]:
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.0))
    yield create_sim_app(engine, settings=SimServerSettings(port=0))


@pytest.mark.parametrize(
    ("path", "body", "status", "error"),
    [
        # SGLang: its validation handler's ErrorResponse for a body its model refuses ...
        ("/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, 400,
         {"object": "error", "type": "Bad Request", "param": "sampling_params.temperature", "code": 400}),
        ("/pause_generation", {"mode": "sideways"}, 400, {"object": "error", "param": "mode", "code": 400}),
        # ... and {"error": {"message"}} for what the engine refuses afterwards.
        ("/generate", {"text": "hello"}, 400, {"error": {}}),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 0}, 400,
         {"error": {"type": "BadRequestError", "param": "max_tokens", "code": 400}}),
        ("/inference/v1/generate", {"token_ids": [1, 2], "sampling_params": {"logprobs": "x"}}, 400,
         {"error": {"type": "BadRequestError", "param": "sampling_params.logprobs", "code": 400}}),
        ("/completion", {"prompt": [1, 2], "n_probs": -1}, 400,
         {"error": {"code": 400, "type": "invalid_request_error"}}),
        ("/parse_function_call", {"text": "x", "tool_call_parser": "qwen25", "tools": [{"function": 3}]}, 400,
         {"object": "error", "param": "tools[0].function", "code": 400}),
        # The simulator's own protocol refuses unknown fields.
        ("/sim/faults", {"fail_next": 1, "explode": True}, 400, {"error": {"param": "explode"}}),
    ],
)
async def test_a_refused_body_is_named_in_the_engines_error_shape(
    app: QuartTrio, path: str, body: dict[str, Any], status: int, error: dict[str, Any]
) -> None:
    response = await app.test_client().post(path, json=body)
    got = await response.get_json()
    assert response.status_code == status, got
    inner = got.get("error", got)
    expected = error.get("error", error)
    assert {k: inner.get(k) for k in expected} == expected, got
    assert isinstance(inner["message"], str) and inner["message"]


async def test_unknown_fields_of_an_engine_protocol_are_tolerated(app: QuartTrio, tokenizer: ChatTokenizer) -> None:
    prompt = list(tokenizer.encode("Hello"))
    client = app.test_client()
    cases = [
        ("/generate", {"input_ids": prompt, "bogus": 1, "sampling_params": {"max_new_tokens": 2, "whatever": True}}),
        ("/v1/completions", {"prompt": prompt, "max_tokens": 2, "best_of": 1, "user": "u"}),
        ("/completion", {"prompt": prompt, "n_predict": 2, "samplers": "kt"}),
    ]
    for path, body in cases:
        response = await client.post(path, json=body)
        assert response.status_code == 200, (path, await response.get_data())
