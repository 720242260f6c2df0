"""One turn's generation, as the session actor runs it: permission, streaming, preemption.

:class:`TurnGeneration` asks the :class:`GenerationController` for permission,
streams the engine's tokens into the step and the agent's channel, and
handles every way a generation can stop:

* **finished** — the engine's stop, length, or one of the request's stop
  sequences;
* **paused** — the controller aborted it at a token boundary for a weight
  update. With partial rollout it waits for resume and continues from the
  prompt plus the tokens already sampled, with the remaining budget, so the
  agent gets one reply and the step holds every token once, in order, each
  stamped with the version that sampled it. Without it the partial attempt is
  kept on the step as ``discarded`` and the turn is generated afresh (a
  streaming agent that already saw part of it gets ``generation_interrupted``);
* **agent gone** — an acknowledged abort, reading on to the engine's finish
  (cut after ``ABORT_DRAIN_SECONDS`` without a token) so the step keeps every
  token the engine produced;
* **engine failure** — the step records the error and the agent gets 502/504.

Whatever happens, the controller is told the generation ended (``End``), so a
pause is acknowledged only once every output is recorded.
"""

from __future__ import annotations

import logging
import time
from array import array
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import attrs
import trio

from ..config import ProxyConfig
from ..core.attempts import apply_finish, discard_attempt, record_tokens
from ..core.parser import NOTHING, OutputParser
from ..core.requests import SamplingExtras
from ..core.session_state import Prepared, TurnResult
from ..core.tito import reasoning_opened_by_prompt
from ..core.turn_events import TopLogprobs, TurnAccepted, TurnDelta, TurnDone, TurnEvent, TurnFailed, TurnIds
from ..engines.base import (
    Backend,
    BackendError,
    GenerateFinish,
    GenerateRequest,
    Generation,
    SamplingParams,
)
from ..errors import Conflict, EngineError, Overloaded, ProxyError
from ..http.sockets import WakeLater
from ..tokenization.tokenizer import ChatTokenizer
from .agent_channel import AgentChannel
from .controller import ABORT_BOUND, ABORT_LIMIT, GenerationController, GenerationHandle, Permit, Waiting
from .output import OutputFormat, parse_remotely, tool_call_id
from .turn_end import GONE, TurnFailure, engine_error, gone, tell
from .turn_stream import Relay

log = logging.getLogger(__name__)


#: A turn whose agent left reads on to the engine's abort finish; it cuts the stream once
#: this many seconds pass without a token (or ``ABORT_LIMIT`` in all): while tokens come, the
#: engine is still sending what it generated (a backlog, or an abort call not yet answered).
ABORT_DRAIN_SECONDS = 5.0


@attrs.define
class GenerationSettings:
    partial_rollout: bool = False
    #: Seconds a turn waits for permission while paused before it gets 503.
    pause_wait_timeout: float = 600.0
    routed_experts: bool = False

    @classmethod
    def of(cls, config: ProxyConfig) -> GenerationSettings:
        return cls(
            partial_rollout=config.preemption.partial_rollout,
            pause_wait_timeout=config.preemption.pause_wait_timeout,
            routed_experts=config.engines.use_rollout_routing_replay,
        )


#: Sampling settings a runtime keeps (one per setting seen; all dropped when full).
_MAX_SAMPLINGS = 256


