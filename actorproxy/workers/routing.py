"""Which worker serves a request: the owner of its session, found in the URL, a header, the agent's key or the body.

A session belongs to worker ``crc32(key) % N`` where the key is the session id without a
sub-agent suffix (``<session>/sub-<n>`` is recorded by its parent's worker) and without a
segment suffix (``<session>#<n>``, a trajectory id). CRC-32 is stable across processes and
runs, unlike Python's salted ``hash()``: a restarted worker owns the same sessions, and the
journal it recovers is theirs.

The sources are those of :func:`actorproxy.server.identity.resolve_identity`, in its order:
the per-session URL, ``X-Session-Id``, ``X-Claude-Code-Session-Id``, ``X-SMG-Routing-Key``,
then the session an agent's session key names (which confines the call to that session
anyway), then the body's ``session_id`` (or ``trajectory_id`` for ``/trajectory/read``).
"""

from __future__ import annotations

import base64
import binascii
import zlib
from typing import Literal
from urllib.parse import unquote

import msgspec

#: Model routes (any mount: ``/``, ``/sess/<id>/``, ``/<trajectory_uid>/<prompt_uid>/``): a turn of a session.
TURN_SUFFIXES = ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/messages/count_tokens")
#: Our routes whose JSON body names the session.
BODY_SESSION_PATHS = frozenset({"/session/finalize", "/trajectory/read"})
#: Routes answered for every worker by the one that receives them (``fanout``).
FANOUT_PATHS = frozenset({
    "/v1/rollout/pause", "/v1/rollout/resume", "/v1/rollout/pause_state", "/trajectory/read",
    "/trajectory/stats", "/sessions", "/metrics", "/health", "/ready", "/ui/api/overview",
})
#: The Claw-R1 gateway: prompt groups span sessions (and so workers), and its hand-off queue is one process's.
GATEWAY_PATHS = frozenset({
    "/generate", "/init_trajectory", "/compute_reward", "/submit_steps", "/trajectory/fetch_batch",
})
GATEWAY_SUFFIXES = ("/v1/register_trajectory", "/v1/complete_trajectory")
_SESSION_HEADERS = (b"x-session-id", b"x-claude-code-session-id", b"x-smg-routing-key")
_KEY_PREFIX = "ap1."
#: The most of a body read to find its session id (a bigger one without a session header is served where it lands).
MAX_BODY = 64 * 1024 * 1024

NEED_BODY: Literal["body"] = "body"


class _Ids(msgspec.Struct):
    session_id: object = None
    trajectory_id: object = None


_IDS = msgspec.json.Decoder(_Ids)


def owner_key(session_id: str) -> str:
    """The part of a session (or trajectory) id that decides its worker."""
    key = session_id.partition("/sub-")[0]
    if "#" in key:
        head, _, index = key.rpartition("#")
        if index.isdigit():
            key = head
    return key


def owner(session_id: str, workers: int) -> int:
    """The worker that serves ``session_id``: stable across processes and restarts."""
    return zlib.crc32(owner_key(session_id).encode()) % workers


def is_gateway(path: str) -> bool:
    return path in GATEWAY_PATHS or path.startswith("/complete_trajectory/") or path.endswith(GATEWAY_SUFFIXES)


def _url_session(path: str) -> str | None:
    """The session a URL names (``/sess/<id>/v1/...``, ``/<trajectory>/<prompt>/v1/...``, ``/session/<id>``)."""
    parts = path.split("/")
    if path.startswith("/session/") and len(parts) >= 3 and parts[2] not in ("finalize", "open", ""):
        return unquote(path[len("/session/"):])
    if path.startswith("/ui/api/session/"):
        return unquote(path[len("/ui/api/session/"):])
    if len(parts) >= 5 and parts[3] == "v1" and parts[1] and parts[2]:
        return unquote(parts[2] if parts[1] == "sess" else parts[1])
    return None


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            text = value.decode("latin-1").strip()
            if text:
                return text
    return None


def _key_session(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The session an agent's session key names (not checked here: the owner checks it)."""
    token = _header(headers, b"x-api-key")
    auth = _header(headers, b"authorization")
    if auth is not None:
        scheme, _, rest = auth.partition(" ")
        if scheme.lower() == "bearer" and rest.strip():
            token = rest.strip()
    if token is None or not token.startswith(_KEY_PREFIX):
        return None
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        return base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


def head_session(path: str, headers: list[tuple[bytes, bytes]]) -> str | None | Literal["body"]:
    """The session a request head names; ``NEED_BODY`` when only its body can say; ``None``: no session."""
    path = path.partition("?")[0]
    turn = path.endswith(TURN_SUFFIXES)
    if turn or path.startswith(("/session/", "/ui/api/session/")):
        session = _url_session(path)
        if session is not None:
            return session
    if turn:
        for name in _SESSION_HEADERS:
            session = _header(headers, name)
            if session is not None:
                return session
        return _key_session(headers) or NEED_BODY
    if path in BODY_SESSION_PATHS:
        return NEED_BODY
    return None


def body_session(body: bytes) -> str | None:
    """The ``session_id`` (else ``trajectory_id``) of a JSON body; ``None`` when it names none (or is not JSON)."""
    try:
        ids = _IDS.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    for value in (ids.session_id, ids.trajectory_id):
        if isinstance(value, str) and value.strip():
            return value.strip()
    return None
