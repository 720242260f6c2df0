"""What the simulated engine is told to say (:class:`ScriptedOutput`) and what it did (:class:`SimRequestStats`)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import attrs

from ..engines.base import FinishReason


def _ids_converter(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(i) for i in value)


def _logprobs_converter(value: Sequence[float] | None) -> tuple[float, ...] | None:
    return None if value is None else tuple(array("f", value))


@attrs.frozen
class ScriptedOutput:
    """An exact output for one request: the ids are used as they are.

    ``logprobs`` (rounded to float32) default to the engine's deterministic values.
    ``finish`` is reported if every token is emitted without a stop id or the
    length limit ending it first (``"abort"`` simulates an engine-side abort).
    """

    token_ids: tuple[int, ...] = attrs.field(converter=_ids_converter)
    logprobs: tuple[float, ...] | None = attrs.field(default=None, converter=_logprobs_converter)
    finish: FinishReason = "stop"

    def __attrs_post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.token_ids):
            raise ValueError("ScriptedOutput: logprobs and token_ids differ in length")


@attrs.frozen
class SimRequestStats:
    """What the engine did for one request, as of the moment it was asked.

    ``token_ids``: emitted by the schedule (read by the consumer or not).
    ``finish_reason``: ``None`` while running. ``aborted``: ``abort()`` stopped it
    early. ``cancelled``: the caller left the block before the final event (the
    reason is then ``"abort"`` unless the engine had already finished).
    """

    rid: str
    prompt_len: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason | None
    aborted: bool
    cancelled: bool
    routing_key: str | None
    scripted: bool
    started_at: float


@attrs.define
class Plan:
    """The whole output, already cut by the limits; fixed when the generation starts."""

    ids: array[int]
    logprobs: array[float]
    reason: FinishReason
    matched: int | None
    message: str
    scripted: bool
    #: The prompt's hash (a ``hashlib.blake2b`` to go on from) when the policy made the output: an abort before its
    #: end leaves the rest for a request that continues it (:meth:`SimEngine.left_off`).
    prompt_hash: Any = None
