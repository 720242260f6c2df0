"""The one admission step every request passes: who may call, how big a body may be, and how a refusal reads.

The turn lane (:mod:`.lane`) and the Quart app (:mod:`.app`) both ask the same
:class:`Admission`, so that a request is admitted or refused alike whichever of the
two serves it (``tests/server/test_admission.py`` sends the same table of requests to both):

- :meth:`Admission.admit`: the access policy (:mod:`.auth`) for the request's path and
  headers: the admin token on the trainer's routes, the agent's credentials on the
  agent's routes (and the session a session key confines the call to), nothing on the
  public ones; and who the caller is for the per-client session bound.
- :meth:`Admission.check_length` and :meth:`Admission.check_size`: the body limit
  (``max_body``; 413). The Quart app applies the same ``max_body`` and ``body_timeout``
  (408) through its ``MAX_CONTENT_LENGTH`` and ``BODY_TIMEOUT``.
- :meth:`Admission.refusal`: any error as the reply the caller's protocol expects
  (:mod:`.replies`: Anthropic's shape on ``/v1/messages`` routes, OpenAI's elsewhere;
  another dialect's when ``reshape`` is set).

Sans-IO: it reads what it is given and raises or returns; it never touches a socket.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from typing import Final, NamedTuple

import attrs
from werkzeug.exceptions import RequestEntityTooLarge

from ..errors import release
from .auth import AGENT_SUFFIXES, AccessPolicy, Headers, check_scope, route_kind
from .identity import url_mount
from .replies import ErrorReply, error_reply, is_anthropic_route

#: Turns an error reply into another dialect's shape (``--api-dialect dressage``).
Reshape = Callable[[Exception, ErrorReply], ErrorReply]


class Unmatched(enum.Enum):
    """:meth:`Admission.admit`'s ``url_session`` when the caller has not matched the path's mount."""

    UNMATCHED = enum.auto()


UNMATCHED: Final = Unmatched.UNMATCHED


class RequestHeaders:
    """A request's raw headers as the checks read them: case-insensitive, the first value of a repeated name."""

    __slots__ = ("_values",)

    def __init__(self, raw: Iterable[tuple[bytes, bytes]]) -> None:
        # Last to first, so that the first value of a repeated name is the one kept.
        self._values = {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in reversed([*raw])}

    def get(self, key: str, /) -> str | None:
        return self._values.get(key.lower())


class Admitted(NamedTuple):
    """A request let in: the session an agent's key confines it to, and who it is for the session bound.

    A named tuple, not an attrs class: one is made per turn, on the lane's hot path.
    """

    #: The session the caller's session key names (``None``: not confined).
    confined: str | None = None
    #: Who opens a session (:meth:`.auth.AccessPolicy.client_of`; ``None``: the trainer).
    client: str | None = None


@attrs.frozen
class Admission:
    """The admission rules of one app: its access policy, its body limits, its error shape."""

    policy: AccessPolicy
    #: Largest request body accepted, in bytes (413 past it).
    max_body: int
    #: Seconds a request body may take to arrive (408 past it).
    body_timeout: float
    reshape: Reshape | None = None

    def admit(self, path: str, headers: Headers, remote: str | None, *, query_token: str | None = None,
              url_session: str | None | Unmatched = UNMATCHED) -> Admitted:
        """Let the request for ``path`` in, or raise :class:`~actorproxy.errors.Unauthorized`.

        ``remote`` is the client's address; ``query_token`` the ``?token=`` of the URL, which
        only the dashboard's page (``/ui``) takes (a browser opening it cannot send a header).
        ``url_session``: the session the path's mount names, when the caller matched it already
        (the lane's route match: :func:`.identity.url_mount`); by default it is matched here.
        """
        policy = self.policy
        confined = None
        kind = route_kind(path)
        if kind == "admin":
            policy.check_admin({"authorization": f"Bearer {query_token}"} if query_token and path == "/ui" else headers)
        elif kind == "agent":
            confined = policy.agent_session(headers)
            if confined is not None:
                if url_session is UNMATCHED:
                    mount = url_mount(path, AGENT_SUFFIXES)
                    url_session = None if mount is None else mount[1]
                if url_session is not None:
                    # A key opens its own session's URLs only, every route under them (the turns check the
                    # session again, as they also read it from headers and body).
                    check_scope(confined, url_session)
        return Admitted(confined, policy.client_of(headers, confined, remote))

    def check_length(self, headers: Headers) -> None:
        """413 when the body the headers announce is larger than ``max_body``."""
        if announced_length(headers) > self.max_body:
            raise RequestEntityTooLarge()

    def check_size(self, size: int) -> None:
        """413 when ``size`` bytes of body, received so far, are more than ``max_body``."""
        if size > self.max_body:
            raise RequestEntityTooLarge()

    def refusal(self, error: Exception, *, method: str, path: str) -> ErrorReply:
        """The reply to ``error`` in the caller's format; the error is then released (answered and logged)."""
        failed = error_reply(error, anthropic_shape=is_anthropic_route(path), method=method, path=path)
        if self.reshape is not None:
            failed = self.reshape(error, failed)
        release(error)  # its traceback must not keep the body alive in a cycle
        return failed


def announced_length(headers: Headers) -> int:
    """The announced body length, as werkzeug reads it (0 when there is none or it is chunked)."""
    value = headers.get("content-length")
    if value is None or headers.get("transfer-encoding") == "chunked":
        return 0
    try:
        return max(0, int(value.strip()))
    except ValueError:
        return 0
