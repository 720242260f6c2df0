"""Our qwen3.jinja renders exactly the text of the official Qwen3 template.

The expected strings are written out by hand from the Qwen3 format, so a
change in the template (or in how transformers renders it) shows up as a diff.
"""

from __future__ import annotations

from typing import Any

import pytest

from actorproxy.tokenization.tokenizer import ChatTokenizer

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city, e.g. Zürich",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
# transformers' `tojson`: ensure_ascii=False and json.dumps' default ", " / ": " separators.
WEATHER_TOOL_JSON = (
    '{"type": "function", "function": {"name": "get_weather", '
    '"description": "Weather for a city, e.g. Zürich", '
    '"parameters": {"type": "object", "properties": {"city": {"type": "string"}}, '
    '"required": ["city"]}}}'
)
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_POSTAMBLE = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def case(name: str, messages: list[dict[str, Any]], expected: str, **render: Any) -> Any:
    """One conversation, how it is rendered (``tokenizer.render``'s keywords) and the official template's text."""
    return pytest.param(messages, render, expected, id=name)


RENDERINGS = [
    case("user_turn_with_generation_prompt", [{"role": "user", "content": "Hi there"}],
         "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"),
    case("without_generation_prompt", [{"role": "user", "content": "Hi"}],
         "<|im_start|>user\nHi<|im_end|>\n", add_generation_prompt=False),
    case(
        "system_and_user",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    case(
        "later_system_message_renders_in_place",
        [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Note."}],
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>system\nNote.<|im_end|>\n",
        add_generation_prompt=False,
    ),
    case(
        "tools_without_system",
        [{"role": "user", "content": "Weather?"}],
        "<|im_start|>system\n"
        + TOOLS_PREAMBLE
        + "\n"
        + WEATHER_TOOL_JSON
        + TOOLS_POSTAMBLE
        + "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n",
        tools=[WEATHER_TOOL],
    ),
    case(
        "tools_with_system",
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}],
        "<|im_start|>system\nBe brief.\n\n"
        + TOOLS_PREAMBLE
        + "\n"
        + WEATHER_TOOL_JSON
        + '\n{"type": "function", "function": {"name": "noop", "parameters": {}}}'
        + TOOLS_POSTAMBLE
        + "<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n",
        tools=[WEATHER_TOOL, {"type": "function", "function": {"name": "noop", "parameters": {}}}],
    ),
    case(
        "tool_calls_and_merged_tool_results",
        [
            {"role": "user", "content": "Weather in Paris and Oslo?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": {"city": "Oslo", "n": [1, 2]}},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "9C"},
            {"role": "assistant", "content": "Paris 18C, Oslo 9C."},
        ],
        "<|im_start|>user\nWeather in Paris and Oslo?<|im_end|>\n"
        # Content, then each call on its own line.
        "<|im_start|>assistant\nChecking.\n"
        # A string is inserted as is; a dict goes through tojson.
        '<tool_call>\n{"name": "get_weather", "arguments": {"city":"Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "n": [1, 2]}}\n'
        "</tool_call><|im_end|>\n"
        # Both results share one user turn.
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n"
        "<tool_response>\n9C\n</tool_response><|im_end|>\n"
        # The last message is after the last query, so it gets a (here empty) think block.
        "<|im_start|>assistant\n<think>\n\n</think>\n\nParis 18C, Oslo 9C.<|im_end|>\n",
        add_generation_prompt=False,
    ),
    case(
        "tool_call_without_content_and_without_function_wrapper",
        [
            {"role": "user", "content": "Go"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {}}]},
            {"role": "tool", "content": "done"},
        ],
        "<|im_start|>user\nGo<|im_end|>\n"
        # No content: no newline before the first call, and no reasoning, so no think block.
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\ndone\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    case(
        "reasoning_dropped_before_last_query_kept_after",
        [
            {"role": "user", "content": "First?"},
            {"role": "assistant", "content": "One.", "reasoning_content": "old thoughts"},
            {"role": "user", "content": "Second?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "\nneed a tool\n",
                "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "content": "42"},
            {"role": "assistant", "content": "\nIt is 42.", "reasoning_content": "got it"},
        ],
        "<|im_start|>user\nFirst?<|im_end|>\n"
        # Before the last user query: reasoning is dropped.
        "<|im_start|>assistant\nOne.<|im_end|>\n"
        "<|im_start|>user\nSecond?<|im_end|>\n"
        # After it (a tool loop): reasoning is kept, stripped of surrounding newlines.
        "<|im_start|>assistant\n<think>\nneed a tool\n</think>\n\n"
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        # Content is left-stripped of newlines after the think block.
        "<|im_start|>assistant\n<think>\ngot it\n</think>\n\nIt is 42.<|im_end|>\n",
        add_generation_prompt=False,
    ),
    case(
        "tool_response_written_as_user_text_is_not_a_query",
        [
            {"role": "user", "content": "Go"},
            {"role": "assistant", "content": "Calling.", "reasoning_content": "plan"},
            {"role": "user", "content": "<tool_response>\nok\n</tool_response>"},
        ],
        "<|im_start|>user\nGo<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nplan\n</think>\n\nCalling.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nok\n</tool_response><|im_end|>\n",
        add_generation_prompt=False,
    ),
    case(
        "reasoning_embedded_in_content_is_split",
        [
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>\nold\n</think>\n\nA1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "<think>\nnew\n</think>\n\nA2"},
        ],
        "<|im_start|>user\nQ1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n"
        "<|im_start|>user\nQ2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nnew\n</think>\n\nA2<|im_end|>\n",
        add_generation_prompt=False,
    ),
]


