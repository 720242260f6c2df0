"""``actorproxy run --workers N`` as real processes on port 0, for the tests of several workers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio
from _children import die_with_parent

WORKERS = 2


class Proxy:
    """An ``actorproxy run --workers N`` process and what it has logged."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process
        self.log = ""
        self.changed = trio.Event()
        self.url = ""
        self.eof = False

    async def read_log(self) -> None:
        assert self.process.stderr is not None
        async with trio.lowlevel.FdStream(os.dup(self.process.stderr.fileno())) as stream:
            while data := await stream.receive_some(65536):
                self.log += data.decode(errors="replace")
                self.changed.set()
                self.changed = trio.Event()
        self.eof = True
        self.changed.set()

    async def wait_log(self, pattern: str, count: int = 1) -> list[str]:
        """The matches of ``pattern`` once there are ``count`` of them in the log (two minutes at most)."""
        with trio.fail_after(120):
            while len(found := re.findall(pattern, self.log)) < count:
                if self.eof:
                    raise AssertionError(f"the proxy exited ({self.process.wait()}):\n{self.log}")
                await self.changed.wait()
        return found

    def worker_pid(self, index: int) -> int:
        return int(re.findall(rf"worker {index} serving \(pid (\d+)\)", self.log)[-1])


def _start(tmp_path: Path, flags: tuple[str, ...], workers: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "actorproxy", "run", "--workers", str(workers), "--port", "0", "--data-dir",
         str(tmp_path / "data"), "--store", "sqlite", "--sim-token-interval", "0.001", *flags],
        stderr=subprocess.PIPE, cwd=tmp_path, preexec_fn=die_with_parent,
    )


@asynccontextmanager
async def run_workers(tmp_path: Path, *flags: str, workers: int = WORKERS) -> AsyncIterator[Proxy]:
    """``actorproxy run --workers N`` (``--workers 1``: the single process) with ``flags``, until the block ends."""
    process = _start(tmp_path, flags, workers)
    proxy = Proxy(process)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(proxy.read_log)
            proxy.url = (await proxy.wait_log(r"serving on (http://\S+)"))[0]
            yield proxy
            nursery.cancel_scope.cancel()
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        assert process.stderr is not None
        process.stderr.close()


def client(proxy: Proxy) -> httpx.AsyncClient:
    """A client whose every request opens a new connection (so the kernel chooses its worker each time)."""
    return httpx.AsyncClient(base_url=proxy.url, timeout=60, limits=httpx.Limits(max_keepalive_connections=0))


