"""Benchmark processes: an engine (the stub or ``actorproxy sim``) and a proxy, each in its own process.

Plain blocking helpers (context managers around :class:`subprocess.Popen`): the benchmarks
start their servers before they measure anything, and stop them (SIGTERM, then SIGKILL
after 10 s) however the block exits.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

HERE = Path(__file__).parent


class Server(NamedTuple):
    url: str
    pid: int


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_ready(url: str, process: subprocess.Popen[Any], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


@contextmanager
def running(command: Sequence[str], **popen: Any) -> Iterator[subprocess.Popen[Any]]:
    process = subprocess.Popen(command, **popen)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def post_json(url: str, body: object, timeout: float = 30.0) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        raw = response.read()
    return json.loads(raw) if raw.strip() else None


@contextmanager
def engine_stub(reply: dict[str, Any], *flags: str) -> Iterator[Server]:
    """``engine_stub.py`` answering with ``reply`` (``{"ids", "pieces"}``), with extra ``flags``."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(reply, f)
    try:
        command = [sys.executable, str(HERE / "engine_stub.py"), "--reply", f.name, *flags]
        with running(command, stdout=subprocess.PIPE, text=True) as process:
            assert process.stdout is not None
            line = process.stdout.readline()
            if not line.startswith("PORT "):
                raise RuntimeError(f"the engine stub did not start: {line!r}")
            url = f"http://127.0.0.1:{int(line.split()[1])}"
            wait_ready(url + "/health", process)
            yield Server(url, process.pid)
    finally:
        Path(f.name).unlink()


@contextmanager
def sim_engine(*flags: str) -> Iterator[Server]:
    """``actorproxy sim`` (every wire format, simulated sampling)."""
    port = free_port()
    command = [sys.executable, "-m", "actorproxy", "sim", "--port", str(port), "--log-level", "WARNING", *flags]
    with running(command) as process:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/health", process)
        yield Server(url, process.pid)


@contextmanager
def proxy(backend: str, engine_url: str, *flags: str) -> Iterator[Server]:
    """``actorproxy run`` in front of one engine, with a store of its own.

    Each proxy gets a fresh ``--data-dir`` (unless the flags name one): the default
    ``./actorproxy-data`` would be shared by every run started here, and a run would then
    read (and count) the sessions an earlier, interrupted run left behind.
    """
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="actorproxy-bench-") as data:
        own = [] if "--data-dir" in flags else ["--data-dir", data]
        command = [sys.executable, "-m", "actorproxy", "run", "--port", str(port), "--backend", backend,
                   "--backend-url", engine_url, "--log-level", "WARNING", *own, *flags]
        with running(command) as process:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url + "/health", process)
            yield Server(url, process.pid)
