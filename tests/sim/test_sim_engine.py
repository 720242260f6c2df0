"""The simulated engine: determinism, exact timing on MockClock, limits, aborts, scripts."""

from __future__ import annotations

import base64
import json
import math
import random
import struct
from array import array
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from trio.testing import MockClock

from actorproxy.engines.base import (
    Backend,
    BackendError,
    GenerateFinish,
    GenerateRequest,
    Generation,
    SamplingParams,
    TokenDelta,
)
from actorproxy.sim import ScriptedOutput, SimConfig, SimEngine
from actorproxy.sim.clock import Pacer, Wake
from actorproxy.sim.policy import policy_text, read_prompt, sample_value, token_logprob
from actorproxy.tokenization.tokenizer import ChatTokenizer

# Binary-exact times, so MockClock readings compare with ==.
TIMED = SimConfig(prefill_latency=0.5, token_interval=0.25)

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
                "unit": {"type": "string", "enum": ["c", "f"]},
            },
            "required": ["city", "days", "unit"],
        },
    },
}
SEARCH: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "number", "minimum": 0.5, "maximum": 2},
                "exact": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "filter": {
                    "type": "object",
                    "properties": {"lang": {"type": "string"}},
                    "required": ["lang"],
                },
            },
            "required": ["query", "limit", "exact", "tags", "filter"],
        },
    },
}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def prompt(
    tok: ChatTokenizer,
    user: str = "What is up?",
    *,
    tools: list[dict[str, Any]] | None = None,
    thinking: bool = False,
    after_tool: bool = False,
) -> array[int]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": user}]
    if after_tool:
        call = {"name": "get_weather", "arguments": {"city": "Paris", "days": 1, "unit": "c"}}
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
            {"role": "tool", "content": "sunny"},
        ]
    return tok.encode(tok.render(messages, tools=tools, enable_thinking=thinking))


def req(ids: array[int], max_new_tokens: int = 512, **kw: Any) -> GenerateRequest:
    routing_key = kw.pop("routing_key", None)
    return GenerateRequest(ids, SamplingParams(max_new_tokens, **kw), routing_key=routing_key)


async def run(
    engine: SimEngine, request: GenerateRequest
) -> tuple[list[tuple[float, TokenDelta]], GenerateFinish, float]:
    """All events with the clock time each arrived, the finish, and its time."""
    deltas: list[tuple[float, TokenDelta]] = []
    async with engine.open_generation(request) as gen:
        async for event in gen:
            if isinstance(event, TokenDelta):
                deltas.append((trio.current_time(), event))
            else:
                return deltas, event, trio.current_time()
    raise AssertionError("stream ended without GenerateFinish")


async def aborted_after(engine: SimEngine, request: GenerateRequest, n: int) -> list[tuple[float, TokenDelta]]:
    """The tokens of a generation aborted once it gave ``n`` (with the clock time each arrived)."""
    deltas: list[tuple[float, TokenDelta]] = []
    async with engine.open_generation(request) as gen:
        async for event in gen:
            if isinstance(event, TokenDelta):
                deltas.append((trio.current_time(), event))
                if len(deltas) == n:
                    await gen.abort()
    return deltas


