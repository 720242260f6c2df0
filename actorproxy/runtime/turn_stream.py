"""What the ingress holds while a turn runs: the turn's events, and closing them to say the agent left."""

from __future__ import annotations

from collections.abc import Callable

import trio

from ..core.turn_events import TurnDelta, TurnDone, TurnEvent, TurnMoved
from ..telemetry import note_first_token, note_turn


class TurnStream:
    """The events of one turn: iterate it; close it (``with``) when done."""

    def __init__(
        self,
        first: TurnEvent,
        channel: trio.MemoryReceiveChannel[TurnEvent],
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._first: TurnEvent | None = first
        self._channel = channel
        self._on_close = on_close

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
            return _noted(await self._channel.receive())

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
        self._channel.close()
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

    def __enter__(self) -> TurnStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> TurnStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


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