class Samplings:
    """The sampling settings turns ask for, each one :class:`SamplingParams` while it repeats.

    A runtime's turns mostly sample alike: the same budget (``max_tokens``, while the
    context window has room for it), temperature, top-p and seed, and always the
    tokenizer's stop ids. So a turn's settings are looked up, not made: every turn that
    samples alike hands the engine the same object, which is also the key of the engine
    body's template (``engines/connection.py: BodyTemplate``), found by identity.
    """

    __slots__ = ("_stop", "_kept")

    def __init__(self, stop_token_ids: tuple[int, ...]) -> None:
        self._stop = stop_token_ids
        self._kept: dict[tuple[int, float, float, int | None, int, SamplingExtras | None],
                         tuple[SamplingParams, dict[str, float | int | None]]] = {}

    def of(self, max_new_tokens: int, temperature: float, top_p: float, seed: int | None,
           top_logprobs: int = 0, extras: SamplingExtras | None = None
           ) -> tuple[SamplingParams, dict[str, float | int | None]]:
        """The settings of a turn, and what its step records of them: kept ones when a turn asked for these before.

        The record (a step's ``sampling``) is shared by every step that sampled alike: no one writes to it.
        """
        key = (max_new_tokens, temperature, top_p, seed, top_logprobs, extras)
        kept = self._kept.get(key)
        if kept is None:
            if len(self._kept) >= _MAX_SAMPLINGS:
                self._kept.clear()
            more, stop = {}, self._stop
            if extras is not None:
                more = attrs.asdict(extras, filter=lambda field, value: field.name != "stop_token_ids")
                # The call's own stop ids come after the tokenizer's (none of the tokenizer's with ignore_eos).
                own = () if extras.ignore_eos else stop
                stop = (*own, *(tid for tid in extras.stop_token_ids if tid not in own))
            sampling = SamplingParams(max_new_tokens, temperature, top_p, stop_token_ids=stop,
                                      seed=seed, top_logprobs=top_logprobs, **more)
            kept = self._kept[key] = (sampling, sampling_record(sampling))
        return kept


def sampling_record(sampling: SamplingParams) -> dict[str, float | int | None]:
    """What a step records of how its tokens were sampled (``Step.sampling``): every setting that shapes the
    distribution a token was drawn from, by the engines' own names; the budget is the step's ``max_new_tokens``."""
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "seed": sampling.seed,
        # The stop ids are masked until min_tokens (the alternatives' logprobs are of what is left); llama.cpp
        # masks the end-of-text ids for ignore_eos.
        "min_tokens": sampling.min_tokens,
        "ignore_eos": sampling.ignore_eos,
    }


@attrs.frozen
class GenerationServices:
    """What every generation of a runtime runs with: a session's turns and the token-in generations alike."""

    tokenizer: ChatTokenizer
    backend: Backend
    controller: GenerationController
    settings: GenerationSettings
    #: How outputs are parsed.
    output_format: OutputFormat
    #: The sampling settings turns ask for (a runtime's sessions share one).
    samplings: Samplings = attrs.field(
        default=attrs.Factory(lambda self: Samplings(self.tokenizer.stop_token_ids), takes_self=True))


def likeliest(alternatives: TopLogprobs, k: int) -> TopLogprobs:
    """The ``k`` likeliest of a token's alternatives as an engine lists them, the likeliest first, each id once.

    vLLM puts the sampled token first and may list one more than the k likeliest beside it;
    SGLang and llama.cpp list the k likeliest in order (then this changes nothing).
    """
    seen: set[int] = set()
    out = []
    for pair in sorted(alternatives, key=lambda pair: -pair[1]):  # (stable: an engine's own order among equals)
        if pair[0] not in seen:
            seen.add(pair[0])
            out.append(pair)
    return tuple(out[:k])


