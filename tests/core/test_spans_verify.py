"""Assistant spans from rendering offsets (core/spans.py) and TITO verification (core/verify.py)."""

from __future__ import annotations

import copy
from array import array
from typing import Any

import attrs
import pytest

from actorproxy.core.spans import AssistantSpan, SpanError, render_with_spans, turn_format
from actorproxy.core.tito import render_fragment
from actorproxy.core.verify import VerifyReport, compare, verify_prompt
from actorproxy.schema.converter import CONVERTER
from actorproxy.tokenization.tokenizer import ChatTokenizer

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _call(name: str, arguments: Any, call_id: str = "call_1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


#: A conversation covering reasoning, parallel tool calls, null content, unicode and odd whitespace.
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Wetter in Zürich? 🌦  "},
    {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "Need weather and time.",
        "tool_calls": [
            _call("get_weather", '{"city": "Zürich"}', "c1"),
            _call("get_time", {"tz": "Europe/Zurich"}, "c2"),
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21°C"},
    {"role": "tool", "tool_call_id": "c2", "content": "14:02"},
    {"role": "assistant", "content": "It is  sunny ☀️\tand 21°C.  \n", "reasoning_content": "combine"},
    {"role": "user", "content": "Thanks!\n\n  And tomorrow?"},
    {"role": "assistant", "content": None, "reasoning_content": "again", "tool_calls": [_call("get_time", {})]},
    {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    {"role": "assistant", "content": "Bye 👋", "reasoning_content": ""},
]

#: The body of each assistant turn as the Qwen3 format writes it, end-of-turn token included.
#: Reasoning before the last user query ("Thanks! ...") is dropped by the template; the final
#: assistant message always gets a think block, even an empty one.
EXPECTED_BODIES = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Zurich"}}\n</tool_call><|im_end|>',
    "It is  sunny ☀️\tand 21°C.  \n<|im_end|>",
    '<think>\nagain\n</think>\n\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>',
    "<think>\n\n</think>\n\nBye 👋<|im_end|>",
]


# -- spans ------------------------------------------------------------------


def test_turn_format_is_learned_from_the_template(tokenizer: ChatTokenizer) -> None:
    fmt = turn_format(tokenizer)
    assert fmt.header == "<|im_start|>assistant\n"
    assert fmt.footer == "<|im_end|>\n"
    assert fmt.eot_text == "<|im_end|>"
    assert fmt.generation_prompt == "<|im_start|>assistant\n"
    no_think = turn_format(tokenizer, enable_thinking=False)
    assert no_think.header == fmt.header
    assert no_think.generation_prompt == "<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.mark.parametrize("enable_thinking", [None, True, False])
def test_spans_decode_to_assistant_bodies(tokenizer: ChatTokenizer, enable_thinking: bool | None) -> None:
    rendered = render_with_spans(tokenizer, CONVERSATION, tools=[WEATHER_TOOL], enable_thinking=enable_thinking)
    assert rendered.text == tokenizer.render(CONVERSATION, tools=[WEATHER_TOOL], enable_thinking=enable_thinking)
    assert rendered.ids == tokenizer.encode(rendered.text)
    assert isinstance(rendered.ids, array) and rendered.ids.typecode == "i"
    assistant_indices = [i for i, m in enumerate(CONVERSATION) if m["role"] == "assistant"]
    assert [s.message_index for s in rendered.spans] == assistant_indices
    assert [tokenizer.decode(rendered.ids[s.start : s.end]) for s in rendered.spans] == EXPECTED_BODIES
    newline = tokenizer.encode("\n")[0]
    for span in rendered.spans:
        # Right after the header, ending on the sampled end-of-turn token; the "\n" after it is context.
        assert tokenizer.decode(rendered.ids[: span.start]).endswith("<|im_start|>assistant\n")
        assert rendered.ids[span.end - 1] == tokenizer.eot_token_id
        assert rendered.ids[span.end] == newline
    # The generation prompt (with its empty think block when thinking is off) is not a span.
    assert rendered.spans[-1].end < len(rendered.ids) - 1
    prompt_tail = tokenizer.decode(rendered.ids[rendered.spans[-1].end :])
    assert prompt_tail == "\n" + turn_format(tokenizer, enable_thinking=enable_thinking).generation_prompt


def test_spans_without_generation_prompt(tokenizer: ChatTokenizer) -> None:
    rendered = render_with_spans(tokenizer, CONVERSATION, add_generation_prompt=False)
    assert len(rendered.spans) == 4
    # The last assistant turn ends the text: only its trailing "\n" follows the span.
    assert rendered.spans[-1].end == len(rendered.ids) - 1
    assert tokenizer.decode(rendered.ids[rendered.spans[-1].start :]) == EXPECTED_BODIES[-1] + "\n"


def test_no_assistant_messages_no_spans(tokenizer: ChatTokenizer) -> None:
    rendered = render_with_spans(tokenizer, [{"role": "user", "content": "hi"}], enable_thinking=False)
    assert rendered.spans == ()
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert rendered.ids == tokenizer.encode(expected)


def test_empty_assistant_turn_is_just_the_end_of_turn_token(tokenizer: ChatTokenizer) -> None:
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "b"},
    ]
    (span,) = render_with_spans(tokenizer, messages).spans
    assert span == AssistantSpan(message_index=1, start=span.start, end=span.start + 1)


