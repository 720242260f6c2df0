"""A turn's fragment is tokenized once per distinct text: the same ids as ``encode``, bounded, aged.

The fragment a continuing turn sends (what the template writes after the last
sampled token for the new messages) is often a text an earlier turn sent too: the
same tool result or user message in rollouts of one prompt group, an
environment's canned reply. :class:`~actorproxy.tokenization.prompt_cache.FragmentMemo`
keeps the ids of recent fragment texts, keyed by the whole text, so a repeat is
not tokenized again. The ids must be exactly ``encode``'s for every text (special
tokens written in it, whitespace and Unicode that merge across pieces), and each
caller gets its own array.
"""

from __future__ import annotations

import concurrent.futures
import sys
from array import array
from typing import Any

import hypothesis.strategies as st
from _util import run_turn
from hypothesis import HealthCheck, given, settings

from actorproxy.config import ProxyConfig
from actorproxy.core.tito import render_fragment
from actorproxy.runtime.runtime import open_runtime
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.tokenization import prompt_cache as pc
from actorproxy.tokenization.tokenizer import ChatTokenizer

_text = st.lists(st.sampled_from(["a", "b", " ", "  ", "\n", "\r\n", "\t", "é", "e\u0301", "日本", "!", "1", "12",
                                  "'s", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|im_start|>user\n",
                                  "\u2063", "<|im_", "🙂", "\u00a0", "ﬁ", "<tool_response>"]),
                 max_size=16).map("".join)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(texts=st.lists(_text, min_size=1, max_size=8))
def test_memo_or_not_the_ids_are_encodes(tokenizer: ChatTokenizer, texts: list[str]) -> None:
    """Texts in any order, repeated, prefixes and extensions of each other: ``encode`` every time."""
    for text in [*texts, *reversed(texts), *(a + b for a, b in zip(texts, texts[1:], strict=False)), *texts]:
        assert tokenizer.encode_fragment(text).tolist() == tokenizer.encode(text).tolist()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(contents=st.lists(_text, min_size=1, max_size=4), closed=st.booleans(),
       thinking=st.sampled_from([None, True, False]))
def test_rendered_fragments_memoized_are_their_encodes(tokenizer: ChatTokenizer, contents: list[str], closed: bool,
                                                       thinking: bool | None) -> None:
    """The texts a turn really sends (user and tool messages rendered after a reply), twice each."""
    messages = [{"role": "tool" if i % 2 else "user", "content": c} for i, c in enumerate(contents)]
    try:
        text = render_fragment(tokenizer, messages, tools=None, closed_by_eot=closed, enable_thinking=thinking)
    except Exception:  # a content that writes the stand-in's marker: no fragment, nothing to tokenize
        return
    for _ in range(2):
        assert tokenizer.encode_fragment(text).tolist() == tokenizer.encode(text).tolist()


def test_each_caller_gets_its_own_ids(tokenizer: ChatTokenizer) -> None:
    text = "\n<|im_start|>user\nand 7 times 8?<|im_end|>\n<|im_start|>assistant\n"
    first = tokenizer.encode_fragment(text)
    expected = first.tolist()
    first.append(1)
    first[0] = 5
    second = tokenizer.encode_fragment(text)
    assert second.tolist() == expected and second is not first
    second.extend([7, 7])
    assert tokenizer.encode_fragment(text).tolist() == expected


