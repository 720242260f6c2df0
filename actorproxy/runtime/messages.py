"""Messages between the ingress and the actors, and the events of a turn."""

from __future__ import annotations

from typing import Any

import attrs
import trio

from ..core.messages import AssistantOutput
from ..core.parser import OutputDelta
from ..errors import ProxyError
from .actor import Reply


@attrs.frozen
class Identity:
    """Who a request belongs to (from headers, URL or body)."""

    session_id: str
    instance_id: str | None = None
    turn_id: str | None = None
    rollout_id: str | None = None


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


# -- events a session sends back while it runs a turn ------------------------


@attrs.frozen
class TurnAccepted:
    step_index: int
    prompt_tokens: int


@attrs.frozen
class TurnDelta:
    delta: OutputDelta


@attrs.frozen
class TurnDone:
    step_index: int
    output: AssistantOutput
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    tool_call_parse_error: bool
    #: The request's stop sequence that ended the reply, if one did.
    stop_sequence: str | None = None
    #: The session that ran the turn (a sub-agent's child session, when routed there).
    session_id: str | None = None


@attrs.frozen
class TurnFailed:
    error: ProxyError


@attrs.frozen
class TurnMoved:
    """The ingress sends the turn again: to the session's successor (it was retiring), or to ``session_id``.

    ``session_id`` names a sub-agent's child session the turn belongs to.
    """

    session_id: str | None = None


TurnEvent = TurnAccepted | TurnDelta | TurnDone | TurnFailed | TurnMoved


# -- session mailbox messages -------------------------------------------------


@attrs.frozen
class RunTurn:
    request: ChatRequest
    identity: Identity
    events: trio.MemorySendChannel[TurnEvent]


@attrs.frozen
class FinalizeSession:
    reward: float | None
    reason: str
    reply: Reply
    #: Names the prompt group when the session's turns did not.
    instance_id: str | None = None


@attrs.frozen
class DescribeSession:
    reply: Reply
