"""What the actors answer: attrs classes, turned into JSON only in ``server/`` by the wire converter.

A field named in a class's ``__wire_omit_if_default__`` is left out of its JSON
while it holds its default (``sub_agents`` of a session without any, ``engines``
when the engines are not paused with the proxy).
"""

from __future__ import annotations

from typing import Literal

import attrs

from ..store.base import ReadResult as ReadResult

PauseMode = Literal["abort", "wait", "keep"]


@attrs.frozen
class FinalizeResult:
    """A session finalized into the store: how many segments and steps it handed over."""

    __wire_omit_if_default__ = ("sub_agents", "trajectory_file", "refused")

    session_id: str
    segments: int
    steps: int
    #: Its sub-agents' child sessions, finalized with it (``None``: it had none).
    sub_agents: list[FinalizeResult] | None = None
    #: Where ``--trajectory-dir`` wrote its ``proxy_trajectory.json`` (set by the ingress).
    trajectory_file: str | None = None
    #: Turns its guards refused (nothing recorded), by error code (``context_overflow``...); ``None``: none.
    refused: dict[str, int] | None = None


@attrs.frozen
class EngineAck:
    """One engine's answer to a pause, resume or new weight version forwarded to it."""

    __wire_omit_if_default__ = ("error",)

    engine: str
    ok: bool
    error: str | None = None


@attrs.frozen(kw_only=True)
class PauseAck:
    """Generation is paused: every generation in flight stopped (or finished) and recorded its output."""

    __wire_omit_if_default__ = ("engines",)

    status: Literal["paused"] = "paused"
    mode: PauseMode | None
    #: Generations stopped by this pause, and the tokens they had sampled (kept, resumed later).
    aborted: int
    partial_tokens: int
    weight_version: str
    epoch: int
    #: ``--engine-pause``: what each engine answered (``None``: not forwarded).
    engines: list[EngineAck] | None = None


@attrs.frozen(kw_only=True)
class ResumeAck:
    """Generation runs again, under ``weight_version`` and ``epoch``."""

    status: Literal["running"] = "running"
    #: Was it paused (a resume while running changes only the version)?
    resumed: bool
    #: Turns that were waiting for permission and now generate.
    woken: int
    weight_version: str
    epoch: int


@attrs.frozen(kw_only=True)
class PauseState:
    """The controller at a glance (``/v1/rollout/pause_state``, the dashboard, ``/metrics``)."""

    state: Literal["paused", "running"]
    mode: PauseMode | None
    weight_version: str
    epoch: int
    in_flight: int
    waiting: int
    pauses: int
    resumes: int
    aborted_total: int
    #: Tokens sampled so far by each session's generation in flight (for the test harness).
    in_flight_tokens: dict[str, int]
