"""The chat template compiled once and called directly: what ``apply_chat_template`` renders, for less CPU.

Every turn renders a template fragment (:func:`~actorproxy.core.tito.render_fragment`).
Through transformers' ``apply_chat_template`` that costs about half again the
template itself (issue 12): each call looks the template up, rebuilds every message
and tool as plain data, aliases reasoning fields and reads the special-token map.
:class:`CompiledTemplate` does the same preparation of the inputs, leanly, and calls
the compiled Jinja template itself:

* the environment is transformers' own (``ImmutableSandboxedEnvironment``, the same
  ``tojson`` filter, ``raise_exception``, ``strftime_now``, ``dict`` and a namespace
  that refuses underscore names), without the ``{% generation %}`` extension (a
  template that uses it is rendered by transformers);
* the template shipped with actorproxy (``trusted``) runs in a plain environment with
  the same filters and globals: the sandbox guards against template code from
  elsewhere, and it is a third of the rendering time;
* messages lose their keys whose value is ``None`` and get their reasoning under
  ``reasoning_content`` and ``thinking`` too, as transformers does;
* the special tokens (``eos_token``...) are passed as variables, as transformers does.

:func:`compile_template` checks the result against ``apply_chat_template`` on a set
of probe conversations and gives ``None`` (keep using transformers) on any
difference, so a tokenizer renders exactly the same text either way.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import jinja2.utils

log = logging.getLogger(__name__)

#: The names transformers copies a message's reasoning to (the first one set wins).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 (the name templates call it with)
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict`` for templates, without attribute access to the type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore-prefixed names (as transformers' does)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's own signature trick: `namespace(self=...)`)
        self, rest = args[0], args[1:]
        fields = dict(*rest, **kwargs)
        for name in fields:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, fields)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}."
            )


class _Environment(jinja2.Environment):
    """Jinja's environment, reading a message's fields (``message.role``) as its items at once (:func:`_field`)."""

    def getattr(self, obj: Any, attribute: str) -> Any:
        if type(obj) is _Message and attribute not in _MESSAGE_ATTRIBUTES:
            return _field(self, obj, attribute)
        return super().getattr(obj, attribute)


class _SandboxedEnvironment(_Environment, jinja2.sandbox.ImmutableSandboxedEnvironment):
    """transformers' sandbox, reading a message's fields as its items at once (:func:`_field`)."""


def _field(env: jinja2.Environment, message: _Message, name: str) -> Any:
    """``message.name`` for a name that is no attribute of a message: the item, else undefined.

    What Jinja's ``getattr`` gives through :meth:`_Message.__getattr__` (the attribute
    lookup fails, the item is read, and the sandbox finds a plain value safe), without
    the failed lookup and the two calls.
    """
    value = _get(message, name, _ABSENT)  # (not ``message[name]``: a missing field, common, raised a KeyError)
    return env.undefined(obj=message, name=name) if value is _ABSENT else value


_get = dict.get
#: What :func:`_field` reads for a field the message does not have.
_ABSENT: Any = object()


def _environment(*, trusted: bool) -> jinja2.Environment:
    options: dict[str, Any] = {"trim_blocks": True, "lstrip_blocks": True, "extensions": [jinja2.ext.loopcontrols]}
    env = _Environment(**options) if trusted else _SandboxedEnvironment(**options)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _Namespace
    return env


class _Message(dict[str, Any]):
    """A message whose keys read as attributes too (``message.role``), as Jinja reads them.

    Jinja tries the attribute before the item, so on a plain dict every
    ``message.role`` raised and caught an ``AttributeError`` first. Underscore
    names and dict methods (``items``...) resolve exactly as on a plain dict.
    """

    def __getattr__(self, name: str) -> Any:
        if name[:1] == "_":
            raise AttributeError(name)
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


#: The names that are attributes of a message (dict's methods, dunders): read by Jinja's own lookup.
_MESSAGE_ATTRIBUTES = frozenset(dir(_Message))


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as transformers hands it to the template: no ``None`` values, reasoning under every name."""
    out = _Message((key, value) for key, value in message.items() if value is not None)
    for key in _REASONING_FIELDS:
        reasoning = out.get(key)
        if reasoning is not None:
            return _Message({"thinking": reasoning, **out, "reasoning_content": reasoning})
    return out


class CompiledTemplate:
    """A chat template and the variables transformers passes it; :meth:`render` is ``apply_chat_template``'s text."""

    def __init__(self, source: str, special_tokens: Mapping[str, Any], *, trusted: bool) -> None:
        self.source = source
        self._template = template = _environment(trusted=trusted).from_string(source)
        self._special = dict(special_tokens)
        #: The template's globals, flattened once: ``Template.render`` copies their ChainMap on every call.
        self._globals = dict(template.globals)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        kwargs: Mapping[str, Any],
    ) -> str:
        variables = {**self._special, **kwargs} if kwargs else self._special
        names = dict(
            messages=[template_message(m) for m in messages],
            tools=[dict(t) for t in tools] if tools else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        # What ``Template.render`` does (its context: the globals, then these names), with the globals flat.
        template = self._template
        env = template.environment
        context = env.context_class(env, {**self._globals, **names}, template.name, template.blocks,
                                    globals=self._globals)
        try:
            return env.concat(template.root_render_func(context))
        except Exception:
            env.handle_exception()


#: Conversations the compiled template must render as transformers does before it is used.
_PROBE_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
_PROBES: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None, dict[str, Any]]] = [
    ([{"role": "user", "content": "Hi"}], None, {}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": None}], None,
     {"enable_thinking": False}),
    ([{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": None, "reasoning_content": "Use the tool.",
       "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
      {"role": "assistant", "content": "<think>\nsunny\n</think>\n\nIt is 21 C."},
      {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}], [_PROBE_TOOL], {}),
    ([{"role": "user", "content": "."}, {"role": "assistant", "content": "x", "reasoning": "r"}], None,
     {"enable_thinking": True}),
]


def compile_template(
    source: Any,
    special_tokens: Mapping[str, Any],
    apply: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None, bool, dict[str, Any]], str],
    *,
    trusted: bool = False,
) -> CompiledTemplate | None:
    """The template compiled for direct rendering, or ``None`` if it might render differently than ``apply``.

    ``apply(messages, tools, add_generation_prompt, kwargs)`` is the reference (transformers).
    """
    if not isinstance(source, str) or "endgeneration" in source:  # {% generation %}: transformers' own extension
        return None
    try:
        compiled = CompiledTemplate(source, special_tokens, trusted=trusted)
    except Exception as exc:
        log.debug("the chat template is rendered by transformers (it does not compile here: %s)", exc)
        return None
    for messages, tools, kwargs in _PROBES:
        for prompt in (True, False):
            try:
                expected: str | type[BaseException] = apply(messages, tools, prompt, kwargs)
            except Exception as exc:
                expected = type(exc)
            try:
                got: str | type[BaseException] = compiled.render(messages, tools, prompt, kwargs)
            except Exception as exc:
                got = type(exc)
            if got != expected:
                log.debug("the chat template is rendered by transformers (a probe renders differently)")
                return None
    return compiled
