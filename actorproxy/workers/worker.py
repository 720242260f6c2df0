"""One worker process: a whole proxy runtime serving the shared port, its own sessions, its own store.

Worker ``i`` of ``N`` serves:

- the public port, bound with ``SO_REUSEPORT`` beside the other workers (the kernel spreads
  new connections over them); its :class:`~.handoff.Router` sends a connection whose request
  names another worker's session to that worker, and its :class:`~.fanout.FanOut` answers the
  control routes for every worker;
- ``<dir>/w<i>.handoff``: connections handed over by the other workers;
- ``<dir>/w<i>.http``: its own app over HTTP, for the other workers' fanned-out requests (and, there alone,
  the holds of a drain across workers: :mod:`.holds`).

Its SQLite store is ``<data-dir>/worker-<i>/`` (docs/workers.md says why a file per worker).
A worker that (re)starts while the others run first takes their rollout state: the weight
version, the epoch, and a pause in force, before it accepts a single connection.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Awaitable, Callable
from functools import partial

import trio

from ..config import ProxyConfig
from ..http.in_flight import InFlight
from ..runtime.holds import Holds
from ..runtime.runtime import Runtime, open_runtime
from ..schema import jsonio
from ..serve import RunningProxy, asgi_of, bind_host, connection_limits, drain_then_stop
from ..server.app import admission_for, create_app
from ..server.http_server import HTTPServer
from ..tokenization.tokenizer import ChatTokenizer
from .fanout import FanOut, WorkerUnavailable, ask, control_path, lease_prefix
from .handoff import Router, remove_stale, serve_handoffs
from .holds import HoldMetrics, PrivateApp, worker_holds

log = logging.getLogger("actorproxy.workers")


def worker_config(config: ProxyConfig, index: int) -> ProxyConfig:
    """Worker ``index``'s settings: its own store directory under ``--data-dir``."""
    return config.evolve(data_dir=os.path.join(config.store.data_dir, f"worker-{index}"))


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (every worker binds one; not yet listening)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


async def serve_worker(
    config: ProxyConfig,
    *,
    index: int,
    directory: str,
    tokenizer: ChatTokenizer | None = None,
    shutdown_trigger: Callable[[], Awaitable[None]] | None = None,
    task_status: trio.TaskStatus[RunningProxy] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve as worker ``index`` of ``config.server.workers`` until ``shutdown_trigger`` returns; then drain."""
    workers = config.server.workers
    async with open_runtime(worker_config(config, index), tokenizer=tokenizer) as runtime:
        await take_rollout_state(runtime, index, workers, directory)
        admission = admission_for(runtime.config)  # the one step the app, the router and the fan-out ask
        runtime.leases.prefix = lease_prefix(index)  # an acknowledgement reaching another worker comes here
        holds = worker_holds(runtime)  # this worker's parts of drains across workers, until they are settled
        metrics = HoldMetrics(holds)
        app = asgi_of(create_app(runtime, admission, collectors=[metrics]))
        tracker = InFlight()  # the requests in flight of both servers
        stop = trio.Event()
        limits = connection_limits(config)
        private = HTTPServer(PrivateApp(app, holds), tracker=tracker, limits=limits)
        fanout = FanOut(app, workers, directory, admission, index=index, leases=runtime.leases, metrics=metrics,
                        spool_dir=spool_dir(runtime.config))
        public = HTTPServer(fanout, router=Router(index, workers, directory, admission), tracker=tracker,
                            limits=limits)
        control = control_path(directory, index)
        remove_stale(control)
        unix = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await unix.bind(control)
        host = bind_host(config.server.host).strip("[]")
        shared = trio.socket.from_stdlib_socket(shared_port_socket(host, config.server.port))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain_then_stop, runtime, tracker, shutdown_trigger, stop)
            nursery.start_soon(_holds_until, holds, stop)
            await nursery.start(partial(private.serve, "", 0, sock=unix, shutdown_trigger=stop.wait))
            url = await nursery.start(partial(public.serve, host, config.server.port, sock=shared,
                                              shutdown_trigger=stop.wait))
            await nursery.start(_handoffs_until, directory, index, public, stop)
            task_status.started(RunningProxy(url, runtime))


def spool_dir(config: ProxyConfig) -> str | None:
    """Where the fan-out spools the answers to a read of the whole store: a durable store's directory (a disk,
    where the system's temporary directory may be a tmpfs, memory); a store in memory has none (the system's)."""
    directory = config.store.data_dir
    return directory if os.path.isdir(directory) else None


async def _holds_until(holds: Holds, stop: trio.Event) -> None:
    """Let expired holds go until the worker stops (what is still held stays in the store, undeleted)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(holds.run)
        await stop.wait()
        nursery.cancel_scope.cancel()


async def _handoffs_until(directory: str, index: int, server: HTTPServer, stop: trio.Event,
                          *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_handoffs, directory, index, server)
        task_status.started()
        await stop.wait()
        nursery.cancel_scope.cancel()


async def take_rollout_state(runtime: Runtime, index: int, workers: int, directory: str) -> None:
    """Install the weight version, epoch and pause of a running peer (none running: nothing to take)."""
    token = runtime.config.security.admin_token
    headers = [(b"authorization", b"Bearer " + token.encode())] if token else []
    for peer in range(workers):
        if peer == index:
            continue
        try:
            answer = await ask(directory, peer, "GET", b"/v1/rollout/pause_state", headers, b"")
        except WorkerUnavailable:
            continue
        if answer.status != 200:
            continue
        state = jsonio.loads(answer.body, check=False)
        own = await runtime.pause_state()
        if state["weight_version"] != own.weight_version or state["epoch"] != own.epoch:
            await runtime.resume(weight_version=str(state["weight_version"]))
            for _ in range(int(state["epoch"]) - own.epoch):
                await runtime.resume(weight_version=str(state["weight_version"]), bump_epoch=True)
        if state["state"] == "paused":
            await runtime.pause(state["mode"] or "abort")
        log.info("worker %d took worker %d's rollout state: %s, weight version %s, epoch %s",
                 index, peer, state["state"], state["weight_version"], state["epoch"])
        return
