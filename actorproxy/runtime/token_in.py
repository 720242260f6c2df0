"""Token-in generations (the Claw-R1 gateway's ``POST /generate {prompt_ids, sampling_params}``).

The agent renders its own prompt and sends the ids; nothing is templated or
re-tokenized. The generation runs exactly as a session's turn does
(:class:`~.generate.TurnGeneration`: permission from the controller, pauses,
partial rollout, aborts, per-token versions) but belongs to no session yet:
the call names no trajectory. Its step (the prompt ids as given, the sampled
ids, their logprobs and versions) waits in :class:`TokenInGenerations` until
the agent's ``/submit_steps`` claims it by its ids; one never claimed within
``--session-ttl`` (or still waiting at shutdown) is stored as a step of its own session ``generate-<id>``
(logged), never dropped.
"""

from __future__ import annotations

import logging
import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

import attrs
import trio

from ..core.prompt_plan import turn_budget
from ..core.records import Step, int_array
from ..core.requests import ChatRequest, SamplingExtras
from ..core.session_state import Prepared
from ..core.turn_events import TURN_WAITING, TurnEvent, TurnFailed
from ..errors import ContextOverflow, EngineError, ProxyError
from . import store as store_msgs
from .actor import ask
from .generate import GenerationServices, GenerationSettings, TurnGeneration

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger(__name__)

#: Token-in generations waiting to be claimed, at most (the oldest is stored as a step past it).
MAX_UNCLAIMED = 100_000


async def generate_tokens(runtime: Runtime, prompt_ids: array[int], *, max_new_tokens: int | None = None,
                          temperature: float | None = None, top_p: float | None = None,
                          seed: int | None = None, extras: SamplingExtras | None = None,
                          waiting: Callable[[], Awaitable[object]] | None = None) -> Step:
    """Generate from exactly ``prompt_ids``; the step holds the sampled ids, logprobs and versions.

    The sampling values are what the agent set (the gateway's ``sampling_params``); ``None`` takes the default.
    ``waiting``, if given, is awaited after each ``--heartbeat-interval`` until the step is generated (paused,
    queued or generating: the caller's ``102 Processing``), as ``Runtime.start_turn``'s is until a turn's first event.

    Refused like a turn (400 ``context_overflow`` over ``--max-prompt-tokens`` or the
    context window; 503 while shutting down; 507 when the store is full); an engine
    failure raises the error the agent would get for a turn.
    """
    runtime.check_admission()
    config = runtime.config
    limits = config.limits
    prompt_len = len(prompt_ids)
    if limits.max_prompt_tokens is not None and prompt_len > limits.max_prompt_tokens:
        raise ContextOverflow(prompt_len, window=runtime.context_window,
                              max_prompt_tokens=limits.max_prompt_tokens, param="prompt_ids")
    if prompt_len >= runtime.context_window:
        raise ContextOverflow(prompt_len, window=runtime.context_window, param="prompt_ids")
    max_new, _ = turn_budget(limits, max_new_tokens, window=runtime.context_window, prompt_len=prompt_len)
    owner = f"generate-{uuid.uuid4().hex}"
    step = Step(index=0, session_id=owner, segment_index=0, turn_id=None, instance_id=None, new_messages=[],
                message_count=0, prompt_len=prompt_len, fragment_ids=int_array(prompt_ids), max_new_tokens=max_new)
    if limits.rollout_temperature is not None:
        temperature = limits.rollout_temperature
    elif temperature is None:
        temperature = 1.0
    request = ChatRequest(messages=[], seed=seed, extras=extras)
    # No session, so no conversation lane: only a session's commit reads it, and this step is never committed.
    prepared = Prepared(step, int_array(prompt_ids), [], temperature, 1.0 if top_p is None else top_p,
                        [], request, cast(Any, None))
    send, receive = trio.open_memory_channel[TurnEvent](16)
    failure: list[ProxyError] = []

    async def drain() -> None:
        async with receive:
            async for event in receive:
                if isinstance(event, TurnFailed):
                    failure.append(event.error)
                elif event is TURN_WAITING and waiting is not None:
                    await waiting()

    runtime.turns.started()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            async with send:
                if waiting is not None:
                    runtime.still_waiting.add(send)
                try:
                    services = GenerationServices(runtime.tokenizer, runtime.backend, runtime.controller,
                                                  GenerationSettings.of(config), runtime.output_format)
                    turn = TurnGeneration(prepared, services, events=send, side=nursery)
                    result = await turn.run()
                finally:
                    runtime.still_waiting.remove(send)
    finally:
        runtime.turns.finished()
    if not result.completed:
        if failure:
            raise failure[0]
        raise EngineError(f"the generation ended without a result ({step.status})")
    step.status = "completed"
    return step


