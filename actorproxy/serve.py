"""The supervisor: the runtime's actors plus the HTTP server, in one nursery.

:func:`serve_proxy` is what ``actorproxy run`` runs; :func:`open_proxy` is the
same thing as an async context manager for tests and notebooks (bind port 0 and
read the URL from the yielded :class:`RunningProxy`).

Shutdown (the trigger returns; for ``actorproxy run`` the first SIGTERM or
SIGINT) drains: new turns get 503 + ``Retry-After``, the turns and other
requests in flight get up to ``--drain-timeout`` to finish (past it the HTTP
handlers are cancelled: each turn's generation is aborted at the engine and
its partial output kept on its step), then the server stops at once (an idle
keep-alive connection holds nothing up), every open session is finalized into
the store with ``boundary_reason: "shutdown"`` and the store is closed. A
second signal exits at once: the journal holds every completed step.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import cast

import attrs
import trio
from quart_trio import QuartTrio

from .config import ProxyConfig
from .engines.base import Backend
from .errors import StartupError
from .http.in_flight import InFlight
from .http.server import ConnectionLimits
from .runtime import collector
from .runtime.runtime import Runtime, open_runtime
from .server.app import create_app
from .server.drain import ASGIApp
from .server.http_server import HTTPServer
from .server.limits import default_max_connections, raise_open_files_limit
from .serving import served
from .tokenization.tokenizer import ChatTokenizer

log = logging.getLogger(__name__)


@attrs.frozen
class RunningProxy:
    """A proxy being served: its base URL and its runtime."""

    url: str
    runtime: Runtime


def primary_ipv4() -> str:
    """The address a route to the outside would leave from (loopback when there is no such route).

    Connecting a UDP socket sends nothing: it only asks the kernel's routing table.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: never reached, only routed
            address = str(probe.getsockname()[0])
        except OSError:
            return "127.0.0.1"
    return "127.0.0.1" if address.startswith("0.") else address


def bind_host(host: str) -> str:
    """The address to bind: ``auto`` is the host's primary IPv4 address (see :func:`primary_ipv4`)."""
    return primary_ipv4() if host == "auto" else host




