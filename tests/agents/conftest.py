"""The real-client tier: today's agent clients against ``actorproxy run``.

The CLIs and the Vercel AI SDK (pinned in ``scripts/agents/package-lock.json``)
and Node.js 22 they need are installed into a cache directory on first use by
``scripts/agents/install.sh``; with
``ACTORPROXY_AGENTS=latest`` the newest versions on npm are used instead. The
tier is skipped only when npm itself cannot be reached. The Python clients that
bring dependencies of their own (mini-swe-agent, LiteLLM, LangGraph, LangChain,
smolagents) get a venv of their own from ``scripts/agents/install_python.sh``
(pinned in ``python-clients.txt``); their tests are skipped only when PyPI cannot
be reached.

Each test starts a real ``actorproxy run`` (defaults: the built-in simulated
engine) on a free port, puts a :class:`WireLog` in front of it, runs the client
headless in a fresh home directory, then finalizes the session and reads its
segments. A failing test shows the wire log: every request the client sent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from agent_harness import INSTALL, INSTALL_PYTHON, Proxy, running_proxy
from wirelog import WireLog


def _npm_reachable(npm: str) -> tuple[bool, str]:
    try:
        ping = subprocess.run([npm, "ping"], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False, "npm ping timed out after 60 s"
    return ping.returncode == 0, (ping.stderr or ping.stdout).strip()[-500:]


def _installed(args: list[str], reachable: Callable[[], tuple[bool, str]], what: str, registry: str) -> Path:
    """The last line ``args`` (an install script) prints; skipped when ``registry`` is unreachable, else failed."""
    try:
        install = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    except subprocess.TimeoutExpired:
        install = None
    if install is None or install.returncode != 0:
        up, detail = reachable()
        if not up:
            pytest.skip(f"{what} skipped: {registry} is unreachable ({detail})")
        pytest.fail(f"installing {what} failed although {registry} is reachable:\n"
                    + ("timed out" if install is None else install.stderr[-4000:]))
    return Path(install.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def agent_bin() -> Path:
    """The install's ``node_modules/.bin``, installed when missing: ``node`` 22 and the clients' commands."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("real agent CLI tier skipped: npm is not installed (it installs Node.js 22 and the clients)")
    args = ["bash", str(INSTALL)] + (["--latest"] if os.environ.get("ACTORPROXY_AGENTS") == "latest" else [])
    install = _installed(args, partial(_npm_reachable, npm), "the agent CLIs", "the npm registry")
    return install / "node_modules" / ".bin"


def _pypi_reachable() -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as dest:
        try:
            probe = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--dest", dest, "--quiet",
                                    "mini-swe-agent"], capture_output=True, text=True, timeout=120)
        except subprocess.TimeoutExpired:
            return False, "pip download timed out after 120 s"
    return probe.returncode == 0, probe.stderr.strip()[-500:]


@pytest.fixture(scope="session")
def clients_python() -> Path:
    """The Python of the Python clients' own venv (scripts/agents/python-clients.txt), installed when missing."""
    return _installed(["bash", str(INSTALL_PYTHON)], _pypi_reachable, "the Python agent clients", "PyPI")


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[Proxy]:
    """``actorproxy run`` on its defaults (the simulated engine), on a free port, tool loops certain."""
    with running_proxy(tmp_path) as proxy:
        yield proxy


@pytest.fixture
def wire(proxy: Proxy, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[WireLog]:
    """A recording forwarder in front of the proxy; its log is a file per test, shown on failure."""
    with WireLog(proxy.port, tmp_path / f"wire-{request.node.name}.jsonl") as log:
        yield log


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    report = yield
    wire = getattr(item, "funcargs", {}).get("wire")
    if report.failed and isinstance(wire, WireLog):
        report.sections.append(("wire log (what the client sent)", wire.summary()))
        proxy = item.funcargs.get("proxy")
        if isinstance(proxy, Proxy):
            report.sections.append(("actorproxy log (tail)", proxy.log.read_text()[-3000:]))
    return report


