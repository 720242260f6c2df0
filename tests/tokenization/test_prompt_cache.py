"""Whole prompts are tokenized once per distinct prefix (issue 12): the same ids, less work.

A session's first turn tokenizes its whole prompt; what it shares with an earlier
prompt (the agent's system prompt and tools, or the whole prompt of a rollout of
the same prompt group) is taken from :class:`~actorproxy.tokenization.prompt_cache.PromptCache`.
The ids must be exactly ``encode``'s, whatever the text holds (special tokens
written in it, whitespace and Unicode at the cuts), and a tokenizer the cut could
change is never cut.
"""

from __future__ import annotations

import concurrent.futures
import sys
from array import array
from typing import Any

import attrs
import hypothesis.strategies as st
from _util import run_turn
from hypothesis import HealthCheck, given, settings

from actorproxy.config import ProxyConfig
from actorproxy.runtime.offload import Offload
from actorproxy.runtime.runtime import open_runtime
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.tokenization import prompt_cache as pc
from actorproxy.tokenization.tokenizer import ChatTokenizer

SYSTEM = "You are a coding agent. Follow the rules of the repository. " * 60
TOOL = {"type": "function", "function": {"name": "read_file", "description": "Read a file. " * 20, "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


class Counted(ChatTokenizer):
    """Counts the characters tokenized (the prompts, not the simulated engine's replies)."""

    chars: list[int] = []

    def encode(self, text: str) -> Any:
        if "<|im_start|>" in text:  # a prompt (the simulated engine tokenizes its replies too)
            self.chars.append(len(text))
        return super().encode(text)


async def test_a_new_session_tokenizes_only_what_its_prompt_does_not_share(tokenizer: ChatTokenizer) -> None:
    """Same system prompt and tools, another task: the shared part is not tokenized again; same ids."""
    tok = Counted(tokenizer.hf, name=tokenizer.name)
    tok.chars = []
    engine = SimEngine(tok, SimConfig(seed=3, token_interval=0.0))
    prompts: dict[str, list[int]] = {}
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tok,
                            offload=Offload.threads()) as runtime:
        for session, task in [("a", "Fix the parser."), ("b", "Write the docs."), ("c", "Fix the parser.")]:
            tok.chars.clear()
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
            assert (await run_turn(runtime, session, messages, tools=[TOOL], max_tokens=4)).done is not None
            prompts[session] = list(tok.chars)
        first, other, same = (max(prompts[s], default=0) for s in "abc")
    assert first > 4000  # the whole prompt, once
    assert other < 200 and same < 200, prompts  # the task and the generation prompt only; nothing at all again


def test_the_ids_are_encodes_for_every_prompt(tokenizer: ChatTokenizer) -> None:
    cache = pc.prompt_cache(tokenizer.encode, dict(tokenizer.hf.added_tokens_decoder), tokenizer.render(
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]))
    assert cache is not None and cache.cut == "<|im_start|>"
    base = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "one"}]
    texts = [
        tokenizer.render(base, tools=[TOOL]),
        tokenizer.render(base, tools=[TOOL]),  # the same prompt: every id from the cache
        tokenizer.render([*base[:1], {"role": "user", "content": " two\n\n"}], tools=[TOOL]),
        tokenizer.render([*base[:1], {"role": "user", "content": "<|im_start|>user\nwritten in"}], tools=[TOOL]),
        tokenizer.render([*base, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "é"}]),
    ]
    for text in texts:
        assert cache.encode(text).tolist() == tokenizer.encode(text).tolist()
    assert cache.hits >= 3


_text = st.lists(st.sampled_from(["a", "b", " ", "\n", "\t", "é", "e\u0301", "日", "!", "1", "<|im_start|>",
                                  "<|im_end|>", "<think>", "<|im_start|>user\n", "\u2063", "<|im_"]),
                 max_size=12).map("".join)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(parts=st.lists(st.tuples(_text, _text), min_size=2, max_size=6))
def test_cut_or_whole_the_ids_are_the_same(tokenizer: ChatTokenizer, parts: list[tuple[str, str]]) -> None:
    """Prompts sharing prefixes (of any text, special tokens included): ``encode`` every time."""
    cache = pc.PromptCache(tokenizer.encode, "<|im_start|>", tokenizer.hf.convert_tokens_to_ids("<|im_start|>"))
    head = "<|im_start|>system\n" + "x " * 600
    for system, user in parts:
        for text in (head + system, head + system + "<|im_start|>user\n" + user, head + user + system):
            assert cache.encode(text).tolist() == tokenizer.encode(text).tolist()