class TurnGeneration:
    """Runs the generation of one step until it finished, failed, or the agent left."""

    def __init__(
        self,
        prepared: Prepared,
        services: GenerationServices,
        *,
        events: trio.MemorySendChannel[TurnEvent],
        relay: Relay | None = None,
        side: trio.Nursery,
        check_permit: Callable[[Permit], None] = lambda permit: None,
    ) -> None:
        self.prepared = prepared
        tokenizer = services.tokenizer
        self.step = step = prepared.step
        self._tok = tokenizer
        self._input_ids = prepared.input_ids
        self._sampling, step.sampling = services.samplings.of(step.max_new_tokens, prepared.temperature,
                                                              prepared.top_p, prepared.request.seed,
                                                              prepared.request.top_logprobs, prepared.request.extras)
        #: Each recorded token's alternatives, when the turn asked for them (``top_logprobs``).
        self._top: list[TopLogprobs] | None = [] if self._sampling.top_logprobs else None
        #: The last attempt's generation, while its alternatives (``Generation.top_logprobs``) are to be kept.
        self._attempt_generation: Generation | None = None
        self._format = services.output_format
        self._reasoning_open = reasoning_opened_by_prompt(tokenizer, prepared.input_ids[-8:])
        # Not a bound method: the parser keeps it, and a cycle through this turn would leave the
        # turn (its parser, detokenizer, channels) to the cycle collector instead of freeing it at once.
        self._call_id = partial(tool_call_id, step.session_id, step.index)
        self.parser = self._new_parser()
        self._backend = services.backend
        self._controller = services.controller
        self._events = events
        self._agent = AgentChannel(events, streaming=prepared.request.stream, relay=relay)
        self._settings = services.settings
        self._side = side  # where a pause's abort task runs (the session actor's nursery)
        self._check_permit = check_permit
        self.client_gone = False
        self.finish: GenerateFinish | None = None
        self._experts: list[str] = []
        self._forced = False  # a pause's abort was not honoured in time and the stream was cut
        #: The agent was told the turn started: the engine took its first generation (see :meth:`_attempt`).
        self._accepted = False
        self._drain_limit = 0.0  # the agent left: when its drain is cut, however much still comes
        #: What is left of this attempt's abort call, if a task reads it: the scope the attempt cancels as it ends.
        self._rest_scope: trio.CancelScope | None = None
        #: The attempt being read: its generation, its handle and the scope that cuts its stream.
        self._live: tuple[Generation, GenerationHandle, trio.CancelScope]
        #: The finish of a reply a stop sequence ended (the attempt's stream is left there).
        self._stop: GenerateFinish | None = None
        #: The next attempt's handle and permission, asked when a pause's abort finish was read (:meth:`_ended`).
        self._next: tuple[GenerationHandle, Permit | Waiting] | None = None

    def _new_parser(self) -> OutputParser:
        request, fmt = self.prepared.request, self._format
        extras = request.extras
        return OutputParser(
            self._tok,
            tool_call_id=self._call_id,
            reasoning_open=self._reasoning_open,
            stop=request.stop,
            stop_ids=extras.stop_token_ids if extras is not None else (),
            include_stop=request.include_stop,
            min_tokens=extras.min_tokens if extras is not None else 0,
            tools=request.tools,
            tool_call_format=fmt.tool_call_format,
            reasoning_format=fmt.reasoning_format,
        )

    async def run(self) -> TurnResult:
        """Generate the turn and hand the result to the agent; ``completed`` once ``TurnDone`` is delivered.

        Every other ending leaves the step's status saying why (``error``,
        ``rejected``, ``aborted``, ``client_disconnected``) and the agent told,
        unless it is gone.
        """
        step, events = self.step, self._events
        not_completed = TurnResult(self.prepared, completed=False)
        try:
            finish = await self._sample()
        except TurnFailure as failure:
            step.status = failure.status  # type: ignore[assignment]
            step.finished_at = time.time()
            if failure.error is not None:
                step.error = step.error or failure.error.message
                held = self._agent.take_held()
                if held:
                    await tell(events, TurnDelta(held))
                await tell(events, TurnFailed(failure.error))
            return not_completed
        if self.client_gone:
            gone(step, finish)
            return not_completed
        parser = self.parser
        step.finished_at = time.time()
        tail = parser.finish()
        step.output = parser.output
        step.tool_call_parse_error = parser.tool_call_parse_error
        step.finish_reason = finish.reason
        # A streamed reply was parsed locally as its tokens came (the agent has it): the step records that parse.
        if self._format.parse_backend != "local" and not self.prepared.request.stream:
            try:
                await parse_remotely(self._format, self._tok, step, parser, self.prepared.request.tools,
                                     self._reasoning_open, self._call_id)
            except BackendError as exc:
                # The agent's request and the generation were fine: SGLang's parser failed.
                step.status, step.error, step.finished_at = "error", str(exc), time.time()
                await tell(events, TurnFailed(EngineError(f"SGLang could not parse the output: {exc}",
                                                          code="parse_failed")))
                return not_completed
        finish_reason: str = finish.reason if finish.reason != "abort" else "stop"
        if step.output.tool_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        done = TurnDone(
            step_index=step.index,
            output=step.output,
            finish_reason=finish_reason,
            prompt_tokens=step.prompt_len,
            completion_tokens=len(step.output_ids),
            tool_call_parse_error=step.tool_call_parse_error,
            stop_sequence=parser.stop_sequence,
            session_id=step.session_id,
            # The step's own arrays, not copies: every write to them (the attempts' tokens, the engine's version
            # spans, a discarded attempt: core/attempts.py) is done by now.
            ids=TurnIds(self._input_ids, step.output_ids, step.output_logprobs, step.output_versions),
            first_token_at=self._agent.first_at,
            top_logprobs=self._top,
        )
        try:
            tail = self._agent.held_then(tail)
            if tail:
                await self._agent.hand_over(TurnDelta(tail))
            await self._agent.hand_over(done)
        except GONE:
            # The agent left before the result was handed over: it never saw this reply.
            gone(step, finish)
            return not_completed
        return TurnResult(self.prepared, completed=True)

    async def _sample(self) -> GenerateFinish:
        """Generate to the end; raises :class:`TurnFailure` if the turn cannot complete."""
        step = self.step
        prompt = self._input_ids
        first = True
        handle = GenerationHandle(step.session_id)
        asked = self._controller.request(handle)
        while True:
            permit = await self._permission(handle, asked)
            if permit is None:  # the agent left while the turn waited: nothing is generated for it
                self.client_gone = True
                self.finish = GenerateFinish("abort")
                return self.finish
            if first:
                first = False
                try:
                    self._check_permit(permit)
                except ProxyError as exc:
                    self._controller.end(handle, aborted=False)
                    raise TurnFailure(exc, "rejected") from None
            budget = self._sampling.max_new_tokens - len(step.output_ids)
            start = len(step.output_ids)
            interrupted = False
            try:
                finish = await self._attempt(prompt, budget, handle)
                interrupted = finish.reason == "abort" and handle.abort_requested
                if self._top is not None and not self.client_gone:
                    self._keep_top(start)
            except BaseException:
                if self._next is not None:  # (asked as the abort finish was read)
                    self._withdraw(self._next[0])
                    self._next = None
                raise
            finally:
                # Aborted: cut by the engine (or at the proxy's bound) after a pause asked; one the engine
                # finished before the abort reached it is not (its step is whole, never preempted). Ended
                # already if the relay read the finish (_ended): then this does nothing.
                self._controller.end(handle, aborted=interrupted)
            ahead, self._next = self._next, None
            self._apply_finish(finish, start)
            if self.client_gone or not interrupted:
                if ahead is not None:
                    self._withdraw(ahead[0])
                self.finish = finish
                return finish
            step.preemptions += 1
            # Asked again before anything else runs (or as the relay read the finish): once the pause is
            # answered, this turn is among the waiting.
            if ahead is None:
                handle = GenerationHandle(step.session_id)
                asked = self._controller.request(handle)
            else:
                handle, asked = ahead
            try:
                ended = await self._after_preemption(finish, start)
            except BaseException:
                self._withdraw(handle)
                raise
            if ended is not None:
                self._withdraw(handle)
                self.finish = ended
                return ended
            if self._settings.partial_rollout:
                prompt = self._input_ids + step.output_ids

    async def _after_preemption(self, finish: GenerateFinish, start: int) -> GenerateFinish | None:
        """After a pause aborted the attempt: how the turn ends here, or ``None`` if it generates again."""
        if not self._agent.still_there():
            self.client_gone = True
            return finish
        if self._settings.partial_rollout:
            if len(self.step.output_ids) >= self._sampling.max_new_tokens:
                return GenerateFinish("length", weight_version=finish.weight_version)
            return None
        await self._discard(start)
        return None

    def _withdraw(self, handle: GenerationHandle) -> None:
        self._controller.withdraw(handle)

    # -- permission -------------------------------------------------------------

    async def _permission(self, handle: GenerationHandle, asked: Permit | Waiting) -> Permit | None:
        """Permission to generate: granted by a method call while running (no scheduler round), else waited for.

        ``None``: the agent left while the turn waited (its end closed wakes the wait).
        """
        if isinstance(asked, Permit):
            return asked
        permit: Permit | None = None
        agent = self._agent
        try:
            if agent.on_leave(partial(asked.give, None)):  # the agent leaving ends the wait: None
                permit = await asked.wait()  # None after pause_wait_timeout (GenerationController.expire_waiting)
        finally:
            agent.on_leave(None)
            if permit is None:  # gave up, the agent left, or cancelled; it may have been admitted just then
                self._controller.withdraw(handle)
        if permit is not None:
            return permit
        if not agent.still_there():
            return None
        wait = self._settings.pause_wait_timeout
        error = Overloaded(
            f"generation is paused for a weight update and did not resume within {wait:g} s; retry",
            code="generation_paused",
        )
        error.retry_after = 5
        raise TurnFailure(error, "error")

    # -- one attempt ------------------------------------------------------------

    async def _attempt(self, prompt: array[int], budget: int, handle: GenerationHandle) -> GenerateFinish:
        step = self.step
        sampling = self._sampling
        if budget != sampling.max_new_tokens:  # an attempt after a preemption: the budget left (and minimum)
            sampled = sampling.max_new_tokens - budget
            sampling = attrs.evolve(sampling, max_new_tokens=budget, min_tokens=max(0, sampling.min_tokens - sampled))
        request = GenerateRequest(
            prompt,
            sampling,
            routing_key=step.session_id,
            return_routed_experts=self._settings.routed_experts,
        )
        if not step.rid:
            step.rid = request.rid
        finish: GenerateFinish | None = None
        failed: BackendError | None = None
        self._forced = False
        try:
            # One scope cuts the stream, by its deadline: a pause's abort not honoured in time
            # (GenerationHandle.bound_abort), or the agent gone (the drain's bound).
            with trio.CancelScope() as stream:
                async with self._backend.open_generation(request) as generation:
                    if self._top is not None:
                        self._attempt_generation = generation
                    if not self._accepted:
                        # Told only once the engine took the generation: a turn refused before (a pause
                        # waited out, no healthy engine, a connection refused, the engine's own error
                        # status) is a plain status with its error, streamed or not: no stream has started.
                        self._accepted = True
                        try:
                            await self._agent.accept(TurnAccepted(step.index, step.prompt_len, self._input_ids))
                        except GONE:
                            self._agent_left(generation, handle, stream)  # read on to the engine's abort finish
                    # A pause's abort is sent in the pause's own call (no task, no nursery per attempt);
                    # what is left of it, if anything, runs in the session's side nursery, in a scope
                    # this attempt cancels as it ends (made only then: most attempts are never aborted).
                    handle.on_abort(lambda: self._abort_asked(handle, generation, stream))
                    try:
                        finish = await self._stream(generation, handle, stream)
                    except BackendError as exc:
                        failed = exc  # raised below, outside the generation's block
                    finally:
                        handle.on_abort(None)
                        if self._rest_scope is not None:
                            self._rest_scope.cancel()
                            self._rest_scope = None
            if stream.cancelled_caught and self.client_gone:
                log.warning("session %s: the agent left and its aborted stream did not end (%g s without a token, "
                            "or %g s in all); cutting it: tokens the engine sent after step %d's %d are lost",
                            handle.session_id, ABORT_DRAIN_SECONDS, ABORT_LIMIT, step.index, len(step.output_ids))
                step.error = step.error or "the agent left and the engine's aborted stream was cut unfinished"
            elif stream.cancelled_caught and handle.abort_bound is not None:
                log.warning("session %s: the aborted stream did not end (%g s without a token, or %g s in all); "
                            "cutting it", handle.session_id, ABORT_BOUND, ABORT_LIMIT)
                self._forced = True
            if failed is not None:
                try:
                    raise failed
                finally:  # (its traceback holds this frame: kept in it, a reference cycle)
                    failed = None
        except BackendError as exc:
            if self.client_gone:
                return GenerateFinish("abort")
            step.error = str(exc)
            raise TurnFailure(engine_error(exc), "error") from None
        if finish is None:
            if self.client_gone or self._forced:
                return GenerateFinish("abort")  # the stream was cut at its bound
            step.error = "engine stream ended without a finish event"
            raise TurnFailure(EngineError(step.error), "error")
        return finish

    async def _stream(self, generation: Generation, handle: GenerationHandle, drain: trio.CancelScope
                      ) -> GenerateFinish | None:
        """Read the engine's events into the step and the agent's channel; the finish, if one came.

        Each token delta goes to :meth:`take`; once the generation can relay (``Generation.relay``),
        the tokens of each read go to it straight from the read, until anything else comes.
        """
        self._live = (generation, handle, drain)
        self._stop = None
        relay = getattr(generation, "relay", None)
        finish: GenerateFinish | None = None
        async for event in generation:
            if isinstance(event, GenerateFinish):
                finish = event
                continue
            go = self.take(event.token_ids, event.logprobs, event.weight_version)
            if go is not True and (isinstance(go, bool) or not await go):
                return self._stop
            if relay is not None and (relaying := relay(self.take, self._ended)) is not None:
                await relaying
                if self._stop is not None:
                    return self._stop
        return finish

    def take(self, ids: Sequence[int], logprobs: Sequence[float], version: str) -> bool | Awaitable[bool]:
        """Tokens the engine sampled: onto the step, through the parser, the delta to the agent (``TokenSink``).

        ``True`` to read on; ``False`` once a stop sequence ended the reply (``_stop`` is then its
        finish: leaving the block stops the engine, and every token sampled so far stays recorded);
        else the awaitable that writes the rest of the delta, of the same answer.
        """
        record_tokens(self.step, ids, logprobs, version)
        handle = self._live[1]
        handle.add_tokens(len(ids))
        parser = self.parser
        delta = parser.feed(ids)
        if self.client_gone:
            # Still coming: what the engine generated before it heard the abort. Read on.
            drain = self._live[2]
            drain.deadline = min(self._drain_limit, trio.current_time() + ABORT_DRAIN_SECONDS)
            return True
        if delta is not NOTHING:  # (every empty delta is NOTHING)
            try:
                if handle.abort_requested:
                    self._agent.hold(delta)  # a pause waits for this stream's end: the agent's copy waits
                else:
                    handing = self._agent.deliver(delta)
                    if handing is not None:
                        return self._delivered(handing, version)
            except GONE:
                self._agent_left(*self._live)
                return True
        if parser.stopped:
            self._stop = GenerateFinish("stop", weight_version=version)
            return False
        return True

    def _ended(self, finish: GenerateFinish) -> bool | WakeLater:
        """The relay read an aborted stream's finish, every token before it taken (``FinishSink``).

        A pause's abort: the generation ends with the controller now, in the reading task (the relay
        hub's), and the next attempt asks for permission at once, as :meth:`_sample` would (so the pause
        is answered with this turn among the waiting). This task's own steps (leaving the generation,
        the preemption's count) may then wait until the pause is answered: where its wake-up waits, if
        the controller holds one. ``False`` for any other finish: the task does it all, woken now.
        """
        handle = self._live[1]
        if self.client_gone or self._stop is not None or finish.reason != "abort" or not handle.abort_requested:
            return False
        self._controller.end(handle, aborted=True)
        following = GenerationHandle(handle.session_id)
        self._next = (following, self._controller.request(following))
        return self._controller.wake_later() or False

    async def _delivered(self, handing: Awaitable[None], version: str) -> bool:
        """:meth:`take`'s answer once the delta it began to write is written."""
        try:
            await handing
        except GONE:
            generation, handle, drain = self._live
            self._agent_left(generation, handle, drain)
            return True
        if self.parser.stopped:
            self._stop = GenerateFinish("stop", weight_version=version)
            return False
        return True

    def _agent_left(self, generation: Generation, handle: GenerationHandle, drain: trio.CancelScope) -> None:
        """The agent left: abort at a token boundary and read on to the engine's abort finish.

        Every token the engine generated is recorded, those it sends while the abort call
        is on its way and unanswered too: the call's answer is read in the session's side
        nursery (as a pause's), not in this loop. The stream is cut, by leaving the block,
        once ``ABORT_DRAIN_SECONDS`` pass without a token (``ABORT_LIMIT`` in all).
        """
        self.client_gone = True
        handle.abort_bound = None  # a pause's bound, if any, no longer pushed back by tokens
        now = trio.current_time()
        self._drain_limit = now + ABORT_LIMIT
        drain.deadline = min(drain.deadline, now + ABORT_DRAIN_SECONDS)
        self._finish_abort(handle, generation.abort_soon(None))

    def _abort_asked(self, handle: GenerationHandle, generation: Generation, stream: trio.CancelScope) -> None:
        """Perform the controller's abort request (a pause), in the pause's own call: the turn stops its own stream.

        The engine is asked to stop at the next token boundary (the call sent now where
        the engine allows) and the stream is read on to its ``abort`` finish; if
        ``ABORT_BOUND`` seconds pass without a token, or ``ABORT_LIMIT`` in all, the
        stream is cut (tokens in flight are then lost). The bound covers the abort call
        too: an engine slow to answer it is waited for (cutting early would lose the
        tokens in flight), but not forever; each token read meanwhile pushes it back
        (``handle.add_tokens``): a backlog is read, not cut.
        """
        if self.client_gone:
            return  # aborted when the agent left, and read on within the drain's own bound
        handle.bound_abort(stream)
        self._finish_abort(handle, generation.abort_soon(handle.abort_batch))

    def _finish_abort(self, handle: GenerationHandle, rest: Callable[[], Awaitable[None]] | None) -> None:
        """What is left of an abort begun now, if anything: read in the side nursery until the attempt ends."""
        if rest is not None:
            if self._rest_scope is None:
                self._rest_scope = trio.CancelScope()
            self._side.start_soon(self._abort_rest, handle, rest, self._rest_scope)

    @staticmethod
    async def _abort_rest(
        handle: GenerationHandle, rest: Callable[[], Awaitable[None]], watch: trio.CancelScope
    ) -> None:
        """What is left of an abort (the engine's answer, or the whole call), until the attempt ends."""
        with watch:
            try:
                await rest()
            except BackendError as exc:
                log.warning("abort of a generation of session %s failed: %s", handle.session_id, exc)

    def _apply_finish(self, finish: GenerateFinish, start: int) -> None:
        apply_finish(self.step, finish, start, self._experts)

    def _keep_top(self, start: int) -> None:
        """The alternatives of the attempt's recorded tokens (those from ``start``), as its generation reported them.

        A stop sequence ends the reply at a token the engine's stream may have gone past: only
        the recorded tokens' are kept. An engine that reported fewer than it sampled fails the
        turn (502): its alternatives are not made up.
        """
        assert self._top is not None
        recorded = len(self.step.output_ids) - start
        got: list[TopLogprobs] | None = getattr(self._attempt_generation, "top_logprobs", None)
        self._attempt_generation = None
        if got is None or len(got) < recorded:
            reported = "none" if got is None else len(got)
            self.step.error = f"the engine reported top logprobs for {reported} of {recorded} tokens"
            raise TurnFailure(EngineError(self.step.error, code="top_logprobs_missing"), "error")
        del self._top[start:]
        k = self._sampling.top_logprobs
        self._top += [likeliest(alternatives, k) for alternatives in got[:recorded]]

    async def _discard(self, start: int) -> None:
        """Non-partial mode: keep the interrupted attempt on the step, out of training, and start over."""
        step = self.step
        if self._agent.streaming and self._agent.shown:
            raise TurnFailure(
                Conflict(
                    "the generation was interrupted by a weight update after part of it was streamed; retry the turn",
                    code="generation_interrupted",
                ),
                "aborted",
            )
        discard_attempt(step, start)
        if self._top is not None:
            del self._top[start:]
        self._experts = []
        self.parser = self._new_parser()