@attrs.define
class _Waiting:
    step: Step
    since: float


@attrs.define
class TokenInGenerations:
    """Token-in generations waiting for the ``/submit_steps`` that names their trajectory."""

    ttl: float
    max_unclaimed: int = MAX_UNCLAIMED
    #: prompt ids (bytes) -> the generations from that prompt, oldest first (n rollouts share a prompt).
    _waiting: OrderedDict[bytes, list[_Waiting]] = attrs.field(factory=OrderedDict)
    _count: int = 0
    claimed: int = 0
    unclaimed_stored: int = 0

    def add(self, step: Step) -> None:
        key = step.fragment_ids.tobytes()
        self._waiting.setdefault(key, []).append(_Waiting(step, time.monotonic()))
        self._count += 1

    def claim(self, prompt_ids: array[int], response_ids: array[int]) -> Step | None:
        """The waiting generation from exactly ``prompt_ids`` whose sampled ids begin with ``response_ids``.

        An agent may keep only the first ``response_length`` ids (Claw-R1's flows cut them): the step
        returned is then cut to the same length (logprobs and versions too). ``None``: no such generation.
        """
        key = prompt_ids.tobytes()
        waiting = self._waiting.get(key)
        if not waiting:
            return None
        n = len(response_ids)
        for i, item in enumerate(waiting):
            output = item.step.output_ids
            if len(output) >= n and output[:n] == response_ids and (n or not output):
                del waiting[i]
                if not waiting:
                    del self._waiting[key]
                self._count -= 1
                self.claimed += 1
                step = item.step
                if len(output) > n:
                    step.output_ids = output[:n]
                    step.output_logprobs = step.output_logprobs[:n]
                    step.output_versions = step.output_versions[:n]
                return step
        return None

    def expired(self, now: float | None = None) -> list[Step]:
        """Take out the generations older than ``ttl`` (and the oldest past ``max_unclaimed``); all at ``inf``."""
        now = time.monotonic() if now is None else now
        out: list[Step] = []
        while self._waiting:
            key, waiting = next(iter(self._waiting.items()))
            if waiting[0].since > now - self.ttl and self._count <= self.max_unclaimed:
                break
            out.append(waiting.pop(0).step)
            self._count -= 1
            if not waiting:
                del self._waiting[key]
        return out

    def statistics(self) -> dict[str, int]:
        return {"waiting": self._count, "claimed": self.claimed, "unclaimed_stored": self.unclaimed_stored}


async def store_unclaimed(runtime: Runtime, generations: TokenInGenerations, steps: list[Step]) -> None:
    """Unclaimed generations go to the store as steps of their own sessions (readable, never trained)."""
    for step in steps:
        await ask(runtime.store, lambda r, s=step: store_msgs.Put(s.session_id, (), (s,), r))  # type: ignore[misc]
    if steps:
        generations.unclaimed_stored += len(steps)
        log.warning("%d token-in generation(s) from POST /generate were not claimed by /submit_steps (within "
                    "--session-ttl, or before shutdown); stored as steps of their sessions generate-<id> "
                    "(/trajectory/read include_steps), not for training", len(steps))
