"""The ``sglang_api`` and ``hybrid`` parse backends over real HTTP, against the simulator's parsing endpoints."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import httpx
import pytest
from _util import WEATHER_TOOL, assemble_chat_stream, chat_chunks

from actorproxy import ProxyConfig, open_proxy
from actorproxy.engines.base import BackendError
from actorproxy.engines.sglang.parse import SGLangParseClient
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.sim.server import RunningSim, SimServerSettings, open_sim_server
from actorproxy.sim.sglang_parse_routes import parse_function_call, separate_reasoning

TOOL_REPLY = (
    '<think>\nCheck it.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)
XML_REPLY = (
    "<think>\nCheck it.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
#: A call of a function the request does not offer: SGLang drops it, our parser keeps it.
UNOFFERED_CALL = (
    '<think>\nHmm.\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>'
)
ANSWER = "<think>\nDone.\n</think>\n\nIt is cold in Oslo."
QUESTION = [{"role": "user", "content": "Weather in Oslo?"}]


@asynccontextmanager
async def stack(
    tokenizer: Any, *parse_backends: str, **proxy: Any
) -> AsyncIterator[tuple[RunningSim, list[httpx.AsyncClient]]]:
    """One simulated SGLang and one proxy per parse backend in front of it (its parse URL is the default)."""
    async with AsyncExitStack() as exit_stack:
        engine = SimEngine(tokenizer, SimConfig(seed=0, token_interval=0.001))
        sim = await exit_stack.enter_async_context(
            open_sim_server(SimServerSettings(port=0), engine=engine, tokenizer=tokenizer)
        )
        clients = []
        for parse_backend in parse_backends:
            config = ProxyConfig.of(
                port=0,
                backend="sglang",
                backend_urls=(sim.url,),
                parse_backend=parse_backend,  # type: ignore[arg-type]
                engine_health_interval=60,
                **proxy,
            )
            assert config.parse_url == sim.url
            running = await exit_stack.enter_async_context(open_proxy(config, tokenizer=tokenizer))
            clients.append(await exit_stack.enter_async_context(httpx.AsyncClient(base_url=running.url, timeout=30)))
        yield sim, clients


async def chat(client: httpx.AsyncClient, session: str, messages: list[dict[str, Any]]) -> httpx.Response:
    body = {"messages": messages, "tools": [WEATHER_TOOL]}
    return await client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": session})


def reply_of(response: httpx.Response) -> tuple[dict[str, Any], str]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["message"], choice["finish_reason"]


async def steps_of(client: httpx.AsyncClient, session: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Finalize ``session``; its segments and steps as the store has them."""
    assert (await client.post("/session/finalize", json={"session_id": session})).status_code == 200
    data = (await client.post("/trajectory/read", json={"session_id": session, "include_steps": True})).json()
    return data["data"], data["steps"]


def arguments(message: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]


# -- through the proxy ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sglang_api", "hybrid"])
async def test_sglang_parse_gives_the_local_reply_and_step(tokenizer: Any, mode: str) -> None:
    async with stack(tokenizer, "local", mode) as (sim, [local, remote]):
        sim.engine.script(TOOL_REPLY, TOOL_REPLY)
        local_reply = reply_of(await chat(local, "s", QUESTION))
        assert not sim.state.parse_requests  # the local parse asks nobody
        remote_reply = reply_of(await chat(remote, "s", QUESTION))
        message, finish = remote_reply
        assert finish == "tool_calls" and message["reasoning_content"] == "Check it."
        assert arguments(message) == [("get_weather", {"city": "Oslo"})]
        assert remote_reply == local_reply  # ids, raw arguments, content: all of it
        # SGLang was asked: reasoning first, then the calls in what follows it.
        [(path1, reasoning), (path2, calls)] = sim.state.parse_requests
        assert (path1, reasoning["reasoning_parser"]) == ("/separate_reasoning", "qwen3")
        assert reasoning["text"].startswith("<think>") and reasoning["text"].endswith("</tool_call>")
        assert (path2, calls["tool_call_parser"]) == ("/parse_function_call", "qwen25")
        assert calls["text"].startswith("<tool_call>\n") and "Check it." not in calls["text"]
        assert [t["function"]["name"] for t in calls["tools"]] == ["get_weather"]
        (_, [local_step]), (_, [remote_step]) = await steps_of(local, "s"), await steps_of(remote, "s")
        for key in ("output", "output_ids", "tool_call_parse_error", "finish_reason", "status"):
            assert remote_step[key] == local_step[key], key
        assert remote_step["status"] == "completed" and not remote_step["tool_call_parse_error"]


