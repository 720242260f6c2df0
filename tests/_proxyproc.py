"""``actorproxy run`` as a real process, for the tests that signal or kill it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import trio
from _children import die_with_parent

_URL = re.compile(r"serving on (http://\S+)")
REPO = Path(__file__).resolve().parent.parent


class ProxyProcess:
    def __init__(self, log: Path, *args: str, preexec: Callable[[], None] = die_with_parent) -> None:
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115 (closed in wait())
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "actorproxy", "run", "--port", "0", "--store", "sqlite", *args],
            stdout=self._log, stderr=self._log, env=env, cwd=str(log.parent), preexec_fn=preexec,
        )
        self.url = ""

    async def started(self, limit: float = 60.0) -> str:
        """The URL, once the proxy logs that it serves.

        Polled (bounded): the log file, written by another process, is the only sign it
        gives. A polled real condition, not a blind sleep; an early exit ends the wait at once.
        """
        with trio.fail_after(limit):
            while True:
                match = _URL.search(self.log_path.read_text(errors="replace"))
                if match:
                    self.url = match.group(1)
                    return self.url
                if self.proc.poll() is not None:
                    raise AssertionError(f"actorproxy exited {self.proc.returncode}:\n{self.log_path.read_text()}")
                with trio.move_on_after(0.05):
                    await self._exited()

    async def wait(self, limit: float = 60.0) -> int:
        """The exit code, as soon as the process exits (bounded)."""
        with trio.fail_after(limit):
            await self._exited()
        self._log.close()
        return self.proc.wait()

    async def _exited(self) -> None:
        """Return when the process has exited: its pidfd turns readable (no polling)."""
        if self.proc.poll() is not None:
            await trio.lowlevel.checkpoint()
            return
        fd = os.pidfd_open(self.proc.pid)
        try:
            await trio.lowlevel.wait_readable(fd)
        finally:
            os.close(fd)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
