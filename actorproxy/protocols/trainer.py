"""The bodies of our own trainer and operator routes (unknown keys are refused: typos fail loudly)."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from ..schema.converter import FieldError, at_least, at_most, ours
from ..store.base import LONGEST_LEASE


def _non_empty(instance: object, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and not value:
        raise FieldError("must be a non-empty string")


@ours
@attrs.frozen
class FinalizeBody:
    """``POST /session/finalize``."""

    session_id: str = attrs.field(validator=_non_empty)
    reward: float | None = None
    instance_id: str | None = attrs.field(default=None, validator=_non_empty)
    #: Dressage's: the sample's label (any JSON), kept on the segments this call closes (``metadata.label``).
    label: Any = None


@ours
@attrs.frozen
class ReadBody:
    """``POST /trajectory/read``."""

    session_id: str | None = attrs.field(default=None, validator=_non_empty)
    trajectory_id: str | None = attrs.field(default=None, validator=_non_empty)
    drain: bool = False
    include_steps: bool = False
    #: Dressage's: only this prompt group's segments.
    instance_id: str | None = attrs.field(default=None, validator=_non_empty)
    #: Dressage's batch read (neither id): at most this many prompt groups.
    max_groups: int | None = attrs.field(default=None, validator=at_least(1))
    #: Dressage's segment view; ``lineage`` (a segment per unbroken conversation) is what is recorded.
    segment_view: Literal["lineage"] | None = None
    #: A drain's: seconds what it read stays held for the trainer's ``POST /trajectory/ack`` (deleted then),
    #: given back for the next drain if none came.
    lease: float | None = attrs.field(default=None, validator=[at_least(1), at_most(LONGEST_LEASE)])


@ours
@attrs.frozen
class AckBody:
    """``POST /trajectory/ack``: a leased drain's data arrived (deleted), or is given back (``release``)."""

    lease: str = attrs.field(validator=_non_empty)
    release: bool = False


@ours
@attrs.frozen
class PauseBody:
    """``POST /v1/rollout/pause`` (an empty body means the defaults)."""

    mode: Literal["abort", "wait", "keep"] = "abort"
    #: Dressage's: why (shown in ``pause_state`` until the resume).
    reason: str | None = None
    #: Dressage's: seconds the pause may wait for the generations in flight to stop.
    timeout_seconds: float | None = attrs.field(default=None, validator=at_least(0))


@ours
@attrs.frozen
class ResumeBody:
    """``POST /v1/rollout/resume``: ``weight_version`` (Dressage: ``version``) is a label or a number, kept as text."""

    weight_version: str | int | None = None
    bump_epoch: bool = False
    version: str | int | None = None
    reason: str | None = None


@ours
@attrs.frozen
class DiscardBody:
    """``POST /session/discard``: drop a rejected attempt's session, live and stored."""

    session_id: str = attrs.field(validator=_non_empty)


@ours
@attrs.frozen
class OpenSessionBody:
    """``POST /session/open``."""

    session_id: str | None = None
