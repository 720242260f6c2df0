"""The start-up tokenizer check against engines that agree, disagree or cannot say.

The engines here are scripted servers on port 0 answering llama.cpp's and vLLM's tokenize routes
with a real tokenizer; tests/realengine/ runs the check against a real llama-server.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from _handler_server import UNREACHABLE, serving

from actorproxy.engines.engine_check import (
    TokenizerMismatch,
    check_endpoints,
    check_engine_tokenizer,
    probe_texts,
    vocab_fits,
)
from actorproxy.http.client import HTTP11Client
from actorproxy.tokenization.tokenizer import ChatTokenizer

Tokenize = Callable[[str], list[int]]


def fake_engine(
    kind: str, tokenize: Tokenize | None, n_vocab: int | None, calls: list[str]
) -> Callable[[httpx.Request], httpx.Response]:
    """An engine's tokenizer routes (served by ``_handler_server``)."""

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path == "/v1/models" and kind == "llamacpp":
            meta = {"n_vocab": n_vocab} if n_vocab is not None else {}
            return httpx.Response(200, json={"data": [{"id": "m", "meta": meta}]})
        if request.url.path == "/tokenize" and tokenize is not None:
            body: dict[str, Any] = json.loads(request.content)
            if kind == "llamacpp":
                assert body["add_special"] is False and body["parse_special"] is True
                return httpx.Response(200, json={"tokens": tokenize(body["content"])})
            assert body["add_special_tokens"] is False
            return httpx.Response(200, json={"tokens": tokenize(body["prompt"]), "count": 0})
        return httpx.Response(404, json={"error": "not found"})

    return handler


async def run_check(tok: ChatTokenizer, kind: str, tokenize: Tokenize | None, n_vocab: int | None) -> list[str]:
    calls: list[str] = []
    async with serving(fake_engine(kind, tokenize, n_vocab, calls)) as url:
        http = HTTP11Client(url)
        await check_endpoints(tok, [(kind, url, http)])
        await http.aclose()
    return calls


@pytest.mark.parametrize("kind", ["llamacpp", "vllm", "sglang"])
async def test_agreeing_engine_passes(tokenizer: ChatTokenizer, kind: str) -> None:
    calls = await run_check(tokenizer, kind, lambda t: list(tokenizer.encode(t)), 151936)
    assert calls.count("/tokenize") == len(probe_texts(tokenizer))


async def test_other_vocabulary_refuses(tokenizer: ChatTokenizer) -> None:
    # A Gemma 3 llama-server reports 262144 tokens: the built-in qwen3 tokenizer must not start.
    with pytest.raises(TokenizerMismatch, match="vocabulary has 262144 tokens, tokenizer 'qwen3' has 151669"):
        await run_check(tokenizer, "llamacpp", lambda t: list(tokenizer.encode(t)), 262144)


@pytest.mark.parametrize("kind", ["llamacpp", "vllm"])
async def test_other_tokenization_refuses(tokenizer: ChatTokenizer, kind: str) -> None:
    # Same vocabulary size, but the engine does not know <|im_end|> as one token.
    split = list(tokenizer.encode("<|im_end"))

    def engine_tokenize(text: str) -> list[int]:
        ids = list(tokenizer.encode(text))
        return [part for t in ids for part in (split if t == tokenizer.eot_token_id else [t])]

    with pytest.raises(TokenizerMismatch) as info:
        await run_check(tokenizer, kind, engine_tokenize, 151936)
    message = str(info.value)
    assert "\n" not in message
    assert "the engine tokenizes" in message and "--skip-tokenizer-check" in message


async def test_engine_that_cannot_say_is_not_refused(
    tokenizer: ChatTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    calls = await run_check(tokenizer, "llamacpp", None, None)
    assert calls == ["/v1/models", "/tokenize"]
    assert "not checked" in caplog.text


async def test_unreachable_engine_is_left_to_the_runtime(tokenizer: ChatTokenizer) -> None:
    http = HTTP11Client(UNREACHABLE)  # nothing listens there: refused
    await check_endpoints(tokenizer, [("vllm", UNREACHABLE, http)])


def test_vocab_padding() -> None:
    assert vocab_fits(151669, 151936)  # Qwen3's padded embedding table
    assert vocab_fits(262144, 262144)
    assert not vocab_fits(151669, 262144)
    assert not vocab_fits(262144, 151936)  # the engine lacks ids we may send


def test_cli_has_the_flag() -> None:
    from actorproxy.cli import build_parser, config_from_args

    args = build_parser().parse_args(["run", "--skip-tokenizer-check"])
    assert config_from_args(args).engines.skip_tokenizer_check is True
    assert config_from_args(build_parser().parse_args(["run"])).engines.skip_tokenizer_check is False


async def test_the_engine_clients_own_connections_are_used(tokenizer: ChatTokenizer) -> None:
    from actorproxy.engines.llamacpp.client import LlamaCppBackend
    from actorproxy.engines.pool import EnginePool
    from actorproxy.sim import SimConfig, SimEngine

    calls: list[str] = []
    async with serving(fake_engine("llamacpp", lambda t: list(tokenizer.encode(t)), 262144, calls)) as url:
        backend = LlamaCppBackend(url)
        pool = EnginePool([backend])
        with pytest.raises(TokenizerMismatch, match="262144"):
            await check_engine_tokenizer(tokenizer, pool)
        assert calls == ["/v1/models"] + ["/tokenize"] * len(probe_texts(tokenizer))
        assert backend.http.opened == 1  # the engine client's own pool, its one connection kept alive
        await check_engine_tokenizer(tokenizer, SimEngine(tokenizer, SimConfig()))  # in-process: nothing to ask
        await pool.aclose()
