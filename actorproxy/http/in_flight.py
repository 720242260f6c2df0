"""A count of things in flight (turns, HTTP requests) that a shutdown can wait to reach zero."""

from __future__ import annotations

import trio


class InFlight:
    """How many are in flight; :meth:`wait_idle` returns once none is (at once if none is now)."""

    def __init__(self) -> None:
        self.active = 0
        self._idle = trio.Event()

    def started(self) -> None:
        self.active += 1

    def finished(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self) -> None:
        while self.active:
            self._idle = trio.Event()
            await self._idle.wait()