@pytest.mark.parametrize("mode", ["sglang_api", "hybrid"])
async def test_sglang_parse_has_the_last_word(tokenizer: Any, mode: str) -> None:
    """Where SGLang's parse differs from ours (it drops calls of functions not offered), SGLang's is recorded."""
    async with stack(tokenizer, "local", mode) as (sim, [local, remote]):
        sim.engine.script(UNOFFERED_CALL, UNOFFERED_CALL)
        local_message, local_finish = reply_of(await chat(local, "s", QUESTION))
        assert (arguments(local_message), local_finish) == ([("get_time", {"tz": "UTC"})], "tool_calls")
        message, finish = reply_of(await chat(remote, "s", QUESTION))
        assert (message["content"], message["reasoning_content"], finish) == ("", "Hmm.", "stop")
        assert "tool_calls" not in message
        _, [step] = await steps_of(remote, "s")
        assert step["output"] == {"content": "", "reasoning_content": "Hmm.", "tool_calls": []}
        assert step["tool_call_parse_error"]  # a block without a call: flagged


@pytest.mark.parametrize("mode", ["sglang_api", "hybrid"])
async def test_a_streamed_reply_records_what_was_streamed_and_its_echo_continues(tokenizer: Any, mode: str) -> None:
    """The stream's deltas come from the local parse as the tokens arrive, before SGLang could be asked. Where SGLang
    would differ (it drops the call of a function not offered), the step records what the agent was streamed: the
    call it saw, ran and echoes back. Else its next turn matches nothing recorded (a new segment)."""
    async with stack(tokenizer, mode) as (sim, [client]):
        sim.engine.script(UNOFFERED_CALL, ANSWER)
        body = {"messages": QUESTION, "tools": [WEATHER_TOOL], "stream": True}
        streamed = assemble_chat_stream(chat_chunks(
            (await client.post("/v1/chat/completions", json=body, headers={"X-Session-Id": "s"})).text))
        assert [c["function"]["name"] for c in streamed["calls"]] == ["get_time"]
        assert not sim.state.parse_requests  # nobody asked
        echo = {"role": "assistant", "content": streamed["content"], "reasoning_content": streamed["reasoning"],
                "tool_calls": streamed["calls"]}
        follow_up = [*QUESTION, echo, {"role": "tool", "tool_call_id": streamed["calls"][0]["id"], "content": "noon"}]
        message, _ = reply_of(await chat(client, "s", follow_up))  # (not streamed: SGLang's parse)
        assert message["content"] == "It is cold in Oslo."
        segments, [first, _] = await steps_of(client, "s")
        assert [c["function"]["name"] for c in first["output"]["tool_calls"]] == ["get_time"]
        assert [s["start_reason"] for s in segments] == ["session_start"] and segments[0]["num_steps"] == 2


async def test_hybrid_falls_back_to_the_local_parse(tokenizer: Any) -> None:
    async with stack(tokenizer, "local", "hybrid") as (sim, [local, hybrid]):
        sim.engine.script(TOOL_REPLY, TOOL_REPLY)
        expected = reply_of(await chat(local, "s", QUESTION))
        sim.faults.fail_next_parses(1)
        assert reply_of(await chat(hybrid, "s", QUESTION)) == expected
        assert sim.faults.fail_parses == 0
        assert [path for path, _ in sim.state.parse_requests] == ["/separate_reasoning"]  # it failed: no more asked
        (_, [local_step]), ([segment], [step]) = await steps_of(local, "s"), await steps_of(hybrid, "s")
        assert step["status"] == "completed" and step["output"] == local_step["output"]
        assert segment["step_indices"] == [0]