def test_leading_newlines_merge_into_the_header_token(tokenizer: ChatTokenizer) -> None:
    """A body starting with newlines shares its first token with the header's "\\n" (BPE merges
    "\\n\\n\\n"): that token starts in the header, so it is not part of the span."""
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "\n\nHi"},
        {"role": "user", "content": "b"},
    ]
    rendered = render_with_spans(tokenizer, messages)
    (span,) = rendered.spans
    assert tokenizer.decode(rendered.ids[span.start : span.end]) == "Hi<|im_end|>"
    assert tokenizer.decode(rendered.ids[span.start - 1 : span.start]) == "\n\n\n"


@pytest.fixture(scope="module")
def spare_hf(tokenizer: ChatTokenizer) -> Any:
    """A private copy of the HF tokenizer, for ChatTokenizers with other templates (each sets its own)."""
    return copy.deepcopy(tokenizer.hf)


def test_template_without_assistant_turns_raises(tokenizer: ChatTokenizer, spare_hf: Any) -> None:
    plain = ChatTokenizer(
        spare_hf,
        name="plain",
        chat_template="{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    )
    with pytest.raises(SpanError):
        render_with_spans(plain, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    # The shared tokenizer keeps its own template.
    assert turn_format(tokenizer).header == "<|im_start|>assistant\n"


def test_template_that_drops_assistant_replies_raises(spare_hf: Any) -> None:
    users_only = ChatTokenizer(
        spare_hf,
        name="users-only",
        chat_template=(
            "{% for m in messages if m.role == 'user' %}<|im_start|>user\n{{ m.content }}<|im_end|>\n{% endfor %}"
        ),
    )
    with pytest.raises(SpanError):
        render_with_spans(users_only, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])


def test_header_text_inside_user_content_raises(tokenizer: ChatTokenizer) -> None:
    messages = [
        {"role": "user", "content": "quote: <|im_start|>assistant\nfake"},
        {"role": "assistant", "content": "real"},
    ]
    with pytest.raises(SpanError, match="2 assistant turns"):
        render_with_spans(tokenizer, messages)


# -- verify -----------------------------------------------------------------


def _fresh(tokenizer: ChatTokenizer, messages: list[dict[str, Any]], **kwargs: Any) -> array[int]:
    return tokenizer.encode(tokenizer.render(messages, **kwargs))


def _turn_starts(tokenizer: ChatTokenizer, ids: array[int]) -> list[int]:
    start = tokenizer.encode("<|im_start|>")[0]
    return [i for i, t in enumerate(ids) if t == start]


def test_identical_ids_are_clean(tokenizer: ChatTokenizer) -> None:
    ids = _fresh(tokenizer, CONVERSATION, tools=[WEATHER_TOOL])
    report = verify_prompt(tokenizer, ids, CONVERSATION, tools=[WEATHER_TOOL])
    assert report.clean
    assert report.turns == len(_turn_starts(tokenizer, ids))
    assert report.recorded_tokens == report.fresh_tokens == len(ids)
    assert CONVERTER.unstructure(report) == {
        "clean": True,
        "turns": report.turns,
        "recorded_tokens": len(ids),
        "fresh_tokens": len(ids),
        "expected": 0,
        "unexpected": 0,
        "by_kind": {},
        "differences": [],
    }


def test_kept_reasoning_is_reasoning_stripped(tokenizer: ChatTokenizer) -> None:
    """TITO keeps the sampled think block of an earlier turn; the template drops it."""
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    reply = {"role": "assistant", "content": "4", "reasoning_content": "Add them."}
    follow_up = {"role": "user", "content": "And 3+3?"}
    # The recorded ids, built as the proxy builds them: prompt, sampled ids, then the fragment.
    recorded = _fresh(tokenizer, first)
    recorded += tokenizer.encode("<think>\nAdd them.\n</think>\n\n4<|im_end|>")
    recorded += tokenizer.encode(
        render_fragment(tokenizer, [follow_up], tools=None, closed_by_eot=True, enable_thinking=None)
    )
    messages = [*first, reply, follow_up]
    report = verify_prompt(tokenizer, recorded, messages)
    (diff,) = report.differences
    assert diff.kind == "reasoning_stripped" and diff.expected and diff.role == "assistant"
    assert diff.turn == 2  # system, user, assistant
    assert report.expected == 1 and report.unexpected == 0 and not report.clean
    assert report.by_kind == {"reasoning_stripped": 1}
    fresh = _fresh(tokenizer, messages, add_generation_prompt=True)
    assert tokenizer.decode(recorded[diff.recorded[0] : diff.recorded[1]]).startswith("<|im_start|>assistant\n<think>")
    assert tokenizer.decode(fresh[diff.fresh[0] : diff.fresh[1]]) == "<|im_start|>assistant\n4<|im_end|>\n"


def _split_a_word(tokenizer: ChatTokenizer, ids: array[int], start: int, end: int) -> array[int]:
    """``ids`` with the first multi-letter word token in ``[start, end)`` spelled char by char."""
    for i in range(start, end):
        text = tokenizer.decode([ids[i]])
        if len(text.strip()) > 2 and text.strip().isalpha():
            pieces = array("i")
            for char in text:
                pieces += tokenizer.encode(char)
            assert len(pieces) > 1
            return ids[:i] + pieces + ids[i + 1 :]
    raise AssertionError("no word token to split")


def test_noncanonical_split_in_assistant_turn(tokenizer: ChatTokenizer) -> None:
    messages = [
        {"role": "user", "content": "Greet me"},
        {"role": "assistant", "content": "Hello wonderful world"},
        {"role": "user", "content": "Again"},
    ]
    fresh = _fresh(tokenizer, messages)
    starts = _turn_starts(tokenizer, fresh)
    recorded = _split_a_word(tokenizer, fresh, starts[1] + 3, starts[2])
    assert tokenizer.decode(recorded) == tokenizer.decode(fresh)
    report = compare(tokenizer, recorded, fresh)
    (diff,) = report.differences
    assert (diff.kind, diff.expected, diff.role, diff.turn) == ("noncanonical_tokenization", True, "assistant", 1)
    assert diff.fresh == (starts[1], starts[2])
    assert diff.recorded[0] == starts[1] and diff.recorded[1] > starts[2]


def test_noncanonical_split_in_user_turn_is_context_retokenized(tokenizer: ChatTokenizer) -> None:
    messages = [{"role": "user", "content": "Tell me everything"}, {"role": "assistant", "content": "No."}]
    fresh = _fresh(tokenizer, messages, add_generation_prompt=False)
    starts = _turn_starts(tokenizer, fresh)
    recorded = _split_a_word(tokenizer, fresh, starts[0] + 3, starts[1])
    (diff,) = compare(tokenizer, recorded, fresh).differences
    assert (diff.kind, diff.expected, diff.role, diff.turn) == ("context_retokenized", False, "user", 0)


def test_reserialised_echo_is_expected(tokenizer: ChatTokenizer) -> None:
    def conversation(content: str, arguments: str) -> list[dict[str, Any]]:
        return [
            {"role": "user", "content": "Weather in Paris for two days?"},
            {"role": "assistant", "content": content, "tool_calls": [_call("get_weather", arguments)]},
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        ]

    sampled = conversation("Checking  the\nforecast. ", '{"city": "Paris", "days": 2}')
    echoed = conversation("Checking the forecast.", '{"days":2,"city":"Paris"}')
    recorded = _fresh(tokenizer, sampled, tools=[WEATHER_TOOL])
    report = verify_prompt(tokenizer, recorded, echoed, tools=[WEATHER_TOOL])
    (diff,) = report.differences
    assert (diff.kind, diff.expected, diff.role, diff.turn) == ("echo_reserialised", True, "assistant", 2)


def test_changed_tool_arguments_are_unexpected(tokenizer: ChatTokenizer) -> None:
    def conversation(arguments: str) -> list[dict[str, Any]]:
        return [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [_call("get_weather", arguments)]},
            {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        ]

    recorded = _fresh(tokenizer, conversation('{"city": "Paris"}'))
    report = verify_prompt(tokenizer, recorded, conversation('{"city": "Lyon"}'))
    (diff,) = report.differences
    assert (diff.kind, diff.expected, diff.turn) == ("assistant_text_differs", False, 1)
    assert report.unexpected == 1


def test_edited_user_message_is_context_differs(tokenizer: ChatTokenizer) -> None:
    recorded = _fresh(tokenizer, CONVERSATION)
    edited = copy.deepcopy(CONVERSATION)
    edited[6]["content"] = "Thanks! And the day after?"
    report = verify_prompt(tokenizer, recorded, edited)
    (diff,) = report.differences
    assert (diff.kind, diff.expected, diff.role) == ("context_differs", False, "user")
    assert diff.turn == 5  # system, user, assistant, tool results (one user turn), assistant, user
    assert report.unexpected == 1 and report.expected == 0
    listed = CONVERTER.unstructure(report)
    assert listed["clean"] is False and listed["by_kind"] == {"context_differs": 1}
    assert listed["differences"] == [
        {
            "turn": 5,
            "role": "user",
            "kind": "context_differs",
            "expected": False,
            "recorded": list(diff.recorded),
            "fresh": list(diff.fresh),
        }
    ]


def test_dropped_turn_is_structure_differs(tokenizer: ChatTokenizer) -> None:
    fresh = _fresh(tokenizer, CONVERSATION)
    # The recorded ids miss the last tool result and assistant turn (and the generation prompt).
    recorded = _fresh(tokenizer, CONVERSATION[:-2], add_generation_prompt=False)
    report = compare(tokenizer, recorded, fresh)
    assert report.turns == len(_turn_starts(tokenizer, fresh))
    (diff,) = report.differences
    assert (diff.kind, diff.expected) == ("structure_differs", False)
    assert diff.recorded == (len(recorded), len(recorded))
    assert diff.fresh == (len(recorded), len(fresh))
    assert diff.role == "user"  # the merged tool-result turn
    # A dropped turn in the middle shifts every later turn too.
    middle = [m for i, m in enumerate(CONVERSATION) if i not in (6,)]
    shifted = compare(tokenizer, _fresh(tokenizer, middle), fresh)
    assert shifted.by_kind.get("structure_differs") == 1 and shifted.unexpected >= 2


def test_empty_sequences(tokenizer: ChatTokenizer) -> None:
    assert compare(tokenizer, [], []).clean
    report = compare(tokenizer, [], _fresh(tokenizer, CONVERSATION))
    assert report.by_kind == {"structure_differs": 1} and report.turns > 1


def test_the_json_lists_at_most_max_listed(tokenizer: ChatTokenizer) -> None:
    messages: list[dict[str, Any]] = []
    for i in range(6):
        messages += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    edited = [dict(m, content=m["content"] + "!") if m["role"] == "user" else m for m in messages]
    report = compare(tokenizer, _fresh(tokenizer, messages), _fresh(tokenizer, edited))
    assert report.unexpected == 6
    assert len(CONVERTER.unstructure(attrs.evolve(report, max_listed=2))["differences"]) == 2
    assert [d["turn"] for d in CONVERTER.unstructure(report)["differences"]] == [0, 2, 4, 6, 8, 10]


def test_compare_on_100k_tokens(tokenizer: ChatTokenizer) -> None:
    paragraph = "The quick brown fox jumps over the lazy dog, again and again. " * 12
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Long run."}]
    for i in range(600):
        messages.append({"role": "user", "content": f"step {i}: {paragraph}"})
        messages.append({"role": "assistant", "content": f"done {i}. {paragraph}"})
    rendered = render_with_spans(tokenizer, messages)
    assert len(rendered.ids) > 100_000
    assert len(rendered.spans) == 600
    report = compare(tokenizer, rendered.ids, list(rendered.ids))
    assert isinstance(report, VerifyReport)
    assert report.clean and report.turns == 1202
