"""Anthropic Messages replies (sans-IO): the message JSON, the SSE events of a streamed one, errors."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..core.ids import uuid4_hex
from ..core.messages import AssistantOutput, ToolCall
from ..core.parser import OutputDelta
from ..core.turn_events import TurnAccepted, TurnDone
from ..errors import ProxyError
from ..schema.jsonio import dumps


def new_message_id() -> str:
    return "msg_" + uuid4_hex()


def thinking_signature(thinking: str) -> str:
    """A deterministic stand-in for Anthropic's opaque signature (clients drop unsigned thinking)."""
    return "actorproxy-sha256-" + hashlib.sha256(thinking.encode()).hexdigest()


def _tool_input(call: ToolCall) -> Any:
    return call.parsed if isinstance(call.parsed, dict) else json.loads(call.arguments)


def _blocks(output: AssistantOutput, thinking: bool) -> list[bytes]:
    """The reply's content blocks' JSON; ``thinking`` false leaves the reasoning out (the request did not enable
    it)."""
    blocks: list[bytes] = []
    if output.reasoning and thinking:
        blocks.append(b'{"type":"thinking","thinking":' + dumps(output.reasoning) + b',"signature":'
                      + dumps(thinking_signature(output.reasoning)) + b"}")
    if output.content:
        blocks.append(b'{"type":"text","text":' + dumps(output.content) + b"}")
    for call in output.tool_calls:
        blocks.append(b'{"type":"tool_use","id":' + dumps(call.id) + b',"name":' + dumps(call.name) + b',"input":'
                      + dumps(_tool_input(call)) + b"}")
    return blocks


def stop_reason(done: TurnDone) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for a finished turn."""
    if done.finish_reason == "length":
        return "max_tokens", None
    if done.output.tool_calls:
        return "tool_use", None
    if done.stop_sequence is not None:
        return "stop_sequence", done.stop_sequence
    return "end_turn", None


def _usage(done: TurnDone) -> bytes:
    """The ``usage`` object's JSON."""
    return b'{"input_tokens":%d,"output_tokens":%d}' % (done.prompt_tokens, done.completion_tokens)


def message_bytes(done: TurnDone, *, message_id: str, model: str, session_id: str, thinking: bool = True) -> bytes:
    """The ``message`` reply's JSON bytes, written directly around the strings it carries: no JSON value is
    built (the bytes its value would give: ``tests/protocols/test_anthropic_reply.py``). Only a tool call's
    input is a value, the one its arguments were read to."""
    reason, sequence = stop_reason(done)
    return b"".join((
        b'{"id":', dumps(message_id), b',"type":"message","role":"assistant","model":', dumps(model),
        b',"content":[', b",".join(_blocks(done.output, thinking)), b'],"stop_reason":', dumps(reason),
        b',"stop_sequence":', dumps(sequence),
        b',"usage":', _usage(done),
        # Our extra object, as on the OpenAI route (clients ignore unknown fields).
        b',"actorproxy":{"session_id":', dumps(done.session_id or session_id),
        b',"step_index":%d,"tool_call_parse_error":%s}}'
        % (done.step_index, b"true" if done.tool_call_parse_error else b"false"),
    ))


_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """Anthropic's ``error.type`` for an HTTP status."""
    return _ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")


def error_json(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def proxy_error_json(error: ProxyError) -> dict[str, Any]:
    return error_json(error.status, error.anthropic_message)


class EventWriter:
    """The SSE events of one streamed message.

    Content blocks get consecutive indexes, and each is closed before the next
    opens; a thinking block gets its ``signature_delta`` just before it closes.
    Every frame is written as bytes directly, around the strings it carries: no
    event's JSON value is built (the same bytes it would give:
    ``tests/protocols/test_anthropic_reply.py``), as chat's chunks are.
    """

    def __init__(self, *, message_id: str, model: str, thinking: bool = True) -> None:
        self._message_id = message_id
        self._show_thinking = thinking  # false: reasoning deltas are not sent (the request did not enable it)
        self._model = model
        self._index = -1
        self._open: str | None = None
        self._thinking: list[str] = []
        #: tool-call index -> block index
        self._calls: dict[int, int] = {}

    @staticmethod
    def _event(name: bytes, members: bytes = b"") -> bytes:
        """The frame of event ``name`` whose data holds ``members`` (JSON text, each after a comma) after its type."""
        return b"event: " + name + b'\ndata: {"type":"' + name + b'"' + members + b"}\n\n"

    def start(self, accepted: TurnAccepted) -> bytes:
        return self._event(b"message_start", b',"message":{"id":' + dumps(self._message_id)
                           + b',"type":"message","role":"assistant","model":' + dumps(self._model)
                           + b',"content":[],"stop_reason":null,"stop_sequence":null,'
                           b'"usage":{"input_tokens":%d,"output_tokens":0}}' % accepted.prompt_tokens)

    def heartbeat(self) -> bytes:
        return self._event(b"ping")

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        frames = []
        if self._open == "thinking":
            signature = thinking_signature("".join(self._thinking))
            frames.append(self._delta(b'"type":"signature_delta","signature":' + dumps(signature)))
        frames.append(self._event(b"content_block_stop", b',"index":%d' % self._index))
        self._open = None
        return frames

    def _begin(self, kind: str, block: bytes) -> list[bytes]:
        """Close the open block and open one of ``kind``: ``block`` is its ``content_block``'s JSON."""
        frames = self._close()
        self._index += 1
        self._open = kind
        self._thinking = []
        frames.append(self._event(b"content_block_start", b',"index":%d,"content_block":%s' % (self._index, block)))
        return frames

    def _delta(self, delta: bytes, index: int | None = None) -> bytes:
        """A ``content_block_delta`` frame whose delta object holds ``delta`` (its members' JSON text)."""
        return self._event(b"content_block_delta", b',"index":%d,"delta":{%s}' % (
            self._index if index is None else index, delta))

    def delta(self, delta: OutputDelta) -> bytes:
        frames: list[bytes] = []
        if delta.reasoning and self._show_thinking:
            if self._open != "thinking":
                frames += self._begin("thinking", b'{"type":"thinking","thinking":"","signature":""}')
            self._thinking.append(delta.reasoning)
            frames.append(self._delta(b'"type":"thinking_delta","thinking":' + dumps(delta.reasoning)))
        if delta.content:
            if self._open != "text":
                frames += self._begin("text", b'{"type":"text","text":""}')
            frames.append(self._delta(b'"type":"text_delta","text":' + dumps(delta.content)))
        for piece in delta.tool_calls:
            if piece.id is not None:
                frames += self._begin("tool_use", b'{"type":"tool_use","id":' + dumps(piece.id) + b',"name":'
                                      + dumps(piece.name or "") + b',"input":{}}')
                self._calls[piece.index] = self._index
            if piece.arguments:
                # Pieces of a call arrive in order, right after its first one.
                index = self._calls.get(piece.index, self._index)
                frames.append(self._delta(b'"type":"input_json_delta","partial_json":' + dumps(piece.arguments),
                                          index))
        return b"".join(frames)

    def finish(self, done: TurnDone) -> bytes:
        reason, sequence = stop_reason(done)
        members = (b',"delta":{"stop_reason":' + dumps(reason) + b',"stop_sequence":' + dumps(sequence)
                   + b'},"usage":' + _usage(done))
        return b"".join([*self._close(), self._event(b"message_delta", members), self._event(b"message_stop")])

    def error(self, error: ProxyError) -> bytes:
        body = proxy_error_json(error)
        return b"event: error\ndata: " + dumps(body) + b"\n\n"