async def test_sglang_api_failure_is_a_502_and_leaves_the_segment(tokenizer: Any) -> None:
    async with stack(tokenizer, "sglang_api") as (sim, [client]):
        sim.engine.script(TOOL_REPLY, ANSWER, ANSWER)
        message, finish = reply_of(await chat(client, "s", QUESTION))
        assert finish == "tool_calls"
        before = (await client.get("/session/s")).json()["open_segment"]
        call = message["tool_calls"][0]
        follow_up = QUESTION + [message, {"role": "tool", "tool_call_id": call["id"], "content": "-3 °C"}]
        sim.faults.fail_next_parses(1)
        failed = await chat(client, "s", follow_up)
        assert failed.status_code == 502, failed.text
        error = failed.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "parse_failed")
        assert "/separate_reasoning" in error["message"] and "HTTP 500" in error["message"]
        session = (await client.get("/session/s")).json()
        assert session["open_segment"] == before  # nothing of the failed turn was recorded into it
        assert session["recent_steps"][-1]["status"] == "error"
        # The same turn again goes through and continues the segment.
        message, finish = reply_of(await chat(client, "s", follow_up))
        assert (message["content"], message["reasoning_content"], finish) == ("It is cold in Oslo.", "Done.", "stop")
        after = (await client.get("/session/s")).json()["open_segment"]
        assert (after["segment_index"], after["steps"]) == (before["segment_index"], 2)
        [segment], steps = await steps_of(client, "s")
        assert segment["step_indices"] == [0, 2]
        assert [(s["status"], s["in_segment"]) for s in steps] == [
            ("completed", True),
            ("error", False),
            ("completed", True),
        ]
        # The failed step still holds what the engine sampled (it was the same answer).
        assert steps[1]["output_ids"] == steps[2]["output_ids"]
        start = steps[2]["prompt_tokens"]
        assert segment["token_ids"][start:] == steps[2]["output_ids"]


async def test_qwen3_coder_calls_through_sglang(tokenizer: Any) -> None:
    async with stack(tokenizer, "local", "sglang_api", tool_call_format="qwen3_coder") as (sim, [local, remote]):
        sim.engine.script(XML_REPLY, XML_REPLY)
        expected = reply_of(await chat(local, "s", QUESTION))
        message, finish = reply_of(await chat(remote, "s", QUESTION))
        assert finish == "tool_calls" and message["reasoning_content"] == "Check it."
        assert arguments(message) == [("get_weather", {"city": "Oslo", "days": 3})]  # typed by the schema
        assert (message, finish) == expected
        assert [body.get("tool_call_parser") for _, body in sim.state.parse_requests] == [None, "qwen3_coder"]
        _, [step] = await steps_of(remote, "s")
        assert step["output"]["tool_calls"] == message["tool_calls"] and not step["tool_call_parse_error"]


# -- the simulator's endpoints ------------------------------------------------------------------


