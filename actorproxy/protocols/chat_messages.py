"""A chat-completions body's messages checked once per distinct message, not once per turn (issue 12).

An agent sends its whole conversation every turn: at turn 200 of a tool-calling
session that is 400 messages, 249 KB, of which two are new. Parsing and checking
every message again (typing each field, the nesting bound, the ``developer``
role) cost about 3 ms per turn at that length, growing with the history.

So the body is read through the memo every agent body reads through
(:mod:`.memo`): as raw JSON text first (msgspec hands out each top-level
field's and each message's bytes without building them, at C speed), and each
message is looked up in a :class:`MessageMemo`: bytes a turn already sent, byte
for byte, map to the message that was parsed and checked then — the same
:class:`FrozenMessage` object every turn, so later per-turn work
(``MessageCut``, the append-only match) is an identity check too. Only messages
not seen before are parsed (by orjson, as the whole body would be) and checked
against the typed schema itself (``openai_types.ChatMessage``: msgspec reads the
attrs class and runs its validators), so the two paths hold one set of rules.
A message's validity depends on nothing but its own text, so equal bytes mean
equal verdicts: editing an old message changes its bytes and it is checked
again.

Anything the fast path cannot vouch for — a body msgspec cannot read, a part
orjson refuses, a non-ASCII top-level key, nesting past the bound, a message
the schema refuses — is loaded and checked the ordinary way, whole
(``jsonio.load_body``, ``parse_chat_body``), so what is accepted is what was
accepted before, and every error is the one the full check gives, word for word.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import msgspec

from ..core.requests import ChatRequest, offered_tools, sampling_extras
from ..errors import BadRequest
from ..schema.converter import structure
from ..schema.jsonio import MAX_DEPTH
from ..tokenization.message_fields import FrozenMessage
from . import memo as shared
from .memo import FIELD_MEMO_BYTES, MEMO_BYTES, MessageMemo
from .openai_types import ChatMessage, ChatOptions

# -- one message checked against the typed schema (``openai_types.ChatMessage``) -------------------------


class _One(msgspec.Struct):
    """One message under a field: msgspec keeps a struct's checks built; a bare class is looked up every call."""

    message: ChatMessage


def _check(message: Any) -> FrozenMessage:
    """One message checked (raises where the schema refuses it), with ``developer`` read as ``system``."""
    msgspec.convert({"message": message}, _One)
    frozen = FrozenMessage(message)
    if message.get("role") == "developer":  # templates know "system", not OpenAI's newer "developer"
        frozen["role"] = "system"
    return frozen


#: vLLM's chat extensions the proxy does not honour, each refused when set (not null, false or empty), and why.
UNHONOURED = (
    ("use_beam_search", "the proxy samples: a trajectory is what the policy sampled"),
    ("watermarking", "the proxy samples from the policy's own distribution"),
    ("allowed_token_ids", "the proxy samples from the policy's own distribution"),
    ("bad_words", "the proxy samples from the policy's own distribution"),
    ("repetition_detection", "the proxy does not cut a reply the policy is still sampling"),
    ("thinking_token_budget", "the proxy does not end the policy's reasoning for it"),
    ("truncate_prompt_tokens", "the engine is given the whole prompt (a longer one is a 400)"),
    ("chat_template", "the proxy renders with its tokenizer's template (actorproxy run --tokenizer)"),
    ("documents", "the proxy's template renders messages and tools only"),
    ("prompt_logprobs", "the reply carries the sampled tokens' logprobs only"),
    ("logprob_token_ids", "the reply carries the sampled tokens' logprobs and top_logprobs only"),
)


def chat_request(options: ChatOptions, messages: list[dict[str, Any]], sent_tools: Sequence[Any]) -> ChatRequest:
    """The request a chat body's typed fields ask for, with these messages; :class:`BadRequest` naming a field
    the converter takes but the call refuses (the rules across fields)."""
    max_tokens = options.max_completion_tokens if options.max_completion_tokens is not None else options.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest("'max_tokens' must be at least 1", param="max_tokens")
    thinking = (options.chat_template_kwargs or {}).get("enable_thinking", options.enable_thinking)
    if thinking is None and options.reasoning_effort is not None:
        thinking = options.reasoning_effort != "none"
    if thinking is not None and not isinstance(thinking, bool):
        raise BadRequest("'enable_thinking' must be a boolean", param="chat_template_kwargs.enable_thinking")
    stop = [options.stop] if isinstance(options.stop, str) else list(options.stop or [])
    if options.top_logprobs is not None and not options.logprobs:
        raise BadRequest("'logprobs' must be true when 'top_logprobs' is set", param="top_logprobs")
    if options.logit_bias:
        raise BadRequest("'logit_bias' is not supported: the proxy samples from the policy's own distribution "
                         "(docs/endpoints.md)", param="logit_bias")
    if options.repetition_penalty == 0:
        raise BadRequest("'repetition_penalty' must be greater than 0", param="repetition_penalty")
    if options.min_tokens and max_tokens is not None and options.min_tokens > max_tokens:
        raise BadRequest(f"'min_tokens' must be at most max_tokens ({max_tokens}), got {options.min_tokens}",
                         param="min_tokens")
    for name, why in UNHONOURED:
        value = getattr(options, name)
        if value is not None and value is not False and value != []:
            raise BadRequest(f"'{name}' is not supported: {why} (docs/endpoints.md)", param=name)
    if options.continue_final_message or options.add_generation_prompt is False:
        # Each turn is the conversation so far plus the assistant's new turn: a prefilled reply is not one.
        field = "continue_final_message" if options.continue_final_message else "add_generation_prompt"
        raise BadRequest(f"'{field}' is not supported: every turn is rendered with the template's generation "
                         "prompt (send the conversation without a prefilled assistant message)", param=field)
    return ChatRequest(
        messages=messages,
        tools=offered_tools(sent_tools, options.tool_choice == "none"),
        max_tokens=max_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        seed=options.seed,
        enable_thinking=thinking,
        stop=tuple(stop),
        stream=bool(options.stream),
        top_logprobs=options.top_logprobs or 0,
        extras=sampling_extras(top_k=options.top_k, min_p=options.min_p, presence_penalty=options.presence_penalty,
                               frequency_penalty=options.frequency_penalty,
                               repetition_penalty=options.repetition_penalty, min_tokens=options.min_tokens,
                               ignore_eos=options.ignore_eos, stop_token_ids=options.stop_token_ids),
        include_stop=bool(options.include_stop_str_in_output or options.no_stop_trim),
    )


