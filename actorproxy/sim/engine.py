"""The simulated engine: a deterministic, in-process :class:`Backend` on Trio's clock.

Outputs depend only on the engine seed, the request's ``sampling.seed`` and the
prompt ids. Token ``n`` (1-based) is emitted at ``start + prefill + n * token_interval``
(``start``: when the ``async with`` block was entered; ``prefill = prefill_latency +
prefill_per_token * len(prompt)``), the ``GenerateFinish`` at the same instant as the
last token, so tests under ``MockClock(autojump_threshold=0)`` know what came when.
Same-instant events resolve one way whatever the task order: a token due at ``t``
is emitted before an abort, cancel or weight swap made at ``t`` (it keeps the old
version). The stream is pull-based but on that schedule: a lagging consumer gets
the tokens already due at once, stamped with the version of their emission time.
With ``SimConfig.decode_steps`` the engine decodes in steps, as a GPU engine batching
every running request: ``start + prefill`` is rounded up to a multiple of
``token_interval`` on the active clock, so every stream's tokens come at the same instants.

Unscripted, the output policy reads the ChatML/Qwen3 prompt (tools in the first
system turn; last turn a user message or tool responses; thinking disabled by
``<think>\\n\\n</think>``, left open, or on) and writes optional reasoning, then
Hermes tool calls with arguments drawn from the tools' JSON schemas or a short
text answer, then the end-of-turn token. Temperature 0 ignores the request seed.

:meth:`SimEngine.pause` freezes every schedule (a weight update, a stalled engine):
the tokens due after the pause began come that much later once it is resumed.
:meth:`SimEngine.prompt_logprobs` and, on request, ``GenerateFinish.routed_experts``
are deterministic functions of the engine seed and the token prefix.
"""

from __future__ import annotations

import hashlib
import math
import random
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence

import trio

from ..config.sim_engine import SimConfig
from ..engines.base import (
    BackendError,
    GenerateRequest,
    ModelInfo,
)
from ..tokenization.tokenizer import ChatTokenizer
from .clock import Pacer, PauseClock
from .generation import SimGeneration
from .outputs import Plan, ScriptedOutput, SimRequestStats
from .policy import policy_text, prompt_logprobs, read_prompt, token_logprob

ScriptItem = str | Sequence[int] | ScriptedOutput


def _continuation_hash(routing_key: str | None, prompt: bytes) -> hashlib.blake2b:
    """The hash a stopped generation is found by: its routing key's and its prompt's (then its tokens')."""
    hashed = hashlib.blake2b(digest_size=16, person=b"sim-left-off")
    key = (routing_key or "").encode()
    hashed.update(len(key).to_bytes(4, "little") + key)
    hashed.update(prompt)
    return hashed


