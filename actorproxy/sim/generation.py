"""One simulated generation: the token schedule of :mod:`.engine`, streamed, aborted or cancelled."""

from __future__ import annotations

import base64
import bisect
import math
from array import array
from typing import TYPE_CHECKING

import trio

from ..engines.base import FinishReason, GenerateFinish, GenerateRequest, GenerationEvent, TokenDelta
from .clock import Wake
from .outputs import Plan, SimRequestStats
from .policy import alternatives, routed_experts

if TYPE_CHECKING:
    from ..engines.base import AbortBatch
    from .engine import SimEngine


class SimGeneration:
    """One simulated generation; use ``async with engine.open_generation(req) as gen``.

    Iterating yields one :class:`TokenDelta` per token, then one
    :class:`GenerateFinish`. Leaving the block early stops it (recorded as cancelled).
    """

    def __init__(self, engine: SimEngine, request: GenerateRequest) -> None:
        self.rid = request.rid
        # Dropped once started: the engine keeps thousands of these for stats() and
        # a prompt can be long; only its length and routing key are kept.
        self._request: GenerateRequest | None = request
        self._prompt_len = len(request.input_ids)
        self._routing_key = request.routing_key
        self._top = request.sampling.top_logprobs
        #: The prompt, kept only until the end when routed experts are asked for.
        self._routed_prompt: array[int] | None = None
        self._engine = engine
        self._plan = Plan(array("i"), array("f"), "abort", None, "", False)
        self._start = 0.0  # wall clock
        # Schedule times below are on the engine's active clock (see PauseClock).
        self._first = 0.0  # start + prefill
        self._entered = False
        self._done = False  # the final event was delivered, or the block was left
        self._next = 0  # tokens delivered
        self._stop_at = math.inf  # when an abort or cancel took effect
        self._abort_early = False
        self._aborted = False
        self._cancelled = False
        self._sleeping: Wake | None = None  # while waiting for the next token's time

    @property
    def top_logprobs(self) -> list[tuple[tuple[int, float], ...]] | None:
        """Each delivered token's alternatives (``policy.alternatives``), when the request asked for them."""
        if not self._top:
            return None
        plan = self._plan
        return [alternatives(plan.ids[i], plan.logprobs[i], self._top) for i in range(self._next)]

    def _due(self, index: int) -> float:
        return self._first + (index + 1) * self._engine.config.token_interval

    @property
    def _finish_time(self) -> float:
        n = len(self._plan.ids)
        return self._due(n - 1) if n else self._first

    async def __aenter__(self) -> SimGeneration:
        await trio.lowlevel.checkpoint()
        if self._entered or self._request is None:
            raise RuntimeError("a SimGeneration can be entered only once")
        request = self._request
        self._plan, self._first = self._engine.begin(self, request)
        self._start = trio.current_time()
        if request.return_routed_experts:
            self._routed_prompt = array("i", request.input_ids)  # a copy: the caller may reuse its array
        self._entered, self._request = True, None
        if self._abort_early:
            self.request_abort()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # No await: this runs during cancellation too and must not be interrupted.
        if self._entered and not self._done:
            self._cancelled = True
            self._stop_at = min(self._stop_at, self._engine.clock.active())
            self._routed_prompt = None
            self._engine.left_off(self._plan, self._next)
            self._close()

    def _close(self) -> None:
        self._done = True
        self._engine.end(self.rid)

    def kick(self) -> None:
        """Wake a sleeping ``__anext__`` so it re-reads the (resumed) clock."""
        if self._sleeping is not None:
            self._sleeping.wake()

    @property
    def final_ready(self) -> bool:
        """True when the next event is the ``GenerateFinish`` and is due: iterating returns it at once.

        Lets a server attach the finish reason to the chunk of the last token.
        """
        if not self._entered or self._done:
            return False
        n, plan = self._next, self._plan
        target = self._due(n) if n < len(plan.ids) else self._finish_time
        if target > self._stop_at:
            return True
        return n >= len(plan.ids) and self._engine.clock.active() >= target

    def __aiter__(self) -> SimGeneration:
        return self

    async def __anext__(self) -> GenerationEvent:
        if not self._entered:
            raise RuntimeError("enter the generation with `async with` before iterating")
        if self._done:
            raise StopAsyncIteration
        plan = self._plan
        while True:
            n = self._next
            target = self._due(n) if n < len(plan.ids) else self._finish_time
            if target > self._stop_at:
                await trio.lowlevel.checkpoint()
                self._engine.left_off(plan, self._next)
                return self._final("abort", None, "aborted")
            clock = self._engine.clock
            # Compared in wall time, the deadline slept to: active() = now - offset can stay a
            # rounding error short of ``target`` at wall(target) = target + offset, and under a
            # MockClock (where time does not pass while a task runs) that looped forever.
            due_at = clock.wall(target)
            if trio.current_time() >= due_at:
                await trio.lowlevel.checkpoint()
                break
            # Sleep until due (the engine's pacer), but wake at once on abort or resume.
            self._sleeping = wake = Wake(trio.lowlevel.current_task())
            try:
                await self._engine.pacer.sleep(due_at, wake)
            finally:
                self._sleeping = None
        if n < len(plan.ids):
            self._next += 1
            version = self._engine.version_at(self._engine.clock.wall(target))
            return TokenDelta(
                token_ids=(plan.ids[n],), logprobs=(plan.logprobs[n],), weight_version=version
            )
        return self._final(plan.reason, plan.matched, plan.message)

    def _final(self, reason: FinishReason, matched: int | None, message: str) -> GenerateFinish:
        self._close()
        engine = self._engine
        version = engine.version_at(engine.clock.wall(min(self._finish_time, self._stop_at)))
        experts = None
        if self._routed_prompt is not None:
            ids = self._routed_prompt + self._plan.ids[: self._next]
            self._routed_prompt = None
            cfg = engine.config
            raw = routed_experts(
                engine.route_key, ids, layers=cfg.num_layers, topk=cfg.moe_topk, experts=cfg.num_experts
            )
            experts = base64.b64encode(raw).decode("ascii")
        return GenerateFinish(
            reason=reason,
            matched_stop=matched,
            weight_version=version,
            prompt_tokens=self._prompt_len,
            message=message,
            routed_experts=experts,
        )

    async def abort(self) -> None:
        """Stop at the next token boundary; the stream then ends with reason ``"abort"``.

        Tokens due up to now are still delivered. A no-op once the engine finished.
        """
        self.request_abort()
        await trio.lowlevel.checkpoint()

    def abort_nowait(self) -> None:
        """The synchronous twin of :meth:`abort` (for servers aborting many at once)."""
        self.request_abort()

    def abort_soon(self, batch: AbortBatch | None = None) -> None:
        """:meth:`abort`, whole: the simulated engine hears it at once."""
        self.request_abort()

    def request_abort(self) -> None:
        if self._done:
            return
        if not self._entered:
            self._abort_early = True
            return
        now = self._engine.clock.active()
        if now < self._finish_time and now < self._stop_at:
            self._stop_at = now
            self._aborted = True
            self.kick()

    def stats(self) -> SimRequestStats:
        try:
            now = self._engine.clock.active()
        except RuntimeError:  # outside trio.run: everything scheduled has happened
            now = math.inf
        end = min(now, self._stop_at)
        count = bisect.bisect_right(range(len(self._plan.ids)), end, key=self._due)
        reason: FinishReason | None = None
        if end >= self._finish_time:
            reason = self._plan.reason
        elif self._stop_at <= now:
            reason = "abort"
        ids, lps = tuple(self._plan.ids[:count]), tuple(self._plan.logprobs[:count])
        return SimRequestStats(
            self.rid,
            self._prompt_len,
            ids,
            lps,
            reason,
            self._aborted,
            self._cancelled,
            self._routing_key,
            self._plan.scripted,
            self._start,
        )
