"""Abort calls: coalesced per engine where the engine takes several ids, else each sent at once.

A pause asks every generation in flight to stop, each from its own task. Sent one by
one, a thousand aborts are a thousand HTTP calls to the engine while it streams; an
:class:`AbortBatcher` sends the ones asked in the same round as one call (vLLM takes
a list of ids; SGLang, when allowed, one ``abort_all``). Each caller still gets the
answer for its own request: the acknowledgement stays per request. Where each abort is
a call of its own (SGLang's ``/abort_request`` takes one rid), :class:`~actorproxy.http.oneshot.OneShot`
opens its connection and sends it in the task that asks, without a scheduling round.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence

import trio


class _Batch:
    def __init__(self) -> None:
        self.ids: list[str] = []
        self.done = trio.Event()
        self.acknowledged: Collection[str] = ()
        self.sent = False  # False once done: the leader was cancelled before the call ended


class AbortBatcher:
    """Coalesce concurrent abort calls; ``send(ids)`` makes the call(s) and returns the ids acknowledged."""

    def __init__(self, send: Callable[[list[str]], Awaitable[Collection[str]]]) -> None:
        self._send = send
        self._open: _Batch | None = None
        self.calls = 0  # abort calls made (statistics, tests)

    async def abort(self, ids: Sequence[str]) -> bool:
        """Abort ``ids`` along with every abort asked in the same round; ``True`` if acknowledged."""
        while True:
            batch = self._open
            if batch is None:
                return await self._lead(ids)
            batch.ids.extend(ids)
            await batch.done.wait()
            if batch.sent:
                return all(i in batch.acknowledged for i in ids)
            # The caller that was sending it was cancelled: send again (and lead, if first).

    async def _lead(self, ids: Sequence[str]) -> bool:
        batch = self._open = _Batch()
        batch.ids.extend(ids)
        try:
            # Every task woken in this round (a pause starts them all at once) joins first.
            await trio.lowlevel.checkpoint()
            self._open = None
            self.calls += 1
            batch.acknowledged = await self._send(batch.ids)
            batch.sent = True
        finally:
            if self._open is batch:
                self._open = None
            batch.done.set()
        return all(i in batch.acknowledged for i in ids)
