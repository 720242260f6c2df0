"""OpenAI Responses API output (sans-IO): the response object and the typed SSE events of a stream.

Item ids derive from the response id (``rs_``/``msg_``/``fc_`` + its hex + the
item's position); a function call's ``call_id`` is the proxy's tool-call id, so
an echoed call matches the step it came from. Reasoning goes out as
``reasoning_text`` content and, when the client asks for
``reasoning.encrypted_content``, also as a reversible ``encrypted_content``.

Every reply is written as bytes directly, around the strings it carries, as chat's
and Anthropic's are: no JSON value of the response, an item or an event is built
(the bytes the values would give: ``tests/protocols/test_responses_reply.py``). Only
the logprobs, when asked for, are a value; the echoed request fields come as the
call's JSON text (``ResponsesCall.echo_json``). The output items are written once
each, as :class:`Issued` (id and JSON text): a stored response keeps them so, and
an ``item_reference`` parses the one it names (``responses_api.IssuedItems``).
"""

from __future__ import annotations

import base64
import time
from typing import Any

from ..core.ids import uuid4_hex
from ..core.messages import AssistantOutput
from ..core.parser import OutputDelta
from ..core.turn_events import TurnDone
from ..errors import ProxyError
from ..schema.jsonio import dumps
from .openai_chat import sampled_logprobs
from .responses_api import ENCRYPTED_PREFIX, Issued, ResponsesCall, tool_namespaces


def new_response_id() -> str:
    return "resp_" + uuid4_hex()


def encrypt_reasoning(text: str) -> str:
    """Our stand-in for OpenAI's encrypted reasoning: reversible, so a stateless client's echo restores it."""
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


def _usage(done: TurnDone) -> bytes:
    """The ``usage`` object's JSON."""
    return (b'{"input_tokens":%d,"input_tokens_details":{"cached_tokens":0},"output_tokens":%d,'
            b'"output_tokens_details":{"reasoning_tokens":0},"total_tokens":%d}'
            % (done.prompt_tokens, done.completion_tokens, done.prompt_tokens + done.completion_tokens))


def _status(done: TurnDone) -> bytes:
    return b"incomplete" if done.finish_reason == "length" else b"completed"


#: An item kind's id prefix, and its members between ``type`` and ``status`` while it is in progress.
_PREFIX = {"reasoning": "rs", "message": "msg", "function_call": "fc"}
_OPENED = {"reasoning": b',"summary":[],"content":[]', "message": b',"role":"assistant","content":[]'}