@attrs.frozen
class ChatFields:
    """A chat body's fields but ``messages``, typed: what an agent sends the same every turn."""

    options: ChatOptions
    #: The tools as sent (the template renders them so; ``options.tools`` is their verdict).
    tools: tuple[Any, ...]
    #: The request these fields ask for, with no messages: each turn's request is this one holding its
    #: body's messages (the tools and settings by reference, made once while the fields repeat).
    request: ChatRequest


def _fields(value: dict[str, Any]) -> ChatFields:
    """The fields but ``messages`` structured by the one converter (raises where it refuses them)."""
    options, tools = structure(value, ChatOptions), tuple(value.get("tools") or ())
    return ChatFields(options, tools, chat_request(options, [], tools))


class ChatMemo(MessageMemo[FrozenMessage]):
    """The messages recent turns sent, checked; and the other fields they came with, typed."""

    def __init__(self, max_bytes: int = MEMO_BYTES, field_bytes: int = FIELD_MEMO_BYTES) -> None:
        super().__init__(max_bytes)
        self.options: MessageMemo[ChatFields] = MessageMemo(field_bytes)

    def age(self) -> None:
        super().age()
        self.options.age()


@attrs.frozen
class ChatBody:
    """A chat-completions body read from bytes: its fields typed, its messages all known good."""

    #: The body's fields but ``messages``, typed (the memo's shared object while they repeat).
    fields: ChatFields
    #: Its messages (a list of its own), checked and with ``developer`` read as ``system``: the memo's shared
    #: :class:`FrozenMessage` objects.
    messages: list[dict[str, Any]]


def load_chat_body(raw: bytes, memo: ChatMemo) -> Any:
    """A request body: a :class:`ChatBody` when every message is known good, else its JSON value.

    Raises what :func:`~actorproxy.schema.jsonio.load_body` raises (empty, not JSON,
    too deep), with the same words (:func:`actorproxy.protocols.memo.load`). The JSON
    value returned then goes through ``parse_chat_body`` whole, as before.
    """
    return shared.load(raw, lambda raw: _from_memo(raw, memo))


def _from_memo(raw: bytes, memo: ChatMemo) -> ChatBody | None:
    """The body with its messages from the memo, or ``None`` where the ordinary way must decide.

    A long body is read from the end of the kept one it starts with (:func:`.memo.read`): only
    its new messages are split, copied and checked. It is kept up to its last message: the
    messages before any point are what they are whatever follows.
    """
    read = shared.read(raw, "messages", memo.bodies)
    if read is None:
        return None
    seen = read.seen
    checked = _checked(read.texts, memo, list(read.fields.items()), 0 if seen is None else seen.depth)
    if checked is None:
        return None
    typed, new, depth = checked
    messages = new if seen is None else seen.items + new
    read.keep(memo.bodies, len(new), messages, depth)
    return ChatBody(typed, list(messages))


def _checked(
    texts: list[msgspec.Raw], memo: ChatMemo, fields: list[tuple[str, bytes]], depth: int
) -> tuple[ChatFields, list[FrozenMessage], int] | None:
    """The other fields typed and the messages checked, each from the memo when its text was seen.

    ``fields``: the body's other fields (name, JSON text); ``depth``: the deepest message
    already read. ``None`` past the nesting bound. Also the deepest message's nesting.
    Raises where a field or a new message is refused (the full check names the culprit).
    """
    typed, around = shared.options(memo.options, fields, _fields)
    messages, level = shared.items(memo, list(map(bytes, texts)), _check)
    depth = max(depth, level)
    # The nesting bound: the body's other fields (the object they are in counted), and its messages array.
    if max(around, 2 + depth) > MAX_DEPTH:
        return None
    return typed, messages, depth
