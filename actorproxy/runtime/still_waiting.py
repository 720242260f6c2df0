"""One task that tells every turn whose caller waits for its first event that it still waits, each interval.

The caller (``runtime/runtime.py: Runtime.start_turn``, given a ``waiting`` callback: a
stream's early start and its heartbeats, a ``102 Processing``) calls back each time it is
told, and stops waiting as it takes the turn's first event.
"""

from __future__ import annotations

import attrs
import trio

from ..core.turn_events import TURN_WAITING, TurnEvent


@attrs.define(eq=False)
class StillWaiting:
    """The turns whose callers wait for their first event, each sent :data:`TURN_WAITING` after each ``interval``
    without it (``Runtime.start_turn``'s ``waiting``: a stream's early start, a heartbeat, a ``102 Processing``).

    One task for all of them (:meth:`run`): a cancel scope around each turn's wait cost ~6 µs a turn (4.1 against
    10.5 µs a receive, in isolation), this a dict entry. Each turn is due an interval after it began to wait, and
    again an interval after each time it was told, so the dict's order (insertion) is that of the due times.
    """

    interval: float
    _due: dict[trio.MemorySendChannel[TurnEvent], float] = attrs.field(factory=dict, init=False)
    _idle: trio.Event | None = attrs.field(default=None, init=False)  # set when a turn comes: the task sleeps

    def add(self, send: trio.MemorySendChannel[TurnEvent]) -> None:
        """The turn that ``send`` answers waits for its first event from now."""
        self._due[send] = trio.current_time() + self.interval
        if self._idle is not None:
            self._idle.set()
            self._idle = None

    def remove(self, send: trio.MemorySendChannel[TurnEvent]) -> None:
        """It no longer waits."""
        self._due.pop(send, None)

    async def run(self) -> None:
        due = self._due
        while True:
            if not due:
                idle = self._idle = trio.Event()
                await idle.wait()
                continue
            send, at = next(iter(due.items()))
            now = trio.current_time()
            if at > now:
                await trio.sleep_until(at)
                continue
            del due[send]
            stats = send.statistics()
            if not stats.open_receive_channels or not stats.open_send_channels:
                continue  # its caller left (it had not removed it yet), or the turn is over
            due[send] = now + self.interval  # (last: the latest due time)
            # Only while the caller is blocked on its channel, and nothing is queued there. Nothing it is told
            # may come after its first event, and that event may be on its way already with the buffer empty:
            # handed straight to a caller blocked on the channel, which has not run yet (it is no longer blocked
            # then). A caller still busy with the last telling (a heartbeat being written) is not told again.
            if stats.tasks_waiting_receive and not stats.current_buffer_used:
                send.send_nowait(TURN_WAITING)  # (both ends open, a caller blocked: it cannot raise)
