"""Shared fixtures."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

import httpx
import pytest

# 'actorproxy run' processes the tests start keep their data in memory unless a test asks for
# --store sqlite with its own --data-dir (never a shared ./actorproxy-data).
os.environ.setdefault("ACTORPROXY_STORE", "memory")

from actorproxy import ProxyConfig, open_proxy  # noqa: E402
from actorproxy.serve import RunningProxy  # noqa: E402
from actorproxy.sim import SimConfig, SimEngine  # noqa: E402
from actorproxy.tokenization.tokenizer import ChatTokenizer, load_tokenizer  # noqa: E402

# Ctrl-C ends the run and a skip keeps its reason, also inside a Trio test (see tests/_trio_outcomes.py).
pytest_plugins = ["_trio_outcomes"]


@pytest.fixture(scope="session")
def tokenizer() -> ChatTokenizer:
    """The built-in qwen3 tokenizer (built into the user cache on first use, then reused)."""
    return load_tokenizer(None)


# The HTTP-level tests: a simulated engine (a module overrides ``engine`` for another seed or pace),
# a proxy in front of it on a free port, and an httpx client for it.


@pytest.fixture
async def engine(tokenizer: ChatTokenizer) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=5, token_interval=0.0005))


@pytest.fixture
async def proxy(engine: SimEngine, tokenizer: ChatTokenizer) -> AsyncIterator[RunningProxy]:
    async with open_proxy(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer) as running:
        yield running


@pytest.fixture
async def http(proxy: RunningProxy) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as client:
        yield client
