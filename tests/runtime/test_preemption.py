"""Preemptible generation under MockClock: acknowledged pause, resume, partial rollout."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from actorproxy.core.requests import ChatRequest, Identity, sampling_extras
from actorproxy.core.turn_events import TurnDelta
from actorproxy.engines.base import GenerateRequest
from actorproxy.sim import SimConfig
from actorproxy.testing import SimulatedProxy, TurnResult, open_simulated_proxy

INTERVAL = 0.01
USER = [{"role": "user", "content": "Tell me a story."}]


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text).tolist() + [tokenizer.eot_token_id]


async def _steps(sim: SimulatedProxy, session: str) -> list[dict[str, Any]]:
    await sim.finalize(session)
    return list((await sim.read(session))["steps"])


async def test_pause_at_an_exact_token_then_resume_with_a_new_version(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    stories = {f"s{i}": _ids(tokenizer, f"Once upon a time number {i} there was a very long story indeed.")
               for i in range(3)}
    async with open_simulated_proxy(
        tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL), partial_rollout=True
    ) as sim:
        pause_at = 5
        for session, ids in stories.items():
            sim.engine.script(ids[:pause_at + 1] + ids, routing_key=session)  # more than the pause will let out
            sim.engine.script(ids[pause_at:], routing_key=session)  # what it samples after resume
        results: dict[str, TurnResult] = {}

        async def turn(session: str) -> None:
            results[session] = await sim.chat(session, USER, stream=True)

        async with trio.open_nursery() as nursery:
            for session in stories:
                nursery.start_soon(turn, session)
            for session in stories:
                await sim.wait_for_tokens(session, pause_at)
            ack = await sim.pause()
            assert ack["status"] == "paused"
            assert (ack["aborted"], ack["partial_tokens"]) == (3, 3 * pause_at)
            assert (await sim.pause_state())["waiting"] == 3  # each asks to continue
            await trio.sleep(1.0)  # the trainer updates the weights
            resumed = await sim.resume(weight_version="1")
            assert resumed["woken"] == 3 and resumed["weight_version"] == "1"
        for session, ids in stories.items():
            result = results[session]
            text = tokenizer.decode(ids[:-1])
            assert result.output.content == result.streamed_content == text  # one reply, nothing twice
            [step] = await _steps(sim, session)
            assert step["output_ids"] == ids  # every token once, in order
            assert step["concat_versions"][-len(ids):] == [0] * pause_at + [1] * (len(ids) - pause_at)
            assert step["preemptions"] == 1 and step["status"] == "completed"


async def test_a_resumed_generation_asks_for_the_minimum_left(
    tokenizer: Any, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A partial rollout's continuation asks for what is left of the turn: its budget and its ``min_tokens``."""
    ids = _ids(tokenizer, "Once upon a time there was a very long story indeed.")
    async with open_simulated_proxy(
        tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL), partial_rollout=True
    ) as sim:
        asked: list[tuple[int, int]] = []
        opened = sim.engine.open_generation

        def recording(request: GenerateRequest) -> Any:
            asked.append((request.sampling.max_new_tokens, request.sampling.min_tokens))
            return opened(request)

        monkeypatch.setattr(sim.engine, "open_generation", recording)
        pause_at = 5
        sim.engine.script(ids, routing_key="s")
        sim.engine.script(ids[pause_at:], routing_key="s")
        request = ChatRequest(messages=USER, max_tokens=64, extras=sampling_extras(min_tokens=8))
        done: list[Any] = []

        async def turn() -> None:
            async with await sim.runtime.start_turn(request, Identity("s")) as events:
                done.extend([event async for event in events])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(turn)
            await sim.wait_for_tokens("s", pause_at)
            assert (await sim.pause())["partial_tokens"] == pause_at
            await sim.resume(weight_version="1")
        [step] = await _steps(sim, "s")
        assert step["output_ids"] == ids and step["preemptions"] == 1
        assert asked == [(64, 8), (64 - pause_at, 8 - pause_at)]


