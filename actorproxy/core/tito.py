"""Token in, token out: the append-only contract and fragment rendering (sans-IO).

An :class:`OpenSegment` holds the exact ids of one growing training sample and
the messages those ids account for. For each new request :func:`plan_turn`
decides:

* **continue** — the request's messages start with the accounted ones (the
  assistant turns we produced compared by meaning, see ``messages``), the tools
  are unchanged, and there are new messages. Only the new messages are rendered
  (:func:`render_fragment`) and tokenized; sampled ids are never re-tokenized.
* **fresh** — anything else opens a new segment whose prompt is the whole
  conversation rendered once, with a reason code saying why.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Mapping, Sequence
from operator import attrgetter, is_
from typing import Any, Literal

import attrs

from ..tokenization.message_fields import FrozenMessage
from ..tokenization.tokenizer import ChatTokenizer
from .messages import AssistantOutput, echo_tolerance, message_key
from .records import Step

BoundaryReason = Literal[
    "session_start",
    "history_rewrite",
    "system_changed",
    "tool_schema_change",
    "tito_failure",
    "template_not_append_only",
]

#: Stands in for an assistant reply when rendering a fragment; cannot occur in real text.
_MARKER = "\u2063actorproxy-fragment\u2063"


class FragmentError(Exception):
    """The template cannot render the new messages as a continuation."""


def snapshot(value: Any) -> Any:
    """A copy of a JSON-like value down to its strings (which are immutable anyway).

    What the segment remembers of a message must not change when an in-process
    agent edits its own dict in place afterwards.
    """
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    return value


@attrs.define(eq=False)
class _Accounted:
    """One message the segment's ids account for."""

    key: tuple[Any, ...] | None = None
    #: The assistant reply we generated (matched by meaning, not bytes).
    output: AssistantOutput | None = None
    #: A snapshot of the last dict that matched: an equal dict next time matches at C speed, and the
    #: same ``FrozenMessage`` (which the wire layer hands out every turn, never edited) by identity.
    raw: Mapping[str, Any] | None = None
    #: The client's rewrites of our reply the echo matching saw through (``echo_tolerance``), once each.
    tolerated: frozenset[str] = frozenset()

    def matches(self, message: Mapping[str, Any]) -> bool:
        if self.raw is not None and (self.raw is message or self.raw == message):
            return True
        if self.output is not None:
            tolerated = echo_tolerance(message, self.output)
            ok = tolerated is not None
            self.tolerated = self.tolerated.union(tolerated or ())
        else:
            ok = message_key(message) == self.key
        if ok:
            self.raw = message if type(message) is FrozenMessage else snapshot(message)
        return ok


_raw = attrgetter("raw")


@attrs.define(eq=False)
class _Mark:
    """The segment as it was before a step was added (so a retry can take the step back)."""

    context_len: int
    accounted_len: int
    closed_by_eot: bool
    closed_by: int | None
    last_request: Any


