"""OpenAI chat completions (sans-IO): the request body in, the JSON reply and SSE chunks out."""

from __future__ import annotations

import time
import weakref
from array import array
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import attrs

from ..core.ids import uuid4_hex
from ..core.parser import OutputDelta
from ..core.requests import ChatRequest, holding
from ..core.turn_events import TopLogprobs, TurnAccepted, TurnDone
from ..errors import BadRequest, ProxyError
from ..schema.converter import structure
from ..schema.jsonio import dumps, ids_json
from ..tokenization.detokenize import byte_level_bytes, byte_table
from .chat_messages import ChatBody, ChatMemo, chat_request, load_chat_body
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
    #: ``return_token_ids: true`` (vLLM's extension): the reply carries the prompt's ids and the sampled ids.
    token_ids: bool = False
    #: ``return_tokens_as_token_ids: true`` (vLLM's): each logprob's token is ``token_id:N``, not its text.
    tokens_as_ids: bool = False


def _include_usage(options: Any, by_default: bool) -> bool:
    """``stream_options.include_usage``, else ``by_default``."""
    if options is None or options.include_usage is None:
        return by_default
    return bool(options.include_usage)


def parse_chat_body(body: Any, *, usage_by_default: bool = False) -> OpenAIChatCall:
    """Validate a chat-completions body; raise :class:`BadRequest` naming the bad field.

    Unknown fields are tolerated (OpenAI clients send many we do not use); see
    docs/endpoints.md for what each known field does here. A :class:`ChatBody`
    (read from bytes by :func:`load_chat_body`) has its messages checked and its
    request made already: the call holds it with the body's messages, by reference.
    """
    call: ChatOptions
    if isinstance(body, ChatBody):  # typed from its bytes: the fields by the converter, each message checked
        call = body.fields.options
        request = holding(body.fields.request, body.messages)
    else:
        call = structure(body, ChatCompletionBody)
        # The typed messages are the verdict; the template gets each message as sent (fields we do not know
        # included), but for the role: templates know "system", not OpenAI's newer "developer".
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in body["messages"]]
        request = chat_request(call, messages, body.get("tools") or ())
    return OpenAIChatCall(
        request=request,
        model=call.model or "",
        stream=request.stream,
        include_usage=_include_usage(call.stream_options, usage_by_default),
        session_id=call.session_id,
        instance_id=call.instance_id,
        turn_id=call.turn_id,
        logprobs=bool(call.logprobs),
        token_ids=bool(call.return_token_ids),
        tokens_as_ids=bool(call.return_tokens_as_token_ids),
    )


def new_completion_id() -> str:
    return "chatcmpl-" + uuid4_hex()


def _usage(done: TurnDone) -> bytes:
    """The ``usage`` object's JSON."""
    return b'{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}' % (
        done.prompt_tokens, done.completion_tokens, done.prompt_tokens + done.completion_tokens)


#: Per tokenizer without a byte table (SentencePiece vocabularies: a GGUF's for llama.cpp): each id's text and
#: bytes spelled so far, an id the tokenizer knows each (so at most its vocabulary).
_SPELLED: weakref.WeakKeyDictionary[Any, dict[int, tuple[str, bytes]]] = weakref.WeakKeyDictionary()


def _spelled_alone(hf: Any, token_id: int, kept: dict[int, tuple[str, bytes]] | None = None) -> tuple[str, bytes]:
    """One token's text and bytes, asked of the tokenizer (a vocabulary with no byte table, an id outside it);
    ``kept``: the tokenizer's spellings so far (:data:`_SPELLED`), asked first and added to.

    An id the tokenizer does not know (a model's vocabulary is often padded past the tokenizer's) has no text, as
    the tokenizer decodes it."""
    if kept is not None and (spelled := kept.get(token_id)) is not None:
        return spelled
    piece = hf.convert_ids_to_tokens([token_id])[0] if token_id >= 0 else None
    if piece is None:
        return "", b""
    spelled = _spelling(hf, token_id, str(piece))
    if kept is not None:
        kept[token_id] = spelled
    return spelled


def _spelling(hf: Any, token_id: int, piece: str) -> tuple[str, bytes]:
    """A known token's text and bytes: its piece's, if it is in GPT-2's byte alphabet, else decoded alone."""
    raw = byte_level_bytes(piece) if piece else None
    if raw is not None:
        return raw.decode("utf-8", errors="replace"), raw
    text = str(hf.decode([token_id], skip_special_tokens=False))
    return text, text.encode("utf-8")


def _placeholder(token_id: int) -> tuple[str, bytes]:
    """A token named by its id, as vLLM's ``return_tokens_as_token_ids`` writes it: ``token_id:N``, and its bytes."""
    text = f"token_id:{token_id}"
    return text, text.encode()


