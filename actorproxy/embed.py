"""The whole proxy inside any Python program: asyncio trainers, Ray workers, plain scripts.

:func:`start_proxy` runs ``actorproxy run`` (same runtime, same
:class:`~actorproxy.config.ProxyConfig`) on a background thread with its own
Trio loop and returns once it listens::

    with start_proxy(trajectory_dir="runs/7") as proxy:
        url = proxy.session_url("trial-3")      # http://10.0.0.5:41231/sess/trial-3/v1
        ... run an agent against url ...
        proxy.finalize("trial-3", reward=1.0)   # writes runs/7/trial-3/proxy_trajectory.json
        data = proxy.read("trial-3")

An agent loop written against an in-process proxy object (LiveRL's) uses its
calls instead: ``session_url``, ``session_anthropic_base``, ``await
open_session(id, trajectory_dir=...)`` and ``await pop_session(id)``, which
finalizes the trial, hands over its data (drained from the store) as the dict
:func:`~actorproxy.session_meta.session_meta` builds, and writes
``<trajectory_dir>/proxy_trajectory.json``.

Every call also exists as an asyncio coroutine (``afinalize``, ``aread``) that
never blocks the caller's event loop, and :class:`EmbeddedProxy` is an async
context manager too. By default it binds the host's primary IPv4 address on a
free port (``host="auto"``), so agents in sandboxes and containers on the host
can reach it, and guards the trainer's routes with a random admin token that
only this object knows. Errors inside the proxy surface to the caller: a
start-up failure is raised by :func:`start_proxy`, and a proxy that died is
reported by the next call.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from .closing import Closing
from .config import ProxyConfig
from .serve import RunningProxy, serve_proxy
from .server.auth import AccessPolicy
from .session_meta import fresh_meta, session_meta
from .trajectory_file import FILE_NAME, build_document, write_document

log = logging.getLogger(__name__)

#: Trials opened with ``open_session`` and not yet popped that are remembered.
_MAX_OPEN_TRIALS = 100_000


class EmbeddedProxyError(RuntimeError):
    """The embedded proxy failed to start, died, or refused a call."""


@attrs.frozen
class SessionAccess:
    """What one trial's agent needs: its base URLs and (with session keys) its key."""

    session_id: str
    #: For Anthropic clients (they append ``/v1/messages``): ``ANTHROPIC_BASE_URL``.
    base_url: str
    #: For OpenAI clients: ``base_url`` of the ``openai`` SDK, Codex, opencode.
    openai_base_url: str
    #: The agent's key (``--agent-auth session-key``), else ``None``: send any placeholder.
    api_key: str | None


