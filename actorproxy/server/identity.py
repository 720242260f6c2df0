"""Who a request belongs to: session, prompt group and turn, from headers or body."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from ..core.requests import Identity
from ..errors import BadRequest
from .auth import check_scope

MAX_ID_LENGTH = 256
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _clean(value: str | None, name: str) -> str | None:
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    if len(value) > MAX_ID_LENGTH or _CONTROL.search(value):  # one C pass, not a generator per character
        raise BadRequest(f"{name} must be at most {MAX_ID_LENGTH} printable characters", param=name)
    return value


#: The headers that name a session, in the order they are asked (after the URL, before the body).
SESSION_HEADERS = ("X-Session-Id", "X-Claude-Code-Session-Id", "X-SMG-Routing-Key")
#: The session that started this one, as the agent names it: opencode sends it on a sub-agent's calls (its task
#: tool), beside the sub-agent's own ``X-Session-Id``.
PARENT_HEADER = "X-Parent-Session-Id"
#: The sub-agent a call is from, as Claude Code names it on every call of one of its Task agents (and not on the
#: main agent's), beside the conversation's ``X-Claude-Code-Session-Id``.
AGENT_HEADER = "X-Claude-Code-Agent-Id"
#: Codex's own header, on every call it makes: its ``session-id`` and ``thread-id`` headers then name its
#: conversation and the thread of the agent that calls (a sub-agent's thread differs from the session).
CODEX_HEADER = "X-Codex-Turn-Metadata"


def url_mount(path: str, suffixes: Iterable[str]) -> tuple[str, str | None, str | None] | None:
    """A model route's path under its mounts: (suffix, URL session, URL prompt group); ``None``: not one.

    ``path`` is the request's path as the app sees it (origin-form, percent-decoded: the ASGI
    ``scope["path"]``). The mounts are ``/``, ``/sess/<session>`` and ``/<trajectory_uid>/<prompt_uid>``
    (a static ``sess`` beats a variable segment), as the URL map matches them: extra leading
    slashes are ignored, other repeated slashes match nothing, and a segment holds no ``/``.
    """
    path = "/" + path.lstrip("/")
    if "//" in path:
        return None
    for suffix in suffixes:
        if path.endswith(suffix):
            prefix = path[: len(path) - len(suffix)]
            if not prefix:
                return suffix, None, None
            parts = prefix.split("/")
            if len(parts) != 3 or parts[0] or not parts[1] or not parts[2]:
                return None
            if parts[1] == "sess":
                return suffix, parts[2], None
            return suffix, parts[1], parts[2]
    return None


def named_session(headers: Any, url_session: str | None = None) -> str | None:
    """The session the URL or a session header names, the first that names one; ``None``: neither does.

    The one reading of a request's head for its session, by the app (:func:`resolve_identity`)
    and by the router of ``--workers``, which sends the request to the worker that will serve
    it as this session. ``headers.get`` gives a repeated header's first value: an empty one
    names nothing, and the next header is asked (never the second value). A value too long or
    with control characters is :class:`BadRequest`. An opencode sub-agent's call, which names
    itself and its parent (:func:`sub_agent_of`), is its parent's, unless the URL names the session.
    """
    session = _clean(url_session, "the session id in the URL")
    if session is None and (named := _parent_named(headers)) is not None:
        return named[0]
    for name in SESSION_HEADERS:
        if session is not None:
            return session
        session = _clean(headers.get(name), name)
    return session


def sub_agent_of(headers: Any) -> str | None:
    """The sub-agent a call says it is from, by the agent's own name for it; ``None``: the call does not say.

    Claude Code sends :data:`AGENT_HEADER` on every call of a Task agent. Codex sends its conversation's
    ``session-id`` and the calling agent's ``thread-id`` (with :data:`CODEX_HEADER`): a thread that is not the
    session's is a sub-agent's (its ``spawn_agent`` tool), named by the thread id. opencode sends every call's
    ``X-Session-Id``, and a sub-agent's (its task tool) also :data:`PARENT_HEADER`: both must be there and differ,
    and the sub-agent's own session id names it.
    """
    agent = _clean(headers.get(AGENT_HEADER), AGENT_HEADER)
    if agent is not None:
        return agent
    if headers.get(CODEX_HEADER) is not None:  # (Codex: a thread other than its session's is a sub-agent's)
        thread = _clean(headers.get("thread-id"), "thread-id")
        return None if thread is None or thread == _clean(headers.get("session-id"), "session-id") else thread
    named = _parent_named(headers)
    return None if named is None else named[1]


def _parent_named(headers: Any) -> tuple[str, str] | None:
    """``(parent, sub-agent)``: the sessions an opencode sub-agent's call names (:func:`sub_agent_of`)."""
    parent = _clean(headers.get(PARENT_HEADER), PARENT_HEADER)
    if parent is None:
        return None
    own = _clean(headers.get("X-Session-Id"), "X-Session-Id")
    return None if own is None or own == parent else (parent, own)


def resolve_identity(
    headers: Any,
    body_session: str | None = None,
    body_instance: str | None = None,
    body_turn: str | None = None,
    *,
    url_session: str | None = None,
    url_instance: str | None = None,
    confined_to: str | None = None,
    client: str | None = None,
) -> Identity:
    """Who a request belongs to; the first source that names a value wins.

    Session: the URL (``/sess/{id}/...``, ``/{trajectory_uid}/{prompt_uid}/...``),
    ``X-Parent-Session-Id`` with ``X-Session-Id`` (a sub-agent's call, below),
    ``X-Session-Id``, ``X-Claude-Code-Session-Id`` (Claude Code sends it on every
    call), ``X-SMG-Routing-Key``, the body's ``session_id``. Prompt group: the
    URL's ``prompt_uid``, ``X-Instance-Id``, ``instance_id``. Turn: ``X-Turn-Id``,
    ``turn_id``. Anthropic's ``metadata.user_id`` is not a session id. A call that
    says it is a sub-agent's (:func:`sub_agent_of`: Claude Code's agent id, Codex's
    thread, opencode's session and parent session) has ``sub_agent``, the agent's
    name for it, by which the session keeps its child.

    ``confined_to`` is the session an agent's session key is for: it names the
    session when nothing else does, and any other session is refused (401).
    ``client`` is who opens the session (:meth:`.auth.AccessPolicy.client_of`).
    """
    session = named_session(headers, url_session) or _clean(body_session, "session_id") or confined_to
    check_scope(confined_to, session or "")
    if session is None:
        raise BadRequest(
            "no session id: use a per-session URL (/sess/<id>/v1/...), or send an X-Session-Id header "
            "(or X-Claude-Code-Session-Id, X-SMG-Routing-Key, or a 'session_id' body field)",
            param="session_id",
            code="missing_session_id",
        )
    instance = (
        _clean(url_instance, "the prompt id in the URL")
        or _clean(headers.get("X-Instance-Id"), "X-Instance-Id")
        or _clean(body_instance, "instance_id")
    )
    return Identity(
        session_id=session,
        instance_id=instance,
        turn_id=_clean(headers.get("X-Turn-Id"), "X-Turn-Id") or _clean(body_turn, "turn_id"),
        rollout_id=_clean(headers.get("X-Rollout-Id"), "X-Rollout-Id"),
        client=client,
        sub_agent=sub_agent_of(headers),
    )
