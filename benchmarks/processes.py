"""Benchmark processes: an engine (the stub, ``actorproxy sim`` or a real vLLM) and a proxy, each in its own process.

Plain blocking helpers (context managers around :class:`subprocess.Popen`): the benchmarks
start their servers before they measure anything, and stop them (SIGTERM, then SIGKILL
after 10 s) however the block exits.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
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
def running(command: Sequence[str], *, grace: float = 10.0, **popen: Any) -> Iterator[subprocess.Popen[Any]]:
    process = subprocess.Popen(command, **popen)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(grace)
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
    with tempfile.TemporaryDirectory(prefix="actorproxy-sim-") as cwd, running(command, cwd=cwd) as process:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/health", process)
        yield Server(url, process.pid)


@contextmanager
def proxy(backend: str, engine_url: str, *flags: str, under: Sequence[str] = ()) -> Iterator[Server]:
    """``actorproxy run`` in front of one engine, with a store of its own.

    Each proxy gets a fresh ``--data-dir`` (unless the flags name one): the default
    ``./actorproxy-data`` would be shared by every run started here, and a run would then
    read (and count) the sessions an earlier, interrupted run left behind. ``under``: a
    command the proxy runs under (valgrind's, given time to start and to write its output as
    the proxy exits).
    """
    port = free_port()
    slow = 10 if under else 1
    with tempfile.TemporaryDirectory(prefix="actorproxy-bench-") as data:
        own = [] if "--data-dir" in flags else ["--data-dir", data]
        command = [*under, sys.executable, "-m", "actorproxy", "run", "--port", str(port), "--backend", backend,
                   "--backend-url", engine_url, "--log-level", "WARNING", *own, *flags]
        # Run from the temporary directory: ``python -m`` puts its working directory first on ``sys.path``, so a
        # run from inside a checkout would run that checkout whatever ``PYTHONPATH`` says (an old tree's figures).
        with running(command, grace=10.0 * slow, cwd=data) as process:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url + "/health", process, timeout=120.0 * slow)
            yield Server(url, process.pid)


#: The master key LiteLLM's proxy is started with (recent LiteLLM refuses to start without one).
LITELLM_KEY = "sk-actorproxy-benchmark"


def litellm_installed() -> bool:
    """Whether LiteLLM's proxy (the ``litellm`` command) is on ``PATH``; if not, says its rows are skipped."""
    if shutil.which("litellm") is not None:
        return True
    print("litellm: not installed (pip install 'litellm[proxy]'), skipped", flush=True)
    return False


@contextmanager
def litellm_proxy(api_base: str, model: str) -> Iterator[Server]:
    """LiteLLM's proxy serving ``model`` (LiteLLM's ``provider/name``) from ``api_base``, one worker.

    Clients name ``model`` and send ``Authorization: Bearer`` :data:`LITELLM_KEY`. LiteLLM is
    told to read its model cost map from its own package rather than fetch it at start-up, and
    not to cut a stream whose last 100 chunks are the same text (its guard against a looping
    model, ``REPEATED_STREAMING_CHUNK_LIMIT``: the benchmarks' paced replies repeat one word).
    """
    port = free_port()
    command = ["litellm", "--model", model, "--api_base", api_base, "--port", str(port), "--num_workers", "1"]
    env = {**os.environ, "OPENAI_API_KEY": "sk-stub", "LITELLM_LOG": "ERROR", "LITELLM_MASTER_KEY": LITELLM_KEY,
           "LITELLM_LOCAL_MODEL_COST_MAP": "True", "REPEATED_STREAMING_CHUNK_LIMIT": str(1 << 62)}
    with running(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as process:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url + "/health/liveliness", process)
        yield Server(url, process.pid)


REPO = HERE.parent


@contextmanager
def vllm_engine(kind: str = "default") -> Iterator[Server]:
    """A real vLLM (``scripts/vllm/install.sh``) serving the tiny Qwen3 of ``scripts/vllm/tiny_model.py``.

    ``kind``: ``default`` (vLLM's default flags) or ``dev`` (``VLLM_SERVER_DEV_MODE=1``,
    ``--enable-scale-out``). Start-up takes 1.5-3 minutes; the server and its engine-core
    process (one process group) are stopped however the block exits.
    """
    installed = subprocess.run(["bash", str(REPO / "scripts" / "vllm" / "install.sh")], capture_output=True,
                               text=True, check=False)
    if installed.returncode != 0:
        raise RuntimeError(f"scripts/vllm/install.sh failed:\n{installed.stderr[-3000:]}")
    python = dict(line.split("=", 1) for line in installed.stdout.splitlines() if "=" in line)["python"]
    cache = Path(os.environ.get("ACTORPROXY_CACHE") or Path.home() / ".cache" / "actorproxy")
    model = cache / "vllm-models" / "tiny-qwen3"
    subprocess.run([sys.executable, str(REPO / "scripts" / "vllm" / "tiny_model.py"), str(model),
                    "--vllm-python", python], check=True, stdout=subprocess.DEVNULL)
    port = free_port()
    temp = Path(tempfile.gettempdir()) / f"vllm-tmp-{port}"  # vLLM leaves its sockets and rendezvous file there
    temp.mkdir(exist_ok=True)
    inductor = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"  # torch's cache, kept where it was
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "TMPDIR": str(temp),
           "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(inductor))}
    flags = ["--enable-scale-out"] if kind == "dev" else []
    if kind == "dev":
        env["VLLM_SERVER_DEV_MODE"] = "1"
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--enforce-eager", "--max-model-len", "4096", *flags]
    with tempfile.NamedTemporaryFile(prefix="vllm-bench-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_ready(url + "/v1/models", process, timeout=900)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"vLLM did not start ({exc}); its log: {log.name}") from exc
        yield Server(url, process.pid)
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):  # then whatever is left of the group
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                pass
        shutil.rmtree(temp, ignore_errors=True)
