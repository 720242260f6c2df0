"""The turn path's per-turn work (issue 12): what is reused from the last turn, and where a turn is prepared.

A turn that adds a short message is prepared on the event loop (the hand-off to a
worker thread would cost more than the work); a long prompt still goes to the
thread (tests/runtime/test_loop_free.py). The messages the history repeats are cut once,
not every turn.
"""

from __future__ import annotations

import threading
import time
from contextlib import AbstractAsyncContextManager
from typing import Any

import attrs
import trio
import trio.testing
from _util import WrappingBackend, garbage_found, run_turn

from actorproxy.config import ProxyConfig
from actorproxy.core import tito
from actorproxy.core.messages import AssistantOutput, output_as_message
from actorproxy.core.records import Step
from actorproxy.core.requests import ChatRequest, Identity
from actorproxy.core.session_state import Planned, Prepared, SessionState, TurnResult
from actorproxy.core.template_probe import probe_template
from actorproxy.core.turn_events import TurnDelta, TurnDone
from actorproxy.engines.base import GenerateRequest, Generation
from actorproxy.runtime.offload import Offload
from actorproxy.runtime.runtime import open_runtime
from actorproxy.runtime.turn_cost import INLINE_CHARS, may_be_small, small_turn
from actorproxy.schema.converter import CONVERTER
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.tokenization.message_fields import MessageCut, template_message_fields
from actorproxy.tokenization.tokenizer import ChatTokenizer


def test_message_cut_reuses_what_the_history_repeats(tokenizer: ChatTokenizer) -> None:
    cut = MessageCut(template_message_fields(str(tokenizer.hf.chat_template)))
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi", "cache_control": {"type": "ephemeral"}},
    ]
    first = cut.cut(history)
    assert first == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert first[0] is not history[0]  # a copy: the agent's own dict is never handed on
    again = [dict(m) for m in history] + [{"role": "user", "content": "more"}]
    second = cut.cut(again)
    assert second[0] is first[0]  # equal to last turn's: reused, not cut again
    assert second[1] == first[1] and second[2] == {"role": "user", "content": "more"}
    history[0]["content"] = "Be verbose."  # an in-process agent edits its dict in place
    third = cut.cut(history)
    assert third[0] == {"role": "system", "content": "Be verbose."} and first[0]["content"] == "Be brief."


def _state(tokenizer: ChatTokenizer) -> SessionState:
    return SessionState("s", config=ProxyConfig.of(port=0), tokenizer=tokenizer, context_window=1_000_000)


def _small(state: SessionState, request: ChatRequest) -> bool:
    """Whether the turn would be rendered on the loop; the plan is rendered after (a plan must be)."""
    planned = state.plan(request, Identity("s"))
    assert isinstance(planned, Planned)
    small = small_turn(planned)
    assert isinstance(state.render(planned), Prepared)
    return small


def test_small_turns_are_told_apart_from_large_ones(tokenizer: ChatTokenizer) -> None:
    probe_template(tokenizer)
    long_text = "word " * 4000
    messages: list[dict[str, Any]] = [{"role": "user", "content": long_text}]
    assert not _small(_state(tokenizer), ChatRequest(messages=messages))  # a whole long prompt to render
    state = _state(tokenizer)
    prepared = state.prepare(ChatRequest(messages=messages), Identity("s"))
    assert isinstance(prepared, Prepared)
    prepared.step.output_ids = [tokenizer.encode("ok")[0], tokenizer.eot_token_id]
    prepared.step.output = AssistantOutput(content="ok", reasoning="", tool_calls=())
    state.commit(TurnResult(prepared, completed=True))
    follow = [*messages, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
    rewritten = [{"role": "user", "content": long_text + "!"}, *follow[1:]]
    many = follow + [{"role": "user", "content": "x"}] * 40
    big_new = [*follow[:-1], {"role": "user", "content": "y" * (INLINE_CHARS + 1)}]
    # Each request is planned against the same segment (a turn not committed leaves it be; the rewrite goes last).
    assert _small(state, ChatRequest(messages=follow))  # only the short new message
    assert not may_be_small(state, ChatRequest(messages=many), tokenizer)  # not even planned on the loop
    assert may_be_small(state, ChatRequest(messages=big_new), tokenizer)
    assert not _small(state, ChatRequest(messages=big_new))
    assert not _small(state, ChatRequest(messages=rewritten))  # a rewrite renders it all


async def test_a_turn_is_cut_and_planned_once(tokenizer: ChatTokenizer, monkeypatch: Any) -> None:
    """Deciding where to prepare a turn and preparing it share one cut and one plan (not one each)."""
    calls = {"cut": 0, "plan_turn": 0}
    cut, plan = MessageCut.cut, tito.plan_turn

    def counted_cut(self: MessageCut, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        calls["cut"] += 1
        return cut(self, messages)

    def counted_plan(*args: Any, **kwargs: Any) -> Any:
        calls["plan_turn"] += 1
        return plan(*args, **kwargs)

    monkeypatch.setattr(MessageCut, "cut", counted_cut)
    for module in ("actorproxy.core.session_state", "actorproxy.core.prompt_plan", "actorproxy.runtime.turn_cost"):
        monkeypatch.setattr(f"{module}.plan_turn", counted_plan, raising=False)
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.0))
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer,
                            offload=Offload.threads()) as runtime:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        for turn in range(3):
            result = await run_turn(runtime, "s", messages, max_tokens=4)
            assert result.done is not None
            messages += [result.message, {"role": "user", "content": f"and {turn}?"}]
    assert calls == {"cut": 3, "plan_turn": 3}


