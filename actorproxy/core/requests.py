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


@attrs.frozen(cache_hash=True)
class SamplingExtras:
    """Sampling settings beyond temperature and top-p that a call asked for, by the engines' own names; the
    engines' neutral values stand for those it did not ask for."""

    #: -1: the whole vocabulary.
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    #: vLLM's ``min_tokens`` (SGLang's ``min_new_tokens``): no stop id is sampled before this many tokens.
    min_tokens: int = 0
    #: Sample on past the tokenizer's end-of-turn and end-of-text ids (to the budget, or to one of
    #: ``stop_token_ids``).
    ignore_eos: bool = False
    #: Ids the call stops on besides the tokenizer's own, in the order sent (vLLM's ``stop_token_ids``).
    stop_token_ids: tuple[int, ...] = ()


#: A top-k this large is every model's whole vocabulary (SGLang's own value for it), sent as -1: SGLang keeps a
#: batch's top-ks as 32-bit integers, and a larger one kills its scheduler; vLLM reads any top-k past its
#: vocabulary as the whole of it.
WHOLE_VOCABULARY = 1 << 30

#: What a call that asks for none of them samples with.
_NEUTRAL = SamplingExtras()


def sampling_extras(*, top_k: int | None = None, min_p: float | None = None, presence_penalty: float | None = None,
                    frequency_penalty: float | None = None, repetition_penalty: float | None = None,
                    min_tokens: int | None = None, ignore_eos: bool | None = None,
                    stop_token_ids: Iterable[int] | None = None) -> SamplingExtras | None:
    """The extras a call's fields ask for (``None`` for a field not sent); ``None`` when all are neutral. A top-k
    of 0, or of :data:`WHOLE_VOCABULARY` and more, is the whole vocabulary (-1), as vLLM reads it."""
    extras = SamplingExtras(
        top_k=-1 if not top_k or top_k >= WHOLE_VOCABULARY else top_k,
        min_p=min_p or 0.0,
        presence_penalty=presence_penalty or 0.0,
        frequency_penalty=frequency_penalty or 0.0,
        repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
        min_tokens=min_tokens or 0,
        ignore_eos=bool(ignore_eos),
        stop_token_ids=tuple(dict.fromkeys(stop_token_ids or ())),
    )
    return None if extras == _NEUTRAL else extras


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
    #: Top-k, min-p and penalties, when the call asked for any (``None``: the engines' neutral values).
    extras: SamplingExtras | None = None
    #: The reply's text ends with the stop sequence or stop id that ended it (vLLM's ``include_stop_str_in_output``).
    include_stop: bool = False


def holding(made: ChatRequest, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
            ) -> ChatRequest:
    """A turn's request: ``made`` (what a body's fields ask for, made once while they repeat) holding the turn's
    messages, and ``tools`` when given, by reference (built directly: ``attrs.evolve`` costs more than all of it)."""
    return ChatRequest(messages=messages, tools=made.tools if tools is None else tools, max_tokens=made.max_tokens,
                       temperature=made.temperature, top_p=made.top_p, seed=made.seed,
                       enable_thinking=made.enable_thinking, stop=made.stop, stream=made.stream,
                       top_logprobs=made.top_logprobs, extras=made.extras, include_stop=made.include_stop)


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
