"""Who may call what: the admin token, per-session agent keys, a static API key.

Agents are untrusted: they are the policy's own actions, run in sandboxes that
can reach the proxy's port. So the trainer's and operator's routes (pause and
resume, reading and draining trajectories, finalizing sessions, live details)
can be closed behind ``--admin-token``, and an agent can be confined to its own
session with ``--agent-auth session-key``.

A session key names its session and carries a MAC over it
(``ap1.<session in base64url>.<hmac-sha256, hex>``): the proxy keeps no table
of keys, a key cannot be forged without the secret, and a key for one session
is refused on any other. The secret is ``--session-key-secret``, else derived
from the admin token (keys then survive restarts), else random per process.

Everything here is sans-IO except :func:`add_open_session_route`; every request is
checked against the policy by the one admission step (:mod:`.admission`), on the
turn lane and on the Quart app alike. Comparisons are constant-time.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import secrets
import socket
import urllib.parse
import uuid
from typing import Literal, Protocol

import attrs
from quart import Response, request
from quart_trio import QuartTrio

from ..config import AgentAuth, ProxyConfig
from ..errors import BadRequest, Unauthorized
from ..protocols.trainer import OpenSessionBody
from ..schema import jsonio
from ..schema.converter import structure

#: Path endings served to agents (under ``/``, ``/sess/<id>`` and ``/<trajectory>/<prompt>``).
AGENT_SUFFIXES = (
    "/v1/chat/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
    "/v1/models",
    # The Claw-R1 base URL's completion: an agent's own, never graded (see AccessPolicy.completes).
    # (Registering a trajectory's channel and metadata is the trainer's: not listed, so the admin's.)
    "/v1/complete_trajectory",
)
#: Paths anyone may call: liveness, and the API's description (``/health`` shows its details to the admin alone).
PUBLIC_PATHS = frozenset({"/health", "/ready", "/openapi.json", "/docs"})

_KEY_PREFIX = "ap1"


class Headers(Protocol):
    """What the checks read of a request's headers (case-insensitive in practice)."""

    def get(self, key: str, /) -> str | None: ...


@attrs.frozen
class AccessPolicy:
    """The access rules of one proxy process."""

    admin_token: str | None = None
    agent_auth: AgentAuth = "none"
    api_key: str | None = None
    #: Signs session keys; see the module docstring for its default.
    secret: bytes = attrs.field(factory=lambda: secrets.token_bytes(32), repr=False)

    @classmethod
    def build(
        cls,
        *,
        admin_token: str | None,
        agent_auth: AgentAuth = "none",
        api_key: str | None = None,
        session_key_secret: str | None = None,
    ) -> AccessPolicy:
        """The policy for these settings (``api_key`` alone implies ``agent_auth="api-key"``)."""
        if api_key and agent_auth == "none":
            agent_auth = "api-key"
        if agent_auth == "api-key" and not api_key:
            raise ValueError("--agent-auth api-key needs --api-key (or ACTORPROXY_API_KEY)")
        if session_key_secret:
            secret = hashlib.sha256(b"actorproxy session keys\0" + session_key_secret.encode()).digest()
        elif admin_token:
            secret = hmac.new(admin_token.encode(), b"actorproxy session keys", hashlib.sha256).digest()
        else:
            secret = secrets.token_bytes(32)
        return cls(admin_token=admin_token or None, agent_auth=agent_auth, api_key=api_key or None, secret=secret)

    @classmethod
    def from_config(cls, config: ProxyConfig) -> AccessPolicy:
        return cls.build(
            admin_token=config.security.admin_token,
            agent_auth=config.security.agent_auth,
            api_key=config.security.api_key,
            session_key_secret=config.security.session_key_secret,
        )

    # -- session keys --------------------------------------------------------------------

    def session_key(self, session_id: str) -> str:
        """The key that lets an agent call the model routes of ``session_id`` (and no other)."""
        name = base64.urlsafe_b64encode(session_id.encode()).decode().rstrip("=")
        return f"{_KEY_PREFIX}.{name}.{self._mac(session_id)}"

    def key_session(self, key: str) -> str | None:
        """The session a well-formed, authentic key names; ``None`` for anything else."""
        parts = key.split(".")
        if len(parts) != 3 or parts[0] != _KEY_PREFIX:
            return None
        try:
            session_id = base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)).decode()
        except (binascii.Error, UnicodeDecodeError, ValueError):
            return None
        if not hmac.compare_digest(self._mac(session_id), parts[2]):
            return None
        return session_id

    def _mac(self, session_id: str) -> str:
        return hmac.new(self.secret, session_id.encode(), hashlib.sha256).hexdigest()[:40]

    # -- checks --------------------------------------------------------------------------

    def is_admin(self, headers: Headers) -> bool:
        """Whether the request carries the admin token (always true when none is set)."""
        if self.admin_token is None:
            return True
        presented = bearer(headers)
        return presented is not None and _same(presented, self.admin_token)

    def check_admin(self, headers: Headers) -> None:
        if not self.is_admin(headers):
            raise Unauthorized(
                "this route needs the admin token: send 'Authorization: Bearer <token>' "
                "(the value of --admin-token / ACTORPROXY_ADMIN_TOKEN)",
                code="admin_token_required",
            )

    def agent_session(self, headers: Headers) -> str | None:
        """Check an agent's credentials; the session its key confines it to (``None``: not confined).

        The admin token opens every agent route too (the trainer's own rollout code may use it).
        """
        if self.agent_auth == "none" or (self.admin_token is not None and self.is_admin(headers)):
            return None
        presented = bearer(headers) or headers.get("x-api-key")
        if not presented:
            raise Unauthorized(
                "this proxy needs an API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
                code="missing_api_key",
            )
        if self.agent_auth == "api-key":
            assert self.api_key is not None
            if not _same(presented, self.api_key):
                raise Unauthorized("the API key is not valid", code="invalid_api_key")
            return None
        session = self.key_session(presented)
        if session is None:
            raise Unauthorized(
                "the API key is not a valid session key for this proxy (ask the trainer for the key "
                "that POST /session/open returned)",
                code="invalid_api_key",
            )
        return session

    def completes(self, headers: Headers, confined: str | None, trajectory: str, *, grading: bool) -> bool:
        """Whether the caller completing ``trajectory`` on an agent route is the trainer (``False``: its own agent).

        The one rule for rewards and completion (docs/security.md): the trainer, who
        may grade a trajectory (a reward, a channel) and hand it to training, holds
        the admin token, or is anyone a session key does not confine when no admin
        token is configured (everything is open then). An agent completes only its
        own trajectory, named by its session key, and never grades it
        (``grading``: the call sets a reward or a channel). Anyone else: 401.
        """
        if confined is None:
            if self.is_admin(headers):
                return True
            raise Unauthorized(
                "completing a trajectory needs the admin token: send 'Authorization: Bearer <token>' (an agent "
                "completes its own trajectory only with its session key, --agent-auth session-key)",
                code="admin_token_required",
            )
        check_scope(confined, trajectory)
        if grading:
            raise Unauthorized(
                "a reward or a channel needs the admin token: an agent completes its own trajectory but never "
                "grades it", code="admin_token_required",
            )
        return False

    def client_of(self, headers: Headers, confined: str | None, remote: str | None) -> str | None:
        """Who opens a session, for the per-client session bound (``Identity.client``).

        An agent's session key names it (``key:<session>``); the admin token is the
        trainer (``None``: bound by ``--max-sessions`` only); anyone else is its
        remote address (``addr:<ip>``: agents behind one address share it).
        """
        if confined is not None:
            return f"key:{confined}"
        if self.admin_token is not None and self.is_admin(headers):
            return None
        return f"addr:{remote}" if remote else None

    @property
    def access(self) -> Literal["open", "admin-token"]:
        """``open``: no admin token, so every route (rewards, finalize, drain, pause) is anyone's who reaches it."""
        return "open" if self.admin_token is None else "admin-token"


