"""SGLang's parsing endpoints (a scripted SGLang on port 0) and the choice of the final parse (sans-IO)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from _handler_server import UNREACHABLE, serving

from actorproxy.core.messages import AssistantOutput, ToolCall
from actorproxy.engines.base import BackendError
from actorproxy.engines.sglang.parse import (
    SGLANG_TOOL_CALL_PARSERS,
    RemoteParse,
    SGLangParseClient,
    choose_output,
    completion_text,
)

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": True,
    },
}


@asynccontextmanager
async def client(handler: Callable[[httpx.Request], httpx.Response]) -> AsyncIterator[SGLangParseClient]:
    """A parse client of ``handler`` served over real HTTP (closed after the block)."""
    async with serving(handler) as url, SGLangParseClient(url + "/") as sglang:
        yield sglang


class Recorder:
    """A scripted SGLang: answers per path, remembers the requests."""

    def __init__(self, answers: dict[str, Any], status: int = 200) -> None:
        self.answers = answers
        self.status = status
        self.requests: list[tuple[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.requests.append((request.url.path, body))
        return httpx.Response(self.status, json=self.answers[request.url.path])


async def test_separate_reasoning() -> None:
    engine = Recorder({"/separate_reasoning": {"reasoning_text": "hmm", "text": "\n\nanswer"}})
    async with client(engine) as sglang:
        assert await sglang.separate_reasoning("<think>hmm</think>\n\nanswer", "qwen3") == ("hmm", "\n\nanswer")
    assert engine.requests == [
        ("/separate_reasoning", {"text": "<think>hmm</think>\n\nanswer", "reasoning_parser": "qwen3"})
    ]


async def test_parse_tool_calls() -> None:
    calls = [{"tool_index": 0, "name": "get_weather", "parameters": '{"city": "Paris"}'}]
    engine = Recorder({"/parse_function_call": {"normal_text": "Sure.", "calls": calls}})
    async with client(engine) as sglang:
        result = await sglang.parse_tool_calls("Sure.\n<tool_call>...</tool_call>", [TOOL], "qwen25")
    assert result == ("Sure.", [("get_weather", '{"city": "Paris"}')])
    path, body = engine.requests[0]
    assert path == "/parse_function_call" and body["tool_call_parser"] == "qwen25"
    # Only the fields SGLang's Tool model knows are sent.
    function: dict[str, Any] = TOOL["function"]  # type: ignore[assignment]
    sent = {k: function[k] for k in ("name", "description", "parameters")}
    assert body["tools"] == [{"type": "function", "function": sent}]


async def test_parse_runs_reasoning_then_tools() -> None:
    engine = Recorder(
        {
            "/separate_reasoning": {"reasoning_text": "plan", "text": "\n\n<tool_call>x</tool_call>"},
            "/parse_function_call": {"normal_text": "", "calls": [{"name": "f", "parameters": {"a": 1}}]},
        }
    )
    async with client(engine) as sglang:
        text = "<think>plan</think>\n\n<tool_call>x</tool_call>"
        remote = await sglang.parse(text, [TOOL], tool_call_parser="qwen25")
        assert remote == RemoteParse("plan", "", (("f", '{"a": 1}'),))
        path, body = engine.requests[1]
        assert (path, body["text"], body["tool_call_parser"]) == (
            "/parse_function_call",
            "\n\n<tool_call>x</tool_call>",
            "qwen25",
        )
        engine.requests.clear()
        assert await sglang.parse("plain", [], tool_call_parser="qwen25", reasoning_parser=None) == RemoteParse(
            "", "plain", ()
        )
        assert engine.requests == []  # nothing to ask
    assert SGLANG_TOOL_CALL_PARSERS["qwen3"] == "qwen25"
    assert SGLANG_TOOL_CALL_PARSERS["qwen3_coder"] == "qwen3_coder"


@pytest.mark.parametrize(
    ("status", "answer", "match"),
    [
        (500, {"detail": "Unsupported tool_call_parser: nope"}, "HTTP 500: Unsupported"),
        (200, {"normal_text": "x"}, "unexpected response"),
        (200, {"normal_text": "x", "calls": [{"name": "f", "parameters": 3}]}, "unexpected call"),
        (200, {"normal_text": "x", "calls": [{"parameters": "{}"}]}, "unexpected call"),
        (200, ["not", "an", "object"], "unexpected response"),
    ],
)
async def test_bad_answers_are_backend_errors(status: int, answer: Any, match: str) -> None:
    engine = Recorder({"/parse_function_call": answer}, status=status)
    async with client(engine) as sglang:
        with pytest.raises(BackendError, match=match):
            await sglang.parse_tool_calls("text", [TOOL], "nope")


async def test_transport_failure_is_a_backend_error() -> None:
    async with SGLangParseClient(UNREACHABLE) as sglang:  # nothing listens there: refused
        with pytest.raises(BackendError) as info:
            await sglang.separate_reasoning("text", "qwen3")
    assert info.value.unreachable


async def test_owned_client_is_closed() -> None:
    engine = Recorder({"/separate_reasoning": {"reasoning_text": "", "text": "t"}})
    async with serving(engine) as url:
        sglang = SGLangParseClient(url)
        await sglang.separate_reasoning("t", "qwen3")
        assert sglang.http.idle == 1  # the call's connection, kept alive
        await sglang.aclose()
        assert sglang.http.idle == 0


# -- choosing the output (sans-IO) --------------------------------------------

LOCAL_CALL = ToolCall("call_a", "get_weather", '{"city":"Paris"}', {"city": "Paris"})
LOCAL = AssistantOutput("Sure.", "plan", (LOCAL_CALL,))
TEXT = '<think>plan</think>\n\nSure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>'


def ids(i: int) -> str:
    return f"call_new_{i}"


def test_local_mode_ignores_sglang() -> None:
    remote = RemoteParse("r", "c", ())
    outcome = choose_output("local", text=TEXT, local=LOCAL, local_error=False, remote=remote, tool_call_id=ids)
    assert (outcome.output, outcome.source, outcome.tool_call_parse_error) == (LOCAL, "local", False)


def test_sglang_agreeing_with_us_keeps_the_streamed_calls() -> None:
    remote = RemoteParse("plan", "\nSure.\n", (("get_weather", '{"city": "Paris"}'),))
    outcome = choose_output("sglang_api", text=TEXT, local=LOCAL, local_error=False, remote=remote, tool_call_id=ids)
    assert outcome.source == "sglang" and outcome.output == LOCAL and not outcome.tool_call_parse_error


def test_sglang_disagreeing_wins_with_fresh_ids() -> None:
    remote = RemoteParse("plan", "Sure.", (("get_weather", '{"city": "Lyon"}'), ("now", "{}")))
    outcome = choose_output("hybrid", text=TEXT, local=LOCAL, local_error=True, remote=remote, tool_call_id=ids)
    assert outcome.source == "sglang" and not outcome.tool_call_parse_error
    assert [(c.id, c.name, c.arguments, c.parsed) for c in outcome.output.tool_calls] == [
        ("call_new_0", "get_weather", '{"city": "Lyon"}', {"city": "Lyon"}),
        ("call_new_1", "now", "{}", {}),
    ]


def test_sglang_dropping_a_call_is_flagged() -> None:
    remote = RemoteParse("plan", "Sure.", ())
    outcome = choose_output("sglang_api", text=TEXT, local=LOCAL, local_error=False, remote=remote, tool_call_id=ids)
    assert outcome.output.tool_calls == () and outcome.tool_call_parse_error


@pytest.mark.parametrize(
    "remote",
    [BackendError("SGLang /parse_function_call: HTTP 500"), None, RemoteParse("", "", (("f", "[1]"),))],
)
def test_failures_raise_in_sglang_api_and_fall_back_in_hybrid(remote: Any) -> None:
    outcome = choose_output("hybrid", text=TEXT, local=LOCAL, local_error=False, remote=remote, tool_call_id=ids)
    assert outcome.output == LOCAL and outcome.source == "local" and outcome.fallback
    with pytest.raises(BackendError):
        choose_output("sglang_api", text=TEXT, local=LOCAL, local_error=False, remote=remote, tool_call_id=ids)


def test_a_stop_sequence_keeps_the_local_parse() -> None:
    remote = RemoteParse("", "more text after the stop", ())
    outcome = choose_output(
        "sglang_api", text=TEXT, local=LOCAL, local_error=False, remote=remote, tool_call_id=ids, stopped=True
    )
    assert outcome.output == LOCAL and outcome.source == "local"


def test_completion_text(tokenizer: Any) -> None:
    output_ids = tokenizer.encode("plan\n</think>\n\n<tool_call>\n{}\n</tool_call>").tolist() + [tokenizer.eot_token_id]
    assert completion_text(tokenizer, output_ids) == "plan\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    assert completion_text(tokenizer, output_ids, reasoning_open=True).startswith("<think>plan\n</think>")