class _Items:
    """The output items of one response, as JSON text: ids derived from the response id, in the order opened."""

    def __init__(self, response_id: str, *, include_encrypted: bool, tools: Any = None) -> None:
        self._stem = response_id.removeprefix("resp_")
        self._include_encrypted = include_encrypted
        #: The request's tools as sent: the namespace of a function call's name is looked up there once a call is
        #: written (:meth:`call_members`), not for a reply that calls nothing.
        self._tools = tools
        self._namespaces: dict[str, str] | None = None
        #: The items completed, in order.
        self.done: list[Issued] = []
        #: The sampled tokens' logprobs' JSON, once known, when the client asked for them (on the message's text).
        self.logprobs = b"[]"

    def new_id(self, kind: str) -> str:
        return f"{_PREFIX[kind]}_{self._stem}_{len(self.done)}"

    @staticmethod
    def opened(kind: str, item_id: str, call: bytes = b"") -> bytes:
        """An item in progress: ``call`` is a function call's ``call_id`` and ``name`` members."""
        members = call + b',"arguments":""' if kind == "function_call" else _OPENED[kind]
        return (b'{"id":' + dumps(item_id) + b',"type":"' + kind.encode() + b'"' + members
                + b',"status":"in_progress"}')

    def json(self, kind: str, item_id: str, encoded: bytes, call: bytes = b"", reasoning: str = "") -> bytes:
        """An item completed with its final text's JSON string ``encoded`` (arguments, for a call); ``reasoning`` is
        the text itself, for a reasoning item's ``encrypted_content``."""
        head = b'{"id":' + dumps(item_id) + b',"type":"' + kind.encode() + b'"'
        if kind == "reasoning":
            tail = b'"status":"completed"}'
            if self._include_encrypted:
                tail = b'"status":"completed","encrypted_content":' + dumps(encrypt_reasoning(reasoning)) + b"}"
            return head + b',"summary":[],"content":[{"type":"reasoning_text","text":' + encoded + b"}]," + tail
        if kind == "message":
            return head + b',"role":"assistant","content":[' + self.text_part(encoded) + b'],"status":"completed"}'
        return head + call + b',"arguments":' + encoded + b',"status":"completed"}'

    def complete(self, kind: str, item_id: str, encoded: bytes, call: bytes = b"", reasoning: str = "") -> Issued:
        """Add the item completed (:meth:`json`)."""
        issued = Issued(item_id, self.json(kind, item_id, encoded, call, reasoning))
        self.done.append(issued)
        return issued

    def call_members(self, call_id: str, name: str) -> bytes:
        """A function call item's ``call_id`` and ``name`` members, and its ``namespace`` when one offers it."""
        members = b',"call_id":' + dumps(call_id) + b',"name":' + dumps(name)
        if self._namespaces is None:
            self._namespaces = tool_namespaces(self._tools)
        namespace = self._namespaces.get(name)
        return members if namespace is None else members + b',"namespace":' + dumps(namespace)

    def text_part(self, text: bytes) -> bytes:
        """A message's ``output_text`` part with this (encoded) text."""
        return b'{"type":"output_text","text":' + text + b',"annotations":[],"logprobs":' + self.logprobs + b"}"

    def of(self, output: AssistantOutput) -> list[Issued]:
        """The items of a whole output at once (a non-streamed response)."""
        if output.reasoning:
            self.complete("reasoning", self.new_id("reasoning"), dumps(output.reasoning), reasoning=output.reasoning)
        if output.content or not output.tool_calls:
            self.complete("message", self.new_id("message"), dumps(output.content))
        for call in output.tool_calls:
            members = self.call_members(call.id, call.name)
            self.complete("function_call", self.new_id("function_call"), dumps(call.arguments), members)
        return self.done


def response_bytes(call: ResponsesCall, *, response_id: str, model: str, created_at: int, status: bytes,
                   output: list[bytes], done: TurnDone | None = None, error: ProxyError | None = None) -> bytes:
    """The ``response`` object's JSON (``status`` in_progress, completed, incomplete or failed)."""
    parts = [b'{"id":', dumps(response_id), b',"object":"response","created_at":%d,"status":"%s","model":'
             % (created_at, status), dumps(model), b',"output":[', b",".join(output), b'],"error":']
    if error is None:
        parts.append(b"null")
    else:
        parts += (b'{"code":', dumps(error.code), b',"message":', dumps(error.message), b"}")
    if done is None:
        parts += (b',"incomplete_details":null,"usage":null', call.echo_json, b"}")
    else:
        parts += (b',"incomplete_details":',
                  b'{"reason":"max_output_tokens"}' if done.finish_reason == "length" else b"null",
                  b',"usage":', _usage(done), call.echo_json,
                  b',"actorproxy":{"step_index":%d,"session_id":' % done.step_index, dumps(done.session_id),
                  b',"tool_call_parse_error":%s}}' % (b"true" if done.tool_call_parse_error else b"false"))
    return b"".join(parts)


