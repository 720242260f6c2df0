"""vLLM's chat extensions for rollout code that reads ids from the reply: ``return_token_ids`` (the reply's
``prompt_token_ids``, each choice's ``token_ids``) and ``return_tokens_as_token_ids`` (each logprob's token
written ``token_id:N``), JSON and SSE, with the OpenAI SDK as such code calls them (``extra_body``)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import trio
from _util import finalized_at

from actorproxy.serve import RunningProxy
from actorproxy.sim import SimConfig, SimEngine

REPLY = "Grüße aus Zürich 🌍, das Wetter ist schön."
IDS = {"return_token_ids": True}


@pytest.fixture
async def engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=5, token_interval=0.0))


def _client(proxy: RunningProxy, session: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.url}/sess/{session}/v1", api_key="unused", max_retries=0)


async def test_a_reply_carries_the_prompt_the_engine_was_given_and_the_sampled_ids(
    proxy: RunningProxy, engine: SimEngine, tokenizer: Any
) -> None:
    """Turn 2's prompt is turn 1's prompt and sampled ids, then the new messages' (the ids the engine got, not
    the conversation rendered afresh); the segment the trainer reads is turn 2's prompt and its ids."""
    engine.script(REPLY, "Bis bald.", routing_key="ids")

    def in_thread() -> tuple[Any, Any]:
        messages: list[Any] = [{"role": "user", "content": "Say hello."}]
        with _client(proxy, "ids") as client:
            first = client.chat.completions.create(model="m", messages=messages, extra_body=IDS)
            messages += [{"role": "assistant", "content": first.choices[0].message.content},
                         {"role": "user", "content": "And goodbye?"}]
            return first, client.chat.completions.create(model="m", messages=messages, extra_body=IDS)

    first, second = await trio.to_thread.run_sync(in_thread)
    [segment], [step1, step2] = await finalized_at(proxy.url, "ids")
    p1, t1 = first.prompt_token_ids, first.choices[0].token_ids
    p2, t2 = second.prompt_token_ids, second.choices[0].token_ids
    assert (t1, t2) == (step1["output_ids"], step2["output_ids"])
    assert (len(p1), len(p2)) == (first.usage.prompt_tokens, second.usage.prompt_tokens)
    assert p2[:len(p1) + len(t1)] == p1 + t1 and len(p2) > len(p1) + len(t1)
    assert segment["token_ids"] == p2 + t2
    assert tokenizer.decode(p1).endswith("Say hello.<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(t1) == REPLY + "<|im_end|>"


async def test_a_stream_carries_the_prompt_first_and_the_sampled_ids_last(
    proxy: RunningProxy, engine: SimEngine, tokenizer: Any
) -> None:
    """The prompt's ids on the first chunk only; the sampled ids, every one, on the finish chunk (as its
    logprobs: a delta is parsed text, not tokens); a client that joins every chunk's ``token_ids`` gets them."""
    engine.script(REPLY, routing_key="sse")

    def in_thread() -> list[Any]:
        with _client(proxy, "sse") as client:
            stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi."}],
                                                    stream=True, extra_body=IDS)
            return list(stream)

    chunks = await trio.to_thread.run_sync(in_thread)
    [_], [step] = await finalized_at(proxy.url, "sse")
    dumped = [chunk.model_dump() for chunk in chunks]
    assert "prompt_token_ids" in dumped[0] and all("prompt_token_ids" not in d for d in dumped[1:])
    assert tokenizer.decode(chunks[0].prompt_token_ids).endswith("Hi.<|im_end|>\n<|im_start|>assistant\n")
    sampled = [i for d in dumped for c in d["choices"] for i in c.get("token_ids") or ()]
    assert sampled == step["output_ids"]
    assert [d["choices"][0].get("token_ids") is not None for d in dumped if d["choices"]][-1]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == REPLY


@pytest.mark.parametrize("stream", [False, True])
async def test_logprobs_name_each_token_by_its_id(
    proxy: RunningProxy, engine: SimEngine, tokenizer: Any, stream: bool
) -> None:
    """``return_tokens_as_token_ids``: ``token_id:N`` for the sampled tokens and their alternatives alike, the
    bytes that text's (as vLLM writes them)."""
    session = f"as-ids-{stream}"
    engine.script(REPLY, routing_key=session)
    body = {"messages": [{"role": "user", "content": "Hi."}], "logprobs": True, "top_logprobs": 2,
            "return_tokens_as_token_ids": True, "stream": stream}
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        reply = await http.post(f"/sess/{session}/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    if stream:
        [last] = [d for d in _events(reply.text) if d["choices"] and d["choices"][0]["finish_reason"]]
        content = last["choices"][0]["logprobs"]["content"]
    else:
        content = reply.json()["choices"][0]["logprobs"]["content"]
    [_], [step] = await finalized_at(proxy.url, session)
    assert [entry["token"] for entry in content] == [f"token_id:{i}" for i in step["output_ids"]]
    for entry in content:
        assert bytes(entry["bytes"]) == entry["token"].encode()
        assert len(entry["top_logprobs"]) == 2
        for alternative in entry["top_logprobs"]:
            assert alternative["token"].startswith("token_id:")
            assert bytes(alternative["bytes"]) == alternative["token"].encode()


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


async def test_without_them_the_reply_has_no_ids(proxy: RunningProxy, engine: SimEngine) -> None:
    engine.script(REPLY, REPLY, routing_key="none")
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        for stream in (False, True):
            body = {"messages": [{"role": "user", "content": "Hi."}], "stream": stream, "return_token_ids": False}
            reply = await http.post("/sess/none/v1/chat/completions", json=body)
            assert reply.status_code == 200, reply.text
            assert "token_ids" not in reply.text


async def test_bad_values_are_a_clear_400(proxy: RunningProxy) -> None:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        for field in ("return_token_ids", "return_tokens_as_token_ids"):
            body = {"messages": [{"role": "user", "content": "Hi."}], field: "yes"}
            reply = await http.post("/sess/bad/v1/chat/completions", json=body)
            assert reply.status_code == 400, reply.text
            assert reply.json()["error"]["param"] == field, reply.text
