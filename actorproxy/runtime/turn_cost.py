"""Is a turn's preparation small enough to run on the event loop rather than in a worker thread?

Preparing a turn (:meth:`~actorproxy.core.session_state.SessionState.prepare`)
renders and tokenizes what is new in the conversation. For a long prompt that
is tens to hundreds of milliseconds of CPU, so it runs in a worker thread
(:class:`~.offload.Offload`) and never holds the loop. But a typical agent turn
adds one short message, and then the hand-off to a thread and back (two
scheduler rounds, a futex wake-up each way) costs more than the work itself.

:func:`small_turn` decides, without rendering anything: the messages are cut
(:class:`~actorproxy.tokenization.message_fields.MessageCut`: what last turn
already had is reused), matched against the open segment exactly as the
preparation will (:func:`~actorproxy.core.tito.plan_turn`: dict comparisons),
and the text of what would be rendered is measured: the new messages when the
turn continues the segment, the whole conversation and its tools when it starts
a new one. Up to :data:`INLINE_CHARS` characters the turn is prepared inline.
A request with many messages not seen last turn goes to the thread before any
of this (cutting them is work too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..core.messages import tools_key
from ..core.requests import ChatRequest
from ..core.session_state import SessionState
from ..core.template_probe import cached_probe
from ..core.tito import Continue, plan_turn
from ..tokenization.tokenizer import ChatTokenizer

#: Characters of text to render (about 1,000 tokens) up to which a turn is prepared on the event loop.
INLINE_CHARS = 4096
#: Messages not seen last turn above which a turn goes to the worker thread without a closer look.
INLINE_NEW_MESSAGES = 32


def small_turn(state: SessionState, request: ChatRequest, tokenizer: ChatTokenizer) -> bool:
    """Whether preparing ``request`` renders at most ``INLINE_CHARS`` characters (see module docstring)."""
    cut = state.message_cut
    if len(request.messages) - cut.known > INLINE_NEW_MESSAGES:
        return False
    probe = cached_probe(tokenizer)
    if probe is None:  # the first turn probes the template (renders a few conversations): in the thread
        return False
    messages = cut.cut(request.messages)  # prepare cuts again: every message is then found unchanged
    plan = plan_turn(state.segment, messages, tools_key(request.tools), append_only=probe.append_only)
    if isinstance(plan, Continue):
        return _within(plan.new_messages, INLINE_CHARS)
    budget = INLINE_CHARS - _size(request.tools or [], INLINE_CHARS)
    return budget >= 0 and _within(messages, budget)


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
