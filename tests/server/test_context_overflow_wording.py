"""A prompt that does not fit is refused in the words agent clients look for, on each protocol.

Agent CLIs tell a context overflow from another 400 by its message, and compact their
history on it (Claude Code) or report it as such. The patterns below are the clients' own,
read from the pinned builds (``scripts/agents/package-lock.json``): Claude Code matches
Anthropic's message ``^prompt is too long: \\d+ tokens > \\d+ maximum$`` (and reads the two
numbers), or on OpenAI-shaped errors phrases such as ``maximum context length``; opencode
takes a 400 whose message holds ``prompt is too long``, or ``tokens`` and ``maximum``. The
code stays ``context_overflow`` (the seeds' stable payload).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from actorproxy import ProxyConfig, open_proxy
from actorproxy.sim import SimEngine
from actorproxy.tokenization.tokenizer import ChatTokenizer

WINDOW = 64
LONG = "word " * 80  # ~80 tokens: past the window
#: Claude Code's test of an Anthropic error message for a prompt too long (and the numbers it reads from it).
CLAUDE_CODE_ANTHROPIC = re.compile(r"^prompt is too long: (\d+) tokens > (\d+) maximum$")


def opencode_sees_an_overflow(status: int, message: str) -> bool:
    lowered = message.lower()
    return status == 400 and ("prompt is too long" in lowered or ("tokens" in lowered and "maximum" in lowered))


@pytest.fixture
async def http(engine: SimEngine, tokenizer: ChatTokenizer) -> AsyncIterator[httpx.AsyncClient]:
    async with open_proxy(ProxyConfig.of(port=0, context_window=WINDOW), backend=engine, tokenizer=tokenizer) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
            yield client


@pytest.mark.parametrize("stream", [False, True])
async def test_anthropic_messages_word_it_as_anthropic_does(http: httpx.AsyncClient, stream: bool) -> None:
    body = {"model": "m", "max_tokens": 8, "stream": stream, "messages": [{"role": "user", "content": LONG}]}
    refused = await http.post("/v1/messages", json=body, headers={"X-Session-Id": f"a-{stream}"})
    assert refused.status_code == 400, refused.text
    error = refused.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    found = CLAUDE_CODE_ANTHROPIC.match(error["error"]["message"])
    assert found is not None, error
    tokens, most = map(int, found.groups())
    assert tokens >= WINDOW and most == WINDOW - 1  # the longest prompt that leaves room for one token
    assert opencode_sees_an_overflow(refused.status_code, error["error"]["message"])


async def _chat(http: httpx.AsyncClient, session: str) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": LONG}], "max_tokens": 8}
    return await http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": session})


async def _responses(http: httpx.AsyncClient, session: str) -> httpx.Response:
    body = {"model": "m", "input": LONG, "max_output_tokens": 16}
    return await http.post("/v1/responses", json=body, headers={"X-Session-Id": session})


@pytest.mark.parametrize("call", [_chat, _responses])
async def test_openai_routes_word_it_as_openai_does(http: httpx.AsyncClient, call: Any) -> None:
    refused = await call(http, "o")
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["code"] == "context_overflow" and error["type"] == "invalid_request_error"
    assert f"maximum context length is {WINDOW} tokens" in error["message"]
    assert opencode_sees_an_overflow(refused.status_code, error["message"])


async def test_the_prompt_length_guard_is_worded_alike(engine: SimEngine, tokenizer: ChatTokenizer) -> None:
    config = ProxyConfig.of(port=0, max_prompt_tokens=40)
    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as proxy, \
            httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
        body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": LONG}]}
        anthropic = (await http.post("/v1/messages", json=body, headers={"X-Session-Id": "g1"})).json()
        found = CLAUDE_CODE_ANTHROPIC.match(anthropic["error"]["message"])
        assert found is not None and int(found.group(2)) == 40, anthropic
        chat = (await _chat(http, "g2")).json()["error"]
        assert chat["code"] == "context_overflow" and "maximum prompt length is 40 tokens" in chat["message"]
        assert "--max-prompt-tokens" in chat["message"]
