"""A chat call as the session sees it, protocol-neutral, and who it belongs to."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class Identity:
    """Who a request belongs to (from headers, URL or body)."""

    session_id: str
    instance_id: str | None = None
    turn_id: str | None = None
    rollout_id: str | None = None
    #: Who opens the session, for the per-client session bound (``key:<session>`` for an agent's session key,
    #: ``addr:<ip>`` otherwise); ``None``: the trainer (the admin token) or a program embedding the proxy.
    client: str | None = None


@attrs.frozen
class ChatRequest:
    """A chat call, protocol-neutral: what the session actor needs to run a turn."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] = attrs.field(factory=list)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    enable_thinking: bool | None = None
    #: OpenAI ``stop`` sequences, applied to the reply's content.
    stop: tuple[str, ...] = ()
    #: The agent reads the reply as a stream (it may already have seen part of it).
    stream: bool = False