async def serve_proxy(
    config: ProxyConfig,
    *,
    backend: Backend | None = None,
    tokenizer: ChatTokenizer | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[RunningProxy] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve until ``shutdown_trigger`` returns (or forever); then drain and shut down (see the module doc)."""
    if config.server.workers > 1:  # worker processes are started by ``actorproxy run`` alone (actorproxy/workers/)
        raise StartupError("--workers", "an embedded proxy is one process: start worker processes with "
                           "`actorproxy run --workers N` (docs/workers.md)")
    async with open_runtime(config, backend=backend, tokenizer=tokenizer) as runtime:
        tracker = InFlight()
        server = HTTPServer(asgi_of(create_app(runtime)), tracker=tracker, limits=connection_limits(config))
        stop_http = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain_then_stop, runtime, tracker, shutdown_trigger, stop_http)
            # The drain happens before the server is told to stop: by then nothing is in flight that should be
            # waited for, and idle keep-alive connections must not hold the exit.
            url = await nursery.start(partial(server.serve, bind_host(config.server.host).strip("[]"),
                                              config.server.port, shutdown_trigger=stop_http.wait))
            task_status.started(RunningProxy(url, runtime))


def connection_limits(config: ProxyConfig) -> ConnectionLimits:
    """What a client may hold of the HTTP server (``--max-connections``, ``--body-timeout``, ``--body-min-rate``,
    ``--send-timeout``)."""
    server = config.server
    raise_open_files_limit()  # first: the default bound on connections is drawn from it
    return ConnectionLimits(body_grace=server.body_timeout, body_min_rate=server.body_min_rate,
                            max_connections=server.max_connections or default_max_connections(),
                            send_stall=server.send_timeout)


def asgi_of(app: QuartTrio) -> ASGIApp:
    """What serves the Quart app's requests: its ASGI callable (the turn lane in front of Quart), called directly.

    ``Quart.__call__`` only forwards to it: one coroutine level less in every request's task (and on every
    resumption of a streaming turn's task).
    """
    return cast(ASGIApp, app.asgi_app)


async def drain_then_stop(runtime: Runtime, requests: InFlight, shutdown_trigger: Callable[[], Awaitable[None]] | None,
                          stop: trio.Event) -> None:
    """Wait for ``shutdown_trigger`` (none: forever), drain (:func:`_drain`), then set ``stop``, the HTTP
    server's own shutdown trigger."""
    await (shutdown_trigger or trio.sleep_forever)()
    await _drain(runtime, requests, runtime.config.server.shutdown_grace)
    stop.set()


async def _drain(runtime: Runtime, requests: InFlight, limit: float) -> None:
    """Refuse new turns; give the turns and requests in flight ``limit`` seconds to finish."""
    runtime.draining = True
    log.info("draining: %d turn(s) and %d request(s) in flight; new turns get 503 (up to %g s)",
             runtime.turns.active, requests.active, limit)
    with trio.move_on_after(limit):
        await runtime.turns.wait_idle()
        await requests.wait_idle()
    if runtime.turns.active:
        log.warning("drain timeout: aborting %d turn(s) still in flight (their partial output is kept)",
                    runtime.turns.active)


async def serve_until_signal(
    config: ProxyConfig,
    *,
    tokenizer: ChatTokenizer | None = None,
    task_status: trio.TaskStatus[RunningProxy] = trio.TASK_STATUS_IGNORED,
    serve: Callable[..., Awaitable[None]] | None = None,
) -> None:
    """``actorproxy run``: serve; the first SIGTERM/SIGINT drains and exits 0, a second one exits at once.

    ``serve``: what serves (default :func:`serve_proxy`; a worker process of ``--workers`` passes its own).
    """
    first = trio.Event()

    async def watch(signals: AsyncIterator[int]) -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not first.is_set():
                log.info("received %s: draining (a second signal exits at once)", name)
                first.set()
            else:
                log.warning("received %s again: exiting at once; the journal keeps every completed step", name)
                logging.shutdown()
                os._exit(128 + signum)

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch, signals)
            await (serve or serve_proxy)(config, tokenizer=tokenizer, shutdown_trigger=first.wait,
                                         task_status=_TuneGCOnStart(task_status))
            nursery.cancel_scope.cancel()


#: Allocations between two collections of the youngest generation (Python's default: 700).
GC_THRESHOLD = 50_000


def tune_gc() -> None:
    """A serving process's garbage collector: what startup built is frozen, young objects are collected rarely.

    With Python's defaults a proxy streaming to 1,000 agents spent about a third of its CPU
    in the collector: at 700 allocations between young collections, the objects of the
    tokens in flight (a thousand streams interleaved) survived into the old generation,
    and full collections of ~500,000 objects (~0.3 s each) ran every second or two, right
    through a pause. Collected every 50,000 allocations, those objects are gone before the
    collector looks; the modules, the tokenizer and the app (frozen) are never scanned
    again. Reference counting frees everything acyclic as before: only cycles wait longer.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_THRESHOLD, *gc.get_threshold()[1:])
    collector.hold_in_pauses()  # an abort pause holds the young collection (runtime/collector.py)


class _TuneGCOnStart:
    """A task status that tunes the collector (:func:`tune_gc`) once the proxy serves."""

    def __init__(self, inner: trio.TaskStatus[RunningProxy]) -> None:
        self._inner = inner

    def started(self, value: RunningProxy | None = None) -> None:
        assert value is not None
        tune_gc()
        self._inner.started(value)


@asynccontextmanager
async def open_proxy(
    config: ProxyConfig | None = None,
    *,
    backend: Backend | None = None,
    tokenizer: ChatTokenizer | None = None,
) -> AsyncIterator[RunningProxy]:
    """Serve a proxy inside the caller's Trio code (port 0 by default); stop it on exit."""
    async with served(partial(serve_proxy, config or ProxyConfig.of(port=0), backend=backend,
                              tokenizer=tokenizer)) as running:
        yield running
