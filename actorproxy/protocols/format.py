"""What a chat protocol provides to the one generic turn route (``server/turns.py``).

A protocol (OpenAI chat completions, Anthropic Messages, the OpenAI Responses
API) is a :class:`TurnFormat`: it parses a request body into a call carrying a
protocol-neutral :class:`ChatRequest`, renders a finished turn as its JSON reply,
and makes a :class:`StreamWriter` for its SSE frames. The route does the rest
(identity, the runtime, heartbeats, errors), identically for every protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Literal, Protocol, TypeVar

import attrs

from ..core.parser import OutputDelta
from ..core.requests import ChatRequest, Identity
from ..core.turn_events import TurnAccepted, TurnDone
from ..errors import ProxyError
from ..schema.jsonio import load_body

#: Whose error shape a route answers in: OpenAI ``{"error": {...}}`` or Anthropic ``{"type": "error", ...}``.
ErrorStyle = Literal["openai", "anthropic"]


class Headers(Protocol):
    """A request's headers, as far as a format reads them (case-insensitive in practice)."""

    def get(self, key: str, /) -> str | None: ...


class TurnCall(Protocol):
    """A parsed request body: the chat request plus what the route needs to serve it."""

    @property
    def request(self) -> ChatRequest: ...
    @property
    def model(self) -> str: ...
    @property
    def stream(self) -> bool: ...


#: Session, prompt group and turn as a body names them (each ``None`` when it does not).
BodyIdentity = tuple[str | None, str | None, str | None]


@attrs.frozen
class ReplyInfo:
    """What a reply is labelled with: its id, the model name it reports, the session that asked."""

    id: str
    model: str
    session_id: str


class StreamWriter(Protocol):
    """The SSE frames of one streamed reply (bytes; an empty result sends nothing)."""

    def start(self, accepted: TurnAccepted) -> bytes: ...
    def delta(self, delta: OutputDelta) -> bytes: ...
    def heartbeat(self) -> bytes: ...
    def finish(self, done: TurnDone) -> bytes: ...
    def error(self, error: ProxyError) -> bytes: ...


C = TypeVar("C", bound=TurnCall)


class TurnFormat(Generic[C]):
    """One chat protocol. Subclasses implement :meth:`parse`, :meth:`render` and :meth:`writer`.

    The hooks :meth:`body_identity`, :meth:`prepare` and :meth:`completed` let a
    protocol with server-side state (the Responses API's ``previous_response_id``)
    resolve it before the turn and remember the reply after it.
    """

    #: The shape of this protocol's error bodies.
    errors: ErrorStyle = "openai"

    def load(self, raw: bytes) -> Any:
        """A request's body as :meth:`parse` takes it: by default its JSON value (400 when empty or not JSON)."""
        return load_body(raw)

    def age(self) -> None:
        """After a drain of the whole store: what :meth:`load` keeps of recent bodies drops what no turn used
        since the last drain (``Runtime.after_drain``)."""

    def parse(self, body: Any) -> C:
        """The call a body (:meth:`load`) asks for; :class:`~actorproxy.errors.BadRequest` naming the bad field."""
        raise NotImplementedError

    def new_id(self) -> str:
        raise NotImplementedError

    def body_identity(self, call: C, headers: Headers) -> BodyIdentity:
        """Who the body (or a protocol's own header) says the call belongs to; the URL and standard headers win.

        By default the call's ``session_id``, ``instance_id`` and ``turn_id`` attributes, if it has them.
        """
        return (getattr(call, "session_id", None), getattr(call, "instance_id", None), getattr(call, "turn_id", None))

    def prepare(self, call: C, identity: Identity) -> ChatRequest:
        """The request the session runs (a protocol may complete it from stored state)."""
        return call.request

    def completed(self, call: C, identity: Identity, reply: ReplyInfo, done: TurnDone) -> None:
        """Called once the turn finished, before its reply is written."""

    def render(self, call: C, reply: ReplyInfo, done: TurnDone) -> bytes:
        """The non-streamed reply's JSON bytes."""
        raise NotImplementedError

    def writer(self, call: C, reply: ReplyInfo) -> StreamWriter:
        """A writer for the streamed reply's frames."""
        raise NotImplementedError


class Memo(Protocol):
    """What a format keeps of recent bodies (:mod:`.memo`), as far as the format itself handles it."""

    def age(self) -> None: ...


M = TypeVar("M", bound=Memo)


class MemoFormat(TurnFormat[C], Generic[C, M]):
    """A protocol whose bodies load through a memo of recent histories (chat, Anthropic, Responses):
    a history is not converted again every turn."""

    def __init__(self, memo: M, load: Callable[[bytes, M], Any]) -> None:
        self._memo = memo
        self._load = load

    def load(self, raw: bytes) -> Any:
        return self._load(raw, self._memo)

    def age(self) -> None:
        self._memo.age()
