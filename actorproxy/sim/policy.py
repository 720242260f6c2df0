"""The simulated engine's output policy and prompt reading (no I/O, no Trio).

Given the prompt ids the engine received, :func:`read_prompt` finds the offered
tools and what the last turn was; :func:`policy_text` decides what a plausible
agent model would say (reasoning, tool calls built from the tools' JSON
schemas, short answers); :func:`token_logprob` gives each sampled token a
deterministic, float32-exact logprob; :func:`prompt_logprobs` and
:func:`routed_experts` derive per-position values from a rolling hash of the
prefix, so they change wherever an earlier token changes (as a model's would).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import struct
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from ..config.sim_engine import SimConfig
from ..tokenization.tokenizer import ChatTokenizer

_WORDS = (
    "the model reads each file and checks what the tests expect before it changes "
    "anything then it runs the suite again to see which cases still fail and why "
    "small steps keep the plan clear so the answer stays short useful and correct"
).split()

Tools = tuple[tuple[str, Mapping[str, Any]], ...]


def token_logprob(key: bytes, index: int, token_id: int) -> float:
    """A deterministic, float32-exact logprob <= 0 for ``token_id`` at ``index``.

    Mostly near 0, sometimes -0.3..-2, rarely -2..-5, like a sampled token's. A later
    ``prompt_logprobs`` can reuse it with a key derived from the engine seed.
    """
    digest = hashlib.blake2b(struct.pack("<qq", index, token_id), digest_size=8, key=key).digest()
    return _logprob_of(digest)


def alternatives(token_id: int, logprob: float, k: int) -> tuple[tuple[int, float], ...]:
    """The ``k`` likeliest tokens where ``token_id`` was sampled with ``logprob``, the likeliest first: the
    sampled one and ``k - 1`` neighbours of its id sharing the rest of the probability, halving (float32-exact).

    Deterministic, so a test can spell what a reply must list (an engine's ``top_logprobs``).
    """
    rest = max(1.0 - math.exp(logprob), 1e-30)
    step = -1 if token_id >= k else 1
    out = [(token_id, logprob)]
    for i in range(1, k):
        lp = float(struct.unpack("f", struct.pack("f", math.log(rest / 2**i)))[0])
        out.append((token_id + step * i, lp))
    out.sort(key=lambda pair: -pair[1])
    return tuple(out)


def _logprob_of(digest: bytes) -> float:
    """Map 8 hash bytes to a float32-exact logprob <= 0 (the shape ``token_logprob`` promises)."""
    u = int.from_bytes(digest[:4], "little") / 2**32
    v = int.from_bytes(digest[4:8], "little") / 2**32
    if u < 0.85:
        lp = -0.3 * v**4
    elif u < 0.97:
        lp = -0.3 - 1.7 * v
    else:
        lp = -2.0 - 3.0 * v
    return min(float(struct.unpack("f", struct.pack("f", lp))[0]), 0.0)


@attrs.frozen
class PromptView:
    """What the output policy needs from a prompt (see :func:`read_prompt`)."""

    #: ``(name, JSON schema of the parameters)`` of each tool offered.
    tools: Tools = ()
    last_turn: Literal["user", "tool"] = "user"
    #: No assistant turn before the one asked for: the conversation's first turn.
    first_turn: bool = True
    #: ``"on"``: write ``<think>`` first; ``"open"``: a ``<think>`` is open; ``"off"``: none.
    thinking: Literal["on", "open", "off"] = "off"


def _rfind(raw: bytes, pattern: bytes, end: int) -> int:
    """Index of the last int32 item equal to ``pattern`` before item ``end``, or -1."""
    stop = end * 4
    while (k := raw.rfind(pattern, 0, stop)) >= 0 and k % 4:
        stop = k + 3  # a misaligned hit: look for matches starting before it
    return k // 4 if k >= 0 else -1


def _parse_tools(system_text: str) -> Tools:
    # The last pair: Qwen's preamble mentions "<tools></tools>" before the real list.
    end = system_text.rfind("</tools>")
    start = system_text.rfind("<tools>", 0, max(end, 0))
    if start < 0:
        return ()
    block, pos = system_text[start + len("<tools>") : end], 0
    decoder, tools = json.JSONDecoder(), []
    while pos < len(block):
        if block[pos].isspace():
            pos += 1
            continue
        try:
            obj, pos = decoder.raw_decode(block, pos)
        except ValueError:
            break
        fn = obj.get("function", obj) if isinstance(obj, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            tools.append((fn["name"], params if isinstance(params, dict) else {}))
    return tuple(tools)


def read_prompt(tokenizer: ChatTokenizer, ids: array[int], raw: bytes = b"") -> PromptView:
    """Read the tools, the last turn's kind and the thinking mode off a ChatML prompt.

    Decodes only the first system turn and a few tokens after the last two
    ``<|im_start|>``; a prompt that is not ChatML reads as a plain user prompt.
    ``raw`` is ``ids.tobytes()`` if the caller has it already.
    """
    start_ids = tokenizer.encode("<|im_start|>")
    im_start = start_ids[0] if len(start_ids) == 1 else -1
    if im_start not in tokenizer.special_ids or not ids:
        return PromptView()
    raw = raw or ids.tobytes()
    pattern = array("i", [im_start]).tobytes()
    last = _rfind(raw, pattern, len(ids))
    if last < 0:
        return PromptView()
    tools: Tools = ()
    if ids[0] == im_start and tokenizer.decode(ids[1:2]) == "system":
        end = ids.index(tokenizer.eot_token_id) if tokenizer.eot_token_id in ids else len(ids)
        tools = _parse_tools(tokenizer.decode(ids[1:end]))
    prev = _rfind(raw, pattern, last)
    head = tokenizer.decode(ids[prev + 1 : min(last, prev + 4)]) if prev >= 0 else ""
    is_tool = head.startswith("tool") or "<tool_response>" in head
    tail = ids[last + 1 :]
    thinking: Literal["on", "open", "off"] = "off"
    if tokenizer.think_start_id is not None and tokenizer.think_end_id is not None:
        if tokenizer.think_end_id not in tail:
            thinking = "open" if tokenizer.think_start_id in tail else "on"
    # The assistant turns' heads: the one the prompt ends with (asked for), and one for each before it.
    assistant = array("i", [im_start, *tokenizer.encode("assistant")]).tobytes()
    return PromptView(tools, "tool" if is_tool else "user", thinking=thinking, first_turn=raw.count(assistant) <= 1)


def sample_value(schema: Any, rng: random.Random, depth: int = 0) -> Any:
    """A value meeting the common parts of a JSON schema: type, enum, const, bounds."""
    if not isinstance(schema, Mapping):
        return rng.choice(_WORDS)
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return rng.choice(schema["enum"])
    if "const" in schema:
        return schema["const"]
    for key in ("anyOf", "oneOf"):
        options = [s for s in schema.get(key) or () if isinstance(s, Mapping)]
        options = [s for s in options if s.get("type") != "null"] or options
        if options:
            return sample_value(rng.choice(options), rng, depth)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    if kind is None:
        kind = "object" if "properties" in schema else "string"
    if kind == "integer":
        lo = math.ceil(schema.get("minimum", 0))
        return rng.randint(lo, max(lo, math.floor(schema.get("maximum", lo + 100))))
    if kind == "number":
        lo = float(schema.get("minimum", 0.0))
        return round(rng.uniform(lo, max(lo, float(schema.get("maximum", lo + 100.0)))), 2)
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "array":
        low = int(schema.get("minItems", 1))
        count = rng.randint(low, max(low, min(int(schema.get("maxItems", 3)), low + 2)))
        return [sample_value(schema.get("items"), rng, depth + 1) for _ in range(count)]
    if kind == "object":
        return _sample_object(schema, rng, depth + 1)
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 3)))


def _sample_object(schema: Mapping[str, Any], rng: random.Random, depth: int) -> dict[str, Any]:
    props = schema.get("properties")
    props = props if isinstance(props, Mapping) else {}
    required = [r for r in schema.get("required") or () if isinstance(r, str)]
    if depth > 4:  # a recursive schema: stop nesting, keep what is required
        return {name: rng.choice(_WORDS) for name in required}
    out = {
        name: sample_value(sub, rng, depth)
        for name, sub in props.items()
        if name in required or rng.random() < 0.3
    }
    for name in required:
        out.setdefault(name, sample_value(None, rng, depth))
    return out


def _sentence(rng: random.Random, low: int, high: int) -> str:
    text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(low, high)))
    return text[0].upper() + text[1:] + "."


def policy_text(view: PromptView, rng: random.Random, config: SimConfig) -> str:
    """The random policy's output as text, without the end-of-turn token."""
    parts = []
    if view.thinking != "off":
        opening = "<think>\n" if view.thinking == "on" else ""
        parts.append(opening + _sentence(rng, 6, 24) + "\n</think>\n\n")
    p = config.tool_call_probability
    if view.last_turn == "tool":
        later = config.followup_tool_call_probability
        p = p / 2 if later is None else later
    scripted = []
    if config.tool_calls and view.first_turn:
        offered = {name for name, _ in view.tools}
        scripted = [(name, args) for name, args in config.tool_calls if name in offered]
    if scripted:
        parts.append("\n".join(f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n</tool_call>'
                               for name, args in scripted))
    elif view.tools and rng.random() < p:
        calls = []
        for _ in range(2 if rng.random() < config.parallel_tool_call_probability else 1):
            name, params = rng.choice(view.tools)
            try:
                args = _sample_object(params, rng, 0)
            except (TypeError, ValueError):  # a malformed schema (bounds that are not numbers)
                args = {}
            body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
            calls.append(f"<tool_call>\n{body}\n</tool_call>")
        parts.append("\n".join(calls))
    else:
        parts.append(_sentence(rng, 4, 30))
    return "".join(parts)




def _prefix_states(key: bytes, ids: Sequence[int], count: int) -> list[bytes]:
    """A 16-byte hash of each prefix ``ids[: i + 1]`` for ``i < count``: O(count)."""
    states, state = [], b""
    for tok in ids[:count]:
        state = hashlib.blake2b(state + struct.pack("<i", tok), digest_size=16, key=key).digest()
        states.append(state)
    return states


def prompt_logprobs(key: bytes, ids: Sequence[int]) -> list[float | None]:
    """A logprob for every token given the ones before it; the first is ``None``.

    Float32-exact and <= 0; each depends on the whole prefix up to that token.
    """
    out: list[float | None] = [None] if ids else []
    out.extend(_logprob_of(state) for state in _prefix_states(key, ids, len(ids))[1:])
    return out


def routed_experts(key: bytes, ids: Sequence[int], *, layers: int, topk: int, experts: int) -> bytes:
    """Simulated MoE routing of every forwarded token: little-endian int32 bytes.

    Shape ``[len(ids) - 1, layers, topk]`` (the last token is sampled, never forwarded);
    each row holds ``topk`` distinct experts in ``[0, experts)`` per layer and depends
    on the prefix up to that token.
    """
    if not 0 < topk <= experts:
        raise ValueError(f"need 0 < topk <= experts, got topk={topk}, experts={experts}")
    out = array("i")
    for state in _prefix_states(key, ids, max(len(ids) - 1, 0)):
        pool, counter = b"", 0
        for _ in range(layers):
            chosen: list[int] = []
            while len(chosen) < topk:
                if len(pool) < 2:
                    pool += hashlib.blake2b(state + bytes([counter]), digest_size=64).digest()
                    counter = (counter + 1) % 256
                expert, pool = int.from_bytes(pool[:2], "little") % experts, pool[2:]
                if expert not in chosen:
                    chosen.append(expert)
            out.extend(chosen)
    if sys.byteorder == "big":
        out.byteswap()
    return out.tobytes()
