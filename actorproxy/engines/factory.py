"""Build the engine pool a proxy runs on: one client per engine URL, of one kind."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .base import Backend
from .connection import EngineOptions
from .llamacpp.client import LlamaCppBackend
from .pool import EnginePool
from .sglang.client import SGLangBackend
from .vllm.client import VLLMBackend

ENGINE_KINDS = ("sglang", "vllm", "llamacpp")


def make_engine_client(kind: str, url: str, options: EngineOptions, *, routed_experts: bool = False) -> Backend:
    """The client of one engine of ``kind`` (``sglang``, ``vllm`` or ``llamacpp``)."""
    if kind == "sglang":
        return SGLangBackend(url, attrs.evolve(options, routed_experts=routed_experts))
    if kind == "vllm":
        return VLLMBackend(url, options)
    if kind == "llamacpp":
        return LlamaCppBackend(url, options)
    raise ValueError(f"unknown engine kind {kind!r}; known: {', '.join(ENGINE_KINDS)}")


def make_engine_pool(
    kind: str,
    urls: Sequence[str],
    options: EngineOptions,
    *,
    health_interval: float = 5.0,
    routed_experts: bool = False,
) -> EnginePool:
    """An :class:`EnginePool` over one client per URL; ``options.concurrency`` is each engine's limit."""
    clients = [make_engine_client(kind, url, options, routed_experts=routed_experts) for url in urls]
    return EnginePool(
        clients, names=list(urls), max_concurrency=options.concurrency, health_interval=health_interval
    )
