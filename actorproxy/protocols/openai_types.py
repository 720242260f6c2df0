"""The OpenAI chat-completions request body, typed (others' protocol: unknown fields tolerated).

Known fields are typed, so a bad value is a 400 naming its path
(``messages[1].name``) before anything uses it; fields we do not know are
accepted, and messages reach the chat template as the client sent them.

These classes are the one schema of a chat body: the converter structures a whole
body into them, and the fast path (:mod:`.chat_messages`) checks each new message
against :class:`ChatMessage` itself, through msgspec (which reads attrs classes and
runs their validators). The rules between a message's fields (``content`` required
for some roles, ``tool_calls`` only on an assistant message) are validators here,
so both paths apply them. A ``msgspec.Meta`` bound is for the OpenAPI document (and
msgspec); its validator says the same to the converter.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import attrs
import msgspec

from ..schema.converter import FieldError, at_least, between, int64, named

MAX_STOP_SEQUENCES = 16
#: How many ``stop_token_ids`` a call may add to the tokenizer's own.
MAX_STOP_TOKEN_IDS = 64
#: OpenAI's bound on ``top_logprobs``.
MAX_TOP_LOGPROBS = 20

Role = Literal["system", "developer", "user", "assistant", "tool"]


#: The roles whose message must have a ``content`` (an assistant's may be only tool calls; a tool's may be empty).
_CONTENT_REQUIRED = frozenset({"system", "developer", "user"})


def _content(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    """``content``: a string, null, or an array of text parts (this proxy serves a text-only model).

    Null (or absent) only where the message's role allows it.
    """
    if value is None and instance.role in _CONTENT_REQUIRED:
        raise FieldError(f"is required for role {instance.role!r}", field=attribute.name)
    if value is None or isinstance(value, str):
        return
    if not isinstance(value, list):
        raise FieldError("must be a string, an array of content parts or null", field=attribute.name)
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise FieldError("must be an object with a 'type'", field=f"{attribute.name}[{j}]")
        if kind != "text":
            raise FieldError(
                f"is a content part of type {kind!r}, which is not supported (this proxy serves a text-only "
                "model; send text parts only)",
                field=f"{attribute.name}[{j}]",
            )
        if not isinstance(part.get("text"), str):
            raise FieldError("must be a string", field=f"{attribute.name}[{j}].text")


def _on_assistant(instance: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and instance.role != "assistant":
        raise FieldError("must be on an assistant message", field=attribute.name)


def _non_empty(instance: object, attribute: attrs.Attribute[Any], value: list[Any]) -> None:
    if not value:
        raise FieldError("must be a non-empty array", field=attribute.name)


def _one(instance: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value not in (None, 1):
        raise FieldError(f"must be 1 (only n=1 is supported: send n requests for n samples), got {value}",
                         field=attribute.name)


def _stop(instance: object, attribute: attrs.Attribute[Any], value: str | list[str] | None) -> None:
    stop = [value] if isinstance(value, str) else value or []
    if len(stop) > MAX_STOP_SEQUENCES or not all(0 < len(s) <= 256 for s in stop):
        raise FieldError(f"must be a string or an array of at most {MAX_STOP_SEQUENCES} non-empty strings",
                         field=attribute.name)


def _stop_ids(instance: object, attribute: attrs.Attribute[Any], value: list[int] | None) -> None:
    if value is not None and (len(value) > MAX_STOP_TOKEN_IDS or any(tid < 0 for tid in value)):
        raise FieldError(f"must be an array of at most {MAX_STOP_TOKEN_IDS} token ids (integers >= 0)",
                         field=attribute.name)


def _not_null(instance: object, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        raise FieldError("must be a JSON string or an object, not null", field=attribute.name)


@attrs.frozen
class FunctionCall:
    name: Annotated[str, msgspec.Meta(min_length=1)] = attrs.field(validator=named)
    #: A JSON string (some clients send the object itself).
    arguments: str | dict[str, Any] = attrs.field(default="", validator=_not_null)


@attrs.frozen
class ToolCallItem:
    function: FunctionCall
    id: str | None = None
    type: str = "function"


@attrs.frozen
class ChatMessage:
    role: Role
    content: Any = attrs.field(default=None, validator=_content)
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallItem] | None = attrs.field(default=None, validator=_on_assistant)
    reasoning_content: str | None = None
    reasoning: str | None = None


@attrs.frozen
class FunctionDef:
    name: Annotated[str, msgspec.Meta(min_length=1)] = attrs.field(validator=named)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


@attrs.frozen
class FunctionTool:
    function: FunctionDef
    type: Literal["function"] = "function"


@attrs.frozen
class StreamOptions:
    include_usage: bool | None = None


@attrs.frozen
class ChatOptions:
    """``POST /v1/chat/completions`` but its messages: the fields we read (others are ignored).

    The fast path structures a body's other fields into this class, its messages being checked one by one.
    """

    model: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = attrs.field(default=None, validator=_one)
    seed: int | None = attrs.field(default=None, validator=int64)
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    enable_thinking: bool | None = None
    #: ``"none"`` turns thinking off (as Responses' ``reasoning.effort``); any other effort leaves it on.
    reasoning_effort: str | None = None
    stop: str | list[str] | None = attrs.field(default=None, validator=_stop)
    temperature: float | None = attrs.field(default=None, validator=between(0.0, 2.0))
    top_p: float | None = attrs.field(default=None, validator=between(0.0, 1.0))
    logprobs: bool | None = None
    top_logprobs: int | None = attrs.field(default=None, validator=between(0, MAX_TOP_LOGPROBS))
    #: vLLM's extensions: the reply carries the prompt's ids and the sampled ids (``prompt_token_ids``,
    #: ``choices[].token_ids``); each logprob's token is written ``token_id:N``.
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    presence_penalty: float | None = attrs.field(default=None, validator=between(-2.0, 2.0))
    frequency_penalty: float | None = attrs.field(default=None, validator=between(-2.0, 2.0))
    #: Refused unless empty (see ``chat_messages.chat_request``).
    logit_bias: dict[str, Any] | None = None
    #: vLLM's and SGLang's extensions of the API (their OpenAI servers take them): -1 or 0 is the whole vocabulary.
    top_k: int | None = attrs.field(default=None, validator=at_least(-1))
    min_p: float | None = attrs.field(default=None, validator=between(0.0, 1.0))
    repetition_penalty: float | None = attrs.field(default=None, validator=between(0.0, 2.0))
    #: vLLM's: no stop id is sampled before this many tokens; the tokenizer's end ids do not stop the reply; ids
    #: that stop it besides the tokenizer's own (their text is not shown).
    min_tokens: int | None = attrs.field(default=None, validator=at_least(0))
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = attrs.field(default=None, validator=_stop_ids)
    #: vLLM's: the reply's text ends with the stop sequence or stop id that ended it (SGLang's ``no_stop_trim``).
    include_stop_str_in_output: bool | None = None
    no_stop_trim: bool | None = None
    #: vLLM's rendering switches: refused unless at their defaults (see ``chat_messages.chat_request``).
    continue_final_message: bool | None = None
    add_generation_prompt: bool | None = None
    #: vLLM's extensions the proxy does not honour: refused when set (``chat_messages.UNHONOURED``).
    use_beam_search: bool | None = None
    watermarking: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    chat_template: str | None = None
    documents: list[Any] | None = None
    thinking_token_budget: Any = None
    repetition_detection: Any = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    response_format: dict[str, Any] | None = None
    session_id: str | None = None
    instance_id: str | None = None
    turn_id: str | None = None


@attrs.frozen
class ChatCompletionBody(ChatOptions):
    """``POST /v1/chat/completions``: the fields we read (others are ignored)."""

    messages: list[ChatMessage] = attrs.field(kw_only=True, validator=_non_empty)
