"""The sampling fields beyond temperature and top-p reach the engine: chat's penalties and vLLM's and SGLang's
``top_k``, ``min_p`` and ``repetition_penalty`` extensions, Anthropic's ``top_k``; ``logit_bias`` is refused, not
dropped. Each engine's body carries them under its own names."""

from __future__ import annotations

from array import array
from typing import Any

import httpx
import orjson
import pytest
from _util import finalized_at

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
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 10, "max_tokens": 5}, "min_tokens"),
    ({"min_tokens": 10, "max_completion_tokens": 5}, "min_tokens"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": ["13"]}, "stop_token_ids[0]"),
    ({"stop_token_ids": 13}, "stop_token_ids"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"watermarking": True}, "watermarking"),
    ({"allowed_token_ids": [9707]}, "allowed_token_ids"),
    ({"bad_words": ["no"]}, "bad_words"),
    ({"repetition_detection": {"max_pattern_size": 8}}, "repetition_detection"),
    ({"thinking_token_budget": 64}, "thinking_token_budget"),
    ({"truncate_prompt_tokens": 100}, "truncate_prompt_tokens"),
    ({"chat_template": "{{ messages }}"}, "chat_template"),
    ({"documents": [{"title": "a", "text": "b"}]}, "documents"),
    ({"prompt_logprobs": 0}, "prompt_logprobs"),
    ({"logprob_token_ids": [9707]}, "logprob_token_ids"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
])
async def test_a_field_the_engine_cannot_honour_is_a_clear_400(http: httpx.AsyncClient, extra: dict[str, Any],
                                                               param: str) -> None:
    reply = await http.post("/sess/bad/v1/chat/completions", json={"messages": MESSAGES, **extra})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text


async def test_the_calls_stop_ids_and_ignore_eos_reach_the_engine(http: httpx.AsyncClient, tokenizer: Any,
                                                                  sampled: list[SamplingParams]) -> None:
    """vLLM's ``stop_token_ids`` stop a reply besides the tokenizer's own ids; with ``ignore_eos`` only they do."""
    own = [13, 11, 13]
    unset = {"use_beam_search": False, "watermarking": None, "allowed_token_ids": [], "bad_words": [],
             "truncate_prompt_tokens": None, "prompt_logprobs": None, "documents": None}  # as vLLM's defaults
    for extra in ({"stop_token_ids": own}, {"stop_token_ids": own, "ignore_eos": True}, {"ignore_eos": True},
                  {"min_tokens": 3, "ignore_eos": False, "continue_final_message": False,
                   "add_generation_prompt": True, **unset}):
        reply = await http.post("/sess/own/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4,
                                                                       **extra})
        assert reply.status_code == 200, reply.text
    assert [(s.stop_token_ids, s.ignore_eos, s.min_tokens) for s in sampled] == [
        ((*tokenizer.stop_token_ids, 13, 11), False, 0), ((13, 11), True, 0), ((), True, 0),
        (tokenizer.stop_token_ids, False, 3)]


