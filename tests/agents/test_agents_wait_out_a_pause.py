"""Agent CLIs whose turns arrive during a weight update: kept alive by the stream's early start and heartbeats.

The generation is paused before the client starts, so its first call waits; once the
proxy counts a waiting turn, the "weight update" lasts three heartbeat intervals
(``--heartbeat-interval 1``), then generation resumes. A streamed call that waited
past the interval has had its reply started with heartbeats before its first event
(``docs/endpoints.md``, streaming): each client must take that stream, finish without
error and be recorded as one trajectory, as in ``test_agent_clients.py``. And the three at
once with ``--partial-rollout`` while a trainer's updates cut their streams mid-way.
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_harness import Proxy, base_env, check_recording, running_proxy
from test_agent_clients import run_claude_code, run_codex, run_opencode
from test_agent_clients import test_claude_code as claude_code
from test_agent_clients import test_codex as codex
from test_agent_clients import test_opencode as opencode
from wirelog import WireLog

pytestmark = [pytest.mark.heavy, pytest.mark.agents]

HEARTBEAT = 1.0
#: How long the weight update lasts once a turn waits: three heartbeats.
UPDATE_SECONDS = 3.5


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[Proxy]:
    """This module's proxy: heartbeats each second (the other tests' is on the defaults)."""
    with running_proxy(tmp_path, "--heartbeat-interval", str(HEARTBEAT)) as proxy:
        yield proxy


class WeightUpdate:
    """Pause now; resume ``UPDATE_SECONDS`` after the proxy first counts a turn waiting (in a thread)."""

    def __init__(self, proxy: Proxy) -> None:
        self.http = httpx.Client(base_url=proxy.url, timeout=60)
        assert self.http.post("/v1/rollout/pause", json={"mode": "abort"}).json()["status"] == "paused"
        self.waited = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if self.http.get("/v1/rollout/pause_state").json()["waiting"] >= 1:
                    self.waited = True
                    time.sleep(UPDATE_SECONDS)  # the update itself: the scenario's length, not a settling wait
                    break
                time.sleep(0.05)  # polling another process's state: there is no event to wait on
        except BaseException as exc:  # noqa: BLE001 - reported by finish() in the test's thread
            self.error = exc
        finally:
            self.http.post("/v1/rollout/resume", json={})

    def finish(self) -> None:
        self._thread.join(timeout=180)
        self.http.close()
        if self.error is not None:
            raise self.error
        assert self.waited, "no turn ever waited for the pause"


def _streams_that_waited(wire: WireLog) -> list[dict[str, Any]]:
    return [e for e in wire.entries if isinstance(e.get("body"), dict) and e["body"].get("stream")
            and e.get("answer_head", "").startswith((": keep-alive", "event: ping"))]


@pytest.mark.parametrize("client", [claude_code, codex, opencode], ids=["claude-code", "codex", "opencode"])
def test_an_agent_cli_waits_out_a_weight_update(
    client: Callable[..., None], agent_bin: Path, proxy: Proxy, wire: WireLog, tmp_path: Path,
) -> None:
    update = WeightUpdate(proxy)
    try:
        client(agent_bin, proxy, wire, tmp_path)  # runs the client, checks its output and its recording
    finally:
        update.finish()
    waited = _streams_that_waited(wire)
    assert waited, wire.summary()
    # Its stream began with the heartbeats, then went on as any other (the client parsed it: it finished).
    assert all(e["status"] == 200 for e in waited), wire.summary()


#: The response-head timeout the Node clients below are given (Node's own is 300 s): shorter than the update.
HEAD_TIMEOUT_MS = 1500


@pytest.mark.parametrize("mode", ["fetch", "ai-sdk"])
def test_a_node_call_that_does_not_stream_outlasts_its_head_timeout(
    mode: str, agent_bin: Path, proxy: Proxy, wire: WireLog, tmp_path: Path,
) -> None:
    """Node's fetch (undici), bare and under the Vercel AI SDK, calling without streaming during the update.

    Its head timeout (1.5 s) is shorter than the update (3.5 s once the call waits): each ``102 Processing``
    (``--processing-heartbeats auto``: Node's fetch is among the clients that take them) starts it over, and
    the call gets its answer after the resume instead of ``UND_ERR_HEADERS_TIMEOUT``. Through the wire log,
    which passes each interim answer on as it came.
    """
    work = tmp_path / "work"
    work.mkdir()
    (work / "node_modules").symlink_to(agent_bin.parent)  # (node resolves packages from the script's directory up)
    script = work / "node_fetch_wait.mjs"
    script.write_text((Path(__file__).parent / "node_fetch_wait.mjs").read_text())
    update = WeightUpdate(proxy)
    try:
        done = subprocess.run([str(agent_bin / "node"), str(script), mode, f"http://127.0.0.1:{wire.port}",
                               str(HEAD_TIMEOUT_MS)],
                              cwd=work, env=base_env(tmp_path / "home", agent_bin), capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)
    finally:
        update.finish()
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode == 0 and result["status"] == 200, (result, done.stderr[-2000:])
    assert result["finish"] in ("stop", "length"), result
    assert result["ms"] > UPDATE_SECONDS * 1000, result  # it did wait out the update
    calls = [(e["status"], 102 in e.get("interim", ())) for e in wire.entries if e["method"] == "POST"]
    assert calls == [(200, True)], wire.summary()


class Trainer:
    """Weight updates while the agents run (in a thread): whenever a generation is in flight, pause it (``abort``),
    update for ``UPDATE`` seconds, resume with the next weight version; until :meth:`stop`."""

    UPDATE = 0.3

    def __init__(self, proxy: Proxy) -> None:
        self.http = httpx.Client(base_url=proxy.url, timeout=60)
        self.aborted = self.updates = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.http.get("/v1/rollout/pause_state").json()["in_flight"] == 0:
                    time.sleep(0.05)  # polling another process's state: there is no event to wait on
                    continue
                ack = self.http.post("/v1/rollout/pause", json={"mode": "abort"}).json()
                self.aborted += ack["aborted"]
                time.sleep(self.UPDATE)  # the update itself: the scenario's length, not a settling wait
                self.updates += 1
                self.http.post("/v1/rollout/resume", json={"weight_version": str(self.updates)}).raise_for_status()
                self._stop.wait(0.5)  # some generating between two updates
        except BaseException as exc:  # noqa: BLE001 - reported by stop() in the test's thread
            self.error = exc

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self.http.close()
        if self.error is not None:
            raise self.error


def test_agent_clis_stream_through_weight_updates_with_partial_rollout(agent_bin: Path, tmp_path: Path) -> None:
    """Claude Code, Codex and opencode at once while the trainer updates the weights whenever a generation is in
    flight (docs/agents.md, Agent CLIs and weight updates). With ``--partial-rollout`` a streamed turn cut by a
    pause goes on after the resume, under the new weights, in the same reply: each client finishes as if nothing
    happened, and each session is one main trajectory whose cut steps hold every token once."""
    runs = {"claude-code": run_claude_code, "codex": run_codex, "opencode": run_opencode}
    wires: dict[str, WireLog] = {}
    failed: dict[str, BaseException] = {}
    with running_proxy(tmp_path, "--partial-rollout") as proxy:
        port = proxy.port

        def run(session: str) -> None:
            home = tmp_path / session
            home.mkdir()
            try:
                with WireLog(port, home / "wire.jsonl") as wires[session]:
                    runs[session](agent_bin, wires[session], home, session)
            except BaseException as exc:  # noqa: BLE001 - reported below, in the test's thread
                failed[session] = exc

        trainer = Trainer(proxy)
        try:
            agents = [threading.Thread(target=run, args=(session,)) for session in runs]
            for agent in agents:
                agent.start()
            for agent in agents:
                agent.join(timeout=300)
        finally:
            trainer.stop()
        assert not failed, failed
        assert trainer.aborted >= 1, "no update cut a generation"
        preempted = []
        for session, wire in wires.items():
            _, steps = check_recording(proxy, session, wire)
            preempted += [s for s in steps if s["preemptions"]]
        # A cut step holds its tokens in the order the weight versions came (a step cut before its first token has
        # one version only); at least one holds tokens of two.
        assert preempted, "no recorded step was cut by an update"
        spans = []
        for step in preempted:
            assert step["status"] == "completed" and len(step["output_ids"]) == len(step["output_logprobs"])
            versions = step["concat_versions"][-len(step["output_ids"]):]
            assert versions == sorted(versions), (step["session_id"], step["step_index"], versions)
            spans.append(len(set(versions)))
        assert max(spans) >= 2, spans
