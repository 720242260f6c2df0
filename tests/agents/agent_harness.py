"""Helpers of the real-client tier: the proxy subprocess, running a client, checking the recording."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
from _children import die_with_parent
from wirelog import WireLog

REPO = Path(__file__).resolve().parents[2]
INSTALL = REPO / "scripts" / "agents" / "install.sh"
INSTALL_PYTHON = REPO / "scripts" / "agents" / "install_python.sh"
#: Seconds one client run may take (a few model turns on the simulated engine).
RUN_TIMEOUT = 240


@attrs.define
class Proxy:
    """A running ``actorproxy run`` subprocess."""

    url: str
    process: subprocess.Popen[str]
    log: Path

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def session(self, session_id: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Finalize ``session_id`` and read back its segments and steps (sub-agents and side calls included)."""
        with httpx.Client(base_url=self.url, timeout=60) as http:
            http.post("/session/finalize", json={"session_id": session_id}).raise_for_status()
            read = http.post("/trajectory/read", json={"session_id": session_id, "include_steps": True})
            read.raise_for_status()
            payload = read.json()
        return payload["data"], payload["steps"]

    def read(self, session_id: str) -> list[dict[str, Any]]:
        """The segments of a finalized session (read again, not drained)."""
        with httpx.Client(base_url=self.url, timeout=60) as http:
            read = http.post("/trajectory/read", json={"session_id": session_id})
            read.raise_for_status()
            return list(read.json()["data"])

    def stats(self) -> dict[str, Any]:
        with httpx.Client(base_url=self.url, timeout=60) as http:
            return dict(http.get("/trajectory/stats").json())


#: The simulated model calls a tool on every agent's first turn and after a tool result half the time:
#: every run is a tool loop of two or more turns, and the loop ends (the CLIs cap it, too).
SIM_TOOL_LOOP = ("--sim-tool-call-probability", "1", "--sim-followup-tool-call-probability", "0.5")


@contextmanager
def running_proxy(tmp_path: Path, *flags: str) -> Iterator[Proxy]:
    """``actorproxy run`` on its defaults (the simulated engine) and ``flags``, on a free port, tool loops certain."""
    log = tmp_path / "actorproxy.log"
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with log.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "actorproxy", "run", "--port", "0", *SIM_TOOL_LOOP, *flags],
                                   cwd=tmp_path,
                                   stdout=sink, stderr=subprocess.STDOUT, text=True, env=env,
                                   preexec_fn=die_with_parent)
    try:
        url = wait_for_url(process, log)
        yield Proxy(url, process, log)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def proxy_and_wire(tmp_path: Path, *flags: str) -> Iterator[tuple[Proxy, WireLog]]:
    """:func:`running_proxy` with a :class:`WireLog` in front of it (its log ``tmp_path / "wire.jsonl"``)."""
    with running_proxy(tmp_path, *flags) as proxy, WireLog(proxy.port, tmp_path / "wire.jsonl") as wire:
        yield proxy, wire