class _Counting:
    """An encode (one id per character) that counts what it tokenizes."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def __call__(self, text: str) -> array[int]:
        self.texts.append(text)
        ids = array("i")
        ids.frombytes(text.encode("utf-32-le"))
        return ids


def test_a_repeated_fragment_is_tokenized_once() -> None:
    encode = _Counting()
    memo = pc.FragmentMemo(encode)
    for _ in range(3):
        assert memo.encode("a fragment").tolist() == [ord(c) for c in "a fragment"]
    assert memo.encode("another").tolist() == [ord(c) for c in "another"]
    assert encode.texts == ["a fragment", "another"]
    assert (memo.hits, memo.misses) == (2, 2)


def test_a_long_text_is_not_kept() -> None:
    encode = _Counting()
    memo = pc.FragmentMemo(encode)
    text = "x" * (pc.FRAGMENT_MAX_CHARS + 1)
    memo.encode(text)
    memo.encode(text)
    assert encode.texts == [text, text] and len(memo) == 0


def test_the_memo_is_bounded() -> None:
    memo = pc.FragmentMemo(_Counting(), max_bytes=20_000)
    for i in range(500):
        text = f"fragment {i} " + "y" * 200
        assert memo.encode(text).tolist() == [ord(c) for c in text]
    kept = [(t, ids) for generation in (memo.entries.young, memo.entries.old) for t, ids in generation.items()]
    assert sum(pc.fragment_weight(t, ids) for t, ids in kept) <= 40_000
    assert memo.entries.bytes <= 20_000


def test_the_memo_ages_as_the_prompt_cache() -> None:
    """What no turn used since the previous age goes at the next (``Runtime.after_drain``)."""
    encode = _Counting()
    memo = pc.FragmentMemo(encode)
    memo.encode("old")
    memo.age()
    memo.encode("used")
    memo.encode("old")  # found (the one age before keeps it)
    assert encode.texts == ["old", "used"]
    memo.age()
    memo.age()  # nothing used since the previous one: all gone
    memo.encode("old")
    assert encode.texts == ["old", "used", "old"] and len(memo) == 1


def test_the_tokenizer_ages_its_fragments_with_its_prompts(tokenizer: ChatTokenizer) -> None:
    tok = ChatTokenizer(tokenizer.hf, name=tokenizer.name)
    tok.encode_fragment("\n<|im_start|>user\nkept a while<|im_end|>\n")
    assert len(tok.fragments) == 1
    tok.age_prompts()
    tok.age_prompts()
    assert len(tok.fragments) == 0


def test_threads_at_once_keep_the_byte_count_true() -> None:
    """Fragments are tokenized in offload threads too: the generations and the byte count stay in step."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for _ in range(20):
                memo = pc.FragmentMemo(_Counting(), max_bytes=30_000)
                texts = [f"fragment {i % 300}" + "y" * (i % 50) for i in range(2000)]
                assert [ids.tolist() for ids in pool.map(memo.encode, texts)] == [[ord(c) for c in t] for t in texts]
                young = memo.entries.young.items()
                assert memo.entries.bytes == sum(pc.fragment_weight(t, ids) for t, ids in young) <= 30_000
                assert memo.hits + memo.misses == len(texts)
    finally:
        sys.setswitchinterval(switch)


class _Fragments(ChatTokenizer):
    """Records the texts it tokenizes (the simulated engine's replies included)."""

    texts: list[str] = []

    def encode(self, text: str) -> array[int]:
        self.texts.append(text)
        return super().encode(text)


async def test_a_session_repeating_another_ones_turns_tokenizes_no_fragment_again(tokenizer: ChatTokenizer) -> None:
    """Two sessions, the same messages: the second one's continuing turns take their fragments from the memo,
    and record the same prompt ids."""
    tok = _Fragments(tokenizer.hf, name=tokenizer.name)
    tok.texts = []
    engine = SimEngine(tok, SimConfig(seed=3, token_interval=0.0))
    prompts: dict[str, list[list[int]]] = {}
    fragments: dict[str, list[str]] = {}
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tok) as runtime:
        for session in ("a", "b"):
            messages: list[dict[str, Any]] = [{"role": "user", "content": "Question 0"}]
            prompts[session], fragments[session] = [], []
            for turn in range(1, 4):
                tok.texts.clear()
                result = await run_turn(runtime, session, messages, max_tokens=4)
                assert result.done is not None
                assert result.done.ids is not None
                prompts[session].append(list(result.done.ids.prompt_ids))
                fragments[session] += [t for t in tok.texts if t.endswith("<|im_start|>assistant\n")]
                reply = result.done.output
                messages = [*messages, {"role": "assistant", "content": reply.content,
                                        "reasoning_content": reply.reasoning or None},
                            {"role": "user", "content": f"Question {turn}: and é 日本?"}]
    assert len(fragments["a"]) == 3  # the first prompt and two fragments, each tokenized
    assert fragments["b"] == fragments["a"][:1]  # only the first prompt (shorter than the prompt cache takes)
    assert prompts["a"] == prompts["b"]
