"""Abort calls: coalesced per engine where the engine takes several ids, else pipelined on a few connections.

A pause asks every generation in flight to stop, each from its own task. Sent one by
one, a thousand aborts are a thousand HTTP calls to the engine while it streams; an
:class:`AbortBatcher` sends the ones asked in the same round as one call (vLLM takes
a list of ids; SGLang, when allowed, one ``abort_all``). Each caller still gets the
answer for its own request: the acknowledgement stays per request. Where each abort is
a call of its own (SGLang's ``/abort_request`` takes one rid), the pause's calls to one
engine share at most ``ABORT_CONNECTIONS`` connections of their own (:class:`AbortLanes`,
over :class:`~actorproxy.http.oneshot.Pipeline`): opened in the task that asks, without
a scheduling round, and written together, HTTP/1.1-pipelined, once the pause has asked
them all; an abort asked alone goes on a connection of its own
(:class:`~actorproxy.http.oneshot.OneShot`). A pause's answers are read a connection at a
time by the pause itself (``AbortBatch.rest``), not by a task per generation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from functools import partial

import trio

from ..http.oneshot import Origin, Pipeline
from .base import AbortBatch

#: The connections a pause's one-rid abort calls to one engine share, at most. The engine
#: answers the calls on one connection in order (uvicorn starts the next once the last is
#: answered), so a connection's share waits for the calls before it: 32 keep that queue
#: short (1,000 aborts: 32 a connection) where a thousand connections would each be
#: accepted, parsed and closed by the engine while it streams.
ABORT_CONNECTIONS = 32


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


class AbortLanes:
    """A pause's one-rid abort calls to one engine, on at most ``ABORT_CONNECTIONS`` connections of their own.

    The first calls each open a connection (:class:`~actorproxy.http.oneshot.Pipeline`,
    opened at once); the later ones join them in turn. The calls are written together when
    the pause has asked them all (``batch.close()``), one system call a connection. Each
    connection's answers are read by one task, in order, which hands each to its caller's
    ``answered``: the batch's ``rest``, run by the pause while it waits, so the pause's
    pass starts no task per generation and a thousand answers wake 32 tasks, not a
    thousand. Connections of their own: an abort never waits behind a generation's stream
    or the engine client's pool.
    """

    def __init__(self, origin: Origin, path: str, timeout: float, batch: AbortBatch) -> None:
        self._origin, self._path, self._timeout = origin, path, timeout
        self._pipelines: list[tuple[Pipeline, list[Answered]]] = []
        self._asked = 0
        # The batch's list, not the batch: the batch keeps these lanes (``shared``), and holding it back
        # would be a reference cycle, left for the cyclic collector once the pause ends.
        self._rest = batch.rest
        batch.on_close(self.flush)

    def add(self, body: bytes, answered: Answered) -> None:
        """Queue ``POST path`` with ``body``; ``answered`` gets its answer's status (``None``: no answer)."""
        if len(self._pipelines) < ABORT_CONNECTIONS:
            lane: tuple[Pipeline, list[Answered]] = (self._origin.pipeline(self._timeout), [])
            self._pipelines.append(lane)
            self._rest.append(partial(_read_answers, *lane))
        else:
            lane = self._pipelines[self._asked % ABORT_CONNECTIONS]
        self._asked += 1
        lane[0].add(self._origin.request(self._path, body))
        lane[1].append(answered)

    def flush(self) -> None:
        """Write every connection's calls (what a socket does not take now is sent as its answers are read)."""
        for pipeline, _ in self._pipelines:
            pipeline.flush()


#: Where an abort call's answer goes: its status, or ``None`` when the connection ended unanswered.
Answered = Callable[[int | None], Awaitable[None]]


async def _read_answers(pipeline: Pipeline, answered: list[Answered]) -> None:
    """One connection's answers, in order, each to its caller; the connection is closed however this ends."""
    try:
        for index, each in enumerate(answered):
            await each(await pipeline.status(index))
    finally:
        pipeline.close()
