"""The sampled tokens' logprobs, JSON and SSE: ``logprobs``/``top_logprobs`` on chat completions (issue 19 §5),
and ``include: ["message.output_text.logprobs"]`` on the Responses API (the same entries, on the message's
``output_text``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import httpx
import openai
import pytest
import trio
from _util import finalized_at

from actorproxy.protocols.openai_chat import token_logprobs
from actorproxy.schema.jsonio import dumps
from actorproxy.serve import RunningProxy
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.sim.generation import SimGeneration
from actorproxy.sim.policy import alternatives

#: Multi-byte characters, so some characters are split over tokens (their bytes still add up).
REPLY = "Grüße aus Zürich 🌍, das Wetter ist schön."
MESSAGES = [{"role": "user", "content": "Say hello."}]

T = TypeVar("T")


@pytest.fixture
async def engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=5, token_interval=0.0))


async def _asked(
    proxy: RunningProxy, engine: SimEngine, session: str, ask: Callable[[openai.OpenAI], T], *, turns: int = 1
) -> tuple[T, list[dict[str, Any]]]:
    """``ask`` run with an SDK client on ``session``'s URL, whose ``turns`` replies are :data:`REPLY`: what it
    returned, and the session's recorded steps."""
    engine.script(*[REPLY] * turns, routing_key=session)

    def in_thread() -> T:
        with openai.OpenAI(base_url=f"{proxy.url}/sess/{session}/v1", api_key="unused", max_retries=0) as client:
            return ask(client)

    got = await trio.to_thread.run_sync(in_thread)
    _, steps = await finalized_at(proxy.url, session)
    return got, steps


def _check(content: list[Any], step: dict[str, Any], tokenizer: Any, top: int = 0) -> None:
    """One entry per sampled token, its recorded logprob, bytes that add up to the sampled text; ``top``
    alternatives each, the engine's (``sim.policy.alternatives``), spelled as the sampled tokens are."""
    assert [c.logprob for c in content] == pytest.approx(step["output_logprobs"])
    assert len(content) == len(step["output_ids"]) > 10
    joined = b"".join(bytes(c.bytes) for c in content)
    assert joined == tokenizer.decode(step["output_ids"]).encode()
    assert joined.decode().startswith(REPLY)
    assert all(c.logprob <= 0.0 for c in content)
    for entry, token, logprob in zip(content, step["output_ids"], step["output_logprobs"], strict=True):
        expected = alternatives(token, logprob, top) if top else ()
        assert [a.logprob for a in entry.top_logprobs] == pytest.approx([lp for _, lp in expected])
        for alternative, (token_id, _) in zip(entry.top_logprobs, expected, strict=True):
            alone = tokenizer.decode([token_id])
            if "\ufffd" not in alone:  # (a whole character: its bytes are the token's)
                assert (alternative.token, bytes(alternative.bytes)) == (alone, alone.encode())


def _as_the_tokenizer_spells(tokenizer: Any, alphabet: dict[str, int], token_id: int) -> tuple[str, bytes]:
    """A token's text and bytes asked of the tokenizer itself: its piece read through GPT-2's byte ``alphabet``,
    or, for a piece outside it, the token decoded alone."""
    piece = tokenizer.hf.convert_ids_to_tokens([token_id])[0]
    if all(char in alphabet for char in piece):
        raw = bytes(alphabet[char] for char in piece)
        return raw.decode("utf-8", errors="replace"), raw
    text = tokenizer.hf.decode([token_id], skip_special_tokens=False)
    return text, text.encode()