@pytest.mark.parametrize(("messages", "render", "expected"), RENDERINGS)
def test_renders_the_official_text(
    tokenizer: ChatTokenizer, messages: list[dict[str, Any]], render: dict[str, Any], expected: str
) -> None:
    assert tokenizer.render(messages, **render) == expected


def test_thinking_disabled(tokenizer: ChatTokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert tokenizer.render(messages, enable_thinking=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # Enabled is the default: no empty think block.
    assert tokenizer.render(messages, enable_thinking=True) == tokenizer.render(messages)


def test_empty_reasoning_content_leaves_think_in_content(tokenizer: ChatTokenizer) -> None:
    # An explicit reasoning_content string (even "") stops the content from being split.
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>x</think>A1", "reasoning_content": ""},
        {"role": "user", "content": "Q2"},
    ]
    text = tokenizer.render(messages, add_generation_prompt=False)
    assert "<|im_start|>assistant\n<think>x</think>A1<|im_end|>\n" in text


def test_content_parts_are_joined(tokenizer: ChatTokenizer) -> None:
    # Our extension: the official template would render these turns as empty.
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {"type": "image_url", "image_url": {"url": "data:,"}},
                {"type": "text", "text": "what is it?"},
            ],
        },
    ]
    text = tokenizer.render(messages)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nLook:\nwhat is it?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    as_strings = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Look:\nwhat is it?"},
    ]
    assert tokenizer.render(as_strings) == text


def test_content_parts_user_turn_counts_as_query(tokenizer: ChatTokenizer) -> None:
    messages = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
        {"role": "user", "content": [{"type": "text", "text": "Q2"}]},
    ]
    text = tokenizer.render(messages, add_generation_prompt=False)
    assert "<|im_start|>assistant\nA1<|im_end|>\n" in text


def test_null_content_renders_empty(tokenizer: ChatTokenizer) -> None:
    messages = [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": "{}"}]},
    ]
    text = tokenizer.render(messages, add_generation_prompt=False)
    assert text.endswith(
        '<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n{"name": "f", "arguments": {}}'
        "\n</tool_call><|im_end|>\n"
    )


def test_rendered_prompt_encodes_with_chatml_ids(tokenizer: ChatTokenizer) -> None:
    text = tokenizer.render(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Hello"}],
        tools=[WEATHER_TOOL],
    )
    ids = tokenizer.encode(text).tolist()
    assert ids[0] == 151644
    header = tokenizer.encode("<|im_start|>assistant\n").tolist()
    assert header[0] == 151644 and len(header) == 3
    assert ids[-len(header) :] == header
    assert ids.count(151644) == 3
    assert ids.count(151645) == 2