class EmbeddedProxy(Closing):
    """A running embedded proxy. Build it with :func:`start_proxy`."""

    def __init__(self, config: ProxyConfig, *, startup_timeout: float = 300.0) -> None:
        self.config = config
        self._policy = AccessPolicy.from_config(config)
        self._admin = {"Authorization": f"Bearer {config.security.admin_token}"} if config.security.admin_token else {}
        self._startup_timeout = startup_timeout
        self._started = threading.Event()
        self._stopped = threading.Event()
        self._url: str | None = None
        self._error: BaseException | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._thread_main, name="actorproxy", daemon=True)
        self._http: httpx.Client | None = None
        #: Trials opened with :meth:`open_session` and not popped yet: their trajectory directories.
        self._trials: dict[str, Path | None] = {}

    # -- life cycle ----------------------------------------------------------------------

    def _start(self) -> None:
        self._thread.start()
        if not self._started.wait(self._startup_timeout):
            raise EmbeddedProxyError(f"the proxy did not start within {self._startup_timeout:g} s")
        if self._error is not None:
            self._thread.join()
            raise EmbeddedProxyError(f"the proxy failed to start: {_describe(self._error)}") from self._error
        self._http = httpx.Client(base_url=self.url, timeout=None, headers=self._admin)

    def _thread_main(self) -> None:
        try:
            trio.run(self._serve)
        except BaseException as exc:  # reported to the caller, never to a log nobody reads
            self._error = exc
        finally:
            self._started.set()
            self._stopped.set()

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with trio.open_nursery() as nursery:
            running: RunningProxy = await nursery.start(
                lambda task_status: serve_proxy(self.config, shutdown_trigger=self._stop.wait, task_status=task_status)  # type: ignore[union-attr]
            )
            self._url = running.url
            self._started.set()

    def close(self) -> None:
        """Shut down like SIGTERM does (open sessions finalized into the store) and join the thread."""
        if self._http is not None:
            self._http.close()
            self._http = None
        if self._thread.is_alive() and self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join()
        if self._error is not None and not isinstance(self._error, KeyboardInterrupt):
            error, self._error = self._error, None
            raise EmbeddedProxyError(f"the proxy stopped with an error: {_describe(error)}") from error

    async def aclose(self) -> None:
        """:meth:`close` for asyncio code: the drain runs in a worker thread."""
        import asyncio

        await asyncio.get_running_loop().run_in_executor(None, self.close)

    # -- what trials need ----------------------------------------------------------------

    @property
    def url(self) -> str:
        """The proxy's base URL (its advertised address and bound port)."""
        if self._url is None:
            raise EmbeddedProxyError("the proxy is not running")
        return self._url

    def session(self, trial_id: str) -> SessionAccess:
        """Base URLs (and key) for one trial; no I/O. A trial id is one URL path segment: no ``/``."""
        if not trial_id or "/" in trial_id or len(trial_id) > 256:
            raise ValueError(f"a trial id must be 1-256 characters without '/', got {trial_id!r}")
        base = f"{self.url}/sess/{urllib.parse.quote(trial_id, safe='')}"
        key = self._policy.session_key(trial_id) if self.config.security.agent_auth == "session-key" else None
        return SessionAccess(trial_id, base, base + "/v1", key)

    def session_url(self, trial_id: str) -> str:
        """The OpenAI-style per-session base URL of ``trial_id`` (``.../sess/<id>/v1``)."""
        return self.session(trial_id).openai_base_url

    def session_anthropic_base(self, trial_id: str) -> str:
        """``ANTHROPIC_BASE_URL`` of ``trial_id`` (``.../sess/<id>``: Anthropic clients append ``/v1/messages``)."""
        return self.session(trial_id).base_url

    async def open_session(self, trial_id: str, trajectory_dir: str | Path | None = None) -> None:
        """Start a trial: :meth:`pop_session` later writes ``<trajectory_dir>/proxy_trajectory.json``.

        No I/O: the session itself starts with the agent's first call. Opening a
        trial again starts it afresh (its directory is replaced).
        """
        self.session(trial_id)  # the id's checks
        directory = None if trajectory_dir is None else _absolute(trajectory_dir)
        self._trials.pop(trial_id, None)
        self._trials[trial_id] = directory
        while len(self._trials) > _MAX_OPEN_TRIALS:  # opened and never popped: forget the oldest, say so
            forgotten = next(iter(self._trials))
            del self._trials[forgotten]
            log.warning("trial %r was opened and never popped; its trajectory directory is forgotten "
                        "(more than %d open trials)", forgotten, _MAX_OPEN_TRIALS)

    async def pop_session(self, trial_id: str) -> dict[str, Any]:
        """End a trial: finalize it, hand its data over and forget it; the meta LiveRL's agent loop reads.

        The session is finalized (no reward: the trainer grades it), its segments
        and steps are read and drained from the store, and the returned dict holds
        the sequence fields (``traj_acc_ids``, ``initial_prompt_token_len``,
        ``traj_response_mask``, ``traj_response_logprobs``), ``messages_snapshot``,
        the counters and every segment (docs/embedding.md). A trial that never
        made a call gets the empty meta and no file.
        """
        directory = self._trials.pop(trial_id, None)
        try:
            finalized = await self._acall("POST", "/session/finalize", {"session_id": trial_id})
        except _Missing:
            meta = fresh_meta()
            meta["session_id"] = trial_id
            return meta
        read = await self._acall("POST", "/trajectory/read",
                                 {"session_id": trial_id, "drain": True, "include_steps": True})
        meta = session_meta(trial_id, read, finalized.get("refused"))
        meta["trajectory_file"] = finalized.get("trajectory_file")
        if directory is not None:
            import asyncio

            meta["trajectory_dir"] = str(directory)
            path = directory / FILE_NAME
            await asyncio.to_thread(write_document, path, build_document(trial_id, read))
            meta["trajectory_file"] = str(path)
        return meta

    def finalize(self, trial_id: str, reward: float | None = None) -> dict[str, Any]:
        """Close the trial's session into the store (and its trajectory file); returns the summary."""
        body: dict[str, Any] = {"session_id": trial_id}
        if reward is not None:
            body["reward"] = reward
        return self._call("POST", "/session/finalize", body)

    def read(self, trial_id: str, *, drain: bool = False, include_steps: bool = True) -> dict[str, Any]:
        """The trial's finalized segments (and steps): ``{"data": [...], "steps": [...]}``."""
        return self._call(
            "POST", "/trajectory/read", {"session_id": trial_id, "drain": drain, "include_steps": include_steps}
        )

    async def afinalize(self, trial_id: str, reward: float | None = None) -> dict[str, Any]:
        """:meth:`finalize` as an asyncio coroutine (never blocks the caller's event loop)."""
        body: dict[str, Any] = {"session_id": trial_id}
        if reward is not None:
            body["reward"] = reward
        return await self._acall("POST", "/session/finalize", body)

    async def aread(self, trial_id: str, *, drain: bool = False, include_steps: bool = True) -> dict[str, Any]:
        """:meth:`read` as an asyncio coroutine."""
        body = {"session_id": trial_id, "drain": drain, "include_steps": include_steps}
        return await self._acall("POST", "/trajectory/read", body)

    def _check_running(self) -> None:
        if self._error is not None or self._stopped.is_set() or self._http is None:
            detail = f": {_describe(self._error)}" if self._error is not None else ""
            raise EmbeddedProxyError("the proxy is not running" + detail)

    def _call(self, method: str, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self._check_running()
        assert self._http is not None
        return _payload(method, path, self._http.request(method, path, json=dict(body)))

    async def _acall(self, method: str, path: str, body: Mapping[str, Any]) -> dict[str, Any]:
        self._check_running()
        async with httpx.AsyncClient(base_url=self.url, timeout=None, headers=self._admin) as client:
            return _payload(method, path, await client.request(method, path, json=dict(body)))


class _Missing(EmbeddedProxyError):
    """The proxy knows no such session (404)."""


def _payload(method: str, path: str, response: httpx.Response) -> dict[str, Any]:
    payload = response.json()
    if response.status_code == 404:
        raise _Missing(f"{method} {path}: HTTP 404: {payload}")
    if response.status_code >= 400:
        error = payload.get("error", {}) if isinstance(payload, dict) else {}
        raise EmbeddedProxyError(f"{method} {path}: HTTP {response.status_code}: {error.get('message', payload)}")
    assert isinstance(payload, dict)
    return payload


def start_proxy(
    config: ProxyConfig | None = None,
    *,
    host: str = "auto",
    port: int = 0,
    trajectory_dir: str | None = None,
    startup_timeout: float = 300.0,
    **settings: Any,
) -> EmbeddedProxy:
    """Start the proxy on a background thread; returns once it listens (or raises why it could not).

    ``config`` is the full settings tree of ``actorproxy run``; keyword
    ``settings`` (any field, by name, as in :meth:`ProxyConfig.of`) change it. ``host``,
    ``port`` and ``trajectory_dir`` override the config's. Without an admin
    token one is generated, so the trainer's routes are never open on the
    network.
    """
    base = (config or ProxyConfig()).evolve(**settings)
    base = base.evolve(
        host=host,
        port=port,
        trajectory_dir=trajectory_dir if trajectory_dir is not None else base.server.trajectory_dir,
        admin_token=base.security.admin_token or secrets.token_urlsafe(24),
    )
    proxy = EmbeddedProxy(base, startup_timeout=startup_timeout)
    proxy._start()
    return proxy


def _absolute(path: str | os.PathLike[str]) -> Path:
    """``path`` made absolute (``~`` expanded) without touching the disk."""
    return Path(os.path.abspath(os.path.expanduser(path)))


def _describe(error: BaseException) -> str:
    """The innermost meaningful message of a (possibly grouped) start-up exception."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"
