"""What the ingress holds while a turn runs: the turn's events, and closing them to say the agent left.

A streamed reply's deltas need not travel as events: while the ingress waits for its next
event with everything before it written, it opens a :class:`Relay`, and the session's task
writes each delta's frame to the agent's connection itself (no message, no task switch per
token). Every other event (the end of the turn, a failure) and every delta the relay is not
open for go through the channel, in order.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import trio

from ..closing import Closing
from ..core.parser import OutputDelta
from ..core.turn_events import TurnDelta, TurnDone, TurnEvent, TurnFailed, TurnMoved
from ..errors import ProxyError
from ..telemetry import CURRENT, note_first_token, note_turn

#: Takes a streamed delta in the session's task and writes it to the agent: ``None`` once written, else an
#: awaitable the session's task awaits to write the rest (the agent reads slowly: back-pressure, bounded by the
#: socket's buffer); ``trio.BrokenResourceError`` when the agent's connection is gone (as a closed channel).
Take = Callable[[OutputDelta], Awaitable[None] | None]


class Relay:
    """Shared by a turn's two ends: ``take`` is set only while the ingress waits with nothing unwritten.

    The session's end (:class:`~actorproxy.runtime.agent_channel.AgentChannel`) gives a
    delta to ``take`` when it is set, and shuts it (``take = None``) before it sends any
    event through the channel, so a delta never overtakes an event the ingress has not
    written yet; the ingress (:class:`TurnStream`) sets it again when it next waits.

    ``left`` is set by the session's end while it waits with nothing to send (a paused
    turn): the ingress calls it as it closes its end (:meth:`agent_left`), so the turn stops
    waiting for an agent that has gone. Every turn has one, streamed or not.
    """

    __slots__ = ("take", "left", "closed")

    def __init__(self) -> None:
        self.take: Take | None = None
        self.left: Callable[[], None] | None = None
        #: The ingress closed its end.
        self.closed = False

    def agent_left(self) -> None:
        """The ingress closed its end of the turn (the agent left, or the turn's reply is done)."""
        self.take = None
        self.closed = True
        left, self.left = self.left, None
        if left is not None:
            left()


class TurnStream(Closing):
    """The events of one turn: iterate it; close it (``with``) when done."""

    def __init__(
        self,
        first: TurnEvent,
        channel: trio.MemoryReceiveChannel[TurnEvent],
        on_close: Callable[[], None] | None = None,
        relay: Relay | None = None,
    ) -> None:
        self._first: TurnEvent | None = first
        self._channel = channel
        self._on_close = on_close
        self._relay = relay
        self._take: Take | None = None  # what the relay is opened with while this stream waits

    def relay_to(self, take: Take) -> bool:
        """Let the session's task give streamed deltas to ``take`` while this stream waits; whether it can.

        The first delta so taken is noted as the request's first token (time to first
        token), as a received one is.
        """
        if self._relay is None:
            return False
        info = CURRENT.get()

        def first(delta: OutputDelta) -> Awaitable[None] | None:
            # (It must not name itself: a closure holding itself is a reference cycle, and the turn's
            # objects it holds would wait for a collection instead of going when the turn ends.)
            if info is not None and info.first_token_at is None:
                info.first_token_at = time.perf_counter()
            self._take = take
            relay = self._relay
            if relay is not None and relay.take is not None:  # (open: with this one, set by ``receive``)
                relay.take = take
            return take(delta)

        self._take = first
        return True

    @classmethod
    def failed(cls, error: ProxyError) -> TurnStream:
        """The events of a turn refused before its session took it up: its failure, and their end."""
        send: trio.MemorySendChannel[TurnEvent]
        recv: trio.MemoryReceiveChannel[TurnEvent]
        send, recv = trio.open_memory_channel(0)
        send.close()
        return cls(TurnFailed(error), recv)

    @property
    def first(self) -> TurnEvent:
        """The event that started the turn (``TurnAccepted`` or ``TurnFailed``)."""
        return self._first if self._first is not None else TurnMoved()

    async def receive(self) -> TurnEvent:
        """The next event; one already queued is taken without a scheduler round (the tail and ``TurnDone``)."""
        if self._first is not None:
            event, self._first = self._first, None
            return event
        try:
            return _noted(self._channel.receive_nowait())
        except trio.WouldBlock:
            pass
        relay = self._relay
        if relay is None or self._take is None:
            return _noted(await self._channel.receive())
        relay.take = self._take  # everything before is written: the session's task may write the deltas now
        try:
            return _noted(await self._channel.receive())
        finally:
            relay.take = None

    def receive_nowait(self) -> TurnEvent:
        """The next event if one is ready; :class:`trio.WouldBlock` if none is (a streamed reply joins them)."""
        if self._first is not None:
            event, self._first = self._first, None
            return event
        return _noted(self._channel.receive_nowait())

    def __aiter__(self) -> TurnStream:
        return self

    async def __anext__(self) -> TurnEvent:
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def close(self) -> None:
        self._take = None
        self._channel.close()
        if self._relay is not None:
            self._relay.agent_left()
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()


def _noted(event: TurnEvent) -> TurnEvent:
    match event:  # what the access log and the metrics need of the turn
        case TurnDelta():
            note_first_token()
        case TurnDone():
            if event.first_token_at is not None:
                note_first_token(event.first_token_at)
            note_turn(session=event.session_id, prompt_tokens=event.prompt_tokens,
                      sampled_tokens=event.completion_tokens)
    return event