def wait_for_url(process: subprocess.Popen[str], log: Path) -> str:
    """The URL the proxy logs once it serves (it picked the free port itself)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        match = re.search(r"serving on (http://[0-9.]+:\d+)", log.read_text())
        if match:
            return match.group(1)
        if process.poll() is not None:
            raise RuntimeError(f"actorproxy run exited with {process.returncode}:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)  # polling a subprocess's log: there is no event to wait on
    raise RuntimeError(f"actorproxy run did not start in 120 s:\n{log.read_text()[-3000:]}")


def run_client(args: list[str], *, cwd: Path, env: dict[str, str], wire: WireLog) -> subprocess.CompletedProcess[str]:
    """Run a client to completion; a non-zero exit fails with its output and the wire log."""
    try:
        done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{args[0]} did not finish in {RUN_TIMEOUT} s:\n{exc.stdout!r}\n{exc.stderr!r}") from None
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def base_env(home: Path, agent_bin: Path | None = None) -> dict[str, str]:
    """A clean environment: a fresh home, and no variables of this machine's own agent clients.

    ``agent_bin`` (the install's ``node_modules/.bin``, which holds ``node`` too) goes first on
    ``PATH``: the CLIs start with ``#!/usr/bin/env node`` and need the Node.js installed with them.
    """
    keep = ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "SSL_CERT_FILE", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k in keep}
    if agent_bin is not None:
        env["PATH"] = os.pathsep.join([str(agent_bin), env.get("PATH", "")])
    home.mkdir(parents=True, exist_ok=True)
    env.update(HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"), XDG_DATA_HOME=str(home / ".local/share"),
               XDG_STATE_HOME=str(home / ".local/state"), XDG_CACHE_HOME=str(home / ".cache"))
    return env


#: Step boundary reasons that mean the proxy lost the append-only thread (a client's rewrite
#: it could not see through). A real agent's short run has none of them.
LOST = {"history_rewrite", "system_changed", "tool_schema_change", "tito_failure"}


def assert_no_protocol_error(wire: WireLog) -> None:
    """Every request the client sent got a 2xx."""
    errors = [e for e in wire.entries if e.get("status", 599) >= 400]
    assert not errors, "protocol errors:\n" + "\n".join(
        f"{e['method']} {e['path']} -> {e.get('status')}: {e.get('answer_head', '')[:400]}" for e in errors)


def check_recording(proxy: Proxy, session_id: str, wire: WireLog) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The session is one main trajectory: its longest-running conversation, in one segment.

    Returns the main segment and all steps. Sub-agent and side-call segments may
    exist beside it; every segment starts with its conversation, never on a lost match.
    """
    assert_no_protocol_error(wire)
    segments, steps = proxy.session(session_id)
    assert segments, f"nothing recorded for {session_id}"
    # A sub-agent the model started may still be calling when the client's run ends with the main agent's answer
    # (Codex's spawn_agent runs it beside the parent, and `codex exec` exits with the parent's answer): its call
    # is cut, and recorded in its child session as the client's disconnect. Nothing else may be cut or refused.
    cut = [s for s in steps if s["session_id"] != session_id and s["status"] == "client_disconnected"]
    # The proxy's own access log agrees: no 4xx or 5xx answer to anything the client sent (its session's and its
    # sub-agents' calls: other clients may share the proxy), but those cut calls.
    own = re.compile(rf"(session=|/sess/){re.escape(session_id)}[/ ]")
    refused = [line for line in proxy.log.read_text().splitlines()
               if "actorproxy.access" in line and re.search(r" status=[45]\d\d ", line) and own.search(line)]
    hung_up = [line for line in refused if " status=499 " in line and "error=client_disconnected" in line]
    assert len(refused) == len(hung_up) <= len(cut), "the proxy's log shows refused requests:\n" + "\n".join(refused)
    main = [s for s in segments if not s["metadata"].get("sub_agent") and not s["metadata"].get("side_call")]
    summary = json.dumps([(s["trajectory_id"], s["num_steps"], s["start_reason"], s["metadata"].get("sub_agent"),
                           s["metadata"].get("side_call")) for s in segments])
    assert len(main) == 1, f"expected one main segment, got {summary}"
    assert main[0]["start_reason"] == "session_start", summary
    assert max(s["num_steps"] for s in segments) == main[0]["num_steps"], f"the main agent is not the main: {summary}"
    # The simulated model calls a tool on the first turn (SIM_TOOL_LOOP): a loop of two turns or more.
    assert main[0]["num_steps"] >= 2, f"the main trajectory is not a tool loop: {summary}"
    # The main conversation is the one that continues: the agent's last call of its own session (its final
    # answer; a sub-agent's call, in a child session, may come later) is in it.
    own = [s for s in steps if s["session_id"] == session_id and s["status"] != "superseded"]
    last = max(own, key=lambda s: s["created_at"])
    assert last["in_segment"] and f"{session_id}#{last['segment_index']}" == main[0]["trajectory_id"], (
        f"the last call (step {last['step_index']}) is not in the main trajectory: {summary}")
    lost = [(s["session_id"], s["step_index"], s["boundary_reason"]) for s in steps if s["boundary_reason"] in LOST]
    assert not lost, f"segments started on a lost match: {lost}; segments {summary}"
    assert all(s["status"] == "completed" for s in steps if s["status"] != "superseded" and s not in cut), [
        (s["session_id"], s["step_index"], s["status"], s.get("error")) for s in steps]
    return main[0], steps
