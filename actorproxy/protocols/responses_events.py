"""OpenAI Responses API output (sans-IO): the response object and the typed SSE events of a stream.

Item ids derive from the response id (``rs_``/``msg_``/``fc_`` + its hex + the
item's position); a function call's ``call_id`` is the proxy's tool-call id, so
an echoed call matches the step it came from. Reasoning goes out as
``reasoning_text`` content and, when the client asks for
``reasoning.encrypted_content``, also as a reversible ``encrypted_content``.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

from ..core.ids import uuid4_hex
from ..core.messages import AssistantOutput
from ..core.parser import OutputDelta
from ..core.turn_events import TurnDone
from ..errors import ProxyError
from .openai_chat import sampled_logprobs
from .responses_api import ENCRYPTED_PREFIX, ResponsesCall


def new_response_id() -> str:
    return "resp_" + uuid4_hex()


def encrypt_reasoning(text: str) -> str:
    """Our stand-in for OpenAI's encrypted reasoning: reversible, so a stateless client's echo restores it."""
    return ENCRYPTED_PREFIX + base64.b64encode(text.encode()).decode()


def _usage(done: TurnDone) -> dict[str, Any]:
    return {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def _status(done: TurnDone) -> tuple[str, dict[str, str] | None]:
    if done.finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


class _Items:
    """The output items of one response: ids derived from the response id, in the order opened."""

    def __init__(self, response_id: str, *, include_encrypted: bool) -> None:
        self._stem = response_id.removeprefix("resp_")
        self._include_encrypted = include_encrypted
        self.items: list[dict[str, Any]] = []
        #: The sampled tokens' logprobs, once known, when the client asked for them (on the message's text).
        self.logprobs: list[dict[str, Any]] = []

    def open(self, kind: str, **fields: Any) -> dict[str, Any]:
        prefix = {"reasoning": "rs", "message": "msg", "function_call": "fc"}[kind]
        item: dict[str, Any] = {"id": f"{prefix}_{self._stem}_{len(self.items)}", "type": kind}
        if kind == "reasoning":
            item.update(summary=[], content=[])
        elif kind == "message":
            item.update(role="assistant", content=[])
        item.update(fields, status="in_progress")
        self.items.append(item)
        return item

    def done(self, item: dict[str, Any], text: str) -> dict[str, Any]:
        """Fill ``item`` with its final ``text`` (arguments, for a call) and mark it completed."""
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            if self._include_encrypted:
                item["encrypted_content"] = encrypt_reasoning(text)
        elif item["type"] == "message":
            item["content"] = [{"type": "output_text", "text": text, "annotations": [], "logprobs": self.logprobs}]
        else:
            item["arguments"] = text
        item["status"] = "completed"
        return item

    def of(self, output: AssistantOutput) -> list[dict[str, Any]]:
        """The items of a whole output at once (a non-streamed response)."""
        if output.reasoning:
            self.done(self.open("reasoning"), output.reasoning)
        if output.content or not output.tool_calls:
            self.done(self.open("message"), output.content)
        for call in output.tool_calls:
            self.done(self.open("function_call", call_id=call.id, name=call.name, arguments=""), call.arguments)
        return self.items


def response_object(call: ResponsesCall, *, response_id: str, model: str, created_at: int, status: str,
                    output: list[dict[str, Any]], done: TurnDone | None = None,
                    error: ProxyError | None = None) -> dict[str, Any]:
    """The ``response`` object (``status`` in_progress, completed, incomplete or failed)."""
    incomplete = _status(done)[1] if done is not None else None
    body: dict[str, Any] = {
        "id": response_id, "object": "response", "created_at": created_at, "status": status, "model": model,
        "output": output, "error": None if error is None else {"code": error.code, "message": error.message},
        "incomplete_details": incomplete, "usage": None if done is None else _usage(done), **call.echo,
    }
    if done is not None:
        body["actorproxy"] = {"step_index": done.step_index, "session_id": done.session_id,
                              "tool_call_parse_error": done.tool_call_parse_error}
    return body


def response_json(call: ResponsesCall, done: TurnDone, *, response_id: str, model: str,
                  tokenizer: Any = None) -> dict[str, Any]:
    """The whole response object; ``tokenizer`` (when the call asked for logprobs) spells the sampled tokens."""
    made = _Items(response_id, include_encrypted=call.include_encrypted)
    if tokenizer is not None:
        made.logprobs = sampled_logprobs(tokenizer, done)
    items = made.of(done.output)
    return response_object(call, response_id=response_id, model=model, created_at=int(time.time()),
                           status=_status(done)[0], output=items, done=done)


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
        self._items = _Items(response_id, include_encrypted=call.include_encrypted)
        self._sequence = 0
        self._open: dict[str, Any] | None = None
        self._text: list[str] = []

    def _event(self, kind: str, **data: Any) -> bytes:
        payload = json.dumps({"type": kind, **data, "sequence_number": self._sequence}, ensure_ascii=False)
        self._sequence += 1
        return f"event: {kind}\ndata: {payload}\n\n".encode()

    def _response(self, status: str, **kwargs: Any) -> dict[str, Any]:
        return response_object(self._call, response_id=self._response_id, model=self._model,
                               created_at=self._created_at, status=status, output=self._items.items, **kwargs)

    @property
    def items(self) -> list[dict[str, Any]]:
        """The output items opened so far (all of them, once :meth:`finish` has run)."""
        return self._items.items

    def start(self) -> bytes:
        return self._event("response.created", response=self._response("in_progress")) + self._event(
            "response.in_progress", response=self._response("in_progress"))

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self._items.items) - 1}

    def _close(self) -> list[bytes]:
        item = self._open
        if item is None:
            return []
        text, where = "".join(self._text), self._where()
        frames = []
        if item["type"] == "reasoning":
            frames.append(self._event("response.reasoning_text.done", **where, content_index=0, text=text))
            frames.append(self._event("response.content_part.done", **where, content_index=0,
                                      part={"type": "reasoning_text", "text": text}))
        elif item["type"] == "message":
            logprobs = self._items.logprobs
            frames.append(self._event("response.output_text.done", **where, content_index=0, text=text,
                                      logprobs=logprobs))
            frames.append(self._event("response.content_part.done", **where, content_index=0, part={
                "type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}))
        else:
            frames.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                      arguments=text))
        self._items.done(item, text)
        frames.append(self._event("response.output_item.done", output_index=where["output_index"], item=item))
        self._open, self._text = None, []
        return frames

    def _begin(self, kind: str, **fields: Any) -> list[bytes]:
        frames = self._close()
        self._open = self._items.open(kind, **fields)
        frames.append(self._event("response.output_item.added", output_index=len(self._items.items) - 1,
                                  item=dict(self._open)))
        part = {"reasoning": {"type": "reasoning_text", "text": ""},
                "message": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}}.get(kind)
        if part is not None:
            frames.append(self._event("response.content_part.added", **self._where(), content_index=0, part=part))
        return frames

    def delta(self, delta: OutputDelta) -> bytes:
        frames: list[bytes] = []
        if delta.reasoning:
            if self._open is None or self._open["type"] != "reasoning":
                frames += self._begin("reasoning")
            self._text.append(delta.reasoning)
            frames.append(self._event("response.reasoning_text.delta", **self._where(), content_index=0,
                                      delta=delta.reasoning))
        if delta.content:
            if self._open is None or self._open["type"] != "message":
                frames += self._begin("message")
            self._text.append(delta.content)
            frames.append(self._event("response.output_text.delta", **self._where(), content_index=0,
                                      delta=delta.content, logprobs=[]))
        for piece in delta.tool_calls:
            if piece.id is not None:
                frames += self._begin("function_call", call_id=piece.id, name=piece.name or "", arguments="")
            if piece.arguments:
                # A call's pieces arrive in order, right after its first one.
                self._text.append(piece.arguments)
                frames.append(self._event("response.function_call_arguments.delta", **self._where(),
                                          delta=piece.arguments))
        return b"".join(frames)

    def finish(self, done: TurnDone) -> bytes:
        if self._tokenizer is not None:
            # Deltas are parsed text, not tokens: the logprobs come with the text's end, or, when the
            # message ended before (a tool call after it), with the completed response's items.
            logprobs = self._items.logprobs = sampled_logprobs(self._tokenizer, done)
            for item in self._items.items:
                if item["type"] == "message" and item["status"] == "completed":
                    item["content"][0]["logprobs"] = logprobs
        frames = self._close()
        status = _status(done)[0]
        kind = "response.completed" if status == "completed" else "response.incomplete"
        frames.append(self._event(kind, response=self._response(status, done=done)))
        return b"".join(frames)

    def error(self, error: ProxyError) -> bytes:
        """A failure after the stream started: an ``error`` event, then ``response.failed``."""
        frames = [self._event("error", code=error.code, message=error.message, param=error.param)]
        self._open = None
        frames.append(self._event("response.failed", response=self._response("failed", error=error)))
        return b"".join(frames)
