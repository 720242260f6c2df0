"""The token-level output parser and echo matching (sans-IO)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from _streamed import run, streamed
from hypothesis import given, settings
from hypothesis import strategies as st

from actorproxy.core.messages import AssistantOutput, ToolCall, echo_matches, message_key
from actorproxy.core.parser import OutputParser


def _run(
    tokenizer: Any, text: str, chunks: list[int] | None = None, **kwargs: Any
) -> tuple[OutputParser, str, str, list[tuple[int, str | None, str | None, str]]]:
    """``text`` fed in ``chunks``: the parser, and the reasoning, content and calls (index, id, name, arguments)
    it streamed."""
    parser, deltas = run(tokenizer, text, chunks, **kwargs)
    reasoning, content, calls = streamed(deltas)
    return parser, reasoning, content, [(i, *calls[i]) for i in sorted(calls)]


def test_reasoning_content_and_calls(tokenizer: Any) -> None:
    text = (
        "<think>\nI should check.\n</think>\n\nLet me look.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "nested": {"a": [1, 2]}}}\n</tool_call>\n'
        '<tool_call>\n{"name": "search", "arguments": {"query": "café 🌞"}}\n</tool_call>'
    )
    parser, reasoning, content, calls = _run(tokenizer, text)
    out = parser.output
    assert reasoning == out.reasoning == "I should check."
    assert content == out.content == "Let me look."
    assert [c[2] for c in calls] == ["get_weather", "search"]
    assert [c[1] for c in calls] == ["call_0", "call_1"]
    # Arguments are the raw text the model wrote (no longer re-serialised), each call streamed whole.
    assert calls[0][3] == out.tool_calls[0].arguments == '{"city": "Zürich", "nested": {"a": [1, 2]}}'
    assert json.loads(calls[0][3]) == {"city": "Zürich", "nested": {"a": [1, 2]}}
    assert out.tool_calls[1].parsed == {"query": "café 🌞"}
    assert [c[0] for c in calls] == [0, 1]
    _, deltas = run(tokenizer, text)
    assert sum(len(d.tool_calls) for d in deltas) == 2  # one piece a call, as its block closes
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [c[1:] for c in calls]
    assert not parser.tool_call_parse_error


def test_reasoning_opened_by_the_prompt(tokenizer: Any) -> None:
    parser, reasoning, content, _ = _run(tokenizer, "thinking here\n</think>\n\nanswer", reasoning_open=True)
    assert (reasoning, content) == ("thinking here", "answer")


def test_malformed_call_is_returned_as_content_and_flagged(tokenizer: Any) -> None:
    parser, _, content, calls = _run(tokenizer, "<tool_call>\n{\"name\": \"f\", \"arguments\": {oops}\n</tool_call>")
    # Its name was complete and its arguments begun before it failed: nothing of it was streamed as a call. The
    # reply has no call, the raw text as content (streamed too), the flag.
    assert calls == []
    assert parser.output.tool_calls == () and parser.tool_call_parse_error
    assert content == '<tool_call>\n{"name": "f", "arguments": {oops}\n</tool_call>'
    parser, _, content, calls = _run(tokenizer, "<tool_call>\n[\"not\", \"a call\"]\n</tool_call>")
    assert calls == [] and parser.tool_call_parse_error
    parser, _, content, calls = _run(tokenizer, 'Sure.\n<tool_call>\n{"name": "f", "argu')
    assert calls == [] and parser.tool_call_parse_error
    assert content == 'Sure.\n<tool_call>\n{"name": "f", "argu'


#: Replies read the same however the engine chunks their ids: text, reasoning, content, calls (id, name, arguments).
CHUNKED = [
    pytest.param(
        "<think>\n推理 with emoji 🧪 and spaces   \n</think>\n\n  Answer: naïve façade ✓  \n"
        '<tool_call>\n{"name": "f", "arguments": {"x": "ü"}}\n</tool_call>',
        "推理 with emoji 🧪 and spaces", "Answer: naïve façade ✓", [("call_0", "f", '{"x": "ü"}')],
        id="multibyte-text-and-whitespace",
    ),
    pytest.param(
        "<think>\nA plan: call twice.\n</think>\n\nOK 👍\n"
        '<tool_call>\n{"name": "a", "arguments": {"k": "v\\n\\"q\\"", "emoji": "🧪"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "parameters": {"n": -1.5e3}}\n</tool_call>',
        "A plan: call twice.", "OK 👍",
        [("call_0", "a", '{"k": "v\\n\\"q\\"", "emoji": "🧪"}'), ("call_1", "b", '{"n": -1.5e3}')],
        id="escapes-and-parameters",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), CHUNKED)
@settings(max_examples=50, deadline=None)
@given(chunks=st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=80))
def test_any_chunking_streams_and_returns_the_same_reply(
    tokenizer: Any, text: str, reasoning: str, content: str, calls: list[tuple[str, str, str]], chunks: list[int]
) -> None:
    whole = _run(tokenizer, text, chunks=[10_000])
    parser, *got = _run(tokenizer, text, chunks=chunks)
    assert whole[1:] == tuple(got) == (reasoning, content, [(i, *call) for i, call in enumerate(calls)])
    out = parser.output
    assert out == whole[0].output
    assert (out.reasoning, out.content, [(c.id, c.name, c.arguments) for c in out.tool_calls]) == (
        reasoning, content, calls)
    assert [c.parsed for c in out.tool_calls] == [json.loads(c.arguments) for c in out.tool_calls]


def test_echo_matching_by_meaning() -> None:
    ours = AssistantOutput(
        content="Checking.",
        reasoning="think",
        tool_calls=(ToolCall("call_a", "f", '{"b": 1, "a": [1, 2]}', {"b": 1, "a": [1, 2]}),),
    )
    call = {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{\n "a": [1,2], "b": 1}'}}
    assert echo_matches({"role": "assistant", "content": " Checking. ", "tool_calls": [call]}, ours)
    assert echo_matches({"role": "assistant", "content": "<think>think</think>Checking.", "tool_calls": [call]}, ours)
    assert echo_matches(
        {"role": "assistant", "content": "Checking.", "reasoning_content": "think", "tool_calls": [call]}, ours
    )
    other_id = {**call, "id": "call_b"}
    assert not echo_matches({"role": "assistant", "content": "Checking.", "tool_calls": [other_id]}, ours)
    other_args = {**call, "function": {"name": "f", "arguments": '{"a": [2, 1], "b": 1}'}}
    assert not echo_matches({"role": "assistant", "content": "Checking.", "tool_calls": [other_args]}, ours)
    assert not echo_matches({"role": "assistant", "content": "Checking!", "tool_calls": [call]}, ours)
    assert not echo_matches({"role": "assistant", "content": "Checking."}, ours)
    assert not echo_matches({"role": "user", "content": "Checking.", "tool_calls": [call]}, ours)
    plain = AssistantOutput("Hi", "", ())
    assert echo_matches({"role": "assistant", "content": [{"type": "text", "text": "Hi"}]}, plain)


def test_message_key_distinguishes_what_renders_differently() -> None:
    parts = {"role": "user", "content": [{"type": "text", "text": "a"}]}
    assert message_key({"role": "user", "content": "a"}) == message_key(parts)
    assert message_key({"role": "user", "content": "a"}) != message_key({"role": "user", "content": "a "})
    assert message_key({"role": "tool", "tool_call_id": "1", "content": "x"}) != message_key(
        {"role": "tool", "tool_call_id": "2", "content": "x"}
    )


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=60))
def test_stop_sequence_split_across_chunks(tokenizer: Any, chunks: list[int]) -> None:
    text = "Step one.\nObservation: the file is there\nmore text"
    parser, _, content, _ = _run(tokenizer, text, chunks=chunks, stop=("Observation:", "never"))
    assert parser.stopped and parser.stop_sequence == "Observation:"
    # The text before the stop sequence is returned as it was sampled, its trailing whitespace
    # included (OpenAI's rule); only the start of the reply is stripped.
    assert content == parser.output.content == "Step one.\n"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=30))
def test_stop_sequence_after_a_space_keeps_the_space(tokenizer: Any, chunks: list[int]) -> None:
    parser, _, content, _ = _run(tokenizer, "  Runs the sea and the see", chunks=chunks, stop=("see",))
    assert parser.stopped and content == parser.output.content == "Runs the sea and the "


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=40))
def test_no_stop_sequence_ends_in_the_first_min_tokens(tokenizer: Any, chunks: list[int]) -> None:
    """vLLM's rule: a stop sequence must end in the text after the first ``min_tokens`` tokens (it may begin
    before), in any chunking."""
    text = "Go. Go. Go. Go on, then go."
    ids = tokenizer.encode(text)
    # Up to the token that ends the second "Go.": the first two are in the quiet window, the third is not.
    second = next(n for n in range(1, len(ids) + 1) if tokenizer.decode(ids[:n]).count("Go.") == 2)
    parser, _, content, _ = _run(tokenizer, text, chunks=chunks, stop=("Go.",), min_tokens=second)
    assert parser.stopped and content == parser.output.content == "Go. Go. "
    # The window ends inside a sequence: the sequence that straddles it stops the reply.
    parser, _, content, _ = _run(tokenizer, text, chunks=chunks, stop=("Go.",), min_tokens=second - 1)
    assert parser.stopped and content == "Go. "
    parser, _, content, _ = _run(tokenizer, text, chunks=chunks, stop=("Go.", "go."), min_tokens=len(ids))
    assert not parser.stopped and content == text


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=5), min_size=1, max_size=30))
def test_include_stop_keeps_the_stop_text(tokenizer: Any, chunks: list[int]) -> None:
    """vLLM's ``include_stop_str_in_output``: the content ends with the stop sequence, and a stop id's text is
    shown."""
    parser, _, content, _ = _run(tokenizer, "Runs the sea and the see more", chunks=chunks, stop=("see",),
                                 include_stop=True)
    assert parser.stopped and content == parser.output.content == "Runs the sea and the see"
    dot = tokenizer.encode(".")[0]
    _, _, shown, _ = _run(tokenizer, "Hi.", chunks=chunks, stop_ids=(dot,), include_stop=True)
    _, _, hidden, _ = _run(tokenizer, "Hi.", chunks=chunks, stop_ids=(dot,))
    assert (shown, hidden) == ("Hi.", "Hi")


def test_stop_sequence_absent_changes_nothing(tokenizer: Any) -> None:
    parser, _, content, _ = _run(tokenizer, "plain answer", stop=("###",))
    assert not parser.stopped and content == "plain answer"


def test_tool_call_ends_open_reasoning(tokenizer: Any) -> None:
    # Qwen3.5 sometimes calls a tool without closing </think> (SGLang's qwen3 parser agrees).
    text = 'still thinking\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    parser, reasoning, content, calls = _run(tokenizer, text, reasoning_open=True)
    assert (reasoning, content) == ("still thinking", "")
    assert [(c.name, c.arguments) for c in parser.output.tool_calls] == [("f", "{}")]


def test_text_around_calls_and_stop_sequences_outside_them(tokenizer: Any) -> None:
    text = (
        'First.\n<tool_call>\n{"name": "f", "arguments": {"s": "STOP inside"}}\n</tool_call>\n'
        "Between.\n"
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>\nAfter. STOP here\nnot shown'
    )
    parser, _, content, calls = _run(tokenizer, text, stop=("STOP",))
    # Stop sequences apply to content only: the argument text never ends the reply.
    assert content == parser.output.content == "First.\n\nBetween.\n\nAfter. "
    assert [c[2:] for c in calls] == [("f", '{"s": "STOP inside"}'), ("g", "{}")]
    assert parser.stopped and not parser.tool_call_parse_error

