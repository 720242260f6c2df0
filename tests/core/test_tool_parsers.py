"""Format-specific tool-call parsing and streaming: Hermes/Qwen3 JSON and Qwen3-Coder XML (sans-IO)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from _streamed import assert_stream_matches_output, run, streamed
from hypothesis import given, settings
from hypothesis import strategies as st

from actorproxy.core.parser import OutputParser, ToolCallDelta, default_tool_call_format, tool_schemas
from actorproxy.core.tool_parsers import CallPiece, HermesBlockParser, XmlBlockParser, convert_parameter

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "scale": {"type": "number"},
                "metric": {"type": "boolean"},
                "options": {"type": "object"},
                "hours": {"type": "array", "items": {"type": "integer"}},
                "note": {"type": ["string", "null"]},
            },
        },
    },
}
TOOLS = [WEATHER]


def xml_call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def feed_chars(parser: HermesBlockParser | XmlBlockParser, text: str) -> list[CallPiece]:
    return [piece for ch in text for piece in parser.feed(ch)]


# -- Hermes / Qwen3 JSON -------------------------------------------------------


def test_hermes_pieces_char_by_char() -> None:
    block = HermesBlockParser()
    pieces = feed_chars(block, '\n{"name": "f", "arguments": {"a": "}", "b": [1]}}\n')
    assert pieces[0] == CallPiece(0, "f")
    assert "".join(p.arguments for p in pieces) == '{"a": "}", "b": [1]}'
    result = block.close()
    assert result is not None and result.pieces == ()
    assert result.calls[0].arguments == '{"a": "}", "b": [1]}' and result.calls[0].parsed == {"a": "}", "b": [1]}


def test_hermes_call_is_streamed_whole_as_its_block_closes(tokenizer: Any) -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    ids = tokenizer.encode(text).tolist()
    parser = OutputParser(tokenizer, tool_call_id=lambda i: f"call_{i}")
    per_token = [parser.feed([tid]).tool_calls for tid in ids]
    # Nothing of the call before its block closed and parsed, then all of it in one piece (docs/parsers.md).
    assert per_token[:-1] == [()] * (len(ids) - 1) and ids[-1] == tokenizer.tool_call_end_id
    assert per_token[-1] == (ToolCallDelta(0, "call_0", "f", '{"x": 1}'),)
    assert parser.output.tool_calls[0].arguments == '{"x": 1}'


def test_hermes_raw_arguments_are_kept(tokenizer: Any) -> None:
    # Raw text as the model wrote it (spacing, key order, escapes), not re-serialised.
    raw = '{ "b":1,"a" : "caf\\u00e9 ☕", "nested": {"deep": [true, null, 1.50]} }'
    parser, deltas = run(tokenizer, f'<tool_call>\n{{"name": "f", "arguments": {raw}}}\n</tool_call>')
    call = parser.output.tool_calls[0]
    assert call.arguments == raw and call.parsed == {"b": 1, "a": "café ☕", "nested": {"deep": [True, None, 1.5]}}
    assert_stream_matches_output(parser, deltas)


@pytest.mark.parametrize(
    ("body", "arguments"),
    [
        ('{"name": "f", "parameters": {"a": 1}}', '{"a": 1}'),
        ('{"arguments": {"a": 1}, "name": "f"}', '{"a": 1}'),
        ('{"name": "f", "arguments": "{\\"a\\": 1}"}', '{"a": 1}'),
        ('{"name": "f"}', "{}"),
        ('{"name":"f","arguments":{}}', "{}"),
    ],
)
def test_hermes_variants(tokenizer: Any, body: str, arguments: str) -> None:
    text = f"<tool_call>\n{body}\n</tool_call>"
    parser, deltas = run(tokenizer, text)
    assert not parser.tool_call_parse_error
    call = parser.output.tool_calls[0]
    assert (call.name, call.arguments, call.parsed) == ("f", arguments, json.loads(arguments))
    assert_stream_matches_output(parser, deltas)
    # The last deltas: </tool_call>, the end-of-turn token, the empty tail feed, finish.
    before_close = [p for d in deltas[:-4] for p in d.tool_calls]
    assert before_close == []


def test_double_encoded_arguments_arrive_whole_at_the_close(tokenizer: Any) -> None:
    parser, deltas = run(tokenizer, '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}\n</tool_call>')
    pieces = [p for d in deltas for p in d.tool_calls]
    assert pieces == [ToolCallDelta(0, "call_0", "f", '{"a": [1, 2]}')]


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "f", "arguments": {oops}',  # invalid JSON, announced before it failed
        '{"name": "f", "arguments": [1, 2]}',  # arguments not an object
        '{"name": "", "arguments": {}}',  # empty name
        '{"arguments": {"a": 1}}',  # no name
        '{"name": "f", "arguments": "not json"}',
        '{"name": "f", "arguments": {"a": 1}} trailing',
        '{"name": "f", "arguments": {"a": 1}, "name": "g"}',  # streamed name is not the final one
        "",
        "plain words",
    ],
)
def test_hermes_malformed_blocks_become_content(tokenizer: Any, body: str) -> None:
    text = f"Sure.\n<tool_call>\n{body}\n</tool_call>\nafter"
    parser, deltas = run(tokenizer, text)
    assert parser.tool_call_parse_error and parser.output.tool_calls == ()
    assert parser.output.content == f"Sure.\n<tool_call>\n{body}\n</tool_call>\nafter"
    assert "".join(d.content for d in deltas) == parser.output.content


def test_a_good_call_after_a_malformed_one_is_the_replys_first(tokenizer: Any) -> None:
    text = (
        '<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {"b": 2}}\n</tool_call>'
    )
    parser, deltas = run(tokenizer, text)
    _, _, calls = streamed(deltas)
    # Nothing of the malformed call was streamed: the good call is index 0, streamed as the reply has it.
    assert calls == {0: ("call_0", "g", '{"b": 2}')}
    assert [(c.id, c.name) for c in parser.output.tool_calls] == [("call_0", "g")]
    assert parser.tool_call_parse_error


def test_truncated_call_is_flagged_raw_content(tokenizer: Any) -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    ids = tokenizer.encode(text).tolist()  # no end-of-turn: max_tokens cut it
    parser = OutputParser(tokenizer, tool_call_id=lambda i: f"call_{i}")
    deltas = [parser.feed([tid]) for tid in ids] + [parser.finish()]
    assert parser.tool_call_parse_error and parser.output.tool_calls == ()
    assert parser.output.content == "".join(d.content for d in deltas) == text


# -- Qwen3-Coder XML -----------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "schema", "expected"),
    [
        ("Paris", {"type": "string"}, "Paris"),
        ("42", {"type": "string"}, "42"),
        ("42", {"type": "integer"}, 42),
        (" 42 ", {"type": "integer"}, 42),
        ("4.5", {"type": "integer"}, "4.5"),
        ("many", {"type": "integer"}, "many"),
        ("4.5", {"type": "number"}, 4.5),
        ("4", {"type": "number"}, 4),
        ("1e400", {"type": "number"}, "1e400"),
        ("NaN", {"type": "number"}, "NaN"),
        ("True", {"type": "boolean"}, True),
        ("false", {"type": "boolean"}, False),
        ("yes", {"type": "boolean"}, "yes"),
        ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
        ("{broken", {"type": "object"}, "{broken"),
        ("[1, 2]", {"type": "array"}, [1, 2]),
        ("[1, 2]", {"type": "object"}, "[1, 2]"),
        ("null", {"type": "integer"}, None),
        ("NULL", {"type": "string"}, None),
        ("3", {"type": ["integer", "null"]}, 3),
        ("3", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 3),
        ("x", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, "x"),
        ("7", {"type": "int"}, 7),
        ("7", {}, "7"),
        ("7", None, "7"),
    ],
)
def test_convert_parameter(value: str, schema: Any, expected: Any) -> None:
    result = convert_parameter(value, schema)
    assert result == expected and type(result) is type(expected)


def test_xml_pieces_char_by_char() -> None:
    block = XmlBlockParser(tool_schemas(TOOLS))
    text = (
        "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n"
    )
    pieces = feed_chars(block, text)
    assert pieces[0] == CallPiece(0, "get_weather")
    args = [p.arguments for p in pieces[1:]]
    # The string value streams as it grows, held back only by the length of its end tag.
    assert args[0] == '{"city": "' and "".join(args[1:-3]) == "Paris" and args[-3] == '"'
    assert args[-2:] == [', "days": 2', "}"]
    result = block.close()
    assert result is not None and result.calls[0].arguments == '{"city": "Paris", "days": 2}'


def test_xml_exact_pieces_for_typed_parameters() -> None:
    block = XmlBlockParser(tool_schemas(TOOLS))
    text = (
        "<function=get_weather>\n<parameter=days>\n3\n</parameter>\n"
        "<parameter=metric>\ntrue\n</parameter>\n</function>"
    )
    assert block.feed(text) == [
        CallPiece(0, "get_weather"),
        CallPiece(0, None, '{"days": 3'),
        CallPiece(0, None, ', "metric": true'),
        CallPiece(0, None, "}"),
    ]


def test_xml_call_converted_by_schema(tokenizer: Any) -> None:
    text = "I'll check.\n" + xml_call(
        "get_weather",
        city="São Paulo 🌧",
        days="3",
        scale="1.5",
        metric="False",
        options='{"units": "C", "x": [1, 2]}',
        hours="[6, 12]",
        note="null",
        extra="not in the schema",
    )
    parser, deltas = run(tokenizer, text, tools=TOOLS, tool_call_format="qwen3_coder")
    assert not parser.tool_call_parse_error and parser.output.content == "I'll check."
    call = parser.output.tool_calls[0]
    assert call.name == "get_weather" and call.parsed == {
        "city": "São Paulo 🌧",
        "days": 3,
        "scale": 1.5,
        "metric": False,
        "options": {"units": "C", "x": [1, 2]},
        "hours": [6, 12],
        "note": None,
        "extra": "not in the schema",
    }
    assert json.loads(call.arguments) == call.parsed
    assert_stream_matches_output(parser, deltas)


def test_xml_multiline_value_keeps_inner_newlines(tokenizer: Any) -> None:
    code = 'def f():\n    return "</param>"\n\n'
    text = f"<tool_call>\n<function=write>\n<parameter=content>\n{code}\n</parameter>\n</function>\n</tool_call>"
    parser, deltas = run(tokenizer, text, tool_call_format="qwen3_coder")
    assert parser.output.tool_calls[0].parsed == {"content": code}
    assert_stream_matches_output(parser, deltas)


def test_xml_several_calls_and_empty_arguments(tokenizer: Any) -> None:
    text = (
        "<think>\nplan\n</think>\n\n"
        + xml_call("get_weather", city="Oslo")
        + "\n<tool_call>\n<function=now>\n</function>\n<function=get_weather>\n<parameter=days>\n1\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    parser, deltas = run(tokenizer, text, tools=TOOLS, tool_call_format="qwen3_coder")
    out = parser.output
    assert out.reasoning == "plan" and out.content == ""
    assert [(c.id, c.name, c.arguments) for c in out.tool_calls] == [
        ("call_0", "get_weather", '{"city": "Oslo"}'),
        ("call_1", "now", "{}"),
        ("call_2", "get_weather", '{"days": 1}'),
    ]
    assert_stream_matches_output(parser, deltas)


@pytest.mark.parametrize(
    "body",
    [
        "<function=f>\n<parameter=a>\n1\n</function>",  # parameter never closed
        "<function=f>\n<parameter=a>\n1\n</parameter>\n",  # function never closed
        "<function=f>\nstray text\n</function>",
        "stray <function=f>\n</function>",
        "<function=>\n</function>",
        "<function=f>\n</function>\ntrailing",
        "",
        '{"name": "f", "arguments": {}}',  # the JSON format is not this one
    ],
)
def test_xml_malformed_blocks_become_content(tokenizer: Any, body: str) -> None:
    text = f"Sure.\n<tool_call>\n{body}\n</tool_call>"
    parser, deltas = run(tokenizer, text, tool_call_format="qwen3_coder")
    assert parser.tool_call_parse_error and parser.output.tool_calls == ()
    assert parser.output.content == "".join(d.content for d in deltas) == text


def test_xml_string_that_could_be_null_waits() -> None:
    block = XmlBlockParser({})
    assert [p.arguments for p in block.feed("<function=f>\n<parameter=a>\nNul")] == [""]
    assert [p.arguments for p in block.feed("l\n</parameter>\n</function>")] == ['{"a": null', "}"]
    block = XmlBlockParser({})
    block.feed("<function=f>\n<parameter=a>\nNuance of the text")
    result = [p.arguments for p in block.feed("\n</parameter>\n</function>")]
    assert result[-1] == "}" and block.close() is not None


# -- chunking invariance -------------------------------------------------------

HERMES_TEXT = (
    "<think>\nLet me think … 🤔\n</think>\n\nChecking two cities.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich \\"old\\" town", "n": [1, {"k": "}]"}]}}\n'
    "</tool_call>\n"
    '<tool_call>\n{"name": "search", "arguments": "{\\"q\\": \\"naïve\\"}"}\n</tool_call>\n'
    '<tool_call>\n{"name": "bad", "arguments": {"x": }\n</tool_call>\nDone ✓'
)
XML_TEXT = (
    "<think>\nplanning\n</think>\n\nOn it.\n"
    + xml_call("get_weather", city="Zürich\n2nd line 🌞", days="4", metric="true")
    + "\n"
    + xml_call("get_weather", options='{"deep": {"x": [1, "ü"]}}', note="null")
    + "\n<tool_call>\n<function=broken>\n<parameter=a>\n1\n</tool_call>\ntail"
)


@settings(max_examples=50, deadline=None)
@given(sizes=st.lists(st.integers(min_value=1, max_value=9), min_size=1, max_size=120), xml=st.booleans())
def test_any_chunking_gives_the_same_result(tokenizer: Any, sizes: list[int], xml: bool) -> None:
    kwargs: dict[str, Any] = {"tools": TOOLS, "tool_call_format": "qwen3_coder"} if xml else {}
    text = XML_TEXT if xml else HERMES_TEXT
    whole, whole_deltas = run(tokenizer, text, sizes=[100_000], **kwargs)
    parts, part_deltas = run(tokenizer, text, sizes=sizes, **kwargs)
    assert whole.output == parts.output and whole.tool_call_parse_error and parts.tool_call_parse_error
    assert [c.parsed for c in whole.output.tool_calls] == [c.parsed for c in parts.output.tool_calls]
    assert streamed(whole_deltas) == streamed(part_deltas)
    assert_stream_matches_output(parts, part_deltas)
    assert len(parts.output.tool_calls) == 2


@settings(max_examples=80, deadline=None)
@given(data=st.data(), xml=st.booleans())
def test_block_parsers_accept_any_text_fragments(data: Any, xml: bool) -> None:
    if xml:
        text = (
            "\n<function=get_weather>\n<parameter=city>\nA \"q\" \\ é\n\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n"
        )
    else:
        text = '\n{"name": "get_weather", "arguments": {"city": "A \\"q\\" \\\\ é", "s": "\\u00e9}"}}\n'
    cuts = sorted(data.draw(st.sets(st.integers(min_value=1, max_value=len(text) - 1), max_size=30)))
    fragments = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    block: HermesBlockParser | XmlBlockParser = XmlBlockParser(tool_schemas(TOOLS)) if xml else HermesBlockParser()
    pieces = [p for fragment in fragments for p in block.feed(fragment)]
    result = block.close()
    assert result is not None
    pieces += result.pieces
    assert pieces[0].name == "get_weather" and all(p.name is None for p in pieces[1:])
    assert "".join(p.arguments for p in pieces) == result.calls[0].arguments
    assert json.loads(result.calls[0].arguments) == result.calls[0].parsed


# -- options -------------------------------------------------------------------


def test_reasoning_format_none_keeps_think_tags_as_content(tokenizer: Any) -> None:
    parser, deltas = run(tokenizer, "<think>\nhmm\n</think>\n\nanswer", reasoning_format="none", reasoning_open=True)
    assert parser.output.reasoning == "" and parser.output.content == "<think>\nhmm\n</think>\n\nanswer"
    assert_stream_matches_output(parser, deltas)


def test_unknown_formats_are_refused(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="tool_call_format"):
        OutputParser(tokenizer, tool_call_id=str, tool_call_format="mistral")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reasoning_format"):
        OutputParser(tokenizer, tool_call_id=str, reasoning_format="deepseek")  # type: ignore[arg-type]


class _FakeTokenizer:
    def __init__(self, template: Any) -> None:
        self.hf = type("HF", (), {"chat_template": template})()


def test_default_tool_call_format(tokenizer: Any) -> None:
    assert default_tool_call_format(tokenizer) == "qwen3"
    coder = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    assert default_tool_call_format(_FakeTokenizer(coder)) == "qwen3_coder"
    assert default_tool_call_format(_FakeTokenizer({"default": "x", "tool_use": coder})) == "qwen3_coder"
    assert default_tool_call_format(_FakeTokenizer(None)) == "qwen3"


def test_tool_schemas_tolerates_odd_tools() -> None:
    schemas = tool_schemas([WEATHER, {"name": "flat", "input_schema": {"properties": {"a": {}}}}, {"x": 1}])
    assert set(schemas) == {"get_weather", "flat"} and schemas["flat"] == {"a": {}}
