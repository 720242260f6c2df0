"""The conversations of one session: its main one, side calls and sub-agents (sans-IO).

An agent's session is mostly one conversation, but not only: opencode asks a
title generator first, Claude Code sends helper calls, both with another system
prompt than the agent loop; Claude Code's Task agents run whole conversations
of their own. Each conversation the session keeps is a :class:`Lane` with its
own open segment, so none breaks the append-only thread of another.

Which one is the *main* conversation is decided by what happens, not by what
came first: the first lane that **continues** (a second turn, or a reply that
calls tools and so waits for their results) becomes the main one. Until one
does, every new conversation gets a lane of its own; once one has, a new
conversation is a sub-agent's (a child session, see ``--sub-agents``). If the
session ends before any lane continued, the main one is the lane with the most
turns, then the one offered tools, then the latest.

The other lanes are **side calls**: their segments carry ``metadata.side_call``
(``--side-calls train``) or are not handed to training (``log``). A sub-agent's
child session whose one conversation ended after a single turn is a side call
too. Steps never move between lanes or sessions: the choice of the main lane
only labels segments, so a late choice can neither lose nor duplicate a step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from operator import is_
from typing import Any, get_args

import attrs

from ..tokenization.message_fields import FrozenMessage
from .messages import message_key
from .tito import BoundaryReason, OpenSegment

log = logging.getLogger(__name__)

#: Lanes one session keeps before its main conversation is known; past it, new ones are sub-agents.
MAX_LANES = 8
#: Sub-agent child sessions one session may open; past it, turns stay in the session itself. A long agent run
#: starts a sub-agent per task (each of Claude Code's Task agents has an id of its own), so the bound is far above
#: what one run needs; the children are sessions, which the registry's ``--max-sessions`` bounds all together.
MAX_SUB_AGENTS = 1024

#: Reasons that close a segment because the conversation went on (not because the session ended).
BOUNDARY_REASONS = frozenset(get_args(BoundaryReason))

ConversationKey = tuple[Any, Any]

#: The first half of the key of a sub-agent the agent named (``(AGENT_NAMED, the agent's name for it)``): a
#: :func:`conversation_key` holds message keys (tuples) or ``None``, never a string, so the two never meet.
AGENT_NAMED = "agent-named"


def conversation_key(messages: list[dict[str, Any]]) -> ConversationKey:
    """The keys of a conversation's system prompt (``None`` without one) and first other message."""
    system = messages[0] if messages and messages[0].get("role") == "system" else None
    first = next((m for m in messages if m.get("role") != "system"), None)
    return (
        message_key(system) if system is not None else None,
        message_key(first) if first is not None else None,
    )


@attrs.define(eq=False)
class Lane:
    """One conversation of a session: its key, its open segment, how it went so far."""

    key: ConversationKey
    segment: OpenSegment | None = None
    #: Completed turns (a retried turn counts once).
    turns: int = 0
    #: Its last request offered tools.
    offers_tools: bool = False
    #: Step index of its latest turn (which lane was used last).
    last_step: int = -1
    #: It continued: a second turn, or a reply that called tools.
    continued: bool = False

    def rank(self) -> tuple[int, bool, int]:
        """How likely this lane is the main one when none continued."""
        return (self.turns, self.offers_tools, self.last_step)


def find_lane(lanes: Iterable[Lane], key: ConversationKey, *, by: str) -> Lane | None:
    """The lane ``key`` belongs to: ``by="key"`` the same system prompt and first message,
    ``"system"`` the same system prompt (a rewritten conversation), ``"first"`` the same
    first message (a changed system prompt). Lanes are tried in the order given."""
    index = {"key": None, "system": 0, "first": 1}[by]
    for lane in lanes:
        if (lane.key == key) if index is None else (lane.key[index] == key[index]):
            return lane
    return None


def one_shot(lane: Lane, segment: OpenSegment, reason: str) -> bool:
    """A conversation that ended after one turn (closed by the session's end, not by a second turn)."""
    return lane.turns <= 1 and len(segment.steps) == 1 and not lane.continued and reason not in BOUNDARY_REASONS


