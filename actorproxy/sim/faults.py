"""Fault injection for the simulated engine server.

A test (or ``POST /sim/faults``) arms faults; the routes consume them:

- ``fail_next_requests(n)``: the next ``n`` generate requests of any protocol
  get HTTP 500 before anything is generated;
- ``fail_next_parses(n)``: the next ``n`` requests to SGLang's parsing endpoints
  (``/parse_function_call``, ``/separate_reasoning``) get HTTP 500; generate
  requests are not affected (nor do they consume it);
- ``drop_next_stream(after_tokens=k)``: the next streaming request has its TCP
  connection closed, mid-body, after ``k`` tokens were sent (the client sees an
  incomplete chunked body; the engine records the request as cancelled);
- ``delay_aborts(seconds)``: abort calls (SGLang ``/abort_request``, vLLM's
  ``abort_requests``) take effect and answer only after ``seconds`` (a busy engine);
- ``stall(seconds)``: the engine stops emitting tokens (running and new
  requests) for ``seconds``, or until :meth:`clear_stall` when ``None``;
- ``unhealthy``: ``GET /health`` answers 503.
"""

from __future__ import annotations

import math

import attrs
import trio

from ..same_named import build_from
from ..schema.converter import at_least, ours
from .engine import SimEngine

_STALL = "sim-fault-stall"


@ours
@attrs.frozen
class FaultsUpdate:
    """``POST /sim/faults``: the faults to arm; an absent field leaves its fault as it is.

    ``clear`` first disarms everything; ``stall: true`` stalls until ``stall: false``
    (or for ``stall_seconds``). The simulator's own protocol: unknown fields are refused.
    """

    clear: bool = False
    fail_next: int | None = attrs.field(default=None, validator=at_least(0))
    fail_next_parses: int | None = attrs.field(default=None, validator=at_least(0))
    drop_after: int | None = attrs.field(default=None, validator=at_least(0))
    abort_delay: float | None = attrs.field(default=None, validator=at_least(0.0))
    unhealthy: bool | None = None
    stall: bool | None = None
    stall_seconds: float | None = attrs.field(default=None, validator=at_least(0.0))


@attrs.frozen
class FaultsSnapshot:
    """The armed faults (``GET`` and ``POST /sim/faults``)."""

    fail_next: int
    fail_next_parses: int
    drop_after: int | None
    abort_delay: float
    unhealthy: bool
    stalled: bool
    #: Seconds left of a timed stall (``None``: not stalled, or until cleared).
    stall_remaining: float | None


class DropConnection(Exception):
    """Raised inside a streamed body to make the server close the connection abruptly."""


@attrs.define(eq=False)
class SimFaults:
    """The faults armed on one simulated server; mutate from tests or over HTTP."""

    _engine: SimEngine
    fail_next: int = 0
    fail_parses: int = 0
    drop_after: int | None = None
    abort_delay: float = 0.0
    unhealthy: bool = False
    _stall_until: float | None = None  # Trio time; inf: until cleared
    _changed: trio.Event = attrs.field(factory=trio.Event)

    # -- arming -------------------------------------------------------------

    def fail_next_requests(self, count: int = 1) -> None:
        """The next ``count`` generate requests answer HTTP 500."""
        self.fail_next = max(0, count)

    def fail_next_parses(self, count: int = 1) -> None:
        """The next ``count`` parse requests (``/parse_function_call``, ``/separate_reasoning``) answer HTTP 500."""
        self.fail_parses = max(0, count)

    def drop_next_stream(self, after_tokens: int = 0) -> None:
        """Close the connection of the next streaming request after ``after_tokens`` tokens."""
        self.drop_after = max(0, after_tokens)

    def delay_aborts(self, seconds: float) -> None:
        """Abort calls take effect and answer ``seconds`` late (``0``: at once)."""
        self.abort_delay = max(0.0, seconds)

    def stall(self, seconds: float | None = None) -> None:
        """Freeze token emission for ``seconds`` (``None``: until :meth:`clear_stall`)."""
        self._engine.pause(_STALL)
        self._stall_until = math.inf if seconds is None else trio.current_time() + seconds
        self._poke()

    def clear_stall(self) -> None:
        if self._stall_until is not None:
            self._stall_until = None
            self._engine.resume(_STALL)
            self._poke()

    def clear(self) -> None:
        """Disarm every fault."""
        self.fail_next, self.fail_parses, self.drop_after, self.unhealthy = 0, 0, None, False
        self.abort_delay = 0.0
        self.clear_stall()

    @property
    def stalled(self) -> bool:
        return self._stall_until is not None

    # -- consuming (the routes) -------------------------------------------------

    def take_failure(self) -> bool:
        if self.fail_next > 0:
            self.fail_next -= 1
            return True
        return False

    def take_parse_failure(self) -> bool:
        if self.fail_parses > 0:
            self.fail_parses -= 1
            return True
        return False

    async def abort_wait(self) -> None:
        """What an abort route awaits before it acts (``delay_aborts``)."""
        if self.abort_delay > 0:
            await trio.sleep(self.abort_delay)
        else:
            await trio.lowlevel.checkpoint()

    def take_drop(self) -> int | None:
        after, self.drop_after = self.drop_after, None
        return after

    # -- the stall timer, run by the app while it serves ----------------------------

    def _poke(self) -> None:
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    async def run_timer(self) -> None:
        """End timed stalls when they are due; runs until cancelled."""
        while True:
            changed = self._changed
            deadline = self._stall_until if self._stall_until is not None else math.inf
            with trio.move_on_at(deadline):
                await changed.wait()
                continue
            if self._stall_until is not None and trio.current_time() >= self._stall_until:
                self.clear_stall()

    # -- ``/sim/faults`` ----------------------------------------------------------

    def snapshot(self) -> FaultsSnapshot:
        remaining = None
        if self._stall_until is not None and self._stall_until != math.inf:
            remaining = max(0.0, self._stall_until - trio.current_time())
        return build_from(FaultsSnapshot, self, fail_next_parses=self.fail_parses, stalled=self.stalled,
                          stall_remaining=remaining)

    def apply(self, update: FaultsUpdate) -> None:
        """Arm (or disarm) what ``update`` names."""
        if update.clear:
            self.clear()
        if update.fail_next is not None:
            self.fail_next_requests(update.fail_next)
        if update.fail_next_parses is not None:
            self.fail_next_parses(update.fail_next_parses)
        if update.drop_after is not None:
            self.drop_next_stream(update.drop_after)
        if update.abort_delay is not None:
            self.delay_aborts(update.abort_delay)
        if update.unhealthy is not None:
            self.unhealthy = update.unhealthy
        if update.stall is False:
            self.clear_stall()
        elif update.stall is True or update.stall_seconds is not None:
            self.stall(update.stall_seconds)
