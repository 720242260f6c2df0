"""The simulated engine's active clock (Trio's clock minus the time spent paused), and its pacer.

:class:`Pacer` wakes each generation when its next token is due, one timer task for all of them.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from typing import Any

import trio


class PauseClock:
    """The engine's active clock: Trio's clock minus the time spent paused.

    Schedules are kept in active time, so a pause shifts every token due after it.
    ``wall(a)`` is when active time ``a`` is (or was) reached: ``inf`` while paused
    before it. Pause intervals are kept to stamp lagging tokens with their version.
    """

    _MAX_LOG = 4096

    def __init__(self) -> None:
        self.offset = 0.0  # wall - active, outside pauses
        self.paused_at: float | None = None  # active time the current pause began
        self.holders: set[str] = set()
        self._log: list[tuple[float, float]] = []  # (active start of a pause, offset after it)

    def active(self) -> float:
        if self.paused_at is not None:
            return self.paused_at
        return trio.current_time() - self.offset

    def wall(self, active: float) -> float:
        if self.paused_at is not None and active > self.paused_at:
            return math.inf
        i = bisect.bisect_left(self._log, active, key=lambda entry: entry[0])
        return active + (self._log[i - 1][1] if i else 0.0)

    def pause(self, holder: str) -> None:
        if not self.holders:
            self.paused_at = self.active()
        self.holders.add(holder)

    def resume(self, holder: str) -> bool:
        """Drop ``holder``; True if that ended the pause."""
        self.holders.discard(holder)
        if self.holders or self.paused_at is None:
            return False
        self.offset = trio.current_time() - self.paused_at
        self._log.append((self.paused_at, self.offset))
        if len(self._log) > 2 * self._MAX_LOG:
            del self._log[: -self._MAX_LOG]
        self.paused_at = None
        return True


class Wake:
    """One sleeping task's wake-up: by its deadline (:class:`Pacer`) or earlier (an abort, a resume)."""

    __slots__ = ("task", "done")

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.done = False

    def wake(self) -> None:
        if not self.done:
            self.done = True
            trio.lowlevel.reschedule(self.task)


class Pacer:
    """Wakes the sleeping generations when their next token is due: one timer task for them all.

    A ``trio.move_on_at`` per token cost a cancel scope, a deadline registration and a raised
    ``Cancelled`` for every token of every stream; here a wait is a heap entry and a park, and
    one system task (started by the first wait of a Trio run), asleep until the earliest deadline,
    wakes every wait due by then in one pass. A wait woken early stays in the heap until its
    deadline passes (then dropped).
    """

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Wake]] = []
        self._count = itertools.count()
        self._running = False
        self._scope: trio.CancelScope | None = None  # the timer's sleep: its deadline is the earliest wait's

    async def sleep(self, deadline: float, wake: Wake) -> None:
        """Park the current task (``wake.task``) until ``deadline`` (Trio time; ``inf``: until woken) or
        ``wake.wake()``; cancellable."""
        if deadline != math.inf:
            heapq.heappush(self._heap, (deadline, next(self._count), wake))
            if not self._running:
                self._running = True
                trio.lowlevel.spawn_system_task(self._run, name="actorproxy.sim pacer")
            elif self._scope is not None and deadline < self._scope.deadline:
                self._scope.deadline = deadline

        def abort(_: Any) -> trio.lowlevel.Abort:
            wake.done = True
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def _run(self) -> None:
        heap = self._heap
        try:
            while True:  # for the rest of the run, asleep while nothing waits: no task spawned per generation
                with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as self._scope:
                    await trio.sleep_forever()
                self._scope = None
                now = trio.current_time()
                while heap and heap[0][0] <= now:
                    heapq.heappop(heap)[2].wake()
        finally:
            self._running, self._scope = False, None
