"""The sampling fields beyond temperature and top-p reach the engine: chat's penalties and vLLM's and SGLang's
``top_k``, ``min_p`` and ``repetition_penalty`` extensions, Anthropic's ``top_k``; ``logit_bias`` is refused, not
dropped. Each engine's body carries them under its own names."""

from __future__ import annotations

from array import array
from typing import Any

import httpx
import orjson
import pytest

from actorproxy.engines.base import GenerateRequest, SamplingParams
from actorproxy.engines.llamacpp.protocol import completion_bytes as llamacpp_body
from actorproxy.engines.sglang.protocol import generate_bytes as sglang_body
from actorproxy.engines.vllm.protocol import completion_bytes as vllm_completions_body
from actorproxy.engines.vllm.protocol import generate_tokens_bytes as vllm_generate_body
from actorproxy.sim import SimEngine

MESSAGES = [{"role": "user", "content": "Say hello."}]
ASKED = {"top_k": 5, "min_p": 0.1, "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1}


@pytest.fixture
def sampled(engine: SimEngine, monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    """The sampling settings of every generation the engine is asked for, in order."""
    seen: list[SamplingParams] = []
    opened = engine.open_generation

    def recording(request: GenerateRequest) -> Any:
        seen.append(request.sampling)
        return opened(request)

    monkeypatch.setattr(engine, "open_generation", recording)
    return seen


async def test_chat_and_anthropic_fields_reach_the_engine(http: httpx.AsyncClient, sampled: list[SamplingParams]
                                                          ) -> None:
    asked = await http.post("/sess/s/v1/chat/completions", json={"messages": MESSAGES, **ASKED})
    plain = await http.post("/sess/p/v1/chat/completions", json={"messages": MESSAGES, "top_k": 0,
                                                                 "presence_penalty": 0.0, "logit_bias": {}})
    anthropic = await http.post("/sess/a/v1/messages", json={"model": "m", "max_tokens": 16, "messages": MESSAGES,
                                                             "top_k": 7})
    assert [r.status_code for r in (asked, plain, anthropic)] == [200, 200, 200], (asked.text, plain.text)
    first, second, third = sampled
    assert {key: getattr(first, key) for key in ASKED} == ASKED
    assert (second.top_k, second.min_p, second.presence_penalty, second.repetition_penalty) == (-1, 0.0, 0.0, 1.0)
    assert (third.top_k, third.presence_penalty) == (7, 0.0)


@pytest.mark.parametrize(("extra", "param"), [
    ({"logit_bias": {"9707": 5}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"top_k": "5"}, "top_k"),
])
async def test_a_field_the_engine_cannot_honour_is_a_clear_400(http: httpx.AsyncClient, extra: dict[str, Any],
                                                               param: str) -> None:
    reply = await http.post("/sess/bad/v1/chat/completions", json={"messages": MESSAGES, **extra})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


async def test_a_negative_anthropic_top_k_is_a_clear_400(http: httpx.AsyncClient) -> None:
    reply = await http.post("/sess/bad/v1/messages", json={"model": "m", "max_tokens": 16, "messages": MESSAGES,
                                                           "top_k": -1})
    assert reply.status_code == 400, reply.text
    assert reply.json()["type"] == "error" and "top_k" in reply.json()["error"]["message"], reply.text


def test_each_engines_body_names_them_its_own_way() -> None:
    sampling = SamplingParams(max_new_tokens=8, top_k=5, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5,
                              repetition_penalty=1.1)
    request = GenerateRequest(array("i", [1, 2, 3]), sampling)
    sglang = orjson.loads(sglang_body(request, False))["sampling_params"]
    vllm = [orjson.loads(vllm_generate_body(request))["sampling_params"],
            orjson.loads(vllm_completions_body(request, "m"))]
    llamacpp = orjson.loads(llamacpp_body(request))
    for body in (sglang, *vllm):
        assert {key: body[key] for key in ASKED} == ASKED
    assert {key: llamacpp[key] for key in ("top_k", "min_p", "presence_penalty", "frequency_penalty",
                                           "repeat_penalty")} == dict(zip(
        ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty"), ASKED.values(), strict=True))
    assert llamacpp["repeat_last_n"] == -1  # (the penalties' window: the whole context)
    neutral = orjson.loads(llamacpp_body(GenerateRequest(array("i", [1]), SamplingParams(max_new_tokens=8))))
    assert (neutral["repeat_last_n"], neutral["repeat_penalty"], neutral["top_k"]) == (0, 1.0, 0)
