"""OpenAI chat completions (sans-IO): the request body in, the JSON reply and SSE chunks out."""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import cache
from typing import Any

import attrs

from ..core.ids import uuid4_hex
from ..core.messages import output_as_message
from ..core.parser import OutputDelta
from ..core.requests import ChatRequest, offered_tools
from ..core.turn_events import TurnAccepted, TurnDone
from ..errors import BadRequest, ProxyError
from ..schema.converter import structure
from ..schema.jsonio import dumps
from .chat_messages import ChatBody, ChatMemo, load_chat_body
from .format import MemoFormat, ReplyInfo
from .openai_types import ChatCompletionBody, ChatOptions


@attrs.frozen
class OpenAIChatCall:
    """A validated ``/v1/chat/completions`` body."""

    request: ChatRequest
    model: str
    stream: bool
    include_usage: bool
    #: Identity fields some clients put in the body instead of headers.
    session_id: str | None
    instance_id: str | None
    turn_id: str | None
    #: ``logprobs: true``: the reply carries the sampled tokens' logprobs.
    logprobs: bool = False


def _include_usage(options: Any, by_default: bool) -> bool:
    """``stream_options.include_usage``, else ``by_default``."""
    if options is None or options.include_usage is None:
        return by_default
    return bool(options.include_usage)


def parse_chat_body(body: Any, *, usage_by_default: bool = False) -> OpenAIChatCall:
    """Validate a chat-completions body; raise :class:`BadRequest` naming the bad field.

    Unknown fields are tolerated (OpenAI clients send many we do not use); see
    docs/endpoints.md for what each known field does here. A :class:`ChatBody`
    (read from bytes by :func:`load_chat_body`) has its messages checked already.
    """
    call: ChatOptions
    if isinstance(body, ChatBody):  # typed from its bytes: the fields by the converter, each message checked
        call = body.fields.options
        messages: list[dict[str, Any]] = list(body.messages)
        sent_tools: Sequence[Any] = body.fields.tools
    else:
        call = structure(body, ChatCompletionBody)
        # The typed messages are the verdict; the template gets each message as sent (fields we do not know
        # included), but for the role: templates know "system", not OpenAI's newer "developer".
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in body["messages"]]
        sent_tools = body.get("tools") or ()
    max_tokens = call.max_completion_tokens if call.max_completion_tokens is not None else call.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise BadRequest("'max_tokens' must be at least 1", param="max_tokens")
    thinking = (call.chat_template_kwargs or {}).get("enable_thinking", call.enable_thinking)
    if thinking is None and call.reasoning_effort is not None:
        thinking = call.reasoning_effort != "none"
    if thinking is not None and not isinstance(thinking, bool):
        raise BadRequest("'enable_thinking' must be a boolean", param="chat_template_kwargs.enable_thinking")
    stop = [call.stop] if isinstance(call.stop, str) else list(call.stop or [])
    if call.top_logprobs is not None and not call.logprobs:
        raise BadRequest("'logprobs' must be true when 'top_logprobs' is set", param="top_logprobs")
    stream = bool(call.stream)
    request = ChatRequest(
        messages=messages,
        tools=offered_tools(sent_tools, call.tool_choice == "none"),
        max_tokens=max_tokens,
        temperature=call.temperature,
        top_p=call.top_p,
        seed=call.seed,
        enable_thinking=thinking,
        stop=tuple(stop),
        stream=stream,
    )
    return OpenAIChatCall(
        request=request,
        model=call.model or "",
        stream=stream,
        include_usage=_include_usage(call.stream_options, usage_by_default),
        session_id=call.session_id,
        instance_id=call.instance_id,
        turn_id=call.turn_id,
        logprobs=bool(call.logprobs),
    )


def new_completion_id() -> str:
    return "chatcmpl-" + uuid4_hex()


def _usage(done: TurnDone) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
    }


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's): the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def token_logprobs(tokenizer: Any, ids: Sequence[int], logprobs: Sequence[float]) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content``: each sampled token with its logprob and bytes.

    A byte-level BPE vocabulary (Qwen, Llama 3, GLM, ...) gives each token's exact
    bytes, so a character split over two tokens shows as its two byte runs; ``token``
    is those bytes decoded (U+FFFD for a partial character). Other vocabularies give
    the token decoded alone. ``top_logprobs`` is always empty: the engine returns
    only the sampled token's logprob (see docs/endpoints.md).
    """
    hf = getattr(tokenizer, "hf", tokenizer)
    pieces = [str(p) for p in hf.convert_ids_to_tokens(list(ids))]
    alphabet = _byte_level_alphabet()
    content = []
    for token_id, piece, logprob in zip(ids, pieces, logprobs, strict=False):
        if piece and all(ch in alphabet for ch in piece):
            raw = bytes(alphabet[ch] for ch in piece)
            text = raw.decode("utf-8", errors="replace")
        else:
            text = str(hf.decode([token_id], skip_special_tokens=False))
            raw = text.encode("utf-8")
        content.append({"token": text, "logprob": float(logprob), "bytes": list(raw), "top_logprobs": []})
    return content


def sampled_logprobs(tokenizer: Any, done: TurnDone) -> list[dict[str, Any]]:
    """:func:`token_logprobs` of every token a finished turn sampled."""
    ids = done.ids
    return [] if ids is None else token_logprobs(tokenizer, ids.output_ids, ids.output_logprobs)


def choice_logprobs(tokenizer: Any, done: TurnDone) -> dict[str, Any]:
    """A choice's ``logprobs`` object for a finished turn."""
    return {"content": sampled_logprobs(tokenizer, done), "refusal": None}