async def test_a_short_turn_is_prepared_on_the_loop_a_long_one_in_a_thread(tokenizer: ChatTokenizer) -> None:
    """Which thread tokenizes each turn's prompt: the Trio thread for a short follow-up, a worker otherwise."""
    seen: list[tuple[str, bool]] = []  # (the prompt text tokenized, on the Trio thread?)

    class Watched(ChatTokenizer):
        def encode(self, text: str) -> Any:
            if "<|im_start|>user" in text:  # a prompt (the simulated engine tokenizes its replies too)
                seen.append((text, threading.current_thread() is threading.main_thread()))
            return super().encode(text)

    tok = Watched(tokenizer.hf, name=tokenizer.name)
    engine = SimEngine(tok, SimConfig(seed=1, token_interval=0.0))
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tok,
                            offload=Offload.threads()) as runtime:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "word " * 2000}]
        first = await run_turn(runtime, "s", messages, max_tokens=8)
        assert first.done is not None
        seen.clear()
        messages += [first.message, {"role": "user", "content": "and then?"}]
        assert (await run_turn(runtime, "s", messages, max_tokens=8)).done is not None
        assert [on_loop for text, on_loop in seen if "and then?" in text] == [True], seen
        seen.clear()  # another long prompt (session "s"'s again would come from the prompt cache, untokenized)
        assert (await run_turn(runtime, "other", [{"role": "user", "content": "other words " * 1000}],
                               max_tokens=8)).done is not None
        assert [on_loop for text, on_loop in seen] == [False], seen


async def test_a_non_streaming_turn_wakes_its_agent_for_its_result_only(
    tokenizer: ChatTokenizer, autojump_clock: trio.testing.MockClock
) -> None:
    """No ``TurnAccepted``: the deltas come merged with the result, the first one's time with it; an agent gone
    meanwhile (its wait for the result cancelled, as a hang-up cancels its request) is noticed."""
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.01))
    engine.script("one two three four five six", routing_key="s")
    engine.script("Hello world again", routing_key="s")
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer) as runtime:
        before = time.perf_counter()
        events = [e async for e in await runtime.start_turn(ChatRequest(messages=[{"role": "user", "content": "hi"}]),
                                                              Identity("s"))]
        kinds = [type(e).__name__ for e in events]
        assert kinds == ["TurnDelta", "TurnDone"], kinds
        done = events[-1]
        assert isinstance(done, TurnDone)
        assert "".join(e.delta.content for e in events if isinstance(e, TurnDelta)) == done.output.content
        assert done.first_token_at is not None and before < done.first_token_at < time.perf_counter()
        messages = [{"role": "user", "content": "hi"}, output_as_message(done.output),
                    {"role": "user", "content": "more"}]
        with trio.move_on_after(0.025):  # the agent leaves while the reply is sampled
            await runtime.start_turn(ChatRequest(messages=messages), Identity("s"))
            raise AssertionError("the result came before the agent left")
        await runtime.finalize("s")
        payload = CONVERTER.unstructure(await runtime.read(session_id="s", include_steps=True))
    steps = payload["steps"]
    assert [s["status"] for s in steps] == ["completed", "client_disconnected"]
    assert steps[1]["completion_tokens"] < 4  # stopped at a token boundary soon after, not run to the end


async def test_an_agent_that_leaves_while_its_turn_waits_out_a_pause_is_not_answered(
    tokenizer: ChatTokenizer, autojump_clock: trio.testing.MockClock
) -> None:
    """Cancelling ``start_turn`` closes the turn's channel: the turn, admitted at the resume, does not generate."""
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.01))
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer) as runtime:
        await runtime.pause()
        for stream in (False, True):
            with trio.move_on_after(1):
                await runtime.start_turn(ChatRequest(messages=[{"role": "user", "content": "hi"}], stream=stream),
                                         Identity(f"s{stream}"))
                raise AssertionError("the turn started while paused")
        await runtime.resume()
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(60):  # a streamed turn whose channel stayed open would block on its full buffer
            for stream in (False, True):
                await runtime.finalize(f"s{stream}")
        steps = [CONVERTER.unstructure(await runtime.read(session_id=f"s{stream}", include_steps=True))["steps"]
                 for stream in (False, True)]
    assert [[(s["status"], s["completion_tokens"]) for s in each] for each in steps] == [
        [("client_disconnected", 0)], [("client_disconnected", 0)]]


