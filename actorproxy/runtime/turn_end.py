"""How a turn ends when it does not complete: its failure, the engine's error mapped for the agent, a gone agent."""

from __future__ import annotations

import time

import trio

from ..core.records import Step
from ..core.turn_events import TurnEvent
from ..engines.base import BackendError, GenerateFinish
from ..errors import BadRequest, EngineError, EngineTimeout, Overloaded, ProxyError

#: What a send to an agent that went away raises.
GONE = (trio.BrokenResourceError, trio.ClosedResourceError)


class TurnFailure(Exception):
    """The turn cannot go on; the step is marked and the agent told (unless gone)."""

    def __init__(self, error: ProxyError | None, status: str) -> None:
        super().__init__(str(error))
        self.error = error
        self.status = status


#: ``Retry-After`` of a turn no engine could take (the default interval of the pool's health checks).
ENGINE_RETRY_AFTER = 5


def engine_error(exc: BackendError) -> ProxyError:
    """The agent-facing error for an engine failure.

    503 ``engine_unavailable`` with ``Retry-After`` when no engine could take the turn (none
    healthy, none reachable, or it said it is overloaded); 504 on timeouts, 400 if the engine
    refused the input, else 502.
    """
    message = f"inference engine failed: {exc}"
    if exc.status == 503 or exc.unreachable:
        error = Overloaded(message, code="engine_unavailable")
        error.retry_after = ENGINE_RETRY_AFTER
        return error
    if exc.status == 504:
        return EngineTimeout(message)
    if exc.status == 400:
        return BadRequest(f"the inference engine rejected the request: {exc}", code="engine_rejected")
    return EngineError(message)


def gone(step: Step, finish: GenerateFinish | None) -> None:
    """The agent went away: the step keeps what was sampled, out of the segment."""
    step.status = "client_disconnected"
    step.finish_reason = finish.reason if finish is not None else "abort"
    step.finished_at = time.time()


async def tell(events: trio.MemorySendChannel[TurnEvent], event: TurnEvent) -> None:
    """Send an event to the agent, unless it is gone."""
    try:
        await events.send(event)
    except GONE:
        pass
