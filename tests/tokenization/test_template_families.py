"""Template-generic TITO: Qwen3, Gemma 3, Llama 3.1, GLM-4.5 and DeepSeek-V3.1 templates, and the fallback.

For every family, a multi-turn conversation is built turn by turn the TITO way (the previous ids,
the reply's sampled ids ending in the family's end-of-turn token, then the fragment derived from the
template) and compared, at every turn, with a fresh render of the whole conversation. The family
tokenizers are the Qwen BPE plus each family's control tokens (``_families``).
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from _families import family_tokenizer

from actorproxy.core.records import Step
from actorproxy.core.template_probe import probe_template
from actorproxy.core.tito import Continue, FragmentError, Fresh, OpenSegment, plan_turn, render_fragment
from actorproxy.tokenization.tokenizer import ChatTokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]


def _call(i: int, path: str) -> dict[str, Any]:
    call = {"id": f"c{i}", "type": "function", "function": {"name": "read_file", "arguments": {"path": path}}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


TOOL_CHAT: list[dict[str, Any]] = [
    {"role": "system", "content": "You fix bugs."},
    {"role": "user", "content": "Why does main.py crash? ☕"},
    _call(0, "main.py"),
    {"role": "tool", "tool_call_id": "c0", "content": "import sys\nprint(sys.argv[1])"},
    _call(1, "README.md"),
    {"role": "tool", "tool_call_id": "c1", "content": "Run: python main.py NAME"},
    {"role": "assistant", "content": "It needs an argument:\n\n    python main.py NAME"},
    {"role": "user", "content": "Thanks! And tests?"},
    {"role": "assistant", "content": "None yet."},
    {"role": "user", "content": "Add one."},
]
PLAIN_CHAT: list[dict[str, Any]] = [
    {"role": "user", "content": "Bonjour ! Ça va ?"},
    {"role": "assistant", "content": "Oui, merci."},
    {"role": "user", "content": "Count to three."},
    {"role": "assistant", "content": "1, 2, 3"},
    {"role": "user", "content": "  Again, with spaces.  "},
    {"role": "assistant", "content": "1 2 3"},
    {"role": "user", "content": "Done."},
]
FAMILIES = ["qwen3", "gemma3", "llama3", "glm45", "deepseek_v31"]
CHATS = {
    "qwen3": [(TOOL_CHAT, TOOLS), (PLAIN_CHAT, None)],
    "gemma3": [(PLAIN_CHAT, None), ([{"role": "system", "content": "Be brief."}, *PLAIN_CHAT], None)],
    "llama3": [(TOOL_CHAT, TOOLS), (PLAIN_CHAT, None)],
    "glm45": [(TOOL_CHAT, TOOLS), (PLAIN_CHAT, None)],
    "deepseek_v31": [(TOOL_CHAT, TOOLS), (PLAIN_CHAT, None)],
}
TURN_ENDS = {
    "qwen3": {"<|im_end|>"},
    "gemma3": {"<end_of_turn>"},
    "llama3": {"<|eot_id|>"},
    "glm45": {"<|user|>", "<|observation|>"},
    "deepseek_v31": {"<｜end▁of▁sentence｜>"},
}


def _step(index: int, fragment: array[int], sampled: list[int]) -> Step:
    return Step(
        index=index, session_id="s", segment_index=0, turn_id=None, instance_id=None, new_messages=[],
        message_count=0, prompt_len=0, fragment_ids=fragment, max_new_tokens=1, output_ids=array("i", sampled),
    )  # fmt: skip


def _tito_turns(tok: ChatTokenizer, messages: list[dict[str, Any]], tools: Any) -> list[tuple[str, bool]]:
    """Build ``messages`` turn by turn the TITO way; at each turn, (sampled reply text, TITO == fresh)."""
    points = [i for i, m in enumerate(messages) if m["role"] == "assistant"] + [len(messages)]
    prompt = tok.render(messages[: points[0]], tools=tools)
    seg = OpenSegment(index=0, start_reason="session_start", tools_key="")
    fragment_ids = tok.encode(prompt)
    results = []
    for n, (i, j) in enumerate(zip(points, points[1:], strict=False)):
        full = tok.render(messages[:j], tools=tools)
        # What the model samples: its reply as the template writes it, then the token that ends the turn.
        after = render_fragment(tok, messages[i + 1 : j], tools=tools, closed_by_eot=False, enable_thinking=None)
        reply = full[len(prompt) : len(full) - len(after)]
        sampled = [*tok.encode(reply), tok.encode(after)[0]]
        seg.add_generation(_step(n, fragment_ids, sampled), tok.turn_end_ids)
        assert seg.closed_by_eot and seg.closed_by == sampled[-1]
        fragment_ids = tok.encode(render_fragment(
            tok, messages[i + 1 : j], tools=tools, closed_by_eot=True, closed_by=seg.closed_by, enable_thinking=None
        ))  # fmt: skip
        results.append((reply, list(seg.context_ids) + list(fragment_ids) == list(tok.encode(full))))
        prompt = full
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_turn_end_tokens_come_from_the_template(family: str) -> None:
    tok = family_tokenizer(family)
    assert {tok.token_text(i) for i in tok.turn_end_ids} == TURN_ENDS[family]
    assert tok.turn_end_ids <= set(tok.stop_token_ids), "the engine must stop on every turn-end token"
    assert tok.token_text(tok.eot_token_id) in TURN_ENDS[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_tito_equals_a_fresh_render_at_every_turn(family: str) -> None:
    tok = family_tokenizer(family)
    probe = probe_template(tok)
    assert probe.append_only, probe.reason
    assert probe.checked >= 4
    for messages, tools in CHATS[family]:
        turns = _tito_turns(tok, messages, tools)
        assert len(turns) == sum(m["role"] == "assistant" for m in messages)
        assert all(equal for _, equal in turns), [reply for reply, equal in turns if not equal]


def test_each_family_writes_its_own_replies() -> None:
    """The sampled replies above are each family's own format (the test is not ChatML four times)."""
    replies = {f: [r for r, _ in _tito_turns(family_tokenizer(f), *CHATS[f][0])] for f in FAMILIES}
    assert replies["qwen3"][0] == '<tool_call>\n{"name": "read_file", "arguments": {"path": "main.py"}}\n</tool_call>'
    assert replies["llama3"][0] == '{"name": "read_file", "parameters": {"path": "main.py"}}'
    assert replies["glm45"][0] == (
        "\n<think></think>\n<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>main.py</arg_value>\n</tool_call>"
    )
    assert replies["gemma3"][0] == "Oui, merci."
    assert replies["deepseek_v31"][0] == (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>read_file<｜tool▁sep｜>{"path": "main.py"}<｜tool▁call▁end｜>'
        "<｜tool▁calls▁end｜>"
    )