def completion_json(
    done: TurnDone, *, completion_id: str, model: str, session_id: str, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": output_as_message(done.output),
                "finish_reason": done.finish_reason,
                "logprobs": logprobs,
            }
        ],
        "usage": _usage(done),
        "actorproxy": {
            "session_id": done.session_id or session_id,
            "step_index": done.step_index,
            "tool_call_parse_error": done.tool_call_parse_error,
        },
    }


class ChunkWriter:
    """Builds the SSE frames of one streamed completion (same id, created, model on every chunk).

    A text delta's frame is written as bytes directly: the chunk's fixed head and tail are
    encoded once, and only the text is encoded per delta (the same bytes the chunk's JSON
    value would give: ``tests/protocols/test_openai_chunks.py``).
    """

    def __init__(
        self, *, completion_id: str, model: str, include_usage: bool = False, tokenizer: Any = None
    ) -> None:
        self._include_usage = include_usage
        #: Set when the call asked for logprobs: they go out on the finish chunk.
        self._tokenizer = tokenizer
        self._base = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }
        head = dumps(self._base)[:-1] + b',"choices":[{"index":0,"delta":{"'
        tail = b'},"finish_reason":null,"logprobs":null}]}\n\n'
        #: A content (a reasoning) delta's frame: these, then the text's JSON string, then ``_tail``.
        self._content = b"data: " + head + b'content":'
        self._reasoning = b"data: " + head + b'reasoning_content":'
        self._tail = tail

    def _frame(self, payload: dict[str, Any]) -> bytes:
        return b"data: " + dumps({**self._base, **payload}) + b"\n\n"

    def _choice(
        self, delta: dict[str, Any], finish_reason: str | None = None, logprobs: dict[str, Any] | None = None
    ) -> bytes:
        return self._frame(
            {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}]}
        )

    def start(self, accepted: TurnAccepted | None = None) -> bytes:
        return self._choice({"role": "assistant", "content": ""})

    def heartbeat(self) -> bytes:
        """An SSE comment: clients ignore it, but idle-timeout proxies and agents see the connection alive."""
        return b": keep-alive\n\n"

    def delta(self, delta: OutputDelta) -> bytes:
        if not delta.tool_calls:  # text only (nearly every delta): the frames' bytes at once
            if not delta.reasoning:
                return self._content + dumps(delta.content) + self._tail if delta.content else b""
            if not delta.content:
                return self._reasoning + dumps(delta.reasoning) + self._tail
        frames = []
        if delta.reasoning:
            frames.append(self._reasoning + dumps(delta.reasoning) + self._tail)
        if delta.content:
            frames.append(self._content + dumps(delta.content) + self._tail)
        for piece in delta.tool_calls:
            call: dict[str, Any] = {"index": piece.index}
            if piece.id is not None:
                call.update(id=piece.id, type="function", function={"name": piece.name, "arguments": piece.arguments})
            else:
                call["function"] = {"arguments": piece.arguments}
            frames.append(self._choice({"tool_calls": [call]}))
        return b"".join(frames)

    def finish(self, done: TurnDone) -> bytes:
        # Deltas are parsed text, not tokens: the sampled tokens' logprobs all come with the last chunk
        # (clients append every chunk's logprobs.content, so the sum is the same).
        logprobs = None if self._tokenizer is None else choice_logprobs(self._tokenizer, done)
        frames = [self._choice({}, done.finish_reason, logprobs)]
        if self._include_usage:
            frames.append(self._frame({"choices": [], "usage": _usage(done)}))
        frames.append(b"data: [DONE]\n\n")
        return b"".join(frames)

    def error(self, error: ProxyError) -> bytes:
        return b"data: " + dumps(error.to_openai()) + b"\n\ndata: [DONE]\n\n"


class OpenAIChatFormat(MemoFormat[OpenAIChatCall, ChatMemo]):
    """``/v1/chat/completions``."""

    errors = "openai"

    def __init__(self, tokenizer: Any = None, *, usage_by_default: bool = False) -> None:
        super().__init__(ChatMemo(), load_chat_body)
        #: Turns the sampled ids into tokens when a call asks for logprobs.
        self._tokenizer = tokenizer
        #: A stream without ``stream_options.include_usage`` ends with a usage chunk (Dressage's default).
        self._usage_by_default = usage_by_default

    def _logprobs_tokenizer(self, call: OpenAIChatCall) -> Any:
        return self._tokenizer if call.logprobs else None

    def parse(self, body: Any) -> OpenAIChatCall:
        call = parse_chat_body(body, usage_by_default=self._usage_by_default)
        if call.logprobs and self._tokenizer is None:
            raise BadRequest("'logprobs' is not available on this route", param="logprobs")
        return call

    def new_id(self) -> str:
        return new_completion_id()

    def render(self, call: OpenAIChatCall, reply: ReplyInfo, done: TurnDone) -> Any:
        tokenizer = self._logprobs_tokenizer(call)
        logprobs = None if tokenizer is None else choice_logprobs(tokenizer, done)
        return completion_json(done, completion_id=reply.id, model=reply.model, session_id=reply.session_id,
                               logprobs=logprobs)

    def writer(self, call: OpenAIChatCall, reply: ReplyInfo) -> ChunkWriter:
        return ChunkWriter(completion_id=reply.id, model=reply.model, include_usage=call.include_usage,
                           tokenizer=self._logprobs_tokenizer(call))