class Conversations:
    """Which conversation of a session a turn belongs to: a lane here, or a sub-agent's child session."""

    def __init__(self, session_id: str, *, side_calls: bool, sub_agents: bool) -> None:
        self.session_id = session_id
        #: Tell side calls apart (else the session is one conversation, as a sub-agent's child is).
        self._side_calls = side_calls
        #: Route other conversations to child sessions.
        self._sub_agents = sub_agents
        self.lanes: list[Lane] = []
        #: The lane of the turn being planned (and of the session's latest turn).
        self.active = Lane((None, None))
        #: The lane that continued first: the main conversation (``None`` while none has).
        self.settled: Lane | None = None
        #: Sub-agent child sessions by (system prompt, first message) key, or by the name the agent gave one.
        self.children: dict[ConversationKey, str] = {}
        self._full = False  # (the warning that no more children open, given once)
        #: The last turn's key and the messages it was read from (its system prompts and first other message,
        #: all frozen): a turn opening with those very messages has that key (:meth:`key`).
        self._keyed: tuple[list[dict[str, Any]], ConversationKey] = ([], (None, None))

    def route(self, messages: list[dict[str, Any]], sub_agent: str | None = None) -> str | None:
        """Make the turn's conversation the active lane, or return the child session it moves to.

        A conversation is known by its system prompt and first message. The
        same system prompt is the same conversation (rewritten, maybe); so is
        the same first message under a changed system prompt (a
        ``system_changed`` boundary). Another conversation gets a lane of its
        own while no lane has continued yet; after that it is a sub-agent
        (Claude Code's Task agents) and goes to a child session, matched by its
        system prompt and first message.

        ``sub_agent``: the agent said the turn is a sub-agent's and named it
        (Claude Code's agent id, Codex's thread, opencode's ``X-Parent-Session-Id``):
        it goes to the child session kept for that name, whatever its messages, which
        may open as the main conversation's do (opencode's sub-agent has the main
        agent's system prompt; Codex's forked one its whole history) or as another
        sub-agent's (two Task agents of one type given one task).
        """
        if sub_agent is not None and self._sub_agents:
            named = (AGENT_NAMED, sub_agent)
            child = self.children.get(named) or self._new_child(named)
            if child is not None:
                return child
        key = self.key(messages)
        main = self.settled or (self.lanes[0] if self.lanes and not self._side_calls else None)
        lanes = [main, *(lane for lane in self.lanes if lane is not main)] if main else self.lanes
        lane = find_lane(lanes, key, by="key") or find_lane(lanes, key, by="system")
        child = self.children.get(key) if lane is None else None
        if child is not None:
            return child
        lane = lane or find_lane(lanes, key, by="first")
        if lane is None and (not self.lanes or (self._side_calls and self.settled is None
                                                 and len(self.lanes) < MAX_LANES)):
            lane = Lane(key)
            self.lanes.append(lane)
            if len(self.lanes) > 1:
                log.info("session %s: another conversation before the main one is known; a lane of its own",
                         self.session_id)
        if lane is None:
            child = self._new_child(key)
            if child is not None:
                return child
            lane = main or self.active  # no routing: the turn stays in the main conversation
        self.active = lane
        return None

    def key(self, messages: list[dict[str, Any]]) -> ConversationKey:
        """:func:`conversation_key` of ``messages``, not keyed again when they open with last turn's very messages.

        The key reads the system prompt and the first other message, so the messages up to that one
        decide it; when each of them is the :class:`FrozenMessage` it was last turn (nothing edits one),
        the key is last turn's (a session's turns repeat their opening messages, the same objects).
        """
        deciding, key = self._keyed
        if deciding and len(messages) >= len(deciding) and all(map(is_, deciding, messages)):
            return key
        key = conversation_key(messages)
        for end, message in enumerate(messages, 1):
            if message.get("role") != "system":
                deciding = messages[:end]
                if all(type(m) is FrozenMessage for m in deciding):
                    self._keyed = (deciding, key)
                break
        return key

    def _new_child(self, key: ConversationKey) -> str | None:
        """A new sub-agent child session for ``key``, or ``None`` (routing off, or too many)."""
        if not self._sub_agents:
            return None
        if len(self.children) >= MAX_SUB_AGENTS:
            if not self._full:
                self._full = True
                log.warning("session %s: %d sub-agents already; turns of new ones stay in the session, and may break "
                            "its segments", self.session_id, MAX_SUB_AGENTS)
            return None
        child = f"{self.session_id}/sub-{len(self.children) + 1}"
        self.children[key] = child
        log.info("session %s: a sub-agent's turn; it goes to %s", self.session_id, child)
        return child

    def continued(self, lane: Lane) -> None:
        """``lane`` goes on: the first lane to do so is the main conversation."""
        lane.continued = True
        if self.settled is None:
            self.settled = lane
            if len(self.lanes) > 1:
                log.info("session %s: the main conversation is known; %d other(s) are side calls",
                         self.session_id, len(self.lanes) - 1)

    def is_side(self, lane: Lane) -> bool:
        """Whether ``lane`` is a side call as far as known now (while no lane continued, none is)."""
        return self._side_calls and self.settled is not None and lane is not self.settled

    def at_end(self) -> Iterator[tuple[Lane, bool]]:
        """The session ends: each lane with whether it is a side call, in the order their segments opened.

        The main lane is the one that continued first, else the best ranked (:meth:`Lane.rank`).
        """
        main = self.settled or max(self.lanes, key=Lane.rank, default=None)
        for lane in sorted(self.lanes, key=lambda lane: lane.segment.index if lane.segment else -1):
            yield lane, self._side_calls and lane is not main