@attrs.frozen
class _Added:
    content: str
    special: bool = True
    normalized: bool = False
    lstrip: bool = False
    rstrip: bool = False
    single_word: bool = False


def _toy_encode(text: str) -> array[int]:
    """Special tokens split off, the rest one id per character."""
    ids = array("i")
    while text:
        if text.startswith("<s>"):
            ids.append(1000)
            text = text[3:]
        else:
            ids.append(ord(text[0]) % 1000)
            text = text[1:]
    return ids


def test_a_tokenizer_the_cut_could_change_is_never_cut() -> None:
    sample = "<s>system\ns<s>user\nu<s>assistant\n"
    assert pc.prompt_cache(_toy_encode, {1000: _Added("<s>")}, sample) is not None
    for changed in ({1000: _Added("<s>", lstrip=True)}, {1000: _Added("<s>", normalized=True)},
                    {1000: _Added("<s>"), 1001: _Added("x<", special=False)},  # could straddle the cut
                    {1000: _Added("<s>"), 1001: _Added("a<s>b", special=False)}):
        assert pc.prompt_cache(_toy_encode, changed, sample) is None

    def first_differs(text: str) -> array[int]:  # a text's first piece is tokenized otherwise (Metaspace "first")
        ids = _toy_encode(text)
        for i, tid in enumerate(ids):
            if tid != 1000:
                ids[i] += 1
                break
        return ids

    assert pc.prompt_cache(first_differs, {1000: _Added("<s>")}, sample) is None
    assert pc.prompt_cache(_toy_encode, {1000: _Added("<s>")}, "no special token here") is None


def test_the_cache_is_bounded() -> None:
    cache = pc.PromptCache(_toy_encode, "<s>", 1000, max_bytes=20_000)
    for i in range(50):
        text = f"<s>system {i}\n" + "y" * 2000 + "<s>user\nq"
        assert cache.encode(text).tolist() == _toy_encode(text).tolist()
    kept = [e for gen in (cache._young, cache._old) for v in gen.values() for e in v]
    assert sum(len(text) + 4 * len(ids) for text, ids in kept) <= 40_000


def _utf32(text: str) -> array[int]:
    """One id per character, its code point (at C speed: the threads spend their time in the cache)."""
    ids = array("i")
    ids.frombytes(text.encode("utf-32-le"))
    return ids


def test_threads_writing_at_once_keep_the_byte_count_true() -> None:
    """Prompts are tokenized in offload threads, and the generations and their byte count were updated
    without a lock: a thread that kept an entry while another turned the generations over counted its
    bytes in the new young generation (the bound approximate, the count drifting from what is kept)."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between any two bytecodes, as often as they can
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            for _ in range(40):  # a race: before the lock about one round in six went wrong
                cache = pc.PromptCache(_utf32, "§", ord("§"), max_bytes=30_000)
                texts = [f"§system {i % 7}\n" + "y" * (1100 + i % 50) + f"§user\nq{i}" for i in range(2000)]
                assert list(pool.map(cache.encode, texts)) == list(map(_utf32, texts))
                young = [entry for entries in cache._young.values() for entry in entries]
                assert cache._bytes == sum(len(text) + 4 * len(ids) for text, ids in young) <= 30_000
                assert cache.hits + cache.misses == len(texts)
    finally:
        sys.setswitchinterval(switch)


def test_the_cache_ages_as_the_message_memo() -> None:
    """Its prompts (whole conversations) are a session's data: what no prompt used since the previous age
    goes at the next (``Runtime.after_drain``), instead of staying until the byte bound."""
    cache = pc.PromptCache(_toy_encode, "<s>", 1000)
    old, used = ("<s>system\n" + c * 2000 + "<s>user\nq" for c in "ab")
    cache.encode(old)
    cache.age()
    cache.encode(used)
    cache.encode(old)  # found, a hit (the one age before keeps it)
    assert (cache.hits, cache.misses) == (1, 2)
    cache.age()
    cache.age()  # nothing used since the previous one: all gone
    cache.encode(old)
    assert (cache.hits, cache.misses) == (1, 3)
