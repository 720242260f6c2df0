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


def content_blocks(output: AssistantOutput, *, thinking: bool = True) -> list[dict[str, Any]]:
    """The reply's blocks; ``thinking`` false leaves the reasoning out (the request did not enable it)."""
    blocks: list[dict[str, Any]] = []
    if output.reasoning and thinking:
        blocks.append({"type": "thinking", "thinking": output.reasoning,
                       "signature": thinking_signature(output.reasoning)})
    if output.content:
        blocks.append({"type": "text", "text": output.content})
    for call in output.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": _tool_input(call)})
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


def _usage(done: TurnDone) -> dict[str, int]:
    return {"input_tokens": done.prompt_tokens, "output_tokens": done.completion_tokens}


def message_json(
    done: TurnDone, *, message_id: str, model: str, session_id: str, thinking: bool = True
) -> dict[str, Any]:
    reason, sequence = stop_reason(done)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(done.output, thinking=thinking),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(done),
        # Our extra object, as on the OpenAI route (clients ignore unknown fields).
        "actorproxy": {"session_id": done.session_id or session_id, "step_index": done.step_index,
                       "tool_call_parse_error": done.tool_call_parse_error},
    }


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
    return error_json(error.status, error.message)


class EventWriter:
    """The SSE events of one streamed message.

    Content blocks get consecutive indexes, and each is closed before the next
    opens; a thinking block gets its ``signature_delta`` just before it closes.
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
    def _event(name: str, data: dict[str, Any]) -> bytes:
        return b"event: " + name.encode() + b"\ndata: " + dumps({"type": name, **data}) + b"\n\n"

    def start(self, accepted: TurnAccepted) -> bytes:
        input_tokens = accepted.prompt_tokens
        message: dict[str, Any] = {
            "id": self._message_id, "type": "message", "role": "assistant", "model": self._model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }
        return self._event("message_start", {"message": message})

    def heartbeat(self) -> bytes:
        return self._event("ping", {})

    def _close(self) -> list[bytes]:
        if self._open is None:
            return []
        frames = []
        if self._open == "thinking":
            signature = thinking_signature("".join(self._thinking))
            frames.append(self._delta({"type": "signature_delta", "signature": signature}))
        frames.append(self._event("content_block_stop", {"index": self._index}))
        self._open = None
        return frames

    def _begin(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        frames = self._close()
        self._index += 1
        self._open = kind
        self._thinking = []
        frames.append(self._event("content_block_start", {"index": self._index, "content_block": block}))
        return frames

    def _delta(self, delta: dict[str, Any], index: int | None = None) -> bytes:
        return self._event("content_block_delta", {"index": self._index if index is None else index, "delta": delta})

    def delta(self, delta: OutputDelta) -> bytes:
        frames: list[bytes] = []
        if delta.reasoning and self._show_thinking:
            if self._open != "thinking":
                frames += self._begin("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._thinking.append(delta.reasoning)
            frames.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            if self._open != "text":
                frames += self._begin("text", {"type": "text", "text": ""})
            frames.append(self._delta({"type": "text_delta", "text": delta.content}))
        for piece in delta.tool_calls:
            if piece.id is not None:
                frames += self._begin(
                    "tool_use", {"type": "tool_use", "id": piece.id, "name": piece.name or "", "input": {}}
                )
                self._calls[piece.index] = self._index
            if piece.arguments:
                # Pieces of a call arrive in order, right after its first one.
                index = self._calls.get(piece.index, self._index)
                frames.append(self._delta({"type": "input_json_delta", "partial_json": piece.arguments}, index))
        return b"".join(frames)

    def finish(self, done: TurnDone) -> bytes:
        reason, sequence = stop_reason(done)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        frames = [*self._close(), self._event("message_delta", {"delta": delta, "usage": _usage(done)})]
        return b"".join([*frames, self._event("message_stop", {})])

    def error(self, error: ProxyError) -> bytes:
        body = proxy_error_json(error)
        return b"event: error\ndata: " + dumps(body) + b"\n\n"
