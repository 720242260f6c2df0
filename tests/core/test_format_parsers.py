"""Tool-call and reasoning formats beyond Qwen: GLM-4.5, DeepSeek-V3.1, Kimi-K2, Llama 3, GPT-OSS harmony.

Each generation is written in the family's documented format, tokenized with the family's control
tokens as single tokens (``_families``), and fed to :class:`OutputParser` one token at a time, in
chunks of three and all at once: the final reply is the same, and the streamed pieces add up to it.
"""

from __future__ import annotations

from typing import Any

import pytest
from _families import family_tokenizer
from _streamed import run, streamed

from actorproxy.core.parser import OutputParser, default_tool_call_format

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "lines": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "grep", "parameters": {
        "type": "object", "properties": {"pattern": {"type": "string"}}}}},
]  # fmt: skip


def _parse(family: str, text: str, **kwargs: Any) -> tuple[OutputParser, dict[str, Any]]:
    """Feed ``text`` in three chunkings; all must agree. Returns the last parser and the streamed reply."""
    tok = family_tokenizer(family)
    count = len(tok.encode(text)) + 1  # and the end-of-turn id
    results = []
    for size in (1, 3, count):
        parser, deltas = run(tok, text, [size] * (count // size), tools=TOOLS, **kwargs)
        reasoning, content, calls = streamed(deltas)
        out = parser.output
        sent = {"reasoning": reasoning, "content": content,
                "calls": [dict(zip(("id", "name", "arguments"), calls[i], strict=True)) for i in sorted(calls)]}
        final = {
            "reasoning": out.reasoning,
            "content": out.content,
            "calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in out.tool_calls],
        }
        assert sent == final, f"chunks of {size}: the streamed pieces differ from the reply"
        results.append((parser, final))
    assert results[0][1] == results[1][1] == results[2][1]
    return results[-1]


#: A well-formed reply in each family's format, the parser's options for it, and what it reads: the reasoning,
#: the content and the calls as (id, name, arguments) (arguments typed by the tool's schema when there is one).
WELL_FORMED = [
    pytest.param(
        "glm45",
        "\n<think>The file first.</think>\nReading it.\n<tool_call>read_file\n<arg_key>path</arg_key>\n"
        "<arg_value>src/main.py</arg_value>\n<arg_key>lines</arg_key>\n<arg_value>10</arg_value>\n</tool_call>"
        "<tool_call>grep\n<arg_key>pattern</arg_key>\n<arg_value>def \"x\"</arg_value>\n</tool_call>",
        {"tool_call_format": "glm45", "reasoning_format": "glm45"},
        ("The file first.", "Reading it.",
         [("call_0", "read_file", '{"path": "src/main.py", "lines": 10}'),
          ("call_1", "grep", '{"pattern": "def \\"x\\""}')]),
        id="glm45-reasoning-content-and-xml-calls",
    ),
    pytest.param(
        "glm45",
        "<tool_call>unknown_tool\n<arg_key>opts</arg_key>\n<arg_value>{\"a\": [1, 2]}</arg_value>\n"
        "<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n<arg_key>s</arg_key>\n<arg_value>hello</arg_value>\n"
        "</tool_call>",
        {"tool_call_format": "glm45"},
        ("", "", [("call_0", "unknown_tool", '{"opts": {"a": [1, 2]}, "n": 3, "s": "hello"}')]),
        id="glm45-values-without-a-schema-are-json-when-they-parse",
    ),
    pytest.param(
        "glm45", "<tool_call>list_files\n</tool_call>", {"tool_call_format": "glm45"},
        ("", "", [("call_0", "list_files", "{}")]),
        id="glm45-call-without-arguments",
    ),
    pytest.param(
        "deepseek_v31",
        "Two files.</think>Checking both."
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>read_file<｜tool▁sep｜>{"path": "a.py"}<｜tool▁call▁end｜>'
        '<｜tool▁call▁begin｜>read_file<｜tool▁sep｜>{"path": "b.py", "lines": 5}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>",
        {"tool_call_format": "deepseek_v31", "reasoning_format": "deepseek_v31", "reasoning_open": True},
        ("Two files.", "Checking both.",
         [("call_0", "read_file", '{"path": "a.py"}'), ("call_1", "read_file", '{"path": "b.py", "lines": 5}')]),
        id="deepseek_v31-thinking-then-chained-calls",
    ),
    pytest.param(
        "deepseek_v31", "Hmm, 2+2.</think>4", {"reasoning_format": "deepseek_r1"}, ("Hmm, 2+2.", "4", []),
        id="deepseek_r1-reasoning-starts-without-a-think-tag",
    ),
    pytest.param(
        "kimi_k2",
        "Let me look.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>{"path": "a.py"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.grep:1<|tool_call_argument_begin|> {"pattern": "TODO"} <|tool_call_end|>'
        "<|tool_calls_section_end|>",
        {"tool_call_format": "kimi_k2", "reasoning_format": "kimi_k2"},
        ("", "Let me look.", [("functions.read_file:0", "read_file", '{"path": "a.py"}'),
                              ("functions.grep:1", "grep", '{"pattern": "TODO"}')]),
        id="kimi_k2-calls-keep-the-model-s-own-ids",
    ),
    pytest.param(
        "llama3", '{"name": "read_file", "parameters": {"path": "a.py"}}', {"tool_call_format": "llama3"},
        ("", "", [("call_0", "read_file", '{"path": "a.py"}')]),
        id="llama3-reply-that-is-a-call",
    ),
    pytest.param(
        "llama3",
        '<|python_tag|>{"name": "read_file", "parameters": {"path": "a.py"}}; '
        '{"name": "grep", "arguments": {"pattern": "x"}}',
        {"tool_call_format": "llama3"},
        ("", "", [("call_0", "read_file", '{"path": "a.py"}'), ("call_1", "grep", '{"pattern": "x"}')]),
        id="llama3-python-tag-and-several-calls",
    ),
    pytest.param(
        "llama3", "The answer is {4}.", {"tool_call_format": "llama3"}, ("", "The answer is {4}.", []),
        id="llama3-text-with-braces",
    ),
    pytest.param(
        "gpt_oss",
        "<|channel|>analysis<|message|>Need the file.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>"
        '{"path": "a.py"}<|call|>',
        {"tool_call_format": "gpt_oss", "reasoning_format": "gpt_oss"},
        ("Need the file.", "", [("call_0", "read_file", '{"path": "a.py"}')]),
        id="gpt_oss-analysis-then-a-call",
    ),
    pytest.param(
        "gpt_oss",
        "<|channel|>analysis<|message|>Easy.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Computing.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>",
        {"tool_call_format": "gpt_oss"},
        ("Easy.", "Computing.It is 4.", []),
        id="gpt_oss-preamble-and-final-answer",
    ),
    pytest.param(
        "gpt_oss",
        "<|channel|>analysis<|message|>x<|end|>"
        '<|start|>assistant to=functions.grep<|channel|>commentary json<|message|>{"pattern": "a"}<|call|>',
        {"tool_call_format": "gpt_oss"},
        ("x", "", [("call_0", "grep", '{"pattern": "a"}')]),
        id="gpt_oss-recipient-in-the-role-part",
    ),
]  # fmt: skip


@pytest.mark.parametrize(("family", "text", "options", "expected"), WELL_FORMED)
def test_a_well_formed_reply_is_read_as_its_family_writes_it(
    family: str, text: str, options: dict[str, Any], expected: tuple[str, str, list[tuple[str, str, str]]]
) -> None:
    parser, reply = _parse(family, text, **options)
    calls = [(c["id"], c["name"], c["arguments"]) for c in reply["calls"]]
    assert (reply["reasoning"], reply["content"], calls) == expected
    assert not parser.tool_call_parse_error


#: A call the parser cannot read, and the content it is returned as: ``None`` for the text itself.
MALFORMED = [
    pytest.param("glm45", "<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>a.py\n</tool_call>", None,
                 id="glm45-unclosed-value"),
    pytest.param("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>read_file<｜tool▁sep｜>[1, 2]"
                 "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", None, id="deepseek_v31-arguments-that-are-not-an-object"),
    pytest.param("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>read file<|tool_call_argument_begin|>{}"
                 "<|tool_call_end|><|tool_calls_section_end|>", None, id="kimi_k2-bad-header"),
    pytest.param("llama3", '{"answer": 4}', None, id="llama3-json-that-is-not-a-call"),
    pytest.param("gpt_oss", "<|channel|>commentary to=functions.grep<|message|>not json<|call|>", "not json",
                 id="gpt_oss-bad-arguments"),
]  # fmt: skip


@pytest.mark.parametrize(("family", "text", "content"), MALFORMED)
def test_a_call_that_does_not_parse_is_returned_as_content(family: str, text: str, content: str | None) -> None:
    parser, reply = _parse(family, text, tool_call_format=family)
    assert parser.tool_call_parse_error
    assert (reply["content"], reply["calls"]) == (text if content is None else content, [])


# -- selection --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "expected"),
    [("qwen3", "qwen3"), ("glm45", "glm45"), ("deepseek_v31", "deepseek_v31"), ("llama3", "llama3"),
     ("gemma3", "qwen3")],
)  # fmt: skip
def test_auto_format_from_the_chat_template(family: str, expected: str) -> None:
    assert default_tool_call_format(family_tokenizer(family)) == expected
