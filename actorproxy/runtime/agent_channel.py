"""The turn's end of the agent's event channel: how its deltas reach the agent.

A streaming agent gets each delta as it comes, except while a pause is being answered
(:meth:`AgentChannel.hold`). A non-streaming one reads only the result, so its deltas
are merged and handed over with the result, and the time its first piece was sampled
travels on ``TurnDone`` (time to first token): the agent's task is woken once, for the
result; it is not told the turn started either. Either way the deltas concatenate to
the same text.

A streaming agent's delta is written by this task itself when the ingress has opened the
turn's :class:`~actorproxy.runtime.turn_stream.Relay` (it waits, with everything before
written): no event, no task switch. Any event sent through the channel shuts the relay
first, so nothing overtakes what the ingress still has to write.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

import trio

from ..core.parser import OutputDelta
from ..core.turn_events import TurnAccepted, TurnDelta, TurnEvent
from .turn_stream import Relay


class AgentChannel:
    """Hands a turn's events to the agent's channel; sending raises ``GONE`` once the agent left."""

    def __init__(self, events: trio.MemorySendChannel[TurnEvent], *, streaming: bool,
                 relay: Relay | None = None) -> None:
        self.events = events
        self.streaming = streaming
        self.relay = relay if streaming else None
        self._ends = relay
        self.shown = False  # a visible delta reached the agent (or, not streaming, was produced for it)
        #: Non-streaming: the deltas, merged, handed over with the result.
        self.held: OutputDelta | None = None
        #: Non-streaming: when the first delta was produced (``time.perf_counter``).
        self.first_at: float | None = None

    async def hand_over(self, event: TurnEvent) -> None:
        """``send_nowait`` queues without a scheduler round; only a full channel (a slow reader) is waited for.

        The relay is shut first: the ingress writes this event before any later delta.
        """
        relay = self.relay
        if relay is not None:
            relay.take = None
        try:
            self.events.send_nowait(event)
        except trio.WouldBlock:
            await self.events.send(event)

    async def accept(self, accepted: TurnAccepted) -> None:
        """Tell a streaming agent its turn started; of a non-streaming one, only read that it is still there."""
        if self.streaming:
            await self.hand_over(accepted)
        else:
            self._check_there()

    def deliver(self, delta: OutputDelta) -> Awaitable[None] | None:
        """Hand a delta over (or hold it, see the module); whether the agent is still there is read meanwhile.

        ``None`` once it is written (or held); else the awaitable that hands it over or
        writes the rest, to await before anything else is delivered. A delta written by the
        relay at once takes no coroutine of its own (one a streamed token).
        """
        if not self.streaming:
            self.hold(delta)
            return None
        if self.held is not None:
            delta = merged(self.take_held(), delta)
        relay = self.relay
        take = relay.take if relay is not None else None
        if take is None:
            return self._shown_after(self.hand_over(TurnDelta(delta)))
        rest = take(delta)  # the ingress waits with everything written: this task writes the delta itself
        if rest is not None:
            return self._shown_after(rest)
        self.shown = True
        return None

    async def _shown_after(self, handing: Awaitable[None]) -> None:
        await handing
        self.shown = True

    def hold(self, delta: OutputDelta) -> None:
        """Keep ``delta`` for the next hand-over: a non-streaming agent's result, or a streaming agent's next delta.

        A streaming turn holds what its stream sends while a pause is being answered:
        the acknowledgement waits for every aborted stream's last event, and a frame
        written to each agent meanwhile would delay it. The agent gets the held text
        with its next delta (after the resume) or with the result.
        """
        self._check_there()
        if self.first_at is None and not self.streaming:
            self.first_at = time.perf_counter()
        self.held = merged(self.held, delta)
        self.shown = True

    def on_leave(self, callback: Callable[[], None] | None) -> bool:
        """Have ``callback`` called if the agent leaves (its end closed) from now on (``None``: no longer);
        ``False`` if it has left already (then nothing is kept)."""
        ends = self._ends
        if ends is None:
            return True
        if ends.closed:
            return False
        ends.left = callback
        return True

    def _check_there(self) -> None:
        if not self.still_there():
            raise trio.BrokenResourceError("the agent closed its channel")

    def still_there(self) -> bool:
        """Whether the agent still reads its channel (the ingress closes its end when the agent leaves).

        Read off the relay's flag, which the ingress sets as it closes its end (a channel's
        statistics object is ~100 bytecodes to build, twice a stream in a pause's acknowledgement).
        """
        ends = self._ends
        if ends is not None:
            return not ends.closed
        return self.events.statistics().open_receive_channels > 0

    def take_held(self) -> OutputDelta | None:
        """What is held (nothing is held afterwards)."""
        held, self.held = self.held, None
        return held

    def held_then(self, tail: OutputDelta) -> OutputDelta:
        """What is held followed by ``tail`` (nothing is held afterwards)."""
        return merged(self.take_held(), tail)

def merged(first: OutputDelta | None, then: OutputDelta) -> OutputDelta:
    """One delta saying what ``first`` and then ``then`` say."""
    if first is None:
        return then
    return OutputDelta(first.reasoning + then.reasoning, first.content + then.content,
                       first.tool_calls + then.tool_calls)
