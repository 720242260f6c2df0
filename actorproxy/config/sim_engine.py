"""Settings of the simulated engine (shared by the engine, its output policy, ``actorproxy sim``'s flags and
the ``--sim-*`` settings of ``actorproxy run``, which take their defaults from here)."""

from __future__ import annotations

import json
from typing import Any

import attrs


def parse_tool_calls(text: str) -> tuple[tuple[str, str], ...]:
    """``(name, arguments as JSON text)`` of each call given, one as ``{"name": ..., "arguments": {...}}`` or several
    (made together) as a list of them; ``ValueError`` for anything else."""
    try:
        given: Any = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    calls = given if isinstance(given, list) and given else [given]
    for call in calls:
        if not isinstance(call, dict) or set(call) != {"name", "arguments"} or not isinstance(call["name"], str) \
                or not call["name"] or not isinstance(call["arguments"], dict):
            raise ValueError('expected {"name": "<tool>", "arguments": {...}}, or a list of them')
    return tuple((call["name"], json.dumps(call["arguments"], ensure_ascii=False)) for call in calls)


@attrs.frozen
class SimConfig:
    """Settings of a :class:`SimEngine`; times are in seconds of Trio's clock."""

    seed: int = 0
    token_interval: float = 0.02
    prefill_latency: float = 0.0
    prefill_per_token: float = 0.0
    weight_version: str = "0"
    max_model_len: int = 32768
    model_id: str = "actorproxy-sim"
    #: Chance of a tool call after a user message (when tools are offered).
    tool_call_probability: float = 0.7
    #: Chance of a call right after tool responses; ``None``: half the above (loops end).
    followup_tool_call_probability: float | None = None
    #: Chance that a tool-calling turn makes two parallel calls.
    parallel_tool_call_probability: float = 0.2
    #: ``(name, arguments as JSON text)`` of each call made on a conversation's first turn (no assistant turn before),
    #: those whose tool the prompt offers, together, instead of a random one (:func:`parse_tool_calls`): for a tool
    #: whose arguments must mean something to the agent (opencode's task tool names an agent). Later turns sample
    #: as usual.
    tool_calls: tuple[tuple[str, str], ...] = ()
    #: ``False``: the tokenizer's stop ids also end a generation (as EOS does in an engine).
    ignore_eos: bool = False
    #: Unseeded requests depend on the prompt alone; ``True`` mixes in the request
    #: counter so repeated prompts differ (results then depend on arrival order).
    vary_unseeded: bool = False
    #: Unscripted replies are this many tokens of one filler word (`` so``), then the
    #: end-of-turn token, whatever the prompt; ``None``: the random policy's reply.
    #: For long-stream benchmarks, whose clients count the word to count tokens.
    reply_tokens: int | None = None
    #: Tokens per streamed event, as SGLang's ``--stream-interval``: the tokens come at
    #: ``token_interval`` each but are streamed in bursts of this many.
    stream_interval: int = 1
    #: One engine-wide decoding step every ``token_interval``, as a GPU engine batching every running
    #: request: a request's start + prefill is rounded up to the next step of the engine's active
    #: clock, so all streams get their tokens at the same instants. ``False``: each request keeps the
    #: phase of its own start.
    decode_steps: bool = False
    #: How many requests :meth:`SimEngine.stats` remembers.
    stats_capacity: int = 10_000
    #: Weight-version changes kept to stamp the tokens of lagging consumers.
    version_history: int = 64
    #: Shape of the simulated MoE routing returned with ``return_routed_experts``.
    num_layers: int = 4
    moe_topk: int = 2
    num_experts: int = 16

    def __attrs_post_init__(self) -> None:
        if self.reply_tokens is not None and self.reply_tokens < 1 or self.stream_interval < 1:
            raise ValueError("SimConfig: reply_tokens and stream_interval must be >= 1")
        if self.num_layers < 1 or not 0 < self.moe_topk <= self.num_experts:
            raise ValueError("SimConfig: need num_layers >= 1 and 0 < moe_topk <= num_experts")
