"""Can this chat template be continued append-only? A probe render at start-up (sans-IO).

TITO extends a segment with the sampled ids of a reply and then the fragment
:func:`~.tito.render_fragment` derives for the new messages (the template's text
after a stand-in reply, minus the sampled end-of-turn token). That equals what a
fresh render of the whole conversation gives when the template is *append-only*:

(a) each turn's prompt is a prefix of the next turn's full render (nothing
    before the reply is rewritten: a tool list that moves to the last user
    message, a date, a counter);
(b) the full render ends with exactly the fragment (what follows a reply does
    not depend on the history);
(c) the fragment begins with one of the template's end-of-turn tokens (the
    boundary lies right after a token the model samples);
(d) tokenizing the three pieces apart gives the ids of the whole.

The reply's own rendering may differ from what was sampled (Qwen3 drops the
reasoning of earlier turns): TITO keeps the sampled ids on purpose, so that is
not checked. :func:`probe_template` runs short conversations, with and without
tools, through (a)-(d). A conversation the template refuses (Gemma 3 has no
tool role) or a fragment it cannot render is skipped, not held against it: the
latter falls back per turn (``tito_failure``). The result is cached per
tokenizer and template.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ..tokenization.tokenizer import ChatTokenizer
from .tito import FragmentError, render_fragment


@attrs.frozen
class TemplateProbe:
    """The verdict of :func:`probe_template`."""

    append_only: bool
    #: Why not (``""`` when append-only).
    reason: str = ""
    #: Continuations compared (skipped ones not counted).
    checked: int = 0
    #: Whether offered tools reach the prompt at all (Gemma 3's template has no place for them).
    renders_tools: bool = True


_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def _function(city: str) -> dict[str, Any]:
    return {"name": "get_weather", "arguments": {"city": city}}


def _call(index: int, city: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": f"call_{index}", "type": "function", "function": _function(city)}],
    }


_WITH_TOOLS: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?"},
    _call(0, "Paris"),
    {"role": "tool", "tool_call_id": "call_0", "content": "18 C, sunny"},
    {"role": "assistant", "content": "Sunny, 18 C."},
    {"role": "user", "content": "And Lyon?"},
    _call(1, "Lyon"),
    {"role": "tool", "tool_call_id": "call_1", "content": "20 C"},
    {"role": "assistant", "content": "20 C in Lyon."},
    {"role": "user", "content": "Thanks."},
]
_PLAIN: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello!"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "How are you?"},
    {"role": "assistant", "content": "Fine, thanks."},
    {"role": "user", "content": "Bye."},
]
_CONVERSATIONS: tuple[tuple[list[dict[str, Any]], list[dict[str, Any]] | None], ...] = (
    (_WITH_TOOLS, _TOOLS),
    (_PLAIN, None),
    (_PLAIN[1:], None),
)

_cache: weakref.WeakKeyDictionary[ChatTokenizer, dict[str, TemplateProbe]] = weakref.WeakKeyDictionary()


def probe_template(tokenizer: ChatTokenizer) -> TemplateProbe:
    """Whether ``tokenizer``'s chat template can be continued append-only (see module docstring)."""
    template = str(getattr(tokenizer.hf, "chat_template", "") or "")
    cache = _cache.setdefault(tokenizer, {})
    found = cache.get(template)
    if found is None:
        found = cache[template] = _probe(tokenizer)
    return found


def cached_probe(tokenizer: ChatTokenizer) -> TemplateProbe | None:
    """:func:`probe_template`'s answer if it is known already (probing renders a few conversations), else ``None``."""
    template = str(getattr(tokenizer.hf, "chat_template", "") or "")
    return _cache.get(tokenizer, {}).get(template)


def _probe(tokenizer: ChatTokenizer) -> TemplateProbe:
    checked = 0
    renders_tools = _renders_tools(tokenizer)
    for messages, tools in _CONVERSATIONS:
        try:
            reason, count = _probe_conversation(tokenizer, messages, tools)
        except _Refused:
            continue
        checked += count
        if reason:
            return TemplateProbe(False, reason, checked, renders_tools)
    return TemplateProbe(True, "", checked, renders_tools)


def _renders_tools(tokenizer: ChatTokenizer) -> bool:
    """Whether a tool offered with a one-message chat changes the prompt (a refusal counts as rendering)."""
    chat = _PLAIN[1:2]
    try:
        return _render(tokenizer, chat, _TOOLS) != _render(tokenizer, chat, None)
    except _Refused:
        return True


class _Refused(Exception):
    """The template does not render this conversation at all."""


def _render(tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], tools: Any) -> str:
    try:
        return tokenizer.render(messages, tools=tools, add_generation_prompt=True)
    except Exception as exc:  # a template may raise anything (jinja, ValueError, TypeError)
        raise _Refused(str(exc)) from exc


def _probe_conversation(
    tokenizer: ChatTokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> tuple[str, int]:
    """The first violation of (a)-(d) in one conversation (``""``: none), and how many were compared."""
    points = [i for i, m in enumerate(messages) if m["role"] == "assistant"] + [len(messages)]
    prompts = [_render(tokenizer, messages[:i], tools) for i in points]
    checked = 0
    for n in range(len(points) - 1):
        (i, prompt), (j, full) = (points[n], prompts[n]), (points[n + 1], prompts[n + 1])
        try:
            fragment = render_fragment(
                tokenizer, messages[i + 1 : j], tools=tools, closed_by_eot=False, enable_thinking=None
            )
        except FragmentError:
            continue  # falls back per turn (tito_failure); says nothing about appending
        checked += 1
        where = f"before message {j} of a probe conversation"
        if not full.startswith(prompt):
            at = next((k for k, (a, b) in enumerate(zip(prompt, full, strict=False)) if a != b), len(full))
            return (
                f"the template rewrites earlier text {where}: {prompt[at : at + 30]!r} became {full[at : at + 30]!r}",
                checked,
            )
        body_end = len(full) - len(fragment)
        if not full.endswith(fragment) or body_end < len(prompt):
            return f"what the template writes after a reply depends on the history ({where})", checked
        first = tokenizer.encode(fragment)[:1]
        if not first or first[0] not in tokenizer.turn_end_ids:
            return f"the template writes {fragment[:20]!r} after a reply, not an end-of-turn token ({where})", checked
        pieces = tokenizer.encode(prompt) + tokenizer.encode(full[len(prompt) : body_end]) + tokenizer.encode(fragment)
        if pieces != tokenizer.encode(full):
            return f"tokens merge across a reply's boundaries ({where})", checked
    return "", checked
