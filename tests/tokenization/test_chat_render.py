"""The chat template called directly (``tokenization/chat_render.py``) renders what transformers renders.

Every family's template and every OpenAI conversation of the trace corpus, with and
without the generation prompt, thinking on and off: the text is the same, character
for character, as ``apply_chat_template``'s. A template the compiled path would
render differently is left to transformers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _families import FAMILIES, family_tokenizer

from actorproxy.tokenization.chat_render import CompiledTemplate, compile_template
from actorproxy.tokenization.tokenizer import ChatTokenizer

TRACES = Path(__file__).parents[1] / "traces"


def _conversations() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    found = []
    for file in sorted(TRACES.glob("*.json")):
        for turn in json.loads(file.read_text(encoding="utf-8"))["turns"]:
            body = turn.get("body")
            if isinstance(body, dict) and turn.get("path", "").endswith("/chat/completions"):
                found.append((body["messages"], body.get("tools")))
    return found


CONVERSATIONS = _conversations()


def _transformers(tok: ChatTokenizer, messages: list[dict[str, Any]], tools: Any, **kwargs: Any) -> str | type:
    compiled, tok._compiled = tok._compiled, None  # what render() does without the compiled template
    try:
        return tok.render(messages, tools=tools, **kwargs)
    except Exception as exc:
        return type(exc)
    finally:
        tok._compiled = compiled


def _direct(tok: ChatTokenizer, messages: list[dict[str, Any]], tools: Any, **kwargs: Any) -> str | type:
    try:
        return tok.render(messages, tools=tools, **kwargs)
    except Exception as exc:
        return type(exc)


def test_the_corpus_has_chat_conversations() -> None:
    assert len(CONVERSATIONS) >= 20
    assert any(tools for _, tools in CONVERSATIONS)


@pytest.mark.parametrize("family", ["qwen3", *FAMILIES])
def test_every_family_renders_the_corpus_as_transformers_does(family: str) -> None:
    tok = family_tokenizer(family)
    assert tok._compiled is not None  # the direct path is the one in use
    for messages, tools in CONVERSATIONS:
        for prompt in (True, False):
            for thinking in (None, False):
                expected = _transformers(tok, messages, tools, add_generation_prompt=prompt, enable_thinking=thinking)
                assert _direct(tok, messages, tools, add_generation_prompt=prompt,
                               enable_thinking=thinking) == expected, (family, messages)


def test_only_the_shipped_template_runs_outside_the_sandbox() -> None:
    import jinja2.sandbox

    qwen3 = family_tokenizer("qwen3")._compiled
    gemma = family_tokenizer("gemma3")._compiled
    assert qwen3 is not None and gemma is not None
    assert not isinstance(qwen3._template.environment, jinja2.sandbox.SandboxedEnvironment)
    assert isinstance(gemma._template.environment, jinja2.sandbox.SandboxedEnvironment)
    # The sandbox still refuses what transformers' refuses.
    escape = CompiledTemplate("{{ messages.__class__.__mro__ }}", {}, trusted=False)
    with pytest.raises(jinja2.exceptions.SecurityError):
        escape.render([], None, False, {})


def test_a_template_that_renders_differently_is_left_to_transformers() -> None:
    def reference(messages: Any, tools: Any, prompt: bool, kwargs: Any) -> str:
        return "something else"

    assert compile_template("{{ messages | length }}", {}, reference) is None
    assert compile_template("{% generation %}x{% endgeneration %}", {}, reference) is None
    assert compile_template("{{ broken", {}, reference) is None


def test_none_values_are_dropped_and_reasoning_is_aliased_as_transformers_does(tokenizer: ChatTokenizer) -> None:
    template = "{% for m in messages %}{{ m | tojson }}\n{% endfor %}"
    compiled = CompiledTemplate(template, {}, trusted=False)
    messages = [{"role": "assistant", "content": None, "reasoning": "r"},
                {"role": "user", "content": "x", "name": None}]
    hf = tokenizer.hf
    expected = hf.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert compiled.render(messages, None, False, {}) == expected


@pytest.mark.parametrize("trusted", [True, False])
def test_a_messages_fields_read_as_transformers_reads_them(tokenizer: ChatTokenizer, trusted: bool) -> None:
    """``message.x`` is the item ``x`` (underscore names too); dict methods stay methods; a missing field is undefined.

    The environments read a message's fields as items at once (``chat_render._field``):
    the same values as Jinja's attribute-then-item lookup on transformers' plain dicts.
    """
    template = (
        "{% for m in messages %}{{ m.role }}|{{ m.content }}|{{ m._private }}|{{ m.items is callable }}|"
        "{{ m.get('role') }}|{{ m.missing is defined }}|{{ m.missing | default('none') }}|"
        "{{ m.name is defined }}|{{ m.keys is callable }}\n{% endfor %}"
    )
    messages = [{"role": "user", "content": "hi", "_private": "p", "items": "not the method"},
                {"role": "assistant", "content": "yo", "name": None}]
    expected = tokenizer.hf.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert CompiledTemplate(template, {}, trusted=trusted).render(messages, None, False, {}) == expected