async def test_stop_sequences_wait_for_min_tokens_and_include_stop_keeps_them(http: httpx.AsyncClient,
                                                                             engine: SimEngine) -> None:
    """vLLM's rules for ``stop`` strings: none ends in the first ``min_tokens`` tokens' text, and
    ``include_stop_str_in_output`` keeps the one that ended the reply."""
    text = "Go. Go. Go. Go on."
    engine.script(text, routing_key="late")
    engine.script(text, routing_key="kept")
    late = await http.post("/sess/late/v1/chat/completions", json={"messages": MESSAGES, "stop": ["Go."],
                                                                   "min_tokens": 4})
    kept = await http.post("/sess/kept/v1/chat/completions", json={"messages": MESSAGES, "stop": ["Go."],
                                                                   "include_stop_str_in_output": True})
    engine.script(text, routing_key="sglang")
    untrimmed = await http.post("/sess/sglang/v1/chat/completions", json={"messages": MESSAGES, "stop": ["Go."],
                                                                          "no_stop_trim": True})  # SGLang's name
    replies = (late, kept, untrimmed)
    assert [reply.status_code for reply in replies] == [200, 200, 200], [reply.text for reply in replies]
    assert [(r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"])
            for r in replies] == [("Go. Go. ", "stop"), ("Go.", "stop"), ("Go.", "stop")]


async def test_a_negative_anthropic_top_k_is_a_clear_400(http: httpx.AsyncClient) -> None:
    reply = await http.post("/sess/bad/v1/messages", json={"model": "m", "max_tokens": 16, "messages": MESSAGES,
                                                           "top_k": -1})
    assert reply.status_code == 400, reply.text
    assert reply.json()["type"] == "error" and "top_k" in reply.json()["error"]["message"], reply.text


def test_each_engines_body_names_them_its_own_way() -> None:
    sampling = SamplingParams(max_new_tokens=8, top_k=5, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5,
                              repetition_penalty=1.1, min_tokens=3, ignore_eos=True)
    request = GenerateRequest(array("i", [1, 2, 3]), sampling)
    sglang = orjson.loads(sglang_body(request, False))["sampling_params"]
    vllm = [orjson.loads(vllm_generate_body(request))["sampling_params"],
            orjson.loads(vllm_completions_body(request, "m"))]
    llamacpp = orjson.loads(llamacpp_body(request))
    for body in (sglang, *vllm):
        assert {key: body[key] for key in ASKED} == ASKED
    assert (sglang["min_new_tokens"], sglang["ignore_eos"]) == (3, True)
    assert [(body["min_tokens"], body["ignore_eos"]) for body in vllm] == [(3, True), (3, True)]
    assert llamacpp["ignore_eos"] is True
    assert {key: llamacpp[key] for key in ("top_k", "min_p", "presence_penalty", "frequency_penalty",
                                           "repeat_penalty")} == dict(zip(
        ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repeat_penalty"), ASKED.values(), strict=True))
    assert llamacpp["repeat_last_n"] == -1  # (the penalties' window: the whole context)
    neutral = orjson.loads(llamacpp_body(GenerateRequest(array("i", [1]), SamplingParams(max_new_tokens=8))))
    assert (neutral["repeat_last_n"], neutral["repeat_penalty"], neutral["top_k"]) == (0, 1.0, 0)


#: What a step records of a turn that asked for ASKED at temperature 0.7 and seed 3.
RECORDED = {"temperature": 0.7, "top_p": 1.0, "seed": 3, **ASKED, "min_tokens": 0, "ignore_eos": False}


async def two_turns(http: httpx.AsyncClient, session: str, first: dict[str, Any], second: dict[str, Any]) -> None:
    reply = await http.post(f"/sess/{session}/v1/chat/completions", json={"messages": MESSAGES, **first})
    assert reply.status_code == 200, reply.text
    history = [*MESSAGES, reply.json()["choices"][0]["message"], {"role": "user", "content": "Again."}]
    reply = await http.post(f"/sess/{session}/v1/chat/completions", json={"messages": history, **second})
    assert reply.status_code == 200, reply.text


async def test_the_trainer_reads_how_each_step_was_sampled(http: httpx.AsyncClient,
                                                           sampled: list[SamplingParams]) -> None:
    """A trainer that recomputes the logprobs must sample alike: each step says how, and so does its segment."""
    asked = {"temperature": 0.7, "seed": 3, **ASKED}
    await two_turns(http, "alike", asked, asked)
    segments, steps = await finalized_at(str(http.base_url), "alike")
    assert [step["sampling"] for step in steps] == [RECORDED, RECORDED]
    assert [segment["metadata"]["sampling"] for segment in segments] == [RECORDED]
    # What was recorded is what the engine was asked for.
    assert {key: getattr(sampled[0], key) for key in RECORDED} == RECORDED

    await two_turns(http, "mixed", asked, {})
    segments, steps = await finalized_at(str(http.base_url), "mixed")
    plain = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0,
             "frequency_penalty": 0.0, "repetition_penalty": 1.0, "seed": None, "min_tokens": 0, "ignore_eos": False}
    assert [step["sampling"] for step in steps] == [RECORDED, plain]
    # Steps that sampled differently: one record per step, in the order of `step_indices`.
    assert [segment["metadata"]["sampling"] for segment in segments] == [[RECORDED, plain]]


async def test_a_token_in_step_records_its_sampling_too(http: httpx.AsyncClient) -> None:
    """The Claw-R1 gateway's flow: ids in, the step claimed by the ``/submit_steps`` that names its trajectory."""
    prompt = [9707, 11, 1879]
    reply = await http.post("/generate", json={"prompt_ids": prompt, "sampling_params": {
        "max_tokens": 4, "temperature": 0.5, "top_p": 0.9, "repetition_penalty": 1.2}})
    assert reply.status_code == 200, reply.text
    submitted = await http.post("/submit_steps", json={"steps": [{
        "trajectory_uid": "token-in", "prompt_uid": "p", "prompt_ids": prompt,
        "response_ids": reply.json()["token_ids"], "reward": 1.0, "step_index": 0, "is_last": True}]})
    assert submitted.status_code == 200, submitted.text
    payload = (await http.post("/trajectory/read", json={"session_id": "token-in", "include_steps": True})).json()
    [step] = payload["steps"]
    assert step["sampling"] == {"temperature": 0.5, "top_p": 0.9, "top_k": -1, "min_p": 0.0, "presence_penalty": 0.0,
                                "frequency_penalty": 0.0, "repetition_penalty": 1.2, "seed": None, "min_tokens": 0,
                                "ignore_eos": False}
    assert [segment["metadata"]["sampling"] for segment in payload["data"]] == [step["sampling"]]


@pytest.mark.parametrize(("asked", "bound"), [({}, "at most 4096 tokens (the default max_tokens"),
                                              ({"max_tokens": 100_000}, "tokens (the context window's room after")])
async def test_min_tokens_above_the_turns_budget_is_a_400_naming_it(http: httpx.AsyncClient,
                                                                    sampled: list[SamplingParams],
                                                                    asked: dict[str, int], bound: str) -> None:
    """A ``min_tokens`` above what the turn may generate (the default budget, or ``max_tokens`` cut to the context
    window's room) is refused by the proxy, naming the field and the budget, before the engine is asked."""
    reply = await http.post("/sess/long/v1/chat/completions", json={"messages": MESSAGES, "min_tokens": 90_000,
                                                                    **asked})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "min_tokens"
    assert "'min_tokens' is 90000, but this turn may generate at most" in error["message"], error
    assert bound in error["message"], error
    assert sampled == []


async def test_a_stop_id_that_is_no_token_of_the_model_is_a_400(http: httpx.AsyncClient, tokenizer: Any,
                                                                sampled: list[SamplingParams]) -> None:
    """A stop id is an index into the engine's logits (SGLang's ``min_new_tokens`` masks them with a scatter that an
    id past the vocabulary kills its scheduler with): one the model has no token for is refused, naming it."""
    reply = await http.post("/sess/far/v1/chat/completions", json={"messages": MESSAGES, "min_tokens": 2,
                                                                   "stop_token_ids": [13, tokenizer.id_bound]})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "stop_token_ids"
    assert f"holds {tokenizer.id_bound}, which is no token id of the model" in error["message"], error
    assert sampled == []


async def test_a_top_k_past_any_vocabulary_is_the_whole_vocabulary(http: httpx.AsyncClient,
                                                                   sampled: list[SamplingParams]) -> None:
    """SGLang keeps a batch's top-ks as 32-bit integers (a larger one kills its scheduler) and vLLM reads a top-k past
    its vocabulary as all of it: such a top-k goes to the engine as -1, the whole vocabulary, and is recorded so;
    a 64-bit seed is passed on whole."""
    for top_k in (2**30, 10**12):
        chat = await http.post("/sess/k/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                                    "top_k": top_k, "seed": 2**63 - 1})
        anthropic = await http.post("/sess/a/v1/messages", json={"model": "m", "max_tokens": 2, "messages": MESSAGES,
                                                                 "top_k": top_k})
        assert (chat.status_code, anthropic.status_code) == (200, 200), (chat.text, anthropic.text)
    large = await http.post("/sess/k/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                                 "top_k": 2**30 - 1})
    assert large.status_code == 200, large.text
    assert [s.top_k for s in sampled] == [-1, -1, -1, -1, 2**30 - 1]
    assert sampled[0].seed == 2**63 - 1