def _speller(tokenizer: Any, as_ids: bool = False) -> Callable[[int], tuple[str, bytes]]:
    """A function of a token id: its text and bytes (``token``, ``bytes`` of :func:`token_logprobs`' entries).

    A byte-level vocabulary's bytes come from its byte table (``tokenization/detokenize.py: byte_table``, made
    once per tokenizer, at start), so a token costs no call of the tokenizer's. ``as_ids``: the id's
    placeholder (:func:`_placeholder`)."""
    if as_ids:
        return _placeholder
    table = byte_table(tokenizer) if hasattr(tokenizer, "hf") else None
    hf = getattr(tokenizer, "hf", tokenizer)
    if table is None:
        return partial(_spelled_alone, hf, kept=_SPELLED.setdefault(tokenizer, {}))
    size = len(table)

    def spell(token_id: int) -> tuple[str, bytes]:
        if 0 <= token_id < size:
            raw = table[token_id]
            return raw.decode("utf-8", errors="replace"), raw
        return _spelled_alone(hf, token_id)

    return spell


#: OpenAI's logprob of a token too unlikely to have one (``-inf`` has no JSON number; vLLM writes this too).
VERY_UNLIKELY = -9999.0


def token_logprobs(tokenizer: Any, ids: Sequence[int], logprobs: Sequence[float],
                   top: Sequence[TopLogprobs] | None = None, *, as_ids: bool = False) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content``: each sampled token with its logprob and bytes, and its ``top_logprobs``.

    A byte-level BPE vocabulary (Qwen, Llama 3, GLM, ...) gives each token's exact
    bytes, so a character split over two tokens shows as its two byte runs; ``token``
    is those bytes decoded (U+FFFD for a partial character). Other vocabularies give
    the token decoded alone. ``top_logprobs`` lists ``top``'s alternatives of the token
    (the engine's, the likeliest first), spelled the same way; empty when the call did
    not ask for them. ``as_ids``: every token is written ``token_id:N`` instead (vLLM's
    ``return_tokens_as_token_ids``), its bytes that text's. A logprob below :data:`VERY_UNLIKELY`
    (``-inf``: a probability of 0, which llama.cpp can report) is written as it.
    """
    spell = _speller(tokenizer, as_ids)
    content: list[dict[str, Any]] = []
    for token_id, logprob in zip(ids, logprobs, strict=False):
        text, raw = spell(token_id)
        content.append({"token": text, "logprob": max(float(logprob), VERY_UNLIKELY), "bytes": list(raw),
                        "top_logprobs": []})
    if top is not None:
        for entry, alternatives in zip(content, top, strict=False):
            listed: list[dict[str, Any]] = entry["top_logprobs"]
            for token_id, logprob in alternatives:
                text, raw = spell(token_id)
                listed.append({"token": text, "logprob": max(float(logprob), VERY_UNLIKELY), "bytes": list(raw)})
    return content


def sampled_logprobs(tokenizer: Any, done: TurnDone, *, as_ids: bool = False) -> list[dict[str, Any]]:
    """:func:`token_logprobs` of every token a finished turn sampled (with the alternatives it asked for)."""
    ids = done.ids
    return [] if ids is None else token_logprobs(tokenizer, ids.output_ids, ids.output_logprobs, done.top_logprobs,
                                                 as_ids=as_ids)


def choice_logprobs(tokenizer: Any, done: TurnDone, *, as_ids: bool = False) -> dict[str, Any]:
    """A choice's ``logprobs`` object for a finished turn."""
    return {"content": sampled_logprobs(tokenizer, done, as_ids=as_ids), "refusal": None}


def _ids(ids: array[int] | None) -> bytes:
    """A token array's JSON (``null`` when the turn has none)."""
    return b"null" if ids is None else ids_json(ids)


def _head(kind: bytes, completion_id: str, model: str) -> bytes:
    """A reply object's JSON up to its ``model`` (``id``, ``object``, ``created``, ``model``), left open."""
    return (b'{"id":' + dumps(completion_id) + b',"object":"' + kind + b'","created":%d,"model":' % int(time.time())
            + dumps(model))


def completion_bytes(
    done: TurnDone, *, completion_id: str, model: str, session_id: str, logprobs: dict[str, Any] | None = None,
    token_ids: bool = False,
) -> bytes:
    """The ``chat.completion`` reply's JSON bytes, written directly: no JSON value is built (the bytes its value
    would give: ``tests/protocols/test_openai_completion.py``). Only ``logprobs``, when asked for, is a value.
    ``token_ids``: the choice's ``token_ids`` and the reply's ``prompt_token_ids`` (vLLM's ``return_token_ids``)."""
    output = done.output
    calls = output.tool_calls
    parts = [_head(b"chat.completion", completion_id, model),
             b',"choices":[{"index":0,"message":{"role":"assistant","content":',
             dumps(output.content if (output.content or not calls) else None)]
    if output.reasoning:
        parts += (b',"reasoning_content":', dumps(output.reasoning))
    if calls:
        parts.append(b',"tool_calls":[')
        for i, call in enumerate(calls):
            parts += (b',{"id":' if i else b'{"id":', dumps(call.id), b',"type":"function","function":{"name":',
                      dumps(call.name), b',"arguments":', dumps(call.arguments), b"}}")
        parts.append(b"]")
    parts += (b'},"finish_reason":', dumps(done.finish_reason), b',"logprobs":',
              b"null" if logprobs is None else dumps(logprobs))
    if token_ids:
        parts += (b',"token_ids":', _ids(None if done.ids is None else done.ids.output_ids))
    parts += (b'}],"usage":', _usage(done))
    if token_ids:
        parts += (b',"prompt_token_ids":', _ids(None if done.ids is None else done.ids.prompt_ids))
    parts += (b',"actorproxy":{"session_id":', dumps(done.session_id or session_id),
              b',"step_index":%d,"tool_call_parse_error":%s}}'
              % (done.step_index, b"true" if done.tool_call_parse_error else b"false"))
    return b"".join(parts)


class ChunkWriter:
    """Builds the SSE frames of one streamed completion (same id, created, model on every chunk).

    Every frame is written as bytes directly, around the strings it carries: the chunk's fixed head
    (id, object, created, model) is encoded once a reply, and no chunk's JSON value is built (the
    same bytes it would give: ``tests/protocols/test_openai_chunks.py``). Only ``logprobs``, when
    asked for, is a value (on the finish chunk). ``token_ids`` (vLLM's ``return_token_ids``): the first
    chunk carries ``prompt_token_ids``, the finish chunk's choice every sampled id (``token_ids``), as it
    carries every logprob; ``tokens_as_ids``: the logprobs' tokens are written ``token_id:N``.
    """

    def __init__(
        self, *, completion_id: str, model: str, include_usage: bool = False, tokenizer: Any = None,
        token_ids: bool = False, tokens_as_ids: bool = False,
    ) -> None:
        self._include_usage = include_usage
        #: Set when the call asked for logprobs: they go out on the finish chunk.
        self._tokenizer = tokenizer
        self._token_ids = token_ids
        self._tokens_as_ids = tokens_as_ids
        #: Every frame begins with this: the chunk's head, left open.
        self._open = b"data: " + _head(b"chat.completion.chunk", completion_id, model)
        #: A frame with a choice: these, then its delta's members, then ``_tail`` (or its finish).
        self._choice = self._open + b',"choices":[{"index":0,"delta":{'
        self._tail = b'},"finish_reason":null,"logprobs":null}]}\n\n'
        #: A content (a reasoning) delta's frame: these, then the text's JSON string, then ``_tail``.
        self._content = self._choice + b'"content":'
        self._reasoning = self._choice + b'"reasoning_content":'

    def start(self, accepted: TurnAccepted | None = None) -> bytes:
        if self._token_ids:
            prompt = _ids(None if accepted is None else accepted.prompt_ids)
            return (self._open + b',"prompt_token_ids":' + prompt
                    + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""' + self._tail)
        return self._choice + b'"role":"assistant","content":""' + self._tail

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
            frames.append(self._choice + b'"tool_calls":[{"index":%d' % piece.index)
            if piece.id is not None:
                frames += (b',"id":', dumps(piece.id), b',"type":"function","function":{"name":', dumps(piece.name),
                           b',"arguments":', dumps(piece.arguments), b"}}]", self._tail)
            else:
                frames += (b',"function":{"arguments":', dumps(piece.arguments), b"}}]", self._tail)
        return b"".join(frames)

    def finish(self, done: TurnDone) -> bytes:
        # Deltas are parsed text, not tokens: the sampled tokens' logprobs all come with the last chunk
        # (clients append every chunk's logprobs.content, so the sum is the same).
        logprobs = (b"null" if self._tokenizer is None
                    else dumps(choice_logprobs(self._tokenizer, done, as_ids=self._tokens_as_ids)))
        frames = [self._choice, b'},"finish_reason":', dumps(done.finish_reason), b',"logprobs":', logprobs]
        if self._token_ids:
            frames += (b',"token_ids":', _ids(None if done.ids is None else done.ids.output_ids))
        frames.append(b"}]}\n\n")
        if self._include_usage:
            frames += (self._open, b',"choices":[],"usage":', _usage(done), b"}\n\n")
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

    def render(self, call: OpenAIChatCall, reply: ReplyInfo, done: TurnDone) -> bytes:
        tokenizer = self._logprobs_tokenizer(call)
        logprobs = None if tokenizer is None else choice_logprobs(tokenizer, done, as_ids=call.tokens_as_ids)
        return completion_bytes(done, completion_id=reply.id, model=reply.model, session_id=reply.session_id,
                                logprobs=logprobs, token_ids=call.token_ids)

    def writer(self, call: OpenAIChatCall, reply: ReplyInfo) -> ChunkWriter:
        return ChunkWriter(completion_id=reply.id, model=reply.model, include_usage=call.include_usage,
                           tokenizer=self._logprobs_tokenizer(call), token_ids=call.token_ids,
                           tokens_as_ids=call.tokens_as_ids)