@attrs.define(eq=False)
class OpenSegment:
    """The growing segment of a session: its ids, its messages, its steps."""

    index: int
    start_reason: str
    tools_key: str
    #: Every id of the segment so far: what the engine saw plus what it sampled.
    context_ids: array[int] = attrs.field(factory=lambda: array("i"))
    accounted: list[_Accounted] = attrs.field(factory=list)
    steps: list[Step] = attrs.field(factory=list)
    #: Whether the last sampled token was an end-of-turn token.
    closed_by_eot: bool = True
    #: That token, when it was one (``None`` at the start: the fragment then holds the whole prompt).
    closed_by: int | None = None
    #: The request of the last step added (held by reference): last-step mode and verification re-render it.
    last_request: Any = None
    #: Times the prefix was rebuilt in place (``--on-history-rewrite recompute``), by reason.
    rebuilds: list[str] = attrs.field(factory=list)
    #: Steps whose ids a rebuild replaced. Those whose replies are still in the new conversation are
    #: trained there, re-rendered (the rebuilding step's ``rebuilt_spans``); the others are gone.
    rebuilt_steps: list[Step] = attrs.field(factory=list)
    _marks: list[_Mark] = attrs.field(factory=list)

    def account_messages(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """Account context messages; they must be :func:`snapshot` copies (the segment keeps them)."""
        self.accounted.extend(_Accounted(key=message_key(m), raw=m) for m in messages)

    def add_turn(
        self, step: Step, new_messages: Sequence[Mapping[str, Any]], request: Any, eot_token_id: int | Collection[int]
    ) -> None:
        """Account a completed turn: its new messages, then its fragment and sampled ids."""
        mark = _Mark(len(self.context_ids), len(self.accounted), self.closed_by_eot, self.closed_by, self.last_request)
        self._marks.append(mark)
        self.account_messages(new_messages)
        self.add_generation(step, eot_token_id)
        self.last_request = request

    def add_generation(self, step: Step, eot_token_id: int | Collection[int]) -> None:
        """Append a finished step's fragment and sampled ids to the segment.

        ``eot_token_id``: the token(s) that close a turn (``ChatTokenizer.turn_end_ids``).
        """
        self.context_ids.extend(step.fragment_ids)
        self.context_ids.extend(step.output_ids)
        if step.output is not None:
            self.accounted.append(_Accounted(output=step.output))
        ends = (eot_token_id,) if isinstance(eot_token_id, int) else eot_token_id
        last = step.output_ids[-1] if step.output_ids else None
        self.closed_by = last if last is not None and last in ends else None
        self.closed_by_eot = self.closed_by is not None
        step.in_segment = True
        self.steps.append(step)

    def rebuild(self, reason: str, tools_key: str) -> None:
        """Drop the ids and steps so far: the next step's fragment is the whole conversation rebuilt."""
        for step in self.steps:
            step.in_segment = False
        self.rebuilt_steps.extend(self.steps)
        self.rebuilds.append(reason)
        self.steps = []
        self._marks = []
        self.accounted = []
        self.context_ids = array("i")
        self.closed_by_eot = True
        self.closed_by = None
        self.last_request = None
        self.tools_key = tools_key

    def pop_last(self) -> Step:
        """Take the last turn back out (a retry replaces it): the segment is as it was before it."""
        step = self.steps.pop()
        mark = self._marks.pop()
        del self.context_ids[mark.context_len :]
        del self.accounted[mark.accounted_len :]
        self.closed_by_eot = mark.closed_by_eot
        self.closed_by = mark.closed_by
        self.last_request = mark.last_request
        step.in_segment = False
        return step

    def push_back(
        self, step: Step, new_messages: Sequence[Mapping[str, Any]], request: Any, eot: int | Collection[int]
    ) -> None:
        """Undo :meth:`pop_last` (the retry was refused before anything was recorded)."""
        self.add_turn(step, new_messages, request, eot)

    def repeats_last_request(self, messages: Sequence[Mapping[str, Any]]) -> bool:
        """Whether ``messages`` is the last step's request again (compared as the append-only check does)."""
        if not self.steps:
            return False
        count = self.steps[-1].message_count
        if len(messages) != count:
            return False
        return all(entry.matches(m) for entry, m in zip(self.accounted[:count], messages, strict=True))


@attrs.frozen
class Continue:
    """Extend the open segment with ``new_messages`` rendered as a fragment."""

    new_messages: list[dict[str, Any]]


@attrs.frozen
class Fresh:
    """Open a new segment (closing the current one, if any) for ``reason``."""

    reason: BoundaryReason


TurnPlan = Continue | Fresh


def plan_turn(
    segment: OpenSegment | None, messages: Sequence[dict[str, Any]], tools_key: str, *, append_only: bool = True
) -> TurnPlan:
    """Decide whether ``messages`` append to ``segment`` (see module docstring).

    ``append_only=False`` (the chat template failed :func:`~.template_probe.probe_template`):
    every turn is rendered whole, with the reason ``template_not_append_only``.
    """
    if segment is None or not segment.steps:
        return Fresh("session_start")
    if not append_only:
        return Fresh("template_not_append_only")
    if tools_key != segment.tools_key:
        return Fresh("tool_schema_change")
    accounted = segment.accounted
    # The very frozen messages that matched before match (a C loop); the others are compared one by one.
    same = list(map(is_, map(_raw, accounted), messages))
    start = same.index(False) if False in same else len(same)
    for entry, message in zip(accounted[start:], messages[start:], strict=False):
        if not entry.matches(message):
            was_system = entry.key is not None and entry.key[0] == "system"
            if was_system and message.get("role") == "system" and entry is accounted[0]:
                return Fresh("system_changed")
            return Fresh("history_rewrite")
    if len(messages) <= len(accounted):
        # A prefix of what we have, with nothing new to answer: history was cut.
        return Fresh("history_rewrite")
    return Continue(list(messages[len(accounted) :]))


def render_fragment(
    tokenizer: ChatTokenizer,
    new_messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None,
    closed_by_eot: bool,
    enable_thinking: bool | None,
    closed_by: int | None = None,
) -> str:
    """The text the template writes after the last sampled token for ``new_messages``.

    The template is applied to a stand-in conversation (a user turn and an
    assistant reply holding a marker) followed by the new messages; the
    fragment is what follows the marker. When the reply ended with an
    end-of-turn token (``closed_by``, else the tokenizer's ``eot_token_id``) the
    engine already sampled it, so its text is dropped from the front of the
    fragment; the template must write that very token there (GLM-4.5 writes
    ``<|observation|>`` before tool results and ``<|user|>`` before a user turn,
    and the model must have sampled the one that fits). Cost depends on the new
    messages and the tool list, never on the history.
    """
    stand_in = [{"role": "user", "content": "."}, {"role": "assistant", "content": _MARKER}]
    try:
        text = tokenizer.render(
            [*stand_in, *new_messages],  # copied for the template by ``render``
            tools=tools,
            add_generation_prompt=True,
            enable_thinking=enable_thinking,
        )
    except Exception as exc:  # a template may raise anything (jinja, ValueError, TypeError)
        raise FragmentError(f"template failed on the new messages: {exc}") from exc
    if text.count(_MARKER) != 1:
        # Dropped by the template, or also written in a new message (then we cannot tell where the reply ends).
        raise FragmentError("the stand-in reply is missing from the rendering, or occurs more than once")
    at = text.find(_MARKER)
    fragment = text[at + len(_MARKER) :]
    if closed_by_eot:
        eot_text = tokenizer.token_text(tokenizer.eot_token_id if closed_by is None else closed_by)
        if not fragment.startswith(eot_text):
            raise FragmentError(f"the template does not write the sampled {eot_text!r} after the reply")
        fragment = fragment[len(eot_text) :]
    return fragment


def reasoning_opened_by_prompt(tokenizer: ChatTokenizer, prompt_tail: Sequence[int]) -> bool:
    """Whether the generation prompt leaves a ``<think>`` block open (the model starts inside it)."""
    start, end = tokenizer.think_start_id, tokenizer.think_end_id
    if start is None or end is None:
        return False
    for tid in reversed(prompt_tail):
        if tid == end:
            return False
        if tid == start:
            return True
    return False