async def test_a_partial_rollout_over_the_simulator_records_what_an_uninterrupted_turn_does(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    """Unscripted: the simulator's own policy. Interrupted after 6 tokens and continued after the resume, the turn
    gives the agent and the step the very reply, ids and logprobs of the same turn never interrupted (the
    simulator goes on with its own text, as a model does; its policy alone would start a new reply mid-way)."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    async with open_simulated_proxy(
        tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL, tool_call_probability=1.0),
        partial_rollout=True,
    ) as sim:
        whole = await sim.chat("whole", USER, tools=tools, stream=True)
        results: dict[str, TurnResult] = {}

        async def turn() -> None:
            results["cut"] = await sim.chat("cut", USER, tools=tools, stream=True)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(turn)
            await sim.wait_for_tokens("cut", 6)
            assert (await sim.pause())["aborted"] == 1
            await trio.sleep(1.0)
            await sim.resume()
        [uncut], [cut] = await _steps(sim, "whole"), await _steps(sim, "cut")
    assert cut["preemptions"] == 1 and uncut["preemptions"] == 0
    assert cut["output_ids"] == uncut["output_ids"] and cut["output_logprobs"] == uncut["output_logprobs"]
    assert whole.output is not None and results["cut"].output is not None
    assert results["cut"].output.tool_calls and not cut["tool_call_parse_error"]
    assert results["cut"].output.content == whole.output.content
    assert [(c.name, c.arguments) for c in results["cut"].output.tool_calls] == [
        (c.name, c.arguments) for c in whole.output.tool_calls]


async def test_pause_with_a_thousand_sessions_in_flight(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    async with open_simulated_proxy(
        tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL), partial_rollout=True,
        max_sessions=2000,
    ) as sim:
        done = 0

        async def turn(i: int) -> None:
            nonlocal done
            result = await sim.chat(f"s{i}", USER, max_tokens=40)
            assert result.done is not None and result.done.completion_tokens <= 40
            done += 1

        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(turn, i)
            await trio.sleep(10.5 * INTERVAL)
            await trio.testing.wait_all_tasks_blocked()
            state = await sim.pause_state()
            assert state["in_flight"] == 1000
            assert set(state["in_flight_tokens"].values()) == {10}
            ack = await sim.pause()
            assert (ack["aborted"], ack["partial_tokens"]) == (1000, 10_000)
            after = await sim.pause_state()
            assert after["in_flight"] == 0 and after["waiting"] == 1000
            await sim.resume()
        assert done == 1000


async def test_pause_during_prompt_processing(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    config = SimConfig(token_interval=INTERVAL, prefill_latency=1.0)
    async with open_simulated_proxy(tokenizer=tokenizer, sim_config=config, partial_rollout=True) as sim:
        ids = _ids(tokenizer, "Short answer.")
        sim.engine.script(ids, routing_key="p")
        sim.engine.script(ids, routing_key="p")
        async with trio.open_nursery() as nursery:
            result: list[TurnResult] = []

            async def turn() -> None:
                result.append(await sim.chat("p", USER))

            nursery.start_soon(turn)
            await trio.sleep(0.5)  # the engine is still reading the prompt
            ack = await sim.pause()
            assert (ack["aborted"], ack["partial_tokens"]) == (1, 0)
            await sim.resume(weight_version="3")
        [step] = await _steps(sim, "p")
        assert step["output_ids"] == ids and set(step["concat_versions"][-len(ids):]) == {3}
        assert result[0].output.content == "Short answer."


async def test_pause_between_turns_twice_and_resume_without_pause(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_simulated_proxy(tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL)) as sim:
        first = await sim.chat("b", USER, max_tokens=5)
        assert first.done is not None
        assert (await sim.resume())["resumed"] is False  # resume without pause: a no-op
        ack = await sim.pause()
        assert (ack["aborted"], ack["partial_tokens"]) == (0, 0)  # nothing in flight
        again = await sim.pause()
        assert again["status"] == "paused" and again["aborted"] == 0  # idempotent
        started = trio.current_time()
        async with trio.open_nursery() as nursery:
            waited: list[float] = []

            async def turn() -> None:
                await sim.chat("b", [*USER, first.message, {"role": "user", "content": "more"}], max_tokens=5)
                waited.append(trio.current_time() - started)

            nursery.start_soon(turn)
            await trio.sleep(2.0)
            assert (await sim.pause_state())["waiting"] == 1  # the new turn waits, it does not fail
            await sim.resume()
        assert waited[0] >= 2.0
        state = await sim.pause_state()
        assert (state["state"], state["pauses"], state["resumes"]) == ("running", 1, 1)


async def test_waiting_too_long_gets_503_with_retry_after(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_simulated_proxy(
        tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL), pause_wait_timeout=5.0
    ) as sim:
        await sim.pause()
        started = trio.current_time()
        result = await sim.chat("w", USER)
        assert trio.current_time() - started == pytest.approx(5.0)
        assert result.error is not None and result.error.status == 503
        assert result.error.code == "generation_paused" and result.error.retry_after
        assert (await sim.pause_state())["waiting"] == 0


async def test_each_waiting_turn_gets_its_whole_wait_however_the_pauses_before_it_went(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    """One task bounds every turn's wait for resume: a turn that began to wait after an earlier
    one was woken by a resume still waits its own ``pause_wait_timeout`` from when it asked."""
    async with open_simulated_proxy(
        tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL), pause_wait_timeout=5.0
    ) as sim:
        await sim.pause()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sim.chat, "first", USER)
            await trio.sleep(3.0)
            await sim.resume()  # "first" goes on
        await sim.pause()
        started = trio.current_time()
        result = await sim.chat("second", USER)
        assert trio.current_time() - started == pytest.approx(5.0)
        assert result.error is not None and result.error.code == "generation_paused"
        await sim.resume()


async def test_pause_while_the_client_disconnects(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    async with open_simulated_proxy(
        tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL), partial_rollout=True
    ) as sim:
        ids = _ids(tokenizer, "one two three four five six seven eight nine ten eleven twelve")
        sim.engine.script(ids, routing_key="d")
        from actorproxy.core.requests import ChatRequest, Identity
        from actorproxy.core.turn_events import TurnDelta

        async with trio.open_nursery() as nursery:
            async def hang_up() -> None:
                stream = await sim.runtime.start_turn(ChatRequest(messages=USER, stream=True), Identity("d"))
                async with stream:
                    seen = 0
                    async for event in stream:
                        seen += isinstance(event, TurnDelta)
                        if seen == 4:
                            return  # the agent goes away...

            nursery.start_soon(hang_up)
            await sim.wait_for_tokens("d", 4)
            ack = await sim.pause()  # ...while the trainer pauses
            assert ack["aborted"] <= 1
        await sim.resume()
        [step] = await _steps(sim, "d")
        assert step["status"] == "client_disconnected" and not step["in_segment"]
        rid_stats = sim.engine.stats(step["rid"])
        assert step["output_ids"] == list(rid_stats.token_ids)  # nothing generated was lost
        assert (await sim.pause_state())["in_flight"] == 0


async def test_non_partial_mode(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    async with open_simulated_proxy(tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL)) as sim:
        ids = _ids(tokenizer, "alpha beta gamma delta epsilon zeta eta theta")
        sim.engine.script(ids, ids, routing_key="n")
        results: list[TurnResult] = []
        async with trio.open_nursery() as nursery:

            async def turn() -> None:
                results.append(await sim.chat("n", USER))

            nursery.start_soon(turn)
            await sim.wait_for_tokens("n", 3)
            ack = await sim.pause()
            assert (ack["aborted"], ack["partial_tokens"]) == (1, 3)
            await sim.resume(weight_version="1")
        # The interrupted attempt was discarded and the turn generated afresh under version 1.
        assert results[0].output.content == tokenizer.decode(ids[:-1])
        follow = [*USER, results[0].message, {"role": "user", "content": "go on"}]
        # The weight version changed during this trajectory: the next turn is refused.
        refused = await sim.chat("n", follow)
        assert refused.error is not None and refused.error.status == 409
        assert refused.error.code == "trajectory_version_changed"
        # A fresh session runs at the new version.
        assert (await sim.chat("n2", USER, max_tokens=4)).done is not None
        steps = await _steps(sim, "n")
        assert [s["status"] for s in steps] == ["completed", "rejected"]
        first = steps[0]
        assert first["output_ids"] == ids and set(first["concat_versions"][-len(ids):]) == {1}
        assert [d["output_ids"] for d in first["discarded"]] == [ids[:3]]
        assert first["preemptions"] == 1
        segment = (await sim.read("n"))["data"][0]
        assert segment["num_steps"] == 1 and sum(segment["loss_mask"]) == len(ids)  # discarded tokens untrained


async def test_streamed_turn_interrupted_without_partial_rollout(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with open_simulated_proxy(tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL)) as sim:
        sim.engine.script(_ids(tokenizer, "alpha beta gamma delta"), routing_key="x")
        results: list[TurnResult] = []
        async with trio.open_nursery() as nursery:

            async def turn() -> None:
                results.append(await sim.chat("x", USER, stream=True))

            nursery.start_soon(turn)
            await sim.wait_for_tokens("x", 2)
            await sim.pause()
            await sim.resume()
        assert results[0].error is not None and results[0].error.code == "generation_interrupted"
        [step] = await _steps(sim, "x")
        assert step["status"] == "aborted" and not step["in_segment"]


async def test_mask_tokens_of_older_versions(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    async with open_simulated_proxy(
        tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL),
        partial_rollout=True, mask_nonlast_version_tokens=True,
    ) as sim:
        ids = _ids(tokenizer, "one two three four five six")
        sim.engine.script(ids, routing_key="m")
        sim.engine.script(ids[4:], routing_key="m")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sim.chat, "m", USER)
            await sim.wait_for_tokens("m", 4)
            await sim.pause()
            await sim.resume(weight_version="2")
        await sim.finalize("m")
        [segment] = (await sim.read("m"))["data"]
        sampled = [(v, m) for v, m in zip(segment["versions"], segment["loss_mask"], strict=True) if v >= 0]
        assert sampled == [(0, 0)] * 4 + [(2, 1)] * (len(ids) - 4)


async def test_an_engine_that_ignores_the_abort_is_cut_by_the_turn_itself(
    tokenizer: Any, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The controller only asks; the turn's own task aborts, and cuts its stream after ABORT_LIMIT.

    Tokens keep coming (the engine ignores the abort), so ABORT_BOUND, which runs from the
    last token (a backlog still arriving is read, not cut), never expires: ABORT_LIMIT does.
    """
    from actorproxy.runtime import controller
    from actorproxy.sim.generation import SimGeneration

    def ignored(self: SimGeneration, batch: object = None) -> None:
        pass

    monkeypatch.setattr(SimGeneration, "abort_soon", ignored)
    limit = 30.0
    monkeypatch.setattr(controller, "ABORT_LIMIT", limit)
    async with open_simulated_proxy(tokenizer=tokenizer, sim_config=SimConfig(token_interval=1.0)) as sim:
        sim.engine.script(_ids(tokenizer, "word " * 100), routing_key="deaf")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sim.chat, "deaf", USER)
            await sim.wait_for_tokens("deaf", 3)
            start = trio.current_time()
            ack = await sim.pause()
            assert trio.current_time() - start == pytest.approx(limit)
            assert ack["aborted"] == 1 and ack["partial_tokens"] >= 3
            await sim.resume()
        [step] = await _steps(sim, "deaf")
        assert step["preemptions"] == 1


