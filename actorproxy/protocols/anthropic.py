"""Anthropic Messages wire format (sans-IO): request conversion in, JSON and SSE events out.

:mod:`.anthropic_request` reads requests (:mod:`.anthropic_messages`: a history converted once
per distinct message); :mod:`.anthropic_reply` writes the replies
(message JSON, the streamed events, errors); :class:`AnthropicFormat` joins the two.

A Messages body converts to the same :class:`ChatRequest` the OpenAI path
builds for the equivalent OpenAI conversation, so an agent speaking either
protocol records the same tokens:

- ``system`` becomes a leading system message (text blocks joined with ``\\n``);
- a user message's ``tool_result`` blocks become ``tool`` messages (in order),
  then its text blocks one user message (joined with ``\\n``);
- an assistant message's ``thinking`` blocks become ``reasoning_content``, its
  text blocks ``content`` and its ``tool_use`` blocks ``tool_calls`` (arguments
  ``json.dumps(input, ensure_ascii=False)``); ``redacted_thinking`` is dropped;
- custom tools become function tools (``parameters`` = ``input_schema``).

- a ``role: "system"`` entry inside ``messages`` (current Claude Code sends
  them) becomes a system message at the same place (Qwen templates render a
  system turn mid-conversation); one with ``clear_at: "next_user_message"`` is
  left out once a later user message exists, as Anthropic does.

Anthropic's own fields we do not use are accepted and ignored; what we cannot
honour (images, server tools, assistant prefill) is refused with a 400 naming
it. The per-field decisions for what current clients send are in
docs/endpoints.md ("Anthropic fields").
"""

from __future__ import annotations

from typing import Any

from ..core.turn_events import TurnDone
from .anthropic_messages import AnthropicMemo, MessagesBody, load_messages_body
from .anthropic_reply import EventWriter as EventWriter
from .anthropic_reply import error_json as error_json
from .anthropic_reply import error_type as error_type
from .anthropic_reply import message_bytes as message_bytes
from .anthropic_reply import new_message_id as new_message_id
from .anthropic_reply import proxy_error_json as proxy_error_json
from .anthropic_reply import stop_reason as stop_reason
from .anthropic_reply import thinking_signature as thinking_signature
from .anthropic_request import AnthropicCall as AnthropicCall
from .anthropic_request import convert_messages as convert_messages
from .anthropic_request import convert_tools as convert_tools
from .anthropic_request import parse_messages_body as parse_messages_body
from .format import MemoFormat, ReplyInfo


class AnthropicFormat(MemoFormat[AnthropicCall, AnthropicMemo]):
    """``/v1/messages``."""

    errors = "anthropic"

    def __init__(self) -> None:
        super().__init__(AnthropicMemo(), load_messages_body)

    def parse(self, body: Any) -> AnthropicCall:
        if isinstance(body, MessagesBody):
            return parse_messages_body(body.fields.options, made=body.request)
        return parse_messages_body(body)

    def new_id(self) -> str:
        return new_message_id()

    def render(self, call: AnthropicCall, reply: ReplyInfo, done: TurnDone) -> bytes:
        return message_bytes(done, message_id=reply.id, model=reply.model, session_id=reply.session_id,
                             thinking=call.thinking_shown)

    def writer(self, call: AnthropicCall, reply: ReplyInfo) -> EventWriter:
        return EventWriter(message_id=reply.id, model=reply.model, thinking=call.thinking_shown)