def bearer(headers: Headers) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header."""
    value = headers.get("authorization") or ""
    scheme, _, token = value.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def route_kind(path: str) -> Literal["agent", "public", "admin"]:
    """Which rule guards ``path``: anything not known to be an agent's or public is the admin's."""
    if path in PUBLIC_PATHS or path.startswith(("/ui/assets/", "/docs/assets/")):  # code and style: no data
        return "public"
    if path.startswith("/v1/rollout/"):
        return "admin"
    if path.endswith(AGENT_SUFFIXES):
        return "agent"
    return "admin"


def check_scope(confined_to: str | None, session_id: str) -> None:
    """Refuse a call that names another session than the one the agent's key is for."""
    if confined_to is not None and confined_to != session_id:
        raise Unauthorized(
            "this API key belongs to another session; an agent may call only its own session",
            code="wrong_session",
        )


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the port on this machine."""
    if host == "localhost":
        return True
    if not host:
        return False  # every interface
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


def exposure_problem(host: str, *, admin_token: str | None, insecure: bool) -> str | None:
    """Why listening on ``host`` with these settings would be unsafe (``None``: it is fine)."""
    if insecure or admin_token or is_loopback(host):
        return None
    return (
        f"refusing to listen on {host} without an admin token: anyone who reaches the port could pause "
        "generation and read or drain every trajectory; set --admin-token (or ACTORPROXY_ADMIN_TOKEN), "
        "or pass --insecure on a network you trust"
    )


def new_session_id() -> str:
    """A fresh session id for ``POST /session/open`` (uuid4 hex: never a prefix of another)."""
    return uuid.uuid4().hex


def add_open_session_route(app: QuartTrio, policy: AccessPolicy) -> None:
    """``POST /session/open``: a session for an agent (and, with session keys, its key)."""

    @app.post("/session/open")
    async def open_session() -> Response:
        """A session for an agent: its id, its base URLs and (with session keys) its key."""
        raw = await request.get_data(cache=False, as_text=False)
        assert isinstance(raw, bytes)
        body = structure(jsonio.loads(raw) if raw.strip() else {}, OpenSessionBody)
        session_id = new_session_id() if body.session_id is None else body.session_id
        if not session_id.strip() or len(session_id) > 256:
            raise BadRequest("'session_id' must be a non-empty string of at most 256 characters", param="session_id")
        if any(ord(c) < 32 or ord(c) == 127 or c == "/" for c in session_id):
            raise BadRequest("'session_id' must be printable and contain no '/'", param="session_id")
        base = request.host_url.rstrip("/") + "/sess/" + urllib.parse.quote(session_id, safe="")
        key = policy.session_key(session_id) if policy.agent_auth == "session-key" else None
        payload = {
            "session_id": session_id,
            # Anthropic clients append /v1/messages to their base URL; OpenAI clients take it with /v1.
            "base_url": base,
            "openai_base_url": base + "/v1",
            "api_key": key,
        }
        return Response(jsonio.dumps(payload), status=200, mimetype="application/json")