def test_every_token_of_the_vocabulary_is_spelled_as_the_tokenizer_spells_it(tokenizer: Any) -> None:
    """Sampled tokens and alternatives alike, special tokens included (the alphabet: ``transformers``' own)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = {char: byte for byte, char in bytes_to_unicode().items()}
    ids = list(range(len(tokenizer.hf)))
    top = [[(token_id, -2.0)] for token_id in reversed(ids)]
    content = token_logprobs(tokenizer, ids, [-1.0] * len(ids), top)
    for token_id, entry, mirrored in zip(ids, content, reversed(content), strict=True):
        text, raw = _as_the_tokenizer_spells(tokenizer, alphabet, token_id)
        assert (entry["token"], bytes(entry["bytes"]), entry["logprob"]) == (text, raw, -1.0), token_id
        [alternative] = mirrored["top_logprobs"]  # (the alternative listed is the mirrored entry's)
        assert (alternative["token"], bytes(alternative["bytes"]), alternative["logprob"]) == (text, raw, -2.0)


def test_a_token_the_tokenizer_does_not_know_has_no_text(tokenizer: Any) -> None:
    """A model's vocabulary is often padded past its tokenizer's (Qwen3: 151,936 rows, 151,669 tokens), and a
    policy can sample a padding id: it decodes to nothing, so its entry has no text and no bytes."""
    unknown = len(tokenizer.hf) + 3
    assert tokenizer.decode([unknown]) == ""
    [entry] = token_logprobs(tokenizer, [unknown], [-9.0], [[(unknown + 1, -9.5)]])
    assert (entry["token"], entry["bytes"]) == ("", [])
    assert [(a["token"], a["bytes"]) for a in entry["top_logprobs"]] == [("", [])]


def test_a_byte_level_vocabulary_is_spelled_without_asking_the_tokenizer(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bytes of each token (and of each alternative) are the detokenizer's byte table's: a reply of thousands
    of tokens with alternatives makes no call of the tokenizer's per token."""
    ids = tokenizer.encode(REPLY * 20)
    expected = token_logprobs(tokenizer, ids, [-0.5] * len(ids), [[(i, -1.0), (i + 1, -2.0)] for i in ids])

    def asked(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the tokenizer was asked to spell a token")

    for name in ("convert_ids_to_tokens", "decode"):
        monkeypatch.setattr(tokenizer.hf, name, asked)
    got = token_logprobs(tokenizer, ids, [-0.5] * len(ids), [[(i, -1.0), (i + 1, -2.0)] for i in ids])
    assert got == expected


class _SentencePiece:
    """A vocabulary with no byte table (its pieces' "▁" is outside GPT-2's alphabet): each id is a word, and it
    counts the calls it is asked."""

    def __init__(self) -> None:
        self.calls = 0

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        self.calls += 1
        return [f"\u2581w{i}" if i < 1000 else None for i in ids]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.calls += 1
        return "".join(f" w{i}" for i in ids if i < 1000)


def test_a_vocabulary_without_a_byte_table_spells_each_id_once() -> None:
    """Each known id is asked of the tokenizer once, then kept (an unknown one is not: the kept spellings stay
    within the vocabulary)."""
    tokenizer = _SentencePiece()
    ids = [5, 7, 5, 5, 1234, 7]
    first = token_logprobs(tokenizer, ids, [-1.0] * len(ids), [[(9, -2.0), (5, -3.0)]] * len(ids))
    asked = tokenizer.calls
    assert [(e["token"], bytes(e["bytes"])) for e in first] == [
        (" w5", b" w5"), (" w7", b" w7"), (" w5", b" w5"), (" w5", b" w5"), ("", b""), (" w7", b" w7")]
    assert [a["token"] for a in first[0]["top_logprobs"]] == [" w9", " w5"]
    assert token_logprobs(tokenizer, ids, [-1.0] * len(ids), [[(9, -2.0), (5, -3.0)]] * len(ids)) == first
    assert tokenizer.calls - asked == 1  # the unknown id's question, again
    assert asked == 3 * 2 + 1  # 5, 7 and 9 each a piece and a decode; 1234 a piece


def test_a_token_of_probability_zero_is_very_unlikely_not_null(tokenizer: Any) -> None:
    """``-inf`` (llama.cpp can report a probability of 0) has no JSON number: orjson would write ``null``, which
    OpenAI's schema does not allow. It is written as OpenAI's (and vLLM's) ``-9999.0``, sampled or alternative."""
    [entry] = token_logprobs(tokenizer, [9707], [float("-inf")], [[(9707, float("-inf")), (11, -1e6)]])
    assert entry["logprob"] == -9999.0
    assert [a["logprob"] for a in entry["top_logprobs"]] == [-9999.0, -9999.0]
    assert b"null" not in dumps(entry)


async def test_json_reply_carries_the_sampled_tokens_logprobs(
    proxy: RunningProxy, engine: SimEngine, tokenizer: Any
) -> None:
    def ask(client: openai.OpenAI) -> tuple[Any, Any]:
        return (client.chat.completions.create(model="m", messages=MESSAGES, logprobs=True, top_logprobs=3),
                client.chat.completions.create(model="m", messages=MESSAGES))

    (with_lp, without), steps = await _asked(proxy, engine, "lp", ask, turns=2)
    assert with_lp.choices[0].message.content == REPLY
    assert without.choices[0].logprobs is None
    assert with_lp.choices[0].logprobs.refusal is None
    content = with_lp.choices[0].logprobs.content
    _check(content, steps[0], tokenizer, top=3)
    # A character split over two tokens shows as two byte runs, not as two whole characters.
    assert any(c.token == "\ufffd" and len(c.bytes) < 3 for c in content)


async def test_stream_carries_the_same_logprobs(proxy: RunningProxy, engine: SimEngine, tokenizer: Any) -> None:
    def ask(client: openai.OpenAI) -> Any:
        with client.chat.completions.stream(model="m", messages=MESSAGES, logprobs=True, top_logprobs=2) as stream:
            for _ in stream:
                pass
            return stream.get_final_completion()

    final, steps = await _asked(proxy, engine, "lps", ask)
    assert final.choices[0].message.content == REPLY
    _check(final.choices[0].logprobs.content, steps[0], tokenizer, top=2)


async def test_bad_logprobs_fields_are_a_clear_400(proxy: RunningProxy) -> None:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        for extra, param in (({"top_logprobs": 2}, "top_logprobs"),
                             ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
                             ({"logprobs": "yes"}, "logprobs")):
            reply = await http.post("/sess/bad/v1/chat/completions", json={"messages": MESSAGES, **extra})
            assert reply.status_code == 400, (extra, reply.text)
            assert reply.json()["error"]["param"] == param, reply.text


INCLUDE = ["message.output_text.logprobs"]


async def test_responses_json_carries_the_sampled_tokens_logprobs(
    proxy: RunningProxy, engine: SimEngine, tokenizer: Any
) -> None:
    def ask(client: openai.OpenAI) -> tuple[Any, Any]:
        return (client.responses.create(model="m", input="Say hello.", include=INCLUDE,  # type: ignore[list-item]
                                        top_logprobs=3, store=False),
                client.responses.create(model="m", input="Say hello.", store=False))

    (with_lp, without), steps = await _asked(proxy, engine, "rlp", ask, turns=2)
    [text] = with_lp.output[-1].content
    assert text.text == REPLY
    assert without.output[-1].content[0].logprobs == []
    _check(text.logprobs, steps[0], tokenizer, top=3)


async def test_responses_stream_carries_the_same_logprobs(
    proxy: RunningProxy, engine: SimEngine, tokenizer: Any
) -> None:
    def ask(client: openai.OpenAI) -> tuple[list[Any], Any]:
        with client.responses.stream(model="m", input="Say hello.", include=INCLUDE,  # type: ignore[list-item]
                                     top_logprobs=2, store=False) as stream:
            events = list(stream)
            return events, stream.get_final_response()

    (events, final), (step,) = await _asked(proxy, engine, "rlps", ask)
    [text] = final.output[-1].content
    assert text.text == REPLY
    _check(text.logprobs, step, tokenizer, top=2)
    [done] = [e for e in events if e.type == "response.output_text.done"]
    _check(done.logprobs, step, tokenizer, top=2)


async def test_bad_responses_top_logprobs_is_a_clear_400(proxy: RunningProxy) -> None:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        for value in (21, -1, "3", True):
            body = {"input": "hi", "include": INCLUDE, "top_logprobs": value}
            reply = await http.post("/sess/bad/v1/responses", json=body)
            assert reply.status_code == 400, (value, reply.text)
            assert reply.json()["error"]["param"] == "top_logprobs", reply.text


async def test_an_engine_that_does_not_report_alternatives_fails_the_turn(
    proxy: RunningProxy, engine: SimEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``top_logprobs`` asked and the engine's generation reports none: a 502 naming it, not empty lists; the
    same call without them is answered."""
    monkeypatch.setattr(SimGeneration, "top_logprobs", property(lambda self: None))
    engine.script(REPLY, REPLY, routing_key="nolp")
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        body = {"messages": MESSAGES, "logprobs": True}
        failed = await http.post("/sess/nolp/v1/chat/completions", json=body | {"top_logprobs": 2})
        assert failed.status_code == 502, failed.text
        assert failed.json()["error"]["code"] == "top_logprobs_missing"
        assert "top logprobs for none of" in failed.json()["error"]["message"]
        answered = await http.post("/sess/nolp/v1/chat/completions", json=body)
        assert answered.status_code == 200, answered.text
