"""``actorproxy run --workers N``: the supervisor process, which starts N workers and keeps them running.

It binds the port first (``SO_REUSEPORT``, not listening: this holds the port and resolves
``--port 0``), writes the settings for the workers into a private directory (mode 0700,
also home of their Unix sockets) and starts them, each in its own session so that a
terminal's Ctrl-C reaches the supervisor alone. It is serving once every worker is.

- A worker that exits while the others serve (a crash, a kill) is logged and started again
  (0.5 s later, doubling to 30 s while it keeps failing within 30 s of its start); the
  others go on serving. Until it is back, its sessions' requests get 503 + ``Retry-After``
  and the control routes answer 503 ``worker_unavailable``; its store is recovered from its
  journal when it starts, and it takes the running workers' rollout state first.
- A worker that fails before it ever served stops everything (exit 2), as a single proxy
  that cannot start does.
- SIGTERM/SIGINT: each worker gets SIGTERM and drains (``--drain-timeout``); the supervisor
  exits once all have. A second signal is passed on too: the workers exit at once.
"""

from __future__ import annotations

import logging
import os
import pickle
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator

import trio

from ..config import ProxyConfig
from ..errors import StartupError
from ..serve import bind_host
from .worker import shared_port_socket

log = logging.getLogger("actorproxy.workers")

_FIRST_BACKOFF = 0.5
_MAX_BACKOFF = 30.0
#: A worker that ran this long before it exited is restarted without waiting.
_HEALTHY_RUN = 30.0


class Supervisor:
    """The worker processes of one ``actorproxy run --workers N``."""

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.directory = ""
        self.processes: dict[int, trio.Process] = {}
        self.restarts = 0
        self.stopping = False

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the workers until :meth:`stop`; the URL goes to ``task_status`` once every worker serves."""
        config = self.config
        host = bind_host(config.server.host).strip("[]")
        hold = shared_port_socket(host, config.server.port)
        self.directory = tempfile.mkdtemp(prefix="actorproxy-workers-")
        try:
            port = hold.getsockname()[1]
            config = self.config = shared_secrets(config.evolve(port=port))
            _write_config(self.directory, config)
            async with trio.open_nursery() as nursery:
                ready = [trio.Event() for _ in range(config.server.workers)]
                for index in range(config.server.workers):
                    nursery.start_soon(self._keep, index, ready[index])
                for event in ready:
                    await event.wait()
                task_status.started(f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}")
        finally:
            hold.close()
            shutil.rmtree(self.directory, ignore_errors=True)

    def signal_all(self, signum: int) -> None:
        """Send ``signum`` to every running worker (a second SIGTERM makes them exit at once)."""
        self.stopping = True
        for process in self.processes.values():
            if process.returncode is None:
                process.send_signal(signum)

    async def _keep(self, index: int, ready: trio.Event) -> None:
        backoff = _FIRST_BACKOFF
        while not self.stopping:
            started = trio.current_time()
            code = await self._run_once(index, ready)
            if self.stopping:
                ready.set()  # stopped before it served: nothing to wait for
                return
            if not ready.is_set():
                raise StartupError("--workers", f"worker {index} could not start (exit code {code}; see its log above)")
            self.restarts += 1
            if trio.current_time() - started >= _HEALTHY_RUN:
                backoff = _FIRST_BACKOFF
            log.error("worker %d exited with code %s; starting it again in %g s (its sessions get 503 meanwhile)",
                      index, code, backoff)
            await trio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF)

    async def _run_once(self, index: int, ready: trio.Event) -> int:
        """Start worker ``index``, wait for it to serve (``ready``) and then for its exit; its exit code."""
        read_end, write_end = os.pipe()
        life_read, life_write = os.pipe()  # the worker's sign of the supervisor's life: its end of file
        try:
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "actorproxy.workers.child", self.directory, str(index), str(write_end),
                 str(life_read)],
                pass_fds=(write_end, life_read), start_new_session=True,
            )
        except BaseException:
            os.close(read_end)
            os.close(life_write)
            raise
        finally:
            os.close(write_end)
            os.close(life_read)
        self.processes[index] = process
        try:
            async with trio.lowlevel.FdStream(read_end) as pipe:
                line = b""
                while chunk := await pipe.receive_some(1024):
                    line += chunk
            if line.startswith(b"ready"):
                log.info("worker %d serving (pid %d)", index, process.pid)
                ready.set()
            return await process.wait()
        finally:
            if process.returncode is None:  # cancelled: do not leave it behind
                process.send_signal(signal.SIGTERM)
                with trio.CancelScope(shield=True), trio.move_on_after(self.config.server.shutdown_grace + 10):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
            os.close(life_write)


def shared_secrets(config: ProxyConfig) -> ProxyConfig:
    """``config`` with one session-key secret for every worker (drawn here when none is given nor derived from the
    admin token): a key minted by one worker must open its session on every worker."""
    security = config.security
    if security.session_key_secret or security.admin_token:
        return config
    return config.evolve(session_key_secret=secrets.token_urlsafe(32))


def _write_config(directory: str, config: ProxyConfig) -> None:
    with open(os.path.join(directory, "config.pickle"), "wb") as file:
        pickle.dump(config, file)


async def serve_workers(config: ProxyConfig, signals: AsyncIterator[int],
                        *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve with ``config.server.workers`` workers until the first of ``signals``; then let them drain."""
    supervisor = Supervisor(config)

    async def watch() -> None:
        async for signum in signals:
            name = signal.Signals(signum).name
            if not supervisor.stopping:
                log.info("received %s: the workers drain (a second signal makes them exit at once)", name)
            else:
                log.warning("received %s again: the workers exit at once", name)
            supervisor.signal_all(signal.SIGTERM)

    async with trio.open_nursery() as outer:
        outer.start_soon(watch)
        async with trio.open_nursery() as nursery:
            task_status.started(await nursery.start(supervisor.serve))
        outer.cancel_scope.cancel()  # every worker has exited
