"""The events of a turn: what a session sends back to the ingress while it runs one (plain data)."""

from __future__ import annotations

from array import array

import attrs

from ..errors import ProxyError
from .messages import AssistantOutput
from .parser import OutputDelta

#: A sampled token's most likely alternatives as the engine reported them: ``(token id, logprob)`` pairs, the
#: likeliest first.
TopLogprobs = tuple[tuple[int, float], ...]


@attrs.frozen
class TurnAccepted:
    step_index: int
    prompt_tokens: int
    #: The ids the engine was given (the step's own array, which nothing writes to after; a reader must not).
    prompt_ids: array[int] | None = None


@attrs.frozen
class TurnDelta:
    delta: OutputDelta


@attrs.frozen
class TurnIds:
    """The exact ids of a turn: what the engine was given and what it sampled.

    The finished step's arrays themselves, not copies: once a turn's result is made nothing writes to them
    (a turn's tokens are appended, re-versioned or discarded only while it generates; later turns, the
    commit and the store read them). A reader must not change them either.
    """

    prompt_ids: array[int]
    output_ids: array[int]
    output_logprobs: array[float]
    output_versions: array[int]


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
    #: The turn's exact ids (the white-box /generate returns them).
    ids: TurnIds | None = None
    #: When the first piece of a non-streamed reply was sampled (``time.perf_counter``), for time to first token.
    first_token_at: float | None = None
    #: Each sampled token's most likely alternatives, when the call asked for ``top_logprobs``.
    top_logprobs: list[TopLogprobs] | None = None


@attrs.frozen
class TurnFailed:
    error: ProxyError


@attrs.frozen
class TurnMoved:
    """The ingress sends the turn again: to the session's successor (it was retiring), or to ``session_id``.

    ``session_id`` names a sub-agent's child session the turn belongs to.
    """

    session_id: str | None = None


@attrs.frozen
class TurnWaiting:
    """The turn's caller still waits for its first event, an interval on (``runtime/still_waiting.py``)."""


#: The one :class:`TurnWaiting` (it carries nothing).
TURN_WAITING = TurnWaiting()

TurnEvent = TurnAccepted | TurnDelta | TurnDone | TurnFailed | TurnMoved | TurnWaiting