async def test_endpoints_speak_sglang(tokenizer: Any) -> None:
    async with (
        open_sim_server(SimServerSettings(port=0), tokenizer=tokenizer) as sim,
        httpx.AsyncClient(base_url=sim.url) as http,
    ):
        ok = await http.post("/separate_reasoning", json={"text": "<think>a</think> b ", "reasoning_parser": "qwen3"})
        assert ok.json() == {"reasoning_text": "a", "text": "b"}
        body = {"text": TOOL_REPLY.split("</think>")[1], "tool_call_parser": "qwen25", "tools": [WEATHER_TOOL]}
        answer = (await http.post("/parse_function_call", json=body)).json()
        assert answer == {
            "normal_text": "",
            "calls": [{"tool_index": 0, "name": "get_weather", "parameters": '{"city": "Oslo"}'}],
        }
        for path, bad in [
            ("/parse_function_call", {"text": "x", "tool_call_parser": "nope", "tools": [WEATHER_TOOL]}),
            ("/separate_reasoning", {"text": "x", "reasoning_parser": "nope"}),
            ("/separate_reasoning", {"reasoning_parser": "qwen3"}),
            ("/parse_function_call", {"text": "x", "tool_call_parser": "qwen25", "tools": [{"type": "function"}]}),
        ]:
            refused = await http.post(path, json=bad)
            assert refused.status_code == 400, (path, bad)
            assert refused.json()["object"] == "error" and refused.json()["code"] == 400
        assert "nope" in (await http.post("/separate_reasoning", json={"text": "", "reasoning_parser": "nope"})).text
        # Our client reads all of it, and sees an injected failure as an engine error.
        async with SGLangParseClient(sim.url) as client:
            assert await client.separate_reasoning("plan</think>\n\nok", "qwen3") == ("plan", "ok")
            sim.faults.fail_next_parses(1)
            with pytest.raises(BackendError, match="HTTP 500"):
                await client.parse_tool_calls("x", [WEATHER_TOOL], "qwen25")
            with pytest.raises(BackendError, match="HTTP 400.*nope"):
                await client.parse_tool_calls("x", [WEATHER_TOOL], "nope")
            assert await client.parse_tool_calls("x", [WEATHER_TOOL], "qwen25") == ("x", [])
        armed = await http.post("/sim/faults", json={"fail_next_parses": 2})
        assert armed.json()["fail_next_parses"] == 2
        failed = await http.post("/separate_reasoning", json={"text": "", "reasoning_parser": "qwen3"})
        assert failed.status_code == 500 and failed.json()["code"] == 500
        assert (await http.get("/sim/faults")).json()["fail_next_parses"] == 1


def test_reasoning_split() -> None:
    assert separate_reasoning("<think>\nplan\n</think>\n\nanswer\n", "qwen3") == ("plan\n", "answer")
    assert separate_reasoning("plan</think>answer", "qwen3") == ("plan", "answer")  # the prompt opened it
    assert separate_reasoning("<think>cut short", "qwen3") == ("cut short", "")
    assert separate_reasoning("<think>plan\n<tool_call>\n{}\n</tool_call>", "qwen3") == (
        "plan",
        "<tool_call>\n{}\n</tool_call>",
    )  # a call ends reasoning that was never closed
    assert separate_reasoning("<think>plan\n<tool_call>", "deepseek-r1") == ("plan\n<tool_call>", "")
    assert separate_reasoning(" plain ", "qwen3") == ("", " plain ")
    assert separate_reasoning(" plain ", "qwen3-thinking") == ("plain", "")


def test_json_calls() -> None:
    tools = [{"type": "function", "function": {"name": "search"}}, WEATHER_TOOL]
    text = (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
        '<tool_call>\n[{"name": "search", "parameters": {"q": "é"}}, {"name": "nope", "arguments": {}}]\n</tool_call>\n'
        "<tool_call>\nnot json\n</tool_call>\n<tool_call>no newlines</tool_call> Bye."
    )
    normal, calls = parse_function_call(text, tools, "qwen25")
    assert [(c.tool_index, c.name, json.loads(c.parameters)) for c in calls] == [
        (1, "get_weather", {"city": "Oslo", "days": 2}),
        (0, "search", {"q": "é"}),
    ]
    assert '"é"' in calls[1].parameters  # not ASCII-escaped, as SGLang writes it
    assert normal == "Sure.\n\n\n\n<tool_call>no newlines</tool_call> Bye."
    assert parse_function_call(text, [], "qwen") == (text, [])  # no tools, no calls


def test_xml_calls() -> None:
    body = "<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n4\n</parameter>\n"
    body += "</function>"
    text = (
        f"Let me see.\n<tool_call>\n{body}\n<function=unknown>\n</function>\n</tool_call>\n"
        f"<tool_call>\n{body}\n</tool_call>"
    )
    normal, calls = parse_function_call(text, [WEATHER_TOOL], "qwen3_coder")
    assert [(c.tool_index, c.name, json.loads(c.parameters)) for c in calls] == [
        (0, "get_weather", {"city": "Oslo", "days": 4}),
        (1, "get_weather", {"city": "Oslo", "days": 4}),
    ]
    # A function not offered stays as text; the calls taken from its block do not.
    assert normal == "Let me see.\n<tool_call>\n\n<function=unknown>\n</function>\n</tool_call>"