def test_glm_reply_closed_by_the_wrong_header_is_a_tito_failure() -> None:
    """GLM-4.5 gives the turn back with <|observation|> before tool results: a <|user|> there cannot continue."""
    tok = family_tokenizer("glm45")
    user = tok.encode("<|user|>")[0]
    tool = [{"role": "tool", "tool_call_id": "c0", "content": "ok"}]
    with pytest.raises(FragmentError, match="<\\|user\\|>"):
        render_fragment(tok, tool, tools=TOOLS, closed_by_eot=True, closed_by=user, enable_thinking=None)
    observation = tok.encode("<|observation|>")[0]
    text = render_fragment(tok, tool, tools=TOOLS, closed_by_eot=True, closed_by=observation, enable_thinking=None)
    assert text == "\n<tool_response>\nok\n</tool_response><|assistant|>"


def test_a_template_that_moves_earlier_text_falls_back_to_whole_renders() -> None:
    """Mistral v0.3 writes the tool list before the LAST user message: detected once, then every turn is fresh."""
    tok = family_tokenizer("mistral")
    probe = probe_template(tok)
    assert not probe.append_only
    assert "probe conversation" in probe.reason
    # What the probe found is real: one TITO turn of a plain chat already differs from the fresh render.
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    full = tok.render(messages, tools=TOOLS)
    assert not full.startswith(tok.render(messages[:1], tools=TOOLS))
    seg = OpenSegment(index=0, start_reason="session_start", tools_key="")
    seg.steps.append(_step(0, array("i"), []))
    seg.account_messages(messages[:2])
    assert plan_turn(seg, messages, "", append_only=True) == Continue(messages[2:])
    assert plan_turn(seg, messages, "", append_only=False) == Fresh("template_not_append_only")


def test_probe_is_cached_per_template() -> None:
    tok = family_tokenizer("llama3")
    assert probe_template(tok) is probe_template(tok)


@pytest.mark.parametrize("family", ["glm45", "llama3"])
def test_templates_that_walk_the_arguments_get_them_as_an_object(family: str) -> None:
    """Agents send arguments as JSON text; GLM-4.5 and Llama 3.1 iterate them, so they are decoded first."""
    tok = family_tokenizer(family)
    function = {"name": "read_file", "arguments": '{"path": "main.py"}'}
    as_text = [*TOOL_CHAT[:2], {**TOOL_CHAT[2], "tool_calls": [{"id": "c0", "type": "function", "function": function}]}]
    assert tok.render(as_text, tools=TOOLS) == tok.render(TOOL_CHAT[:3], tools=TOOLS)


def test_qwen3_renders_argument_text_as_sent() -> None:
    tok = family_tokenizer("qwen3")
    call = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": '{"b":1,  "a":2}'}}
    text = tok.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": [call]}])
    assert '"arguments": {"b":1,  "a":2}}' in text


def test_a_harmony_vocabulary_ends_turns_with_return_and_call_not_end() -> None:
    """GPT-OSS: <|end|> closes the analysis message inside a turn, so it must never stop the engine."""
    tok = family_tokenizer("gpt_oss")
    assert {tok.token_text(i) for i in tok.turn_end_ids} == {"<|return|>", "<|call|>"}
    assert tok.token_text(tok.eot_token_id) == "<|return|>"
    assert tok.encode("<|end|>")[0] not in tok.stop_token_ids


@pytest.mark.parametrize("family", ["qwen3", "llama3", "glm45"])
def test_assistant_spans_end_at_each_family_s_turn_end(family: str) -> None:
    """last_step mode and verification locate replies by the template's turn-end tokens (GLM: two of them)."""
    from actorproxy.core.spans import render_with_spans

    tok = family_tokenizer(family)
    rendered = render_with_spans(tok, TOOL_CHAT, tools=TOOLS)
    ends = {tok.token_text(i) for i in tok.turn_end_ids}
    assert len(rendered.spans) == sum(m["role"] == "assistant" for m in TOOL_CHAT)
    for span in rendered.spans:
        assert tok.token_text(rendered.ids[span.end - 1]) in ends
    texts = [tok.decode(rendered.ids[s.start : s.end]) for s in rendered.spans]
    assert texts[-1].startswith("None yet.")
