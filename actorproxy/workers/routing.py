"""Which worker serves a request: the owner of its session, found in the URL, a header, the agent's key or the body.

A session belongs to worker ``crc32(key) % N`` where the key is the session id without a
sub-agent suffix (``<session>/sub-<n>`` is recorded by its parent's worker) and without a
segment suffix (``<session>#<n>``, a trajectory id). CRC-32 is stable across processes and
runs, unlike Python's salted ``hash()``: a restarted worker owns the same sessions, and the
journal it recovers is theirs.

The head is read by the app's own function (:func:`actorproxy.server.identity.named_session`,
on the path the app sees: origin-form, percent-decoded): the per-session URL, then
``X-Session-Id``, ``X-Claude-Code-Session-Id``, ``X-SMG-Routing-Key``; then the session an
agent's key names (checked by the router: see :mod:`.handoff`), then the body's
``session_id`` (or ``trajectory_id`` for ``/trajectory/read``), and for ``/v1/responses`` the
headers Codex names its conversation with. The body is searched within bounds: at most
``MAX_BODY`` bytes (the app's own limit), and a body nested past the interpreter's recursion
limit names nothing here (the app refuses it: 400, it accepts 100 levels).
"""

from __future__ import annotations

import zlib
from typing import Literal

import msgspec

from ..errors import BadRequest
from ..protocols.responses_format import CONVERSATION_HEADERS
from ..server.admission import Admission
from ..server.app import MAX_BODY_BYTES
from ..server.auth import AccessPolicy, Headers
from ..server.identity import named_session, url_mount

#: Model routes (any mount: ``/``, ``/sess/<id>/``, ``/<trajectory_uid>/<prompt_uid>/``): a turn of a session.
TURN_SUFFIXES = ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/v1/messages/count_tokens")
#: Our routes whose JSON body names the session.
BODY_SESSION_PATHS = frozenset({"/session/finalize", "/session/discard", "/trajectory/read"})
#: Routes answered for every worker by the one that receives them (``fanout``), and their method (any other method
#: is the single process's to answer: 405, ``HEAD``, ``OPTIONS``).
FANOUT_ROUTES = {
    "/v1/rollout/pause": "POST", "/v1/rollout/resume": "POST", "/v1/rollout/pause_state": "GET",
    "/trajectory/read": "POST", "/trajectory/stats": "GET", "/sessions": "GET", "/metrics": "GET", "/health": "GET",
    "/ready": "GET", "/ui/api/overview": "GET",
}
#: The Claw-R1 gateway: prompt groups span sessions (and so workers), and its hand-off queue is one process's.
GATEWAY_PATHS = frozenset({
    "/generate", "/init_trajectory", "/compute_reward", "/submit_steps", "/trajectory/fetch_batch",
})
GATEWAY_SUFFIXES = ("/v1/register_trajectory", "/v1/complete_trajectory")
#: The most of a body read to find its session id: the app's limit (a bigger one is refused there: 413).
MAX_BODY = MAX_BODY_BYTES

NEED_BODY: Literal["body"] = "body"


class _Ids(msgspec.Struct):
    session_id: object = None
    trajectory_id: object = None


_IDS = msgspec.json.Decoder(_Ids)


def default_admission() -> Admission:
    """The admission step of an app with no credentials set (the app's own is passed in production)."""
    return Admission(AccessPolicy(), max_body=MAX_BODY, body_timeout=600.0)


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


def head_session(path: str, headers: Headers) -> str | None | Literal["body"]:
    """The session a request head names; ``NEED_BODY`` when only its body (or the agent's key) can say; ``None``: no
    session, or one the app refuses (it is served where it landed, and refused there).

    ``path``: as the app sees it (:func:`actorproxy.http.cycle.request_path`).
    """
    try:
        mount = url_mount(path, TURN_SUFFIXES)
        if mount is not None:
            return named_session(headers, mount[1]) or NEED_BODY
    except BadRequest:
        return None
    for route in ("/session/", "/ui/api/session/"):  # ``<path:session_id>``: the URL alone names it
        if path.startswith(route) and path not in ("/session/finalize", "/session/discard", "/session/open"):
            return path[len(route):] or None
    return NEED_BODY if path in BODY_SESSION_PATHS else None


def body_session(body: bytes, path: str = "", headers: Headers | None = None) -> str | None:
    """The ``session_id`` (else ``trajectory_id``) of a JSON body, then for ``/v1/responses`` Codex's conversation
    headers; ``None`` when nothing names one (or the body is not JSON, too big, or nested too deep to search)."""
    ids = None
    if len(body) <= MAX_BODY:
        try:
            ids = _IDS.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            pass  # the app refuses the body wherever it is served
    for value in (ids.session_id, ids.trajectory_id) if ids is not None else ():
        if isinstance(value, str) and value.strip():
            return value.strip()
    if headers is not None and path.endswith("/v1/responses"):
        for name in CONVERSATION_HEADERS:
            value = (headers.get(name) or "").strip()
            if value:
                return value
    return None
