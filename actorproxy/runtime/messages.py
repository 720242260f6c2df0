"""Messages between the ingress and the actors (the events of a turn are :mod:`actorproxy.core.turn_events`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import trio

from ..core.requests import ChatRequest as ChatRequest
from ..core.requests import Identity as Identity
from ..core.turn_events import TurnEvent
from ..schema.records import StepSummary
from .actor import Reply
from .submitted_steps import SubmitSteps
from .turn_stream import Relay

# -- session mailbox messages -------------------------------------------------


@attrs.frozen
class RunTurn:
    request: ChatRequest
    identity: Identity
    events: trio.MemorySendChannel[TurnEvent]
    #: Where a streamed delta is written from the session's task while the ingress waits, and how the session
    #: learns the agent left while it waits (``runtime/turn_stream.py``).
    relay: Relay | None = None


@attrs.frozen
class FinalizeSession:
    reward: float | None
    reason: str
    reply: Reply
    #: Names the prompt group when the session's turns did not.
    instance_id: str | None = None
    #: The gateway's channel (``train``, ``val``, ...): written on the segments as ``metadata.channel``.
    channel: str | None = None
    #: What ``register_trajectory`` said of the trajectory: ``metadata.trajectory_metadata`` of the segments.
    metadata: dict[str, Any] | None = None
    #: Set on the segments this finalize closes (Dressage's ``label``).
    segment_metadata: Mapping[str, Any] | None = None


@attrs.frozen
class DescribeSession:
    reply: Reply


@attrs.frozen
class Evict:
    """From the registry at ``--max-sessions``: this idle session retires into the store to make room."""


SessionMessage = RunTurn | FinalizeSession | DescribeSession | Evict | SubmitSteps


# -- session replies -------------------------------------------------------------


@attrs.frozen
class OpenSegmentSummary:
    """A live session's open segment at a glance."""

    segment_index: int
    steps: int
    tokens: int
    start_reason: str


@attrs.frozen
class SessionDescription:
    """A live session at a glance (``GET /session/{id}``)."""

    session_id: str
    sub_agents: list[str]
    steps: int
    next_step: int
    open_segment: OpenSegmentSummary | None
    #: The last three steps, without their arrays.
    recent_steps: list[StepSummary]


# -- registry mailbox messages --------------------------------------------------


@attrs.frozen
class Lookup:
    """The live session's mailbox for ``session_id`` (spawned if ``create``), or ``None``."""

    session_id: str
    create: bool
    reply: Reply
    #: Who opens it, when ``create`` spawns it (:attr:`Identity.client`).
    client: str | None = None


@attrs.frozen
class Census:
    reply: Reply


@attrs.frozen
class ListLive:
    """The ids of live sessions, newest first: ``(total, ids[offset:offset + limit])``."""

    offset: int
    limit: int
    reply: Reply


@attrs.frozen
class CloseAll:
    """Finalize every live session (shutdown); answered when all have flushed."""

    reason: str
    reply: Reply


@attrs.frozen
class SessionCounters:
    """What a retired session hands to its successor so indexes keep counting."""

    next_step: int = 0
    next_segment: int = 0


@attrs.frozen
class SessionRetired:
    """Sent to the registry by a session actor that has stopped reading its mailbox."""

    session_id: str
    token: object
    counters: SessionCounters
    #: The session failed on a message (it is counted as ``sessions_failed``).
    failed: bool = False


RegistryMessage = Lookup | SessionRetired | Census | ListLive | CloseAll
