"""Is a turn's preparation small enough to run on the event loop rather than in a worker thread?

Preparing a turn (:meth:`~actorproxy.core.session_state.SessionState.prepare`)
renders and tokenizes what is new in the conversation. For a long prompt that
is tens to hundreds of milliseconds of CPU, so it runs in a worker thread
(:class:`~.offload.Offload`) and never holds the loop. But a typical agent turn
adds one short message, and then the hand-off to a thread and back (two
scheduler rounds, a futex wake-up each way) costs more than the work itself.

The decision takes two looks, and nothing is done twice. :func:`may_be_small`
first, without touching the messages: a request with many messages not seen last
turn (cutting them is work too), or the first turn (the template probe renders a
few conversations), goes to the thread whole. Otherwise the actor plans the turn on
the loop (:meth:`~actorproxy.core.session_state.SessionState.plan`: the messages
cut, what last turn already had reused, then matched against the open segment by
identity or dict comparisons) and :func:`small_turn` measures the text the plan
will render: the new messages when the turn continues the segment, the whole
conversation and its tools when it starts a new one. Up to :data:`INLINE_CHARS`
characters the plan is rendered on the loop, otherwise in the thread
(:meth:`~actorproxy.core.session_state.SessionState.render`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..core.requests import ChatRequest
from ..core.session_state import Planned, SessionState
from ..core.template_probe import cached_probe
from ..core.tito import Continue
from ..tokenization.tokenizer import ChatTokenizer

#: Characters of text to render (about 1,000 tokens) up to which a turn is prepared on the event loop.
INLINE_CHARS = 4096
#: Messages not seen last turn above which a turn goes to the worker thread without a closer look.
INLINE_NEW_MESSAGES = 32


def may_be_small(state: SessionState, request: ChatRequest, tokenizer: ChatTokenizer) -> bool:
    """Whether the turn is worth planning on the loop: few messages not seen last turn, the template probed."""
    if len(request.messages) - state.message_cut.known > INLINE_NEW_MESSAGES:
        return False
    return cached_probe(tokenizer) is not None


def small_turn(planned: Planned) -> bool:
    """Whether rendering ``planned`` renders at most ``INLINE_CHARS`` characters (see module docstring)."""
    plan = planned.plan
    if isinstance(plan, Continue):
        return _within(plan.new_messages, INLINE_CHARS)
    request = planned.request
    budget = INLINE_CHARS - _size(request.tools or [], INLINE_CHARS)
    return budget >= 0 and _within(request.messages, budget)


def _within(messages: Sequence[Mapping[str, Any]], budget: int) -> bool:
    for message in messages:
        budget -= _size(message, budget)
        if budget < 0:
            return False
    return True


def _size(value: Any, cap: int) -> int:
    """The characters of text in a JSON-like value (its strings and keys), counting no further than ``cap``."""
    if isinstance(value, str):
        return len(value)
    total = 0
    if isinstance(value, Mapping):
        for key, item in value.items():
            total += len(key) + _size(item, cap - total)
            if total > cap:
                break
    elif isinstance(value, list | tuple):
        for item in value:
            total += _size(item, cap - total)
            if total > cap:
                break
    else:
        total = 8  # a number, a bool, null
    return total
