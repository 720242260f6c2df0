"""The OpenAI Responses API as a :class:`TurnFormat`, served by the generic turn route.

The protocol itself (body conversion, stored conversations, the typed event
stream) lives in ``responses_api.py`` and ``responses_events.py``; this module
only plugs it into ``server/turns.py``: ``previous_response_id`` is resolved in
:meth:`ResponsesFormat.prepare`, a stored reply remembered in
:meth:`ResponsesFormat.completed`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import attrs

from ..core.parser import OutputDelta
from ..core.requests import ChatRequest, Identity
from ..core.turn_events import TurnAccepted, TurnDone
from ..errors import BadRequest, ProxyError
from .format import BodyIdentity, Headers, MemoFormat, ReplyInfo
from .responses_api import Issued, IssuedItems, ResponseHistory, ResponsesCall, parse_responses_body
from .responses_events import ResponseEventWriter, new_response_id, response_reply
from .responses_memo import ResponsesBody, ResponsesMemo, load_responses_body

#: Codex names its conversation with these headers (after the body's ``session_id``).
CONVERSATION_HEADERS = ("session-id", "thread-id")


class _Writer:
    """``ResponseEventWriter`` as a :class:`~actorproxy.protocols.format.StreamWriter` (an SSE comment as heartbeat).

    ``issued``, for a stored response, keeps its output items as streamed (``item_reference``).
    """

    def __init__(self, inner: ResponseEventWriter, issued: Callable[[list[Issued]], None] | None) -> None:
        self._inner = inner
        self._issued = issued

    def start(self, accepted: TurnAccepted) -> bytes:
        return self._inner.start()

    def delta(self, delta: OutputDelta) -> bytes:
        return self._inner.delta(delta)

    def heartbeat(self) -> bytes:
        return b": keep-alive\n\n"

    def finish(self, done: TurnDone) -> bytes:
        frames = self._inner.finish(done)
        if self._issued is not None:
            self._issued(self._inner.items)
        return frames

    def error(self, error: ProxyError) -> bytes:
        return self._inner.error(error)


class ResponsesFormat(MemoFormat[ResponsesCall, ResponsesMemo]):
    """``/v1/responses``, with the stored conversations ``previous_response_id`` names."""

    errors = "openai"

    def __init__(self, tokenizer: Any = None) -> None:
        super().__init__(ResponsesMemo(), load_responses_body)
        #: Spells the sampled tokens when a call asks for ``message.output_text.logprobs``.
        self._tokenizer = tokenizer
        self.history = ResponseHistory()
        #: Output items of stored responses, for ``item_reference`` input items.
        self.issued = IssuedItems()

    def parse(self, body: Any) -> ResponsesCall:
        if isinstance(body, ResponsesBody):
            call = parse_responses_body(body.fields.options, made=body.request, echo=body.echo,
                                        echo_json=body.echo_json)
        elif isinstance(body, dict):
            # item_reference never converts on the memo's path: such a body arrives here whole.
            body, references = self.issued.resolve(body)
            call = parse_responses_body(body)
            if references:
                call = attrs.evolve(call, references=references)
        else:
            call = parse_responses_body(body)
        if call.logprobs and self._tokenizer is None:
            raise BadRequest("'message.output_text.logprobs' is not available on this route", param="include")
        return call

    def _logprobs_tokenizer(self, call: ResponsesCall) -> Any:
        return self._tokenizer if call.logprobs else None

    def new_id(self) -> str:
        return new_response_id()

    def body_identity(self, call: ResponsesCall, headers: Headers) -> BodyIdentity:
        session = call.session_id
        for name in CONVERSATION_HEADERS:
            session = session or headers.get(name)
        return session, None, None

    def prepare(self, call: ResponsesCall, identity: Identity) -> ChatRequest:
        IssuedItems.check(call, identity.session_id)
        if call.previous_response_id is None:
            return call.request
        return call.continuing(self.history.conversation(identity.session_id, call.previous_response_id))

    def completed(self, call: ResponsesCall, identity: Identity, reply: ReplyInfo, done: TurnDone) -> None:
        if call.store:
            self.history.add(identity.session_id, reply.id, call.previous_response_id, call.own_messages(),
                             done.output)

    def render(self, call: ResponsesCall, reply: ReplyInfo, done: TurnDone) -> bytes:
        body, items = response_reply(call, done, response_id=reply.id, model=reply.model,
                                     tokenizer=self._logprobs_tokenizer(call))
        if call.store:
            self.issued.add(reply.session_id, items)
        return body

    def writer(self, call: ResponsesCall, reply: ReplyInfo) -> _Writer:
        issued = partial(self.issued.add, reply.session_id) if call.store else None
        return _Writer(ResponseEventWriter(call, response_id=reply.id, model=reply.model,
                                           tokenizer=self._logprobs_tokenizer(call)), issued)