class SimEngine:
    """A deterministic in-process engine implementing :class:`Backend` (``kind="sim"``)."""

    kind = "sim"

    def __init__(self, tokenizer: ChatTokenizer, config: SimConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.config = config = config if config is not None else SimConfig()
        self.requests_started = 0
        self._versions: deque[tuple[float, str]] = deque(
            [(-math.inf, config.weight_version)], maxlen=max(1, config.version_history)
        )
        self._scripts: deque[ScriptedOutput] = deque()
        self._keyed_scripts: dict[str, deque[ScriptedOutput]] = {}
        self._running: dict[str, SimGeneration] = {}
        self._history: OrderedDict[str, SimGeneration] = OrderedDict()
        #: What generations stopped before their end had left (their plan, the tokens they gave), by the hash of
        #: the prompt that continues them: their prompt and those tokens (:meth:`left_off`).
        self._left_off: OrderedDict[bytes, tuple[Plan, int]] = OrderedDict()
        self._closed = False
        self._eos = frozenset(() if config.ignore_eos else tokenizer.stop_token_ids)
        self._filler = list(tokenizer.encode(" so"))  # one token in the usual vocabularies
        self.clock = PauseClock()
        self.pacer = Pacer()  # wakes each generation when its next token is due
        self._prompt_key = self._derived_key(b"prompt-logprobs")
        self.route_key = self._derived_key(b"routed-experts")

    def _derived_key(self, purpose: bytes) -> bytes:
        h = hashlib.blake2b(digest_size=32, person=b"actorproxy-sim")
        h.update(f"{self.config.seed}|".encode() + purpose)
        return h.digest()

    @property
    def weight_version(self) -> str:
        return self._versions[-1][1]

    def set_weight_version(self, version: str) -> None:
        """Install a new version: tokens due after this instant are stamped with it."""
        try:
            now = trio.current_time()
        except RuntimeError:  # before trio.run: applies to everything
            now = -math.inf
        self._versions.append((now, version))

    def pause(self, holder: str = "pause") -> None:
        """Freeze every generation (running and new) until :meth:`resume` with each holder.

        Tokens due up to now are still delivered; later ones come after the resume,
        as late as the pause lasted, stamped with the version current when they come.
        Holders let independent pauses (a weight update, a stall) overlap.
        """
        self.clock.pause(holder)

    def resume(self, holder: str = "pause") -> None:
        """Release ``holder``'s pause; generation goes on when no holder is left."""
        if self.clock.resume(holder):
            for gen in list(self._running.values()):
                gen.kick()

    async def freeze_refusal(self) -> str | None:
        """The simulated engine can always freeze its generations in place (a ``keep`` pause)."""
        return None

    def freeze(self) -> None:
        """A ``keep`` pause: :meth:`pause` under a holder of its own, released by :meth:`thaw`."""
        self.pause("keep")

    def thaw(self) -> None:
        self.resume("keep")

    @property
    def paused(self) -> bool:
        return self.clock.paused_at is not None

    async def prompt_logprobs(self, input_ids: Sequence[int]) -> list[float | None]:
        """Deterministic logprobs of every prompt token given the ones before it.

        The first entry is ``None``; the others are float32-exact, <= 0, and depend on
        the engine seed and the whole prefix. O(len(input_ids)).
        """
        await trio.lowlevel.checkpoint()
        return prompt_logprobs(self._prompt_key, input_ids)

    def version_at(self, t: float) -> str:
        for since, version in reversed(self._versions):
            if since < t:
                return version
        return self._versions[0][1]

    def script(self, *outputs: ScriptItem, routing_key: str | None = None) -> None:
        """Queue exact outputs for the next requests (of ``routing_key``, if given).

        A ``str`` is encoded with the tokenizer and gets the end-of-turn token appended
        unless its ids already end with it; a sequence of ints is used as is. A request
        takes from its routing key's queue first, then the global queue, then the
        random policy. ``max_new_tokens``, ``stop_token_ids``, EOS, ``min_tokens`` and ``ignore_eos`` still apply.
        """
        queue = self._scripts
        if routing_key is not None:
            queue = self._keyed_scripts.setdefault(routing_key, deque())
        for item in outputs:
            if isinstance(item, str):
                ids = list(self.tokenizer.encode(item))
                if not ids or ids[-1] != self.tokenizer.eot_token_id:
                    ids.append(self.tokenizer.eot_token_id)
                item = ids
            queue.append(item if isinstance(item, ScriptedOutput) else ScriptedOutput(item))

    def _next_script(self, routing_key: str | None) -> ScriptedOutput | None:
        if routing_key is not None and (queue := self._keyed_scripts.get(routing_key)):
            item = queue.popleft()
            if not queue:  # drop empty queues: routing keys are unbounded
                del self._keyed_scripts[routing_key]
            return item
        return self._scripts.popleft() if self._scripts else None

    def open_generation(self, request: GenerateRequest) -> SimGeneration:
        """A generation to enter with ``async with``; it starts (its clock runs) on entry.

        Entering raises :class:`BackendError` if the engine is closed, the rid is
        running already, or the prompt does not fit ``max_model_len``.
        """
        return SimGeneration(self, request)

    def begin(self, gen: SimGeneration, request: GenerateRequest) -> tuple[Plan, float]:
        """Start ``gen`` (serving ``request``): its plan, and when its first token is due on the active clock."""
        max_len = self.config.max_model_len
        if self._closed:
            raise BackendError("simulated engine is closed", status=503)
        if request.rid in self._running:
            raise BackendError(f"duplicate rid {request.rid}", status=400)
        ids = request.input_ids
        if not isinstance(ids, array) or ids.typecode != "i":
            ids = array("i", ids)
        if len(ids) >= max_len:
            raise BackendError(
                f"prompt of {len(ids)} tokens >= max_model_len {max_len}", status=400
            )
        self.requests_started += 1
        plan = self._make_plan(request, ids)
        cfg = self.config
        first = self.clock.active() + cfg.prefill_latency + cfg.prefill_per_token * len(ids)
        if cfg.decode_steps and cfg.token_interval > 0:  # join the engine's next decoding step
            first = math.ceil(first / cfg.token_interval) * cfg.token_interval
        self._running[request.rid] = gen
        self._history[request.rid] = gen
        self._history.move_to_end(request.rid)
        while len(self._history) > self.config.stats_capacity:
            self._history.popitem(last=False)
        return plan, first

    def end(self, rid: str) -> None:
        """The generation ``rid`` is over (delivered its last event, or was left)."""
        self._running.pop(rid, None)

    def left_off(self, plan: Plan, given: int) -> None:
        """A generation stopped (aborted, or left) after ``given`` tokens of ``plan``: a request of its routing key
        (its session) whose prompt is its prompt and those tokens (a partial rollout's) continues it, as a model
        goes on with its own text, with the tokens and logprobs it would have given unstopped. Keyed by the session
        too: a group's rollouts share their prompt, and a pause stops them all, often after as many tokens. Only the
        policy's plans (a script is the test's to give); the last ``stats_capacity`` are kept."""
        if plan.prompt_hash is None or given >= len(plan.ids):
            return
        continued = plan.prompt_hash.copy()
        continued.update(plan.ids[:given].tobytes())
        self._left_off[continued.digest()] = (plan, given)
        while len(self._left_off) > self.config.stats_capacity:
            self._left_off.popitem(last=False)

    def _request_key(self, request: GenerateRequest, raw: bytes) -> bytes:
        # Temperature 0 is greedy: the request seed must not matter.
        seed = None if request.sampling.temperature == 0 else request.sampling.seed
        counter = self.requests_started if seed is None and self.config.vary_unseeded else 0
        h = hashlib.blake2b(digest_size=32, person=b"actorproxy-sim")
        h.update(f"{self.config.seed}|{seed}|{counter}|".encode())
        h.update(raw)
        return h.digest()

    def _make_plan(self, request: GenerateRequest, ids: array[int]) -> Plan:
        raw = ids.tobytes()
        key = self._request_key(request, raw)
        script = self._next_script(request.routing_key)
        tokens: Sequence[int]
        given: Sequence[float] | None = None
        hashed = None
        if script is not None:
            tokens, given, reason = script.token_ids, script.logprobs, script.finish
        elif self.config.reply_tokens is not None:
            n = self.config.reply_tokens
            tokens, reason = [*(self._filler * n)[:n], self.tokenizer.eot_token_id], "stop"
        else:
            hashed = _continuation_hash(request.routing_key, raw)
            left = self._left_off.pop(hashed.digest(), None) if self._left_off else None
            if left is not None:  # a stopped generation's prompt and tokens: its rest
                before, at = left
                tokens, given, reason = before.ids[at:], before.logprobs[at:], before.reason
            else:
                rng = random.Random(int.from_bytes(key[:8], "little"))
                text = policy_text(read_prompt(self.tokenizer, ids, raw), rng, self.config)
                tokens, reason = [*self.tokenizer.encode(text), self.tokenizer.eot_token_id], "stop"
        sampling = request.sampling
        limit = min(sampling.max_new_tokens, self.config.max_model_len - len(ids))
        stops = (frozenset() if sampling.ignore_eos else self._eos) | frozenset(sampling.stop_token_ids)
        out, lps = array("i"), array("f")
        matched: int | None = None
        if limit <= 0:
            reason, tokens = "length", ()
        planned, filler = len(tokens), self._filler[0]
        went_on = False  # a stop id was masked (min_tokens): the plan's end no longer ends the reply
        i = 0
        while len(out) < limit:
            if i < planned:
                tok = tokens[i]
            elif sampling.ignore_eos or len(out) < sampling.min_tokens:
                tok = filler  # the plan is spent: the policy goes on (ignore_eos) or must (min_tokens)
            elif went_on:
                tok = self.tokenizer.eot_token_id  # it went on to min_tokens: now it ends
            else:
                break
            if tok in stops and len(out) < sampling.min_tokens:
                tok, went_on = filler, True  # stop ids are masked until min_tokens: another token is sampled
            out.append(tok)
            lps.append(given[i] if given is not None and i < planned and tok == tokens[i]
                       else token_logprob(key, i, tok))
            i += 1
            if len(out) >= limit:  # length before stop ids, as SGLang checks them
                reason = "length"
                break
            if tok in stops:
                reason, matched = "stop", tok
                break
        message = "scripted abort" if reason == "abort" else ""
        return Plan(out, lps, reason, matched, message, script is not None, hashed)

    async def abort_all(self) -> None:
        """Abort every running generation (each ends with reason ``"abort"``)."""
        for gen in list(self._running.values()):
            gen.request_abort()
        await trio.lowlevel.checkpoint()

    @property
    def running(self) -> int:
        """Generations entered whose final event was not delivered and block not left."""
        return len(self._running)

    def stats(self, rid: str) -> SimRequestStats:
        """What the engine did for ``rid`` (among the last ``stats_capacity``), else KeyError."""
        return self._history[rid].stats()

    async def model_info(self) -> ModelInfo:
        await trio.lowlevel.checkpoint()
        return ModelInfo(self.config.model_id, self.config.max_model_len, self.weight_version)

    async def aclose(self) -> None:
        """Abort everything; later generations fail with :class:`BackendError`."""
        self._closed = True
        await self.abort_all()