async def test_an_aborted_streams_tokens_move_its_cut_once_a_second_not_each(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A backlog read after a pause's abort pushes the stream's cut back, but its tokens do not
    each move a Trio deadline: the cut stays between ABORT_BOUND and ABORT_BOUND + ABORT_SLACK
    after the last token, moved once a second at most."""
    from actorproxy.runtime.controller import ABORT_BOUND, ABORT_SLACK, GenerationHandle

    handle = GenerationHandle("backlog")
    with trio.CancelScope() as stream:
        handle.bound_abort(stream)
        moves = 0
        for _ in range(300):  # three seconds of tokens, one every 10 ms
            await trio.sleep(0.01)
            before = stream.deadline
            handle.add_tokens(1)
            moves += stream.deadline != before
            assert ABORT_BOUND <= stream.deadline - trio.current_time() <= ABORT_BOUND + ABORT_SLACK
        assert 2 <= moves <= 3  # (300 when each token moved it)
        await trio.sleep(ABORT_BOUND - 0.5)
    assert not stream.cancelled_caught  # still within the bound of its last token


async def test_a_generation_the_engine_finished_before_its_abort_is_not_counted_aborted(
    tokenizer: Any, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pause's ``aborted`` counted every generation whose abort was asked, also one the engine finished
    whole before the abort reached it (vLLM did, on the real-engine tier): its step is whole, never
    preempted, yet the answer said 1. Now only a generation the engine (or the proxy, at its bound) cut."""
    from actorproxy.sim.generation import SimGeneration

    def too_late(self: SimGeneration, batch: object = None) -> None:
        pass  # the abort arrives after the engine sampled the reply's last token

    monkeypatch.setattr(SimGeneration, "abort_soon", too_late)
    async with open_simulated_proxy(tokenizer=tokenizer, sim_config=SimConfig(token_interval=1.0),
                                    partial_rollout=True) as sim:
        ids = _ids(tokenizer, "one two three four five")
        sim.engine.script(ids, routing_key="whole")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sim.chat, "whole", USER)
            await sim.wait_for_tokens("whole", 3)
            ack = await sim.pause()
            assert (ack["aborted"], ack["partial_tokens"]) == (0, 0)
            assert (await sim.pause_state())["aborted_total"] == 0
            await sim.resume()
        [step] = await _steps(sim, "whole")
        assert step["output_ids"] == ids and step["preemptions"] == 0 and step["status"] == "completed"


async def test_a_paused_stream_sends_its_agent_nothing_but_its_tokens(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    # Whether the agent is still there after the pause's abort is read from its channel,
    # not asked with an empty delta: at a pause of a thousand streams, that probe woke
    # every agent's connection task once for nothing.
    ids = _ids(tokenizer, "Once upon a time there was a very long story indeed, and it went on.")
    async with open_simulated_proxy(
        tokenizer=tokenizer, sim_config=SimConfig(token_interval=INTERVAL), partial_rollout=True
    ) as sim:
        sim.engine.script(ids[:6] + ids, routing_key="s")
        sim.engine.script(ids[5:], routing_key="s")
        deltas: list[Any] = []

        async def turn() -> None:
            request = ChatRequest(messages=USER, stream=True)
            async with await sim.runtime.start_turn(request, Identity("s")) as events:
                async for event in events:
                    if isinstance(event, TurnDelta):
                        deltas.append(event.delta)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(turn)
            await sim.wait_for_tokens("s", 5)
            assert (await sim.pause())["aborted"] == 1
            await sim.resume(weight_version="1")
        assert deltas and all(deltas)  # every delta says something
        assert "".join(d.content for d in deltas) == tokenizer.decode(ids[:-1])