def response_reply(call: ResponsesCall, done: TurnDone, *, response_id: str, model: str,
                   tokenizer: Any = None) -> tuple[bytes, list[Issued]]:
    """The whole response object's JSON, and its output items; ``tokenizer`` (when the call asked for logprobs)
    spells the sampled tokens."""
    made = _Items(response_id, include_encrypted=call.include_encrypted, tools=call.echo.get("tools"))
    if tokenizer is not None:
        made.logprobs = dumps(sampled_logprobs(tokenizer, done))
    items = made.of(done.output)
    body = response_bytes(call, response_id=response_id, model=model, created_at=int(time.time()),
                          status=_status(done), output=[item.json for item in items], done=done)
    return body, items


class ResponseEventWriter:
    """The typed SSE events of one streamed response, in the order the ``openai`` SDK accumulates them.

    ``response.created`` and ``response.in_progress``; per output item
    ``output_item.added``, its content part and deltas (``reasoning_text``,
    ``output_text``, ``function_call_arguments``), their ``.done`` events and
    ``output_item.done``; one item open at a time; then ``response.completed``
    (``response.incomplete`` when the length limit ended the reply) with the
    items as streamed and ``usage``.
    """

    def __init__(self, call: ResponsesCall, *, response_id: str, model: str, tokenizer: Any = None) -> None:
        self._call = call
        self._tokenizer = tokenizer  # when the call asked for logprobs: they go out with the text's end
        self._response_id, self._model, self._created_at = response_id, model, int(time.time())
        self._items = _Items(response_id, include_encrypted=call.include_encrypted, tools=call.echo.get("tools"))
        self._sequence = 0
        #: The open item: its kind, id, a call's ``call_id`` and ``name`` members and its name's JSON, its JSON
        #: as added.
        self._open: tuple[str, str, bytes, bytes, bytes] | None = None
        #: What every event about the open item carries after its type: ``item_id``, ``output_index``.
        self._where = b""
        #: The open item's text so far: each delta's JSON string as its frame carries it (its end's events carry
        #: them joined, the text's JSON, not the text joined and encoded again).
        self._text: list[bytes] = []
        #: A reasoning item's text so far, when its end carries it encrypted too.
        self._reasoning: list[str] = []
        #: Where each completed message item is among the items, and its text's JSON (its logprobs come at the end).
        self._messages: list[tuple[int, bytes]] = []

    def _event(self, kind: bytes, members: bytes) -> bytes:
        """The frame of event ``kind`` whose data holds ``members`` (JSON text, each after a comma)."""
        frame = (b"event: " + kind + b'\ndata: {"type":"' + kind + b'"' + members
                 + b',"sequence_number":%d}\n\n' % self._sequence)
        self._sequence += 1
        return frame

    def _response(self, status: bytes, **kwargs: Any) -> bytes:
        output = [item.json for item in self._items.done]
        if self._open is not None:
            output.append(self._open[4])
        return b',"response":' + response_bytes(self._call, response_id=self._response_id, model=self._model,
                                                created_at=self._created_at, status=status, output=output, **kwargs)

    @property
    def items(self) -> list[Issued]:
        """The output items completed so far (all of them, once :meth:`finish` has run)."""
        return self._items.done

    def start(self) -> bytes:
        return self._event(b"response.created", self._response(b"in_progress")) + self._event(
            b"response.in_progress", self._response(b"in_progress"))

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        kind, item_id, call, name, _ = self._open
        pieces = self._text
        encoded = pieces[0] if len(pieces) == 1 else b'"' + b"".join([piece[1:-1] for piece in pieces]) + b'"'
        where = self._where
        frames = []
        if kind == "reasoning":
            frames.append(self._event(b"response.reasoning_text.done", where + b',"content_index":0,"text":' + encoded))
            frames.append(self._event(b"response.content_part.done", where + b',"content_index":0,"part":'
                                      b'{"type":"reasoning_text","text":' + encoded + b"}"))
        elif kind == "message":
            logprobs = self._items.logprobs
            frames.append(self._event(b"response.output_text.done", where + b',"content_index":0,"text":' + encoded
                                      + b',"logprobs":' + logprobs))
            frames.append(self._event(b"response.content_part.done", where + b',"content_index":0,"part":'
                                      + self._items.text_part(encoded)))
            if self._tokenizer is not None:
                self._messages.append((len(self._items.done), encoded))
        else:
            frames.append(self._event(b"response.function_call_arguments.done", where + b',"name":' + name
                                      + b',"arguments":' + encoded))
        item = self._items.complete(kind, item_id, encoded, call, "".join(self._reasoning))
        frames.append(self._event(b"response.output_item.done", b',"output_index":%d,"item":' % (
            len(self._items.done) - 1) + item.json))
        self._open, self._text, self._reasoning = None, [], []
        return frames

    def _begin(self, kind: str, call_id: str = "", name: str = "") -> list[bytes]:
        frames = self._close()
        item_id = self._items.new_id(kind)
        index = len(self._items.done)
        name_json = dumps(name)
        call = self._items.call_members(call_id, name) if kind == "function_call" else b""
        added = _Items.opened(kind, item_id, call)
        self._open = (kind, item_id, call, name_json, added)
        self._where = b',"item_id":' + dumps(item_id) + b',"output_index":%d' % index
        frames.append(self._event(b"response.output_item.added", b',"output_index":%d,"item":' % index + added))
        if kind == "reasoning":
            frames.append(self._event(b"response.content_part.added", self._where + b',"content_index":0,"part":'
                                      b'{"type":"reasoning_text","text":""}'))
        elif kind == "message":
            frames.append(self._event(b"response.content_part.added", self._where + b',"content_index":0,"part":'
                                      b'{"type":"output_text","text":"","annotations":[],"logprobs":[]}'))
        return frames

    def delta(self, delta: OutputDelta) -> bytes:
        frames: list[bytes] = []
        if delta.reasoning:
            if self._open is None or self._open[0] != "reasoning":
                frames += self._begin("reasoning")
            text = dumps(delta.reasoning)
            self._text.append(text)
            if self._call.include_encrypted:
                self._reasoning.append(delta.reasoning)
            frames.append(self._event(b"response.reasoning_text.delta", self._where + b',"content_index":0,"delta":'
                                      + text))
        if delta.content:
            if self._open is None or self._open[0] != "message":
                frames += self._begin("message")
            text = dumps(delta.content)
            self._text.append(text)
            frames.append(self._event(b"response.output_text.delta", self._where + b',"content_index":0,"delta":'
                                      + text + b',"logprobs":[]'))
        for piece in delta.tool_calls:
            if piece.id is not None:
                frames += self._begin("function_call", piece.id, piece.name or "")
            if piece.arguments:
                # A call's pieces arrive in order, right after its first one.
                text = dumps(piece.arguments)
                self._text.append(text)
                frames.append(self._event(b"response.function_call_arguments.delta", self._where + b',"delta":' + text))
        return b"".join(frames)

    def finish(self, done: TurnDone) -> bytes:
        if self._tokenizer is not None:
            # Deltas are parsed text, not tokens: the logprobs come with the text's end, or, when the
            # message ended before (a tool call after it), with the completed response's items.
            self._items.logprobs = dumps(sampled_logprobs(self._tokenizer, done))
            done_items = self._items.done
            for at, text in self._messages:
                item_id = done_items[at].id
                done_items[at] = Issued(item_id, self._items.json("message", item_id, text))
        frames = self._close()
        status = _status(done)
        frames.append(self._event(b"response." + status, self._response(status, done=done)))
        return b"".join(frames)

    def error(self, error: ProxyError) -> bytes:
        """A failure after the stream started: an ``error`` event, then ``response.failed``."""
        frames = [self._event(b"error", b',"code":' + dumps(error.code) + b',"message":' + dumps(error.message)
                              + b',"param":' + dumps(error.param))]
        frames.append(self._event(b"response.failed", self._response(b"failed", error=error)))
        self._open = None
        return b"".join(frames)