async def events_while(gen: Generation, act: Callable[[], Awaitable[None]]) -> list[tuple[float, Any]]:
    """``gen``'s events with the clock time each arrived, while ``act`` runs in a task of its own."""
    got: list[tuple[float, Any]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(act)
        async for event in gen:
            got.append((trio.current_time(), event))
    return got


def ids_of(deltas: list[tuple[float, TokenDelta]]) -> list[int]:
    return [i for _, d in deltas for i in d.token_ids]


def lps_of(deltas: list[tuple[float, TokenDelta]]) -> list[float]:
    return [lp for _, d in deltas for lp in d.logprobs]


def tool_calls(tok: ChatTokenizer, ids: list[int]) -> list[dict[str, Any]]:
    text = tok.decode(ids)
    calls = []
    for chunk in text.split("<tool_call>\n")[1:]:
        body, sep, _ = chunk.partition("\n</tool_call>")
        assert sep, text
        calls.append(json.loads(body))
    return calls


def think_end(tok: ChatTokenizer) -> int:
    assert tok.think_end_id is not None
    return tok.think_end_id


def test_engine_is_a_backend(tokenizer: ChatTokenizer) -> None:
    backend: Backend = SimEngine(tokenizer)
    assert backend.kind == "sim"


# -- determinism -------------------------------------------------------------


async def test_same_seed_and_prompt_give_same_output(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    ids = prompt(tokenizer, tools=TOOLS, thinking=True)
    a, fa, _ = await run(SimEngine(tokenizer, SimConfig(seed=3)), req(ids, seed=7))
    b, fb, _ = await run(SimEngine(tokenizer, SimConfig(seed=3)), req(ids, seed=7))
    assert ids_of(a) == ids_of(b) and lps_of(a) == lps_of(b) and fa == fb
    assert len(ids_of(a)) > 3


async def test_different_seeds_usually_differ(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    ids = prompt(tokenizer)
    engine = SimEngine(tokenizer)
    outputs = {tuple(ids_of((await run(engine, req(ids, seed=s)))[0])) for s in range(8)}
    assert len(outputs) >= 6
    other = SimEngine(tokenizer, SimConfig(seed=1))
    first = ids_of((await run(engine, req(ids, seed=0)))[0])
    assert ids_of((await run(other, req(ids, seed=0)))[0]) != first


async def test_temperature_zero_ignores_request_seed(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    ids = prompt(tokenizer)
    engine = SimEngine(tokenizer)
    runs = [ids_of((await run(engine, req(ids, temperature=0, seed=s)))[0]) for s in range(4)]
    assert all(r == runs[0] for r in runs)


async def test_unseeded_requests_vary_only_when_asked(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    ids = prompt(tokenizer)
    fixed = SimEngine(tokenizer)
    assert len({tuple(ids_of((await run(fixed, req(ids)))[0])) for _ in range(4)}) == 1
    varied = SimEngine(tokenizer, SimConfig(vary_unseeded=True))
    assert len({tuple(ids_of((await run(varied, req(ids)))[0])) for _ in range(4)}) > 1


# -- timing --------------------------------------------------------------------


async def test_token_timing_is_exact(tokenizer: ChatTokenizer, autojump_clock: MockClock) -> None:
    engine = SimEngine(tokenizer, TIMED)
    await trio.sleep(10)
    deltas, finish, t_finish = await run(engine, req(prompt(tokenizer)))
    assert [t for t, _ in deltas] == [10 + 0.5 + n * 0.25 for n in range(1, len(deltas) + 1)]
    assert t_finish == deltas[-1][0]
    assert finish.reason == "stop" and finish.matched_stop == tokenizer.eot_token_id


async def test_prefill_cost_per_prompt_token(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer, SimConfig(prefill_per_token=0.5, token_interval=1.0))
    engine.script([1, 2])
    deltas, _, _ = await run(engine, req(array("i", [5, 6, 7, 8])))
    assert [t for t, _ in deltas] == [3.0, 4.0]


async def test_lagging_consumer_gets_tokens_at_once_with_emission_versions(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer, SimConfig(token_interval=1.0))
    engine.script([10, 11, 12, 13])
    async with engine.open_generation(req(array("i", [1]))) as gen:
        await trio.sleep(2.5)
        engine.set_weight_version("1")
        assert engine.stats(gen.rid).token_ids == (10, 11)
        events = [(trio.current_time(), e) async for e in gen]
    assert [t for t, _ in events] == [2.5, 2.5, 3.0, 4.0, 4.0]
    versions = [e.weight_version for _, e in events]
    assert versions == ["0", "0", "1", "1", "1"]


# -- limits and stops --------------------------------------------------------


async def test_ends_with_eot(tokenizer: ChatTokenizer, autojump_clock: MockClock) -> None:
    engine = SimEngine(tokenizer)
    for seed in range(5):
        deltas, finish, _ = await run(engine, req(prompt(tokenizer), seed=seed))
        assert ids_of(deltas)[-1] == tokenizer.eot_token_id
        assert tokenizer.eot_token_id not in ids_of(deltas)[:-1]
        assert finish.reason == "stop" and finish.matched_stop == tokenizer.eot_token_id
        assert finish.prompt_tokens == len(prompt(tokenizer))
        assert all(len(d.token_ids) == 1 == len(d.logprobs) for _, d in deltas)


async def test_max_new_tokens_gives_length(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer)
    ids = prompt(tokenizer, thinking=True)
    full, _, _ = await run(engine, req(ids))
    deltas, finish, _ = await run(engine, req(ids, max_new_tokens=3))
    assert ids_of(deltas) == ids_of(full)[:3]
    assert finish.reason == "length" and finish.matched_stop is None
    deltas, finish, _ = await run(engine, req(ids, max_new_tokens=0))
    assert deltas == [] and finish.reason == "length"


async def test_max_model_len_caps_output_and_rejects_long_prompts(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer, SimConfig(max_model_len=10))
    engine.script([1] * 20)
    deltas, finish, _ = await run(engine, req(array("i", [7] * 6)))
    assert len(deltas) == 4 and finish.reason == "length"
    with pytest.raises(BackendError) as err:
        await run(engine, req(array("i", [7] * 10)))
    assert err.value.status == 400


async def test_stop_token_ids_end_with_stop_token_included(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer)
    engine.script([5, 6, 7, 8, 9], [5, 6, 7, 8, 9])
    deltas, finish, _ = await run(engine, req(array("i", [1]), stop_token_ids=(9, 7)))
    assert ids_of(deltas) == [5, 6, 7]
    assert finish.reason == "stop" and finish.matched_stop == 7
    # Length is checked first (as SGLang does) when both apply to the same token.
    deltas, finish, _ = await run(engine, req(array("i", [1]), 3, stop_token_ids=(7,)))
    assert ids_of(deltas) == [5, 6, 7] and finish.reason == "length"


async def test_eos_stops_unless_ignored(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    eot = tokenizer.eot_token_id
    engine = SimEngine(tokenizer)
    engine.script([5, eot, 6])
    deltas, finish, _ = await run(engine, req(array("i", [1])))
    assert ids_of(deltas) == [5, eot] and finish.matched_stop == eot
    engine = SimEngine(tokenizer, SimConfig(ignore_eos=True))
    engine.script([5, eot, 6])
    deltas, finish, _ = await run(engine, req(array("i", [1])))
    assert ids_of(deltas) == [5, eot, 6]
    assert finish.reason == "stop" and finish.matched_stop is None


# -- output policy -----------------------------------------------------------


async def test_thinking_on_emits_think_block(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer)
    deltas, _, _ = await run(engine, req(prompt(tokenizer, thinking=True)))
    out = ids_of(deltas)
    assert out[0] == tokenizer.think_start_id
    assert out.count(think_end(tokenizer)) == 1
    text = tokenizer.decode(out)
    assert text.startswith("<think>\n") and "\n</think>\n\n" in text
    assert len(text.split("</think>\n\n")[1]) > len("<|im_end|>")


async def test_thinking_off_emits_no_think_tokens(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer)
    deltas, _, _ = await run(engine, req(prompt(tokenizer, thinking=False)))
    out = ids_of(deltas)
    assert tokenizer.think_start_id not in out and tokenizer.think_end_id not in out


async def test_open_think_in_prompt_is_closed(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    ids = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    deltas, _, _ = await run(SimEngine(tokenizer), req(ids))
    out = ids_of(deltas)
    assert tokenizer.think_start_id not in out and out.count(think_end(tokenizer)) == 1


async def test_tool_calls_are_valid_json_with_required_args(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(
        tokenizer, SimConfig(tool_call_probability=1.0, parallel_tool_call_probability=0.5)
    )
    counts = set()
    for seed in range(12):
        ids = prompt(tokenizer, tools=TOOLS, thinking=seed % 2 == 0)
        deltas, finish, _ = await run(engine, req(ids, seed=seed))
        calls = tool_calls(tokenizer, ids_of(deltas))
        counts.add(len(calls))
        assert finish.reason == "stop"
        for call in calls:
            schema = SCHEMAS[call["name"]]
            assert set(schema["required"]) <= set(call["arguments"])
            assert set(call["arguments"]) <= set(schema["properties"])
        for call in (c for c in calls if c["name"] == "get_weather"):
            args = call["arguments"]
            assert isinstance(args["city"], str) and args["unit"] in ("c", "f")
            assert isinstance(args["days"], int) and 1 <= args["days"] <= 7
        for call in (c for c in calls if c["name"] == "search"):
            args = call["arguments"]
            assert isinstance(args["exact"], bool) and 0.5 <= args["limit"] <= 2
            assert all(isinstance(t, str) for t in args["tags"])
            assert isinstance(args["filter"]["lang"], str)
    assert counts == {1, 2}


async def test_tool_ids_are_the_real_marker_tokens(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer, SimConfig(tool_call_probability=1.0))
    deltas, _, _ = await run(engine, req(prompt(tokenizer, tools=TOOLS)))
    out = ids_of(deltas)
    assert out[0] == tokenizer.tool_call_start_id
    assert out[-2:] == [tokenizer.tool_call_end_id, tokenizer.eot_token_id]


async def test_after_tool_responses_calls_less_often(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer, SimConfig(tool_call_probability=1.0))
    after = prompt(tokenizer, tools=TOOLS, after_tool=True)
    assert read_prompt(tokenizer, after).last_turn == "tool"
    called = 0
    for seed in range(40):
        deltas, _, _ = await run(engine, req(after, seed=seed))
        called += bool(tool_calls(tokenizer, ids_of(deltas)))
    assert 8 <= called <= 32  # about half
    never = SimEngine(tokenizer, SimConfig(followup_tool_call_probability=0.0))
    for seed in range(10):
        deltas, _, _ = await run(never, req(after, seed=seed))
        assert tokenizer.tool_call_start_id not in ids_of(deltas)


async def test_a_set_call_is_made_whenever_its_tool_is_offered(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    call = ("search", '{"query": "the agent named this", "n": 3}')
    engine = SimEngine(tokenizer, SimConfig(tool_call_probability=0.0, tool_calls=(call,)))
    for seed in range(5):
        deltas, _, _ = await run(engine, req(prompt(tokenizer, tools=TOOLS), seed=seed))
        assert tool_calls(tokenizer, ids_of(deltas)) == [
            {"name": "search", "arguments": {"query": "the agent named this", "n": 3}}]
    # Several, together: those whose tool is offered.
    twice = SimEngine(tokenizer, SimConfig(tool_calls=(call, ("absent", "{}"), call)))
    deltas, _, _ = await run(twice, req(prompt(tokenizer, tools=TOOLS)))
    assert [c["name"] for c in tool_calls(tokenizer, ids_of(deltas))] == ["search", "search"]
    # Not after an assistant turn (after tool results, or a user's next message), and not where the tool is not
    # offered: the random policy, as before.
    talk = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Search."}]
    later = tokenizer.encode(tokenizer.render(talk, tools=TOOLS))
    assert read_prompt(tokenizer, later).last_turn == "user" and not read_prompt(tokenizer, later).first_turn
    for request in (prompt(tokenizer, tools=TOOLS, after_tool=True), later, prompt(tokenizer, tools=[WEATHER])):
        deltas, _, _ = await run(engine, req(request))
        assert tokenizer.tool_call_start_id not in ids_of(deltas)


async def test_no_tools_no_calls(tokenizer: ChatTokenizer, autojump_clock: MockClock) -> None:
    engine = SimEngine(tokenizer, SimConfig(tool_call_probability=1.0))
    deltas, _, _ = await run(engine, req(prompt(tokenizer)))
    assert tokenizer.tool_call_start_id not in ids_of(deltas)


def test_read_prompt_from_plain_chatml(tokenizer: ChatTokenizer) -> None:
    tools = "\n".join(json.dumps(t) for t in TOOLS)
    text = (
        f"<|im_start|>system\nBe nice.\n<tools>\n{tools}\n</tools><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    view = read_prompt(tokenizer, tokenizer.encode(text))
    assert [name for name, _ in view.tools] == ["get_weather", "search"]
    assert view.tools[0][1] == SCHEMAS["get_weather"]
    assert view.last_turn == "tool" and view.thinking == "off"
    plain = read_prompt(tokenizer, tokenizer.encode("just some text"))
    assert plain.tools == () and plain.last_turn == "user" and plain.thinking == "off"
    # An id whose bytes straddle two int32 items must not be found by the search.
    assert read_prompt(tokenizer, array("i", [0x7FFF0000, 0x0000FFFF])).tools == ()


@given(
    st.lists(
        st.sampled_from([151643, 151644, 151645, 151657, 151665, 151667, 151668, 198, 872, 8948])
        | st.integers(0, 151_000)
    )
)
def test_read_prompt_never_fails_on_arbitrary_ids(tokenizer: ChatTokenizer, ids: list[int]) -> None:
    view = read_prompt(tokenizer, array("i", ids))
    text = policy_text(view, random.Random(0), SimConfig(tool_call_probability=1.0))
    assert isinstance(text, str)


def test_sample_value_follows_schema() -> None:
    rng = random.Random(0)
    for _ in range(50):
        assert sample_value({"enum": [1, "a"]}, rng) in (1, "a")
        assert 3 <= sample_value({"type": "integer", "minimum": 3, "maximum": 5}, rng) <= 5
        assert isinstance(sample_value({"type": ["null", "number"]}, rng), float)
        assert sample_value({"anyOf": [{"type": "null"}, {"type": "boolean"}]}, rng) in (
            True,
            False,
        )
        arr = sample_value({"type": "array", "items": {"type": "integer"}, "minItems": 2}, rng)
        assert len(arr) >= 2 and all(isinstance(x, int) for x in arr)
        assert sample_value({"const": "x"}, rng) == "x"
    recursive: dict[str, Any] = {"type": "object", "required": ["child"]}
    recursive["properties"] = {"child": recursive}
    assert "child" in sample_value(recursive, rng)


# -- logprobs ------------------------------------------------------------------


@given(st.binary(min_size=1, max_size=64), st.integers(0, 2**40), st.integers(0, 2**31 - 1))
def test_token_logprob_is_float32_exact_and_not_positive(key: bytes, i: int, t: int) -> None:
    lp = token_logprob(key, i, t)
    assert lp <= 0.0
    assert struct.unpack("f", struct.pack("f", lp))[0] == lp
    assert token_logprob(key, i, t) == lp


async def test_logprobs_look_real_and_survive_float32_arrays(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer)
    lps: list[float] = []
    for seed in range(20):
        deltas, _, _ = await run(engine, req(prompt(tokenizer, thinking=True), seed=seed))
        lps += lps_of(deltas)
    assert list(array("f", lps)) == lps
    assert all(lp <= 0 for lp in lps)
    assert sum(lp > -0.3 for lp in lps) > 0.7 * len(lps)
    assert any(lp < -2 for lp in lps)


async def test_scripted_logprobs_are_rounded_to_float32(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer)
    engine.script(ScriptedOutput([1, 2], logprobs=[-0.1, -1.3]))
    deltas, _, _ = await run(engine, req(array("i", [1])))
    assert lps_of(deltas) == list(array("f", [-0.1, -1.3]))
    with pytest.raises(ValueError):
        ScriptedOutput([1, 2], logprobs=[-0.1])


# -- scripting -------------------------------------------------------------------


async def test_scripted_str_and_ids(tokenizer: ChatTokenizer, autojump_clock: MockClock) -> None:
    eot = tokenizer.eot_token_id
    engine = SimEngine(tokenizer)
    engine.script("Hello there", "Done<|im_end|>", [1, 2, 3])
    a, fa, _ = await run(engine, req(array("i", [1])))
    assert ids_of(a) == [*tokenizer.encode("Hello there"), eot]
    assert fa.reason == "stop" and fa.matched_stop == eot
    b, _, _ = await run(engine, req(array("i", [1])))
    assert ids_of(b) == [*tokenizer.encode("Done"), eot]  # no second <|im_end|>
    c, fc, _ = await run(engine, req(array("i", [1])))
    assert ids_of(c) == [1, 2, 3] and fc.reason == "stop" and fc.matched_stop is None
    d, _, _ = await run(engine, req(array("i", [1])))  # queue empty: random policy
    assert ids_of(d)[-1] == eot
    assert engine.stats(engine_rids(engine)[0]).scripted


def engine_rids(engine: SimEngine) -> list[str]:
    return list(engine._history)


async def test_routing_key_queue_comes_first(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer)
    engine.script([1], [2])
    engine.script([7], routing_key="s1")
    first, _, _ = await run(engine, req(array("i", [1]), routing_key="s2"))
    keyed, _, _ = await run(engine, req(array("i", [1]), routing_key="s1"))
    fallback, _, _ = await run(engine, req(array("i", [1]), routing_key="s1"))
    assert (ids_of(first), ids_of(keyed), ids_of(fallback)) == ([1], [7], [2])


async def test_scripted_finish_and_limits(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer)
    engine.script(ScriptedOutput([1, 2], finish="abort"), "a b c d e f g h")
    deltas, finish, _ = await run(engine, req(array("i", [1])))
    assert ids_of(deltas) == [1, 2] and finish.reason == "abort"
    deltas, finish, _ = await run(engine, req(array("i", [1]), max_new_tokens=2))
    assert ids_of(deltas) == list(tokenizer.encode("a b")) and finish.reason == "length"


# -- aborts and cancellation -------------------------------------------------------


@pytest.mark.parametrize(
    "at",
    [1.6, 1.5],  # tokens at 0.75, 1.0, 1.25, 1.5, then 1.75: between two tokens, and on one (that token is kept)
)
async def test_abort_from_another_task_ends_the_generation_at_once(
    tokenizer: ChatTokenizer, autojump_clock: MockClock, at: float
) -> None:
    engine = SimEngine(tokenizer, TIMED)
    engine.script(list(range(100, 120)))
    async with engine.open_generation(req(array("i", [1]))) as gen:

        async def abort_later() -> None:
            await trio.sleep(at)
            await gen.abort()

        got = await events_while(gen, abort_later)
    assert [e.token_ids[0] for _, e in got[:-1]] == [100, 101, 102, 103]
    t_finish, finish = got[-1]
    assert isinstance(finish, GenerateFinish) and finish.reason == "abort"
    assert t_finish == at  # woke at once, did not wait for the next token
    stats = engine.stats(gen.rid)
    assert stats.token_ids == (100, 101, 102, 103) and stats.finish_reason == "abort"
    assert stats.aborted and not stats.cancelled
    assert engine.running == 0


async def test_abort_before_iteration(tokenizer: ChatTokenizer, autojump_clock: MockClock) -> None:
    engine = SimEngine(tokenizer, TIMED)
    gen = engine.open_generation(req(prompt(tokenizer)))
    await gen.abort()  # even before the block is entered
    async with gen:
        events = [e async for e in gen]
        await gen.abort()  # after the end: a no-op
    assert len(events) == 1 and isinstance(events[0], GenerateFinish)
    assert events[0].reason == "abort" and trio.current_time() == 0
    async with engine.open_generation(req(prompt(tokenizer))) as gen2:
        await trio.sleep(0.8)
        await gen2.abort()
        events = [e async for e in gen2]
    assert len(events) == 2 and trio.current_time() == 0.8


async def test_abort_after_the_engine_finished_is_ignored(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer, TIMED)
    engine.script([1, 2])
    async with engine.open_generation(req(array("i", [1]))) as gen:
        await trio.sleep(5)
        await gen.abort()
        events = [e async for e in gen]
    assert isinstance(events[-1], GenerateFinish) and events[-1].reason == "stop"
    assert len(events) == 3 and not engine.stats(gen.rid).aborted


async def test_abort_all_and_aclose(tokenizer: ChatTokenizer, autojump_clock: MockClock) -> None:
    engine = SimEngine(tokenizer, TIMED)
    results: dict[int, tuple[list[int], str, float]] = {}

    async def consume(i: int) -> None:
        deltas, finish, t = await run(engine, req(prompt(tokenizer), seed=i))
        results[i] = (ids_of(deltas), finish.reason, t)

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(consume, i)
        await trio.sleep(1.1)
        assert engine.running == 3
        await engine.abort_all()
    assert engine.running == 0
    assert all(len(ids) == 2 and r == "abort" and t == 1.1 for ids, r, t in results.values())
    await engine.aclose()
    with pytest.raises(BackendError):
        await run(engine, req(prompt(tokenizer)))


async def test_leaving_the_block_early_records_cancelled(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer, TIMED)
    engine.script(list(range(100, 120)))
    async with engine.open_generation(req(array("i", [1]))) as gen:
        async for event in gen:
            assert isinstance(event, TokenDelta)
            if event.token_ids == (101,):
                break
        assert engine.running == 1
    assert engine.running == 0
    stats = engine.stats(gen.rid)
    assert stats.cancelled and not stats.aborted
    assert stats.finish_reason == "abort" and stats.token_ids == (100, 101)
    await trio.sleep(10)
    assert engine.stats(gen.rid).token_ids == (100, 101)  # nothing after the cancel


async def test_cancel_scope_cancels_the_generation(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer, TIMED)
    engine.script(list(range(100, 120)))
    got: list[int] = []
    with trio.move_on_after(1.3):
        async with engine.open_generation(req(array("i", [1]))) as gen:
            async for event in gen:
                assert isinstance(event, TokenDelta)
                got += event.token_ids
    assert got == [100, 101, 102]
    stats = engine.stats(gen.rid)
    assert stats.cancelled and stats.token_ids == (100, 101, 102)


async def test_iteration_needs_the_block_and_rids_are_unique(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer)
    request = req(array("i", [1]))
    with pytest.raises(RuntimeError):
        await engine.open_generation(request).__anext__()
    async with engine.open_generation(request):
        with pytest.raises(BackendError):
            async with engine.open_generation(request):
                pass


async def test_a_stopped_generation_continued_from_its_tokens_gives_the_rest_of_what_it_would_have(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    """Partial rollout asks the engine to go on from the prompt and the tokens it gave: a model goes on with its own
    text, and so does the simulator (its random policy alone would start a new reply mid-way)."""
    ids = prompt(tokenizer, tools=TOOLS, thinking=True)
    whole, finish, _ = await run(SimEngine(tokenizer, SimConfig(seed=3)), req(ids, seed=7))
    engine = SimEngine(tokenizer, SimConfig(seed=3))
    for stop in ("abort", "cancel"):
        async with engine.open_generation(req(ids, seed=7)) as gen:
            given: list[tuple[float, TokenDelta]] = []
            async for event in gen:
                if not isinstance(event, TokenDelta):
                    assert event.reason == "abort"
                    break
                given.append((trio.current_time(), event))
                if len(given) == 5:
                    if stop == "cancel":
                        break  # the block left mid-way (a stream cut)
                    await gen.abort()
        assert ids_of(given) == ids_of(whole)[:5]
        # Twice over: a continuation stopped again goes on from where it stopped.
        more = array("i", [*ids, *ids_of(given)])
        later = await aborted_after(engine, req(more, seed=11), 3)
        rest, end, _ = await run(engine, req(array("i", [*more, *ids_of(later)]), seed=11))
        assert ids_of(given) + ids_of(later) + ids_of(rest) == ids_of(whole)
        assert lps_of(given) + lps_of(later) + lps_of(rest) == lps_of(whole)
        assert (end.reason, end.matched_stop) == (finish.reason, finish.matched_stop)
    # Taken once: the same prompt again is a new request, answered by the policy.
    again, _, _ = await run(engine, req(array("i", [*ids, *ids_of(whole)[:5]]), seed=7))
    assert ids_of(again) != ids_of(whole)[5:]


async def test_stopped_generations_of_one_prompt_in_two_sessions_each_go_on_with_their_own(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    """A group's rollouts share their prompt (GRPO's n samples), and a pause stops them all, often after as many
    tokens: each session's continuation goes on with its own reply (one taking the other's left none for it)."""
    ids = prompt(tokenizer, tools=TOOLS, thinking=True)
    engine = SimEngine(tokenizer, SimConfig(seed=3))
    whole, _, _ = await run(SimEngine(tokenizer, SimConfig(seed=3)), req(ids, seed=7, routing_key="a"))
    given: dict[str, list[int]] = {}
    for session in ("a", "b"):
        given[session] = ids_of(await aborted_after(engine, req(ids, seed=7, routing_key=session), 5))
    assert given["a"] == given["b"] == ids_of(whole)[:5]
    for session in ("a", "b"):
        rest, _, _ = await run(engine, req(array("i", [*ids, *given[session]]), seed=11, routing_key=session))
        assert given[session] + ids_of(rest) == ids_of(whole), session


# -- weights, stats, info ------------------------------------------------------------


async def test_weight_version_change_mid_stream(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer, SimConfig(token_interval=1.0, weight_version="v1"))
    engine.script([1, 2, 3, 4])
    async with engine.open_generation(req(array("i", [1]))) as gen:

        async def swap() -> None:
            await trio.sleep(2)  # same instant as token 2: it keeps the old version
            engine.set_weight_version("v2")

        got = await events_while(gen, swap)
    assert [e.weight_version for _, e in got] == ["v1", "v1", "v2", "v2", "v2"]
    assert engine.weight_version == "v2"
    assert (await engine.model_info()).weight_version == "v2"


async def test_stats_are_bounded_and_track_running(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer, SimConfig(stats_capacity=3, token_interval=1.0))
    rids = []
    for _ in range(5):
        request = req(array("i", [1, 2, 3]))
        rids.append(request.rid)
        engine.script([9, 8, 7])
        await run(engine, request)
    assert engine.requests_started == 5
    with pytest.raises(KeyError):
        engine.stats(rids[1])
    stats = engine.stats(rids[4])
    assert stats.prompt_len == 3 and stats.token_ids == (9, 8, 7)
    assert stats.finish_reason == "stop" and stats.started_at == 12.0
    engine.script([9, 8, 7])
    async with engine.open_generation(req(array("i", [1]))) as gen:
        await trio.sleep(1.5)
        live = engine.stats(gen.rid)
        assert live.token_ids == (9,) and live.finish_reason is None
        async for _ in gen:
            pass
    assert len(engine._history) == 3


async def test_model_info(tokenizer: ChatTokenizer) -> None:
    engine = SimEngine(tokenizer, SimConfig(model_id="m", max_model_len=99, weight_version="7"))
    info = await engine.model_info()
    assert (info.model_id, info.max_model_len, info.weight_version) == ("m", 99, "7")


async def test_runs_under_the_real_clock(tokenizer: ChatTokenizer) -> None:
    engine = SimEngine(tokenizer, SimConfig(token_interval=0.001))
    with trio.fail_after(5):
        deltas, finish, _ = await run(engine, req(prompt(tokenizer, thinking=True)))
    assert deltas and finish.reason == "stop"


def test_stats_outside_trio_after_a_run(tokenizer: ChatTokenizer) -> None:
    engine = SimEngine(tokenizer)
    engine.set_weight_version("w")  # before trio.run: applies from the start
    engine.script([4, 5])
    request = req(array("i", [1]))
    deltas, _, _ = trio.run(run, engine, request)
    assert {d.weight_version for _, d in deltas} == {"w"}
    assert engine.stats(request.rid).token_ids == (4, 5)


# -- prompt logprobs, routed experts -------------------------------------------------


async def test_prompt_logprobs_are_deterministic_and_prefix_dependent(tokenizer: ChatTokenizer) -> None:
    ids = list(prompt(tokenizer, tools=TOOLS))
    engine = SimEngine(tokenizer, SimConfig(seed=3))
    lps = await engine.prompt_logprobs(ids)
    assert len(lps) == len(ids) and lps[0] is None
    values = [lp for lp in lps[1:] if lp is not None]
    assert len(values) == len(ids) - 1
    assert all(lp <= 0.0 for lp in values) and list(array("f", values)) == values
    assert await SimEngine(tokenizer, SimConfig(seed=3)).prompt_logprobs(array("i", ids)) == lps
    assert await SimEngine(tokenizer, SimConfig(seed=4)).prompt_logprobs(ids) != lps
    changed = [*ids[:5], ids[5] + 1, *ids[6:]]
    other = await engine.prompt_logprobs(changed)
    assert other[:5] == lps[:5]  # the past is unchanged
    assert sum(a != b for a, b in zip(other[5:], lps[5:], strict=True)) > (len(ids) - 5) // 2
    assert await engine.prompt_logprobs([]) == [] and await engine.prompt_logprobs([7]) == [None]


def _experts(finish: GenerateFinish) -> list[int]:
    assert finish.routed_experts is not None
    raw = base64.b64decode(finish.routed_experts)
    return list(struct.unpack(f"<{len(raw) // 4}i", raw))


async def test_routed_experts_shape_range_and_prefix_sharing(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    config = SimConfig(num_layers=3, moe_topk=2, num_experts=8)
    engine = SimEngine(tokenizer, config)
    engine.script([10, 11, 12], [10, 11, 12])
    base = array("i", [1, 2, 3, 4])
    plain = await run(engine, req(base))
    assert plain[1].routed_experts is None  # not asked
    request = GenerateRequest(base, SamplingParams(16), return_routed_experts=True)
    deltas, finish, _ = await run(engine, request)
    values = _experts(finish)
    rows = len(base) + len(ids_of(deltas)) - 1
    assert len(values) == rows * 3 * 2 == 36
    assert all(0 <= v < 8 for v in values)
    pairs = [values[i : i + 2] for i in range(0, len(values), 2)]
    assert all(a != b for a, b in pairs)  # top-k experts of one layer are distinct
    # A request continuing this sequence is routed identically over the shared prefix.
    longer = array("i", [*base, 10, 11, 12, 99])
    engine.script([5])
    _, finish2, _ = await run(engine, GenerateRequest(longer, SamplingParams(4), return_routed_experts=True))
    assert _experts(finish2)[: len(values)] == values
    with pytest.raises(ValueError):
        SimConfig(moe_topk=17, num_experts=16)


async def test_routed_experts_of_an_aborted_request_cover_what_was_emitted(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer, TIMED)
    engine.script(list(range(100, 120)))
    request = GenerateRequest(array("i", [1, 2]), SamplingParams(64), return_routed_experts=True)
    async with engine.open_generation(request) as gen:
        await trio.sleep(1.1)  # tokens at 0.75 and 1.0
        await gen.abort()
        events = [e async for e in gen]
    finish = events[-1]
    assert isinstance(finish, GenerateFinish) and finish.reason == "abort"
    assert len(_experts(finish)) == (2 + 2 - 1) * 4 * 2


# -- pause and resume ------------------------------------------------------------------


async def test_pause_shifts_the_schedule_and_new_tokens_get_the_new_version(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer, SimConfig(token_interval=1.0, weight_version="v1"))
    engine.script([1, 2, 3, 4])
    async with engine.open_generation(req(array("i", [9]))) as gen:

        async def update_weights() -> None:
            await trio.sleep(2)  # token 2 is due now: it comes before the pause
            engine.pause()
            assert engine.paused
            await trio.sleep(10)
            assert engine.stats(gen.rid).token_ids == (1, 2)
            engine.set_weight_version("v2")
            engine.resume()

        got = await events_while(gen, update_weights)
    assert [t for t, _ in got] == [1.0, 2.0, 13.0, 14.0, 14.0]
    assert [e.weight_version for _, e in got] == ["v1", "v1", "v2", "v2", "v2"]
    assert not engine.paused


async def test_pause_holders_overlap_and_abort_during_pause(
    tokenizer: ChatTokenizer, autojump_clock: MockClock
) -> None:
    engine = SimEngine(tokenizer, SimConfig(token_interval=1.0))
    engine.script([1, 2, 3, 4])
    async with engine.open_generation(req(array("i", [9]))) as gen:
        await trio.sleep(1.5)
        engine.pause("a")
        engine.pause("b")
        engine.resume("a")
        assert engine.paused and not gen.final_ready  # token 1 (due at 1.0) comes first
        events = [await gen.__anext__()]
        assert not gen.final_ready
        await trio.sleep(5)
        assert engine.stats(gen.rid).token_ids == (1,)
        await gen.abort()
        assert gen.final_ready
        events += [e async for e in gen]
        assert trio.current_time() == 6.5
        engine.resume("b")
    assert [e.token_ids for e in events[:-1] if isinstance(e, TokenDelta)] == [(1,)]
    assert isinstance(events[-1], GenerateFinish) and events[-1].reason == "abort"
    assert engine.stats(gen.rid).token_ids == (1,)


# The generations of test_decode_steps: (start time, scripted tokens); C starts while paused.
STEP_STARTS = {"a": (0.125, [10, 11, 12, 13, 14, 15]), "b": (0.3125, [20, 21, 22, 23]), "c": (1.25, [30, 31])}


@pytest.mark.parametrize(
    ("decode_steps", "expected"),
    [
        # Each request on its own phase: start + prefill + n * interval (active), then the pause.
        (False, {"a": [0.875, 1.125, 1.75, 2.0, 2.25, 2.5], "b": [1.0625, 1.6875, 1.9375, 2.1875],
                 "c": [2.3125, 2.5625]}),
        # One engine-wide step clock: start + prefill is rounded up to a step, so every stream's
        # tokens come at the same instants, before the pause and after it.
        (True, {"a": [1.0, 1.625, 1.875, 2.125, 2.375, 2.625], "b": [1.625, 1.875, 2.125, 2.375],
                "c": [2.375, 2.625]}),
    ],
)
async def test_decode_steps_put_every_stream_on_one_step_clock(
    tokenizer: ChatTokenizer, autojump_clock: MockClock, decode_steps: bool, expected: dict[str, list[float]]
) -> None:
    """``decode_steps``: a request joins the engine's next decoding step, as under continuous batching;
    streams started at different moments (one during a pause) get their tokens together."""
    engine = SimEngine(tokenizer, SimConfig(prefill_latency=0.5, token_interval=0.25, decode_steps=decode_steps))
    times: dict[str, list[float]] = {}

    async def stream(key: str) -> None:
        start, ids = STEP_STARTS[key]
        engine.script(ids, routing_key=key)
        await trio.sleep_until(start)
        deltas, _, _ = await run(engine, req(array("i", [9]), routing_key=key))
        assert ids_of(deltas) == ids
        times[key] = [t for t, _ in deltas]

    async def pause() -> None:
        await trio.sleep_until(1.1875)
        engine.pause()
        await trio.sleep(0.375)
        engine.resume()

    async with trio.open_nursery() as nursery:
        for key in STEP_STARTS:
            nursery.start_soon(stream, key)
        nursery.start_soon(pause)
    assert times == expected


async def test_final_ready_after_the_last_token(tokenizer: ChatTokenizer, autojump_clock: MockClock) -> None:
    engine = SimEngine(tokenizer, SimConfig(token_interval=1.0))
    engine.script([1, 2])
    async with engine.open_generation(req(array("i", [9]))) as gen:
        first = await gen.__anext__()
        assert isinstance(first, TokenDelta) and not gen.final_ready
        await gen.__anext__()
        assert gen.final_ready
        t = trio.current_time()
        assert isinstance(await gen.__anext__(), GenerateFinish) and trio.current_time() == t
        assert not gen.final_ready


async def test_the_pacer_wakes_each_wait_at_its_deadline_or_when_woken(autojump_clock: MockClock) -> None:
    """One timer for every wait: each returns at its deadline, or at once when woken (twice is once); a wait
    with no deadline only when woken; a cancelled wait is never woken again when its deadline comes."""
    pacer = Pacer()
    start = trio.current_time()
    woke: dict[str, float] = {}
    wakes: dict[str, Wake] = {}

    async def sleeper(name: str, deadline: float) -> None:
        wakes[name] = wake = Wake(trio.lowlevel.current_task())
        await pacer.sleep(deadline, wake)
        woke[name] = trio.current_time() - start

    async def cancelled() -> None:
        with trio.move_on_after(0.5):
            await sleeper("cancelled", start + 1)

    async with trio.open_nursery() as nursery:
        for name, deadline in (("b", start + 2), ("a", start + 1), ("never", math.inf), ("early", start + 5)):
            nursery.start_soon(sleeper, name, deadline)
        nursery.start_soon(cancelled)
        await trio.testing.wait_all_tasks_blocked()
        wakes["early"].wake()
        wakes["early"].wake()
        await trio.sleep(3)
        wakes["never"].wake()
    assert woke == {"early": 0, "a": 1, "b": 2, "never": 3}
    await trio.sleep(3)  # the early wait's deadline passes: nothing left to wake
