"""Where a session's CPU work runs: in a worker thread, so it never holds the event loop.

Rendering a 100k-token conversation, tokenizing a 10 MB body or verifying a
segment at close takes tens to hundreds of milliseconds of CPU. On the Trio
thread that would stall every other session, every stream's heartbeat and
``/health``; :meth:`Offload.run` sends it to ``trio.to_thread.run_sync`` with
a :class:`trio.CapacityLimiter` shared by all sessions.

Under :class:`trio.testing.MockClock` a worker thread would let the clock
jump ahead while the thread works (every task looks blocked), so the test
harness (and :func:`Offload.for_current_run` under a MockClock) runs the work
inline instead, keeping virtual time exact.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import attrs
import trio
import trio.testing

T = TypeVar("T")

#: Worker threads a runtime's sessions may use at once.
WORKER_THREADS = 4


@attrs.frozen
class Offload:
    """Runs a session's CPU work: in worker threads (``limiter`` set) or inline (``None``)."""

    limiter: trio.CapacityLimiter | None

    @classmethod
    def threads(cls, count: int = WORKER_THREADS) -> Offload:
        return cls(trio.CapacityLimiter(count))

    @classmethod
    def inline(cls) -> Offload:
        """Run the work on the Trio thread (deterministic: for MockClock tests)."""
        return cls(None)

    @classmethod
    def for_current_run(cls) -> Offload:
        """Worker threads, unless the running Trio clock is a MockClock (then inline)."""
        if isinstance(trio.lowlevel.current_clock(), trio.testing.MockClock):
            return cls.inline()
        return cls.threads()

    async def run(self, work: Callable[[], T], *, inline: bool = False) -> T:
        """``work()``, in a worker thread unless there are none or the caller knows it is small (``inline``)."""
        if self.limiter is None or inline:
            return work()
        return await trio.to_thread.run_sync(work, limiter=self.limiter)
