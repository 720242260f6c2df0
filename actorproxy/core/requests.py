"""A chat call as the session sees it, protocol-neutral, and who it belongs to."""

from __future__ import annotations

from collections.abc import Iterable
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
    #: A sub-agent's call that says so (Claude Code's ``X-Claude-Code-Agent-Id``, Codex's ``thread-id``, opencode's
    #: ``X-Parent-Session-Id``): the sub-agent as the agent names it. The session sends its turns to a child session,
    #: one per name.
    sub_agent: str | None = None


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
    #: How many alternatives of each sampled token the reply lists (OpenAI's ``top_logprobs``); 0: none.
    top_logprobs: int = 0


def holding(made: ChatRequest, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
            ) -> ChatRequest:
    """A turn's request: ``made`` (what a body's fields ask for, made once while they repeat) holding the turn's
    messages, and ``tools`` when given, by reference (built directly: ``attrs.evolve`` costs more than all of it)."""
    return ChatRequest(messages=messages, tools=made.tools if tools is None else tools, max_tokens=made.max_tokens,
                       temperature=made.temperature, top_p=made.top_p, seed=made.seed,
                       enable_thinking=made.enable_thinking, stop=made.stop, stream=made.stream,
                       top_logprobs=made.top_logprobs)


def offered_tools(sent: Iterable[dict[str, Any]] | None, choice_none: bool) -> list[dict[str, Any]]:
    """The tools a turn's prompt lists (a new list): those the agent sent, or none at all when its tool choice
    is "none" (chat's and Responses' ``"none"``, Anthropic's ``{"type": "none"}``): as OpenAI means it, the
    model is offered no tools, so the prompt does not list them."""
    return [] if choice_none or sent is None else list(sent)


#: Roles whose consecutive messages ``--merge-consecutive-messages`` joins (never the assistant's: sampled text).
_MERGED_ROLES = ("system", "user")


def merge_consecutive_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Consecutive ``system`` or ``user`` messages with string content joined into one, with a blank line.

    For templates that require strict alternation (Gemma 3: "Conversation roles must
    alternate"), which refuse what Codex and opencode send (a developer message and two
    user messages at the start). Every character is kept; an assistant's messages (what
    the model sampled) and content given as parts are left as sent. A new list: the
    caller's messages are not changed.
    """
    out: list[dict[str, Any]] = []
    for message in messages:
        last = out[-1] if out else None
        if (last is not None and message.get("role") in _MERGED_ROLES and last.get("role") == message.get("role")
                and isinstance(last.get("content"), str) and isinstance(message.get("content"), str)
                and set(last) == set(message) == {"role", "content"}):
            out[-1] = {"role": last["role"], "content": last["content"] + "\n\n" + message["content"]}
        else:
            out.append(message)
    return out
