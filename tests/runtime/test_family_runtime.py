"""Other model families through the real runtime (no HTTP): GLM-4.5 end to end, and the fallback.

The simulated engine plays the model: each reply is scripted in the family's own format and ends with
the token that family samples to give the turn back.
"""

from __future__ import annotations

from typing import Any

from _families import family_tokenizer
from _util import READ_TOOL, RecordingBackend, check_segment_invariants, run_turn

from actorproxy.config import ProxyConfig
from actorproxy.runtime.runtime import open_runtime
from actorproxy.schema.converter import CONVERTER
from actorproxy.sim import SimConfig, SimEngine

READ = READ_TOOL


async def test_glm45_session_continues_through_tool_calls_and_user_turns() -> None:
    tok = family_tokenizer("glm45")
    engine = SimEngine(tok, SimConfig(seed=1, token_interval=0.0))
    engine.script(
        "\n<think>Read it first.</think>\n<tool_call>read_file\n<arg_key>path</arg_key>\n"
        "<arg_value>main.py</arg_value>\n</tool_call><|observation|>",
        "\n<think>Clear now.</think>\nIt prints its first argument.<|user|>",
        "\n<think></think>\nYou are welcome.<|user|>",
    )
    backend = RecordingBackend(engine)
    config = ProxyConfig.of(port=0, tool_call_format="auto", reasoning_format="glm45")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What does main.py do?"}]
    async with open_runtime(config, backend=backend, tokenizer=tok) as runtime:
        first = await run_turn(runtime, "g", messages, tools=[READ])
        reply = first.message
        assert reply["reasoning_content"] == "Read it first."
        [call] = reply["tool_calls"]
        assert (call["function"]["name"], call["function"]["arguments"]) == ("read_file", '{"path": "main.py"}')
        messages += [reply, {"role": "tool", "tool_call_id": call["id"], "content": "print(sys.argv[1])"}]
        second = await run_turn(runtime, "g", messages, tools=[READ])
        assert second.message["content"] == "It prints its first argument."
        messages += [second.message, {"role": "user", "content": "Thanks!"}]
        third = await run_turn(runtime, "g", messages, tools=[READ])
        assert third.message["content"] == "You are welcome."
        await runtime.finalize("g")
        payload = CONVERTER.unstructure(await runtime.read(session_id="g", drain=True, include_steps=True))
    segments, steps = payload["data"], payload["steps"]
    assert [s["boundary_reason"] for s in segments] == ["finalize"], "every turn continued the segment"
    check_segment_invariants(segments[0], steps, backend.prompts)
    # The engine was told to stop on both of GLM's turn-ends, and the replies ended on the right one.
    assert [tok.token_text(s["output_ids"][-1]) for s in steps] == ["<|observation|>", "<|user|>", "<|user|>"]
    # Each fragment is the template's text after the sampled turn-end: no second <|observation|>.
    first_prompt, second_prompt = backend.prompts[steps[0]["rid"]], backend.prompts[steps[1]["rid"]]
    fragment = tok.decode(second_prompt[len(first_prompt) + len(steps[0]["output_ids"]) :])
    assert fragment == "\n<tool_response>\nprint(sys.argv[1])\n</tool_response><|assistant|>"


async def test_a_template_that_is_not_append_only_renders_every_turn_whole() -> None:
    tok = family_tokenizer("mistral")
    engine = SimEngine(tok, SimConfig(seed=2, token_interval=0.0))
    engine.script("Hello!", "Fine.", "Bye.")
    backend = RecordingBackend(engine)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hi"}]
    async with open_runtime(ProxyConfig.of(port=0), backend=backend, tokenizer=tok) as runtime:
        for follow_up in ("How are you?", "Bye"):
            result = await run_turn(runtime, "m", messages, tools=[READ])
            messages += [result.message, {"role": "user", "content": follow_up}]
        await run_turn(runtime, "m", messages, tools=[READ])
        await runtime.finalize("m")
        payload = CONVERTER.unstructure(await runtime.read(session_id="m", drain=True, include_steps=True))
    segments = payload["data"]
    assert [s["start_reason"] for s in segments] == [
        "session_start", "template_not_append_only", "template_not_append_only"
    ]  # fmt: skip
    # Each prompt is the fresh render of the whole conversation (tools before the LAST user message).
    last = payload["steps"][-1]
    assert list(backend.prompts[last["rid"]]) == list(tok.encode(tok.render(messages, tools=[READ])))