async def test_a_finished_turn_is_freed_by_reference_counting(
    tokenizer: ChatTokenizer, autojump_clock: trio.testing.MockClock
) -> None:
    """No reference cycle through a turn: its generation, parser and channels go when it ends, not at a collection."""
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.01))
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer) as runtime:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        first = await run_turn(runtime, "s", messages, max_tokens=8)  # the session exists
        messages += [first.message, {"role": "user", "content": "more"}]
        with garbage_found() as garbage:
            assert (await run_turn(runtime, "s", messages, max_tokens=8)).done is not None
        left = sorted({type(o).__name__ for o in garbage if type(o).__module__.startswith("actorproxy")})
    assert left == [], left


async def test_a_turns_ids_are_handed_over_as_the_step_holds_them(
    tokenizer: ChatTokenizer, autojump_clock: trio.testing.MockClock
) -> None:
    """``TurnDone.ids`` holds the finished step's arrays themselves (no copy a turn), and nothing changes them
    afterwards: the session's later turns, its commit and its finalize leave them as the engine gave them."""
    engine = SimEngine(tokenizer, SimConfig(seed=1))
    engine.script("one two three four", routing_key="s")
    engine.script("five six", routing_key="s")
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer) as runtime:
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        first = await run_turn(runtime, "s", messages, max_tokens=8)
        assert first.done is not None and first.done.ids is not None
        ids = first.done.ids
        seen = (ids.prompt_ids.tolist(), ids.output_ids.tolist(), ids.output_logprobs.tolist(),
                ids.output_versions.tolist())
        messages += [first.message, {"role": "user", "content": "more"}]
        assert (await run_turn(runtime, "s", messages, max_tokens=8)).done is not None
        await runtime.finalize("s")
        result = await runtime.read(session_id="s", include_steps=True)
    assert result.steps is not None
    step = result.steps[0]
    assert isinstance(step, Step)
    assert (ids.output_ids, ids.output_logprobs, ids.output_versions) == (
        step.output_ids, step.output_logprobs, step.output_versions)
    assert ids.output_ids is step.output_ids and ids.output_logprobs is step.output_logprobs
    assert ids.output_versions is step.output_versions
    assert (ids.prompt_ids.tolist(), ids.output_ids.tolist(), ids.output_logprobs.tolist(),
            ids.output_versions.tolist()) == seen
    assert seen[1] and ids.prompt_ids.tolist() == step.fragment_ids.tolist()


async def test_turns_that_sample_alike_share_one_sampling_setting(
    tokenizer: ChatTokenizer, autojump_clock: trio.testing.MockClock
) -> None:
    """A turn's ``SamplingParams`` is made once per setting: the turns of every session that sample alike hand
    the engine the same object (the key of its body's template), and a turn whose budget differs (its own
    ``max_tokens``, or the context window's room) gets its own, with that budget."""
    seen: list[GenerateRequest] = []

    @attrs.define
    class Seeing(WrappingBackend):
        def open_generation(self, request: GenerateRequest) -> AbstractAsyncContextManager[Generation]:
            seen.append(request)
            return self.inner.open_generation(request)

    backend = Seeing(SimEngine(tokenizer, SimConfig(seed=1, max_model_len=400)))
    async with open_runtime(ProxyConfig.of(port=0), backend=backend, tokenizer=tokenizer) as runtime:
        for session in ("a", "a", "b"):
            assert (await run_turn(runtime, session, [{"role": "user", "content": "hi"}], max_tokens=8)).done
        assert (await run_turn(runtime, "c", [{"role": "user", "content": "hi"}], max_tokens=9)).done
        long = [{"role": "user", "content": "word " * 300}]
        assert (await run_turn(runtime, "d", long, max_tokens=200)).done
    first, again, other, nine, windowed = (request.sampling for request in seen)
    assert again is first and other is first
    assert first.max_new_tokens == 8 and nine.max_new_tokens == 9 and nine is not first
    assert windowed.max_new_tokens == 400 - len(seen[-1].input_ids) < 200
    assert first.stop_token_ids == tokenizer.stop_token_ids


def test_a_prepared_turn_holds_the_cut_messages_by_reference(tokenizer: ChatTokenizer) -> None:
    """The request a prepared turn keeps is the planned one: the cut list, the session's own, is not copied
    again; the caller's list is not held, so what it appends later changes nothing of the turn's."""
    state = _state(tokenizer)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    request = ChatRequest(messages=messages, tools=[], max_tokens=5)
    planned = state.plan(request, Identity("s"))
    assert isinstance(planned, Planned)
    assert planned.request.messages is not messages and planned.request.tools is request.tools
    prepared = state.render(planned)
    assert isinstance(prepared, Prepared)
    assert prepared.request.messages is planned.request.messages
    messages.append({"role": "user", "content": "more"})
    assert prepared.request == ChatRequest(messages=[{"role": "user", "content": "hi"}], tools=[], max_tokens=5)
