"""Tool-call and reasoning formats beyond Qwen: GLM-4.5, DeepSeek-V3.1, Kimi-K2, Llama 3, GPT-OSS harmony.

Each generation is written in the family's documented format, tokenized with the family's control
tokens as single tokens (``_families``), and fed to :class:`OutputParser` one token at a time, in
chunks of three and all at once: the final reply is the same, and the streamed pieces add up to it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from _families import family_tokenizer

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
    ids = [*tok.encode(text), tok.eot_token_id]
    results = []
    for size in (1, 3, len(ids)):
        parser = OutputParser(tok, tool_call_id=lambda i: f"call_{i}", tools=TOOLS, **kwargs)
        reasoning, content, calls = "", "", {}
        deltas = [parser.feed(ids[at : at + size]) for at in range(0, len(ids), size)] + [parser.finish()]
        for delta in deltas:
            reasoning, content = reasoning + delta.reasoning, content + delta.content
            for piece in delta.tool_calls:
                if piece.id is not None:
                    calls[piece.index] = {"id": piece.id, "name": piece.name, "arguments": piece.arguments}
                else:
                    calls[piece.index]["arguments"] += piece.arguments
        out = parser.output
        streamed = {"reasoning": reasoning, "content": content, "calls": [calls[i] for i in sorted(calls)]}
        final = {
            "reasoning": out.reasoning,
            "content": out.content,
            "calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in out.tool_calls],
        }
        if parser.tool_call_parse_error:  # a client may have seen the start of the failed call (docs/parsers.md)
            streamed["calls"] = [c for c in streamed["calls"] if c["id"] in {f["id"] for f in final["calls"]}]
        assert streamed == final, f"chunks of {size}: the streamed pieces differ from the reply"
        results.append((parser, final))
    assert results[0][1] == results[1][1] == results[2][1]
    return results[-1]


def _args(reply: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(c["name"], json.loads(c["arguments"])) for c in reply["calls"]]


# -- GLM-4.5 ----------------------------------------------------------------


def test_glm45_reasoning_content_and_xml_calls() -> None:
    text = (
        "\n<think>The file first.</think>\nReading it.\n<tool_call>read_file\n<arg_key>path</arg_key>\n"
        "<arg_value>src/main.py</arg_value>\n<arg_key>lines</arg_key>\n<arg_value>10</arg_value>\n</tool_call>"
        "<tool_call>grep\n<arg_key>pattern</arg_key>\n<arg_value>def \"x\"</arg_value>\n</tool_call>"
    )
    parser, reply = _parse("glm45", text, tool_call_format="glm45", reasoning_format="glm45")
    assert reply["reasoning"] == "The file first."
    assert reply["content"] == "Reading it."
    assert _args(reply) == [("read_file", {"path": "src/main.py", "lines": 10}), ("grep", {"pattern": 'def "x"'})]
    assert reply["calls"][0]["arguments"] == '{"path": "src/main.py", "lines": 10}'
    assert not parser.tool_call_parse_error


def test_glm45_values_without_a_schema_are_json_when_they_parse() -> None:
    text = (
        "<tool_call>unknown_tool\n<arg_key>opts</arg_key>\n<arg_value>{\"a\": [1, 2]}</arg_value>\n"
        "<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n<arg_key>s</arg_key>\n<arg_value>hello</arg_value>\n"
        "</tool_call>"
    )
    _, reply = _parse("glm45", text, tool_call_format="glm45")
    assert _args(reply) == [("unknown_tool", {"opts": {"a": [1, 2]}, "n": 3, "s": "hello"})]


def test_glm45_call_without_arguments_and_a_malformed_one() -> None:
    _, reply = _parse("glm45", "<tool_call>list_files\n</tool_call>", tool_call_format="glm45")
    assert _args(reply) == [("list_files", {})]
    broken = "<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>a.py\n</tool_call>"
    parser, reply = _parse("glm45", broken, tool_call_format="glm45")
    assert parser.tool_call_parse_error and reply["content"] == broken.strip()


# -- DeepSeek-V3.1 ------------------------------------------------------------


def test_deepseek_v31_thinking_then_chained_calls() -> None:
    text = (
        "Two files.</think>Checking both."
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>read_file<｜tool▁sep｜>{"path": "a.py"}<｜tool▁call▁end｜>'
        '<｜tool▁call▁begin｜>read_file<｜tool▁sep｜>{"path": "b.py", "lines": 5}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>"
    )
    parser, reply = _parse(
        "deepseek_v31", text, tool_call_format="deepseek_v31", reasoning_format="deepseek_v31", reasoning_open=True
    )
    assert (reply["reasoning"], reply["content"]) == ("Two files.", "Checking both.")
    assert _args(reply) == [("read_file", {"path": "a.py"}), ("read_file", {"path": "b.py", "lines": 5})]
    assert [c["id"] for c in reply["calls"]] == ["call_0", "call_1"]
    assert not parser.tool_call_parse_error


def test_deepseek_v31_arguments_that_are_not_an_object_return_the_block_as_content() -> None:
    text = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>read_file<｜tool▁sep｜>[1, 2]<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>"
    )
    parser, reply = _parse("deepseek_v31", text, tool_call_format="deepseek_v31")
    assert parser.tool_call_parse_error
    assert reply["calls"] == [] and reply["content"] == text


def test_deepseek_r1_reasoning_starts_without_a_think_tag() -> None:
    _, reply = _parse("deepseek_v31", "Hmm, 2+2.</think>4", reasoning_format="deepseek_r1")
    assert (reply["reasoning"], reply["content"]) == ("Hmm, 2+2.", "4")


# -- Kimi-K2 ------------------------------------------------------------------


def test_kimi_k2_calls_keep_the_model_s_own_ids() -> None:
    text = (
        "Let me look.<|tool_calls_section_begin|>"
        '<|tool_call_begin|>functions.read_file:0<|tool_call_argument_begin|>{"path": "a.py"}<|tool_call_end|>'
        '<|tool_call_begin|>functions.grep:1<|tool_call_argument_begin|> {"pattern": "TODO"} <|tool_call_end|>'
        "<|tool_calls_section_end|>"
    )
    parser, reply = _parse("kimi_k2", text, tool_call_format="kimi_k2", reasoning_format="kimi_k2")
    assert reply["content"] == "Let me look."
    assert _args(reply) == [("read_file", {"path": "a.py"}), ("grep", {"pattern": "TODO"})]
    assert [c["id"] for c in reply["calls"]] == ["functions.read_file:0", "functions.grep:1"]
    assert reply["calls"][1]["arguments"] == '{"pattern": "TODO"}'
    assert not parser.tool_call_parse_error


def test_kimi_k2_bad_header_is_content() -> None:
    text = (
        "<|tool_calls_section_begin|><|tool_call_begin|>read file<|tool_call_argument_begin|>{}<|tool_call_end|>"
        "<|tool_calls_section_end|>"
    )
    parser, reply = _parse("kimi_k2", text, tool_call_format="kimi_k2")
    assert parser.tool_call_parse_error and reply["content"] == text


# -- Llama 3 JSON ---------------------------------------------------------------


def test_llama3_reply_that_is_a_call() -> None:
    parser, reply = _parse("llama3", '{"name": "read_file", "parameters": {"path": "a.py"}}', tool_call_format="llama3")
    assert _args(reply) == [("read_file", {"path": "a.py"})]
    assert reply["calls"][0]["arguments"] == '{"path": "a.py"}'
    assert reply["content"] == "" and not parser.tool_call_parse_error


def test_llama3_python_tag_and_several_calls() -> None:
    text = (
        '<|python_tag|>{"name": "read_file", "parameters": {"path": "a.py"}}; '
        '{"name": "grep", "arguments": {"pattern": "x"}}'
    )
    _, reply = _parse("llama3", text, tool_call_format="llama3")
    assert _args(reply) == [("read_file", {"path": "a.py"}), ("grep", {"pattern": "x"})]


def test_llama3_text_and_json_that_is_not_a_call() -> None:
    _, reply = _parse("llama3", "The answer is {4}.", tool_call_format="llama3")
    assert reply == {"reasoning": "", "content": "The answer is {4}.", "calls": []}
    parser, reply = _parse("llama3", '{"answer": 4}', tool_call_format="llama3")
    assert reply["content"] == '{"answer": 4}' and reply["calls"] == [] and parser.tool_call_parse_error


# -- GPT-OSS harmony ------------------------------------------------------------


def test_gpt_oss_analysis_then_a_call() -> None:
    text = (
        "<|channel|>analysis<|message|>Need the file.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>"
        '{"path": "a.py"}<|call|>'
    )
    parser, reply = _parse("gpt_oss", text, tool_call_format="gpt_oss", reasoning_format="gpt_oss")
    assert reply["reasoning"] == "Need the file."
    assert reply["content"] == ""
    assert _args(reply) == [("read_file", {"path": "a.py"})]
    assert not parser.tool_call_parse_error


def test_gpt_oss_preamble_and_final_answer() -> None:
    text = (
        "<|channel|>analysis<|message|>Easy.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Computing.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
    )
    _, reply = _parse("gpt_oss", text, tool_call_format="gpt_oss")
    assert (reply["reasoning"], reply["content"], reply["calls"]) == ("Easy.", "Computing.It is 4.", [])


def test_gpt_oss_recipient_in_the_role_part_and_bad_arguments() -> None:
    text = (
        "<|channel|>analysis<|message|>x<|end|>"
        '<|start|>assistant to=functions.grep<|channel|>commentary json<|message|>{"pattern": "a"}<|call|>'
    )
    _, reply = _parse("gpt_oss", text, tool_call_format="gpt_oss")
    assert _args(reply) == [("grep", {"pattern": "a"})]
    bad = "<|channel|>commentary to=functions.grep<|message|>not json<|call|>"
    parser, reply = _parse("gpt_oss", bad, tool_call_format="gpt_oss")
    assert parser.tool_call_parse_error and reply["content"] == "not json" and reply["calls"] == []


# -- selection --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "expected"),
    [("qwen3", "qwen3"), ("glm45", "glm45"), ("deepseek_v31", "deepseek_v31"), ("llama3", "llama3"),
     ("gemma3", "qwen3")],
)  # fmt: skip
def test_auto_format_from_the_chat_template(family: str, expected: str) -> None:
    assert default_tool_call_format(family_tokenizer(family)) == expected
