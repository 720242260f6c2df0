"""Today's agent clients, headless, against ``actorproxy run`` on its defaults (the simulated engine).

Each must finish without a protocol error, and its session must be recorded as
one main trajectory (see ``check_recording``). The client's configuration in each
test is the recipe docs/agents.md gives.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from agent_harness import (
    LOST,
    REPO,
    Proxy,
    assert_no_protocol_error,
    base_env,
    check_recording,
    proxy_and_wire,
    run_client,
)
from wirelog import WireLog

# The tier installs or starts something big: `-m "not heavy"` leaves it out (README.md).
pytestmark = [pytest.mark.heavy, pytest.mark.agents]

PROMPT = "Look at notes.txt and tell me what it says."


def _workdir(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("The build is green. Ship it on Friday.\n")
    return work


def _a_read_past_the_window(tmp_path: Path, tool: str, path_field: str, *, window: int) -> tuple[Path, tuple[str, ...]]:
    """The work directory with a long notes.txt (~6,000 tokens once read), and the proxy flags that make the
    simulated model's first call a read of it (``tool`` with the path in ``path_field``) within a ``window``
    too small for its result."""
    work = _workdir(tmp_path)
    (work / "notes.txt").write_text("".join(f"Line {i}: the build is green and the release ships on Friday.\n"
                                            for i in range(300)))
    read = {"name": tool, "arguments": {path_field: str(work / "notes.txt")}}
    return work, ("--sim-tool-calls", json.dumps([read]), "--sim-tool-call-probability", "0",
                  "--sim-followup-tool-call-probability", "0", "--context-window", str(window))


def claude_code_env(agent_bin: Path, tmp_path: Path, wire: WireLog, session: str) -> dict[str, str]:
    """docs/agents.md's Claude Code environment: its calls through ``wire`` in ``session``, a fresh home."""
    env = base_env(tmp_path / "home", agent_bin)
    env.update(ANTHROPIC_BASE_URL=f"http://127.0.0.1:{wire.port}/sess/{session}", ANTHROPIC_AUTH_TOKEN="unused",
               CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_AUTOUPDATER="1")
    return env


def run_claude_code(agent_bin: Path, wire: WireLog, tmp_path: Path, session: str) -> None:
    """Claude Code headless on ``PROMPT``, its calls through ``wire`` in ``session``."""
    env = claude_code_env(agent_bin, tmp_path, wire, session)
    # Read and Edit only, edits accepted: the random policy's calls are mostly Edits, whose echo
    # comes back with the schema's default "replace_all": false added (one segment all the same).
    done = run_client([str(agent_bin / "claude"), "-p", PROMPT, "--max-turns", "12", "--tools", "Read,Edit",
                       "--permission-mode", "acceptEdits"], cwd=_workdir(tmp_path), env=env, wire=wire)
    assert done.stdout.strip(), done.stderr


def test_claude_code(agent_bin: Path, proxy: Proxy, wire: WireLog, tmp_path: Path) -> None:
    session = "claude-code"
    run_claude_code(agent_bin, wire, tmp_path, session)
    assert all("/v1/messages" in e["path"] for e in wire.entries), [e["path"] for e in wire.entries]
    check_recording(proxy, session, wire)


#: A second instruction, given by starting the CLI again on the session it saved.
FOLLOW_UP = "Now say what you changed."


def _runs_and_resume(kind: str, agent_bin: Path, wire: WireLog,
                     tmp_path: Path) -> tuple[dict[str, str], list[list[str]]]:
    """The environment and the two commands of ``kind``: a run on ``PROMPT``, then its own resume with ``FOLLOW_UP``."""
    if kind == "claude_code":
        claude = str(agent_bin / "claude")
        # run_claude_code's cap: the random policy's loop reaches 6 turns in about 1 run of 32 (exit 1: max turns).
        flags = ["--max-turns", "12", "--tools", "Read,Edit", "--permission-mode", "acceptEdits"]
        return claude_code_env(agent_bin, tmp_path, wire, kind), [[claude, "-p", PROMPT, *flags],
                                                                 [claude, "-c", "-p", FOLLOW_UP, *flags]]
    if kind == "codex":
        exec_ = [str(agent_bin / "codex"), "exec", "--skip-git-repo-check"]
        env = {**base_env(tmp_path / "home", agent_bin), **_codex_home(tmp_path, wire.port, kind)}
        return env, [[*exec_, PROMPT], [*exec_, "resume", "--last", FOLLOW_UP]]
    opencode = str(agent_bin / "opencode")
    return opencode_env(agent_bin, tmp_path, wire, kind), [[opencode, "run", PROMPT],
                                                          [opencode, "run", "--continue", FOLLOW_UP]]


@pytest.mark.parametrize("kind", ["claude_code", "codex", "opencode"])
def test_a_resumed_run_continues_its_trajectory(agent_bin: Path, proxy: Proxy, wire: WireLog, tmp_path: Path,
                                                kind: str) -> None:
    """A rollout that gives the agent a follow-up by starting the CLI again on its saved conversation (``claude -c``,
    ``codex exec resume --last``, ``opencode run --continue``): the CLI rebuilds the conversation from its own
    transcript, and the proxy takes it for the one it served, so both runs are one main trajectory."""
    env, (first, resume) = _runs_and_resume(kind, agent_bin, wire, tmp_path)
    work = _workdir(tmp_path)
    run_client(first, cwd=work, env=env, wire=wire)
    calls = len(wire.entries)
    run_client(resume, cwd=work, env=env, wire=wire)
    assert len(wire.entries) > calls, "the resumed run made no call"
    main, steps = check_recording(proxy, kind, wire)
    last = max(steps, key=lambda s: s["step_index"])
    assert FOLLOW_UP in json.dumps([s["new_messages"] for s in steps if s["step_index"] in main["step_indices"]])
    assert last["step_index"] in main["step_indices"] and main["step_indices"][0] < calls, (main, calls)


#: Two Task agents of one type, given one task, started together by the main agent's first reply (and a Read of the
#: notes: a reader agent's first call, which has no Agent tool).
READER = {"description": "read the notes", "prompt": "Read notes.txt and report what it says.",
          "subagent_type": "reader"}


def test_claude_code_task_agents(agent_bin: Path, tmp_path: Path) -> None:
    """Two Task agents that open alike (one type, one task) run side by side: Claude Code names each one's calls
    (``X-Claude-Code-Agent-Id``), and each is a child session of its own, one segment, with no lost match."""
    session = "claude-code-agents"
    read = {"name": "Read", "arguments": {"file_path": str(tmp_path / "work" / "notes.txt")}}
    # No other call: Claude Code hands a Task agent's report over as a user message, and a random call after it
    # could start agents again.
    flags = ("--sim-tool-calls", json.dumps([{"name": "Agent", "arguments": READER}] * 2 + [read]),
             "--sim-tool-call-probability", "0", "--sim-followup-tool-call-probability", "0")
    with proxy_and_wire(tmp_path, *flags) as (proxy, wire):
        env = claude_code_env(agent_bin, tmp_path, wire, session)
        # A reader agent of its own, with Read only: it starts no agent itself.
        agents = {"reader": {"description": "Reads files and reports what they say.",
                             "prompt": "You read the files you are asked about and report briefly.", "tools": ["Read"]}}
        done = run_client([str(agent_bin / "claude"), "-p", PROMPT, "--max-turns", "6", "--tools", "Read,Agent",
                           "--agents", json.dumps(agents), "--permission-mode", "acceptEdits"],
                          cwd=_workdir(tmp_path), env=env, wire=wire)
        assert done.stdout.strip(), done.stderr
        named = {v for e in wire.entries for k, v in e["headers"].items() if k.lower() == "x-claude-code-agent-id"}
        assert len(named) == 2, wire.summary()  # (it ran both, and named them)
        segments, steps = proxy.session(session)
        summary = json.dumps([(s["trajectory_id"], s["num_steps"], s["start_reason"]) for s in segments])
        lost = [(s["session_id"], s["step_index"], s["boundary_reason"]) for s in steps if s["boundary_reason"] in LOST]
        assert not lost, f"segments started on a lost match: {lost}; segments {summary}"
        children = sorted((s["trajectory_id"], s["num_steps"]) for s in segments if s["metadata"].get("sub_agent"))
        assert children == [(f"{session}/sub-1#0", 2), (f"{session}/sub-2#0", 2)], summary
        main = [s for s in segments
                if s["trajectory_id"].startswith(f"{session}#") and not s["metadata"].get("side_call")]
        assert [(s["start_reason"], s["num_steps"] >= 2) for s in main] == [("session_start", True)], summary


def test_claude_code_takes_a_full_context_window_for_what_it_is(agent_bin: Path, tmp_path: Path) -> None:
    """A prompt past the context window is refused in Anthropic's words, and Claude Code acts on it as it does on
    Anthropic's API: it compacts the conversation (here the compaction's own request is too long too, and it ends
    the run saying so), instead of sending the refused request again as it did another 400."""
    session = "claude-code-full"
    work, flags = _a_read_past_the_window(tmp_path, "Read", "file_path", window=6000)
    with proxy_and_wire(tmp_path, *flags) as (proxy, wire):
        env = claude_code_env(agent_bin, tmp_path, wire, session)
        done = subprocess.run([str(agent_bin / "claude"), "-p", PROMPT, "--max-turns", "6", "--tools", "Read",
                               "--permission-mode", "acceptEdits"], cwd=work, env=env, capture_output=True, text=True,
                              timeout=300, stdin=subprocess.DEVNULL)
        calls = [e for e in wire.entries if "/v1/messages" in e["path"] and "count_tokens" not in e["path"]]
        refused = [i for i, e in enumerate(calls) if e["status"] == 400]
        assert refused, f"no call was refused: {wire.summary()}"
        first = calls[refused[0]]
        assert "prompt is too long:" in first["answer_head"], first["answer_head"]
        assert calls[0]["status"] == 200  # the opening call fitted; the Read's result did not
        after = calls[refused[0] + 1:]
        assert after and after[0]["body"] != first["body"], \
            f"Claude Code sent the refused request again: {wire.summary()}"
        assert "prompt is too long" in (done.stdout + done.stderr).lower(), (done.returncode, done.stdout, done.stderr)
        _, steps = proxy.session(session)
        assert steps and steps[0]["prompt_tokens"] < 6000, steps  # the turn before the overflow is recorded


def _codex_home(tmp_path: Path, port: int, session: str) -> dict[str, str]:
    """docs/agents.md's Codex configuration, its base URL at ``port`` and ``session``: the environment it needs."""
    codex_home = tmp_path / "home" / ".codex"
    codex_home.mkdir(parents=True)
    (codex_home / "config.toml").write_text(f"""\
model = "actorproxy"
model_provider = "actorproxy"
check_for_update_on_startup = false

[model_providers.actorproxy]
name = "actorproxy"
base_url = "http://127.0.0.1:{port}/sess/{session}/v1"
env_key = "ACTORPROXY_API_KEY"
wire_api = "responses"

[analytics]
enabled = false
""")
    return {"CODEX_HOME": str(codex_home), "ACTORPROXY_API_KEY": "unused"}


def run_codex(agent_bin: Path, wire: WireLog, tmp_path: Path, session: str) -> None:
    """``codex exec`` on ``PROMPT``, its calls through ``wire`` in ``session``."""
    env = base_env(tmp_path / "home", agent_bin)
    env.update(_codex_home(tmp_path, wire.port, session))
    done = run_client([str(agent_bin / "codex"), "exec", "--skip-git-repo-check", PROMPT],
                      cwd=_workdir(tmp_path), env=env, wire=wire)
    assert done.stdout.strip(), done.stderr


def test_codex(agent_bin: Path, proxy: Proxy, wire: WireLog, tmp_path: Path) -> None:
    session = "codex"
    run_codex(agent_bin, wire, tmp_path, session)
    assert all(e["path"].endswith("/v1/responses") for e in wire.entries), [e["path"] for e in wire.entries]
    _, steps = check_recording(proxy, session, wire)
    assert len(steps) == len(wire.entries)


def _opencode_config(port: int, session: str) -> dict[str, Any]:
    """docs/agents.md's opencode configuration, its base URL at ``port`` and ``session``."""
    return {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"actorproxy": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "actorproxy",
            "options": {"baseURL": f"http://127.0.0.1:{port}/sess/{session}/v1", "apiKey": "unused"},
            "models": {"actorproxy": {"name": "actorproxy"}},
        }},
        "model": "actorproxy/actorproxy",
        "autoupdate": False,
        "share": "disabled",
    }


def test_codex_spawns_a_sub_agent(agent_bin: Path, tmp_path: Path) -> None:
    """Codex offers its sub-agent tools as the ``multi_agent_v1`` namespace: the model is offered ``spawn_agent`` by
    its own name, and its call goes back with the namespace, which Codex runs. The sub-agent (forked: the parent's
    history first) calls on a thread of its own (``thread-id``), a child session of the session."""
    session = "codex-spawn"
    spawn = {"name": "spawn_agent", "arguments": {"message": "Read notes.txt and report.", "fork_context": True}}
    # The parent's answer after the spawn takes a while (a token every 0.2 s), so that its sub-agent calls before
    # `codex exec` ends with the parent's answer.
    flags = ("--sim-tool-calls", json.dumps(spawn), "--sim-tool-call-probability", "0",
             "--sim-followup-tool-call-probability", "0", "--sim-token-interval", "0.2")
    with proxy_and_wire(tmp_path, *flags) as (proxy, wire):
        env = base_env(tmp_path / "home", agent_bin)
        env.update(_codex_home(tmp_path, wire.port, session))
        done = run_client([str(agent_bin / "codex"), "exec", "--skip-git-repo-check", PROMPT],
                          cwd=_workdir(tmp_path), env=env, wire=wire)
        assert "SpawnAgent" in done.stdout + done.stderr, done.stdout + done.stderr
        # Codex ran the call: the parent's next request carries the call, with its namespace, and the agent's id.
        items = [item for e in wire.entries for item in e["body"].get("input", []) if isinstance(item, dict)]
        calls = [i for i in items if i.get("type") == "function_call" and i.get("name") == "spawn_agent"]
        assert calls and {c.get("namespace") for c in calls} == {"multi_agent_v1"}, wire.summary()
        outputs = [i["output"] for i in items if i.get("type") == "function_call_output"
                   and i.get("call_id") == calls[0]["call_id"]]
        assert outputs and "agent_id" in outputs[0], outputs
        # The session is one main trajectory as any other run's; the sub-agent's call, cut short when the parent's
        # answer ended the run (or not), is the child's.
        main, steps = check_recording(proxy, session, wire)
        # Each call of the parent's thread is a step of the main segment, each of the sub-agent's a step of the
        # child: two parent calls (the spawn, the answer), and a third when the sub-agent finished first (Codex
        # then tells the parent in a <subagent_notification> message, and the parent answers that).
        threads = [{k.lower(): v for k, v in e["headers"].items()} for e in wire.entries]
        parent = [h for h in threads if h.get("thread-id") == h.get("session-id")]
        assert main["start_reason"] == "session_start" and main["num_steps"] == len(parent) >= 2, (main, wire.summary())
        assert len([s for s in steps if s["session_id"] == f"{session}/sub-1"]) == len(threads) - len(parent), steps
        assert {s["session_id"] for s in steps} == {session, f"{session}/sub-1"}, steps


def opencode_env(agent_bin: Path, tmp_path: Path, wire: WireLog, session: str) -> dict[str, str]:
    """docs/agents.md's opencode environment: its calls through ``wire`` in ``session``, a fresh home."""
    env = base_env(tmp_path / "home", agent_bin)
    env.update(OPENCODE_CONFIG_CONTENT=json.dumps(_opencode_config(wire.port, session)),
               OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_MODELS_FETCH="1")
    return env


def run_opencode(agent_bin: Path, wire: WireLog, tmp_path: Path, session: str) -> None:
    """``opencode run`` on ``PROMPT``, its calls through ``wire`` in ``session``."""
    env = opencode_env(agent_bin, tmp_path, wire, session)
    done = run_client([str(agent_bin / "opencode"), "run", PROMPT], cwd=_workdir(tmp_path), env=env, wire=wire)
    assert done.stdout.strip(), done.stderr


def test_opencode(agent_bin: Path, proxy: Proxy, wire: WireLog, tmp_path: Path) -> None:
    session = "opencode"
    run_opencode(agent_bin, wire, tmp_path, session)
    _, steps = check_recording(proxy, session, wire)
    # Its title generator (another system prompt, sent before or beside the first agent call) is a side call.
    titles = [s for s in steps if "title generator" in json.dumps(s["new_messages"][:1])]
    assert len(titles) == 1, titles
    side = [(s["trajectory_id"], s["step_indices"]) for s in proxy.read(session) if s["metadata"].get("side_call")]
    assert side == [(f"{titles[0]['session_id']}#{titles[0]['segment_index']}", [titles[0]["step_index"]])], side


#: The simulated model's first call whenever the task tool is offered: opencode's own general sub-agent.
TASK_CALL = json.dumps({"name": "task", "arguments": {
    "description": "read the notes", "prompt": "Read notes.txt and report what it says.", "subagent_type": "general"}})


def test_opencode_compacts_on_a_full_context_window_and_goes_on(agent_bin: Path, tmp_path: Path) -> None:
    """opencode takes the refusal of a prompt past the window for an overflow (OpenAI's words): it asks for a summary
    of the conversation and goes on from it, a rewritten history the session records as a new segment."""
    session = "opencode-full"
    work, flags = _a_read_past_the_window(tmp_path, "read", "filePath", window=9000)
    with proxy_and_wire(tmp_path, *flags) as (proxy, wire):
        env = opencode_env(agent_bin, tmp_path, wire, session)
        subprocess.run([str(agent_bin / "opencode"), "run", PROMPT], cwd=work, env=env, capture_output=True,
                       text=True, timeout=300, stdin=subprocess.DEVNULL)
        refused = [i for i, e in enumerate(wire.entries) if e["status"] == 400]
        assert refused, f"no call was refused: {wire.summary()}"
        assert "maximum context length is 9000 tokens" in wire.entries[refused[0]]["answer_head"]
        after = wire.entries[refused[0] + 1:]
        assert after and after[0]["body"] != wire.entries[refused[0]]["body"], wire.summary()
        assert any(e["status"] == 200 for e in after), wire.summary()  # it went on, within the window
        _, steps = proxy.session(session)
        assert "history_rewrite" in [s["boundary_reason"] for s in steps if s["session_id"] == session], steps


def test_opencode_sub_agent(agent_bin: Path, tmp_path: Path) -> None:
    """opencode's task tool: the sub-agent opens with the main agent's very system prompt, so only the headers
    opencode sends (``X-Session-Id``, ``X-Parent-Session-Id``) tell it apart; it is a child session, and the main
    conversation stays one segment."""
    session = "opencode-task"
    with proxy_and_wire(tmp_path, "--sim-tool-calls", TASK_CALL) as (proxy, wire):
        env = opencode_env(agent_bin, tmp_path, wire, session)
        done = run_client([str(agent_bin / "opencode"), "run", PROMPT], cwd=_workdir(tmp_path), env=env, wire=wire)
        assert done.stdout.strip(), done.stderr
        calls = [e for e in wire.entries if e["path"].endswith("/chat/completions")]
        by_sub_agent = [e for e in calls if any(k.lower() == "x-parent-session-id" for k in e["headers"])]
        assert by_sub_agent, wire.summary()  # (opencode ran its sub-agent, and said so)
        segments, steps = proxy.session(session)
        summary = json.dumps([(s["trajectory_id"], s["num_steps"], s["start_reason"], s["metadata"].get("sub_agent"),
                               s["metadata"].get("side_call")) for s in segments])
        main = [s for s in segments
                if s["trajectory_id"].startswith(f"{session}#") and not s["metadata"].get("side_call")]
        assert [(s["start_reason"], s["num_steps"] >= 2) for s in main] == [("session_start", True)], summary
        lost = [(s["session_id"], s["step_index"], s["boundary_reason"]) for s in steps if s["boundary_reason"] in LOST]
        assert not lost, f"segments started on a lost match: {lost}; segments {summary}"
        # Every call the sub-agent made is a step of the child session, and nothing else is.
        child = [s for s in steps if s["session_id"] == f"{session}/sub-1"]
        assert len(child) == len(by_sub_agent) >= 1
        assert {s["session_id"] for s in steps} == {session, f"{session}/sub-1"}
        assert all(s["metadata"]["sub_agent"] == "sub-1" for s in segments if s["trajectory_id"].startswith(
            f"{session}/sub-1#")), summary


def test_openai_agents_sdk(proxy: Proxy, wire: WireLog, tmp_path: Path) -> None:
    """The Agents SDK's default model (Responses API), through the runnable example."""
    example = REPO / "examples" / "openai_agents_sdk.py"
    done = subprocess.run([sys.executable, str(example), "--base-url", f"http://127.0.0.1:{wire.port}/sess/sdk/v1"],
                          capture_output=True, text=True, timeout=240, env=base_env(tmp_path / "home"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(e["path"].endswith("/v1/responses") for e in wire.entries), [e["path"] for e in wire.entries]
    main, steps = check_recording(proxy, "sdk", wire)
    assert main["num_steps"] == len(steps) == len(wire.entries) >= 1


def _qwen_settings(home: Path) -> None:
    """Qwen Code's user settings: no telemetry, usage statistics or update checks."""
    settings = home / ".qwen" / "settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
    }))


@pytest.mark.parametrize("auth_type", ["openai", "openai-responses"])
def test_qwen_code(agent_bin: Path, proxy: Proxy, wire: WireLog, tmp_path: Path, auth_type: str) -> None:
    """Qwen Code headless, on chat completions (``openai``) and on the Responses API (``openai-responses``)."""
    session = f"qwen-{auth_type}"
    env = base_env(tmp_path / "home", agent_bin)
    _qwen_settings(tmp_path / "home")
    env.update(OPENAI_API_KEY="unused", OPENAI_BASE_URL=f"http://127.0.0.1:{wire.port}/sess/{session}/v1",
               OPENAI_MODEL="actorproxy")
    done = run_client([str(agent_bin / "qwen"), "--auth-type", auth_type, "--approval-mode", "yolo",
                       "--max-session-turns", "12", PROMPT], cwd=_workdir(tmp_path), env=env, wire=wire)
    assert done.stdout.strip(), done.stderr
    route = "/v1/chat/completions" if auth_type == "openai" else "/v1/responses"
    assert all(e["path"].endswith(route) for e in wire.entries if e["method"] == "POST"), [
        e["path"] for e in wire.entries]
    main, _ = check_recording(proxy, session, wire)
    assert main["num_steps"] >= 2, main  # a tool call and the answer after its result
    if auth_type == "openai-responses":  # it sends our reasoning back as the reply's text: matched, and counted
        assert main["metadata"]["echo_tolerated"]["reasoning_as_text"] >= 1, main["metadata"]


@pytest.mark.parametrize("mode", ["generate", "stream"])
@pytest.mark.parametrize("provider", ["responses", "chat", "anthropic"])
def test_vercel_ai_sdk(agent_bin: Path, proxy: Proxy, wire: WireLog, tmp_path: Path, provider: str,
                       mode: str) -> None:
    """The Vercel AI SDK's tool loop (generateText and streamText): @ai-sdk/openai's default (Responses,
    ``store: true``: later steps send ``item_reference``s), its chat model, and @ai-sdk/anthropic."""
    session = f"ai-sdk-{provider}-{mode}"
    work = tmp_path / "work"
    work.mkdir()
    # The script imports the SDK from the install: node resolves packages from the script's directory up.
    (work / "node_modules").symlink_to(agent_bin.parent)
    script = work / "ai_sdk_agent.mjs"
    script.write_text((Path(__file__).parent / "ai_sdk_agent.mjs").read_text())
    base = f"http://127.0.0.1:{wire.port}/sess/{session}/v1"
    done = run_client([str(agent_bin / "node"), str(script), provider, mode, base], cwd=work,
                      env=base_env(tmp_path / "home", agent_bin), wire=wire)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    route = {"responses": "/v1/responses", "chat": "/v1/chat/completions", "anthropic": "/v1/messages"}[provider]
    assert all(e["path"].endswith(route) for e in wire.entries), [e["path"] for e in wire.entries]
    main, steps = check_recording(proxy, session, wire)
    assert result["calls"] and result["steps"] >= 2, result  # at least one tool round trip
    assert main["num_steps"] == len(steps) == len(wire.entries) == result["steps"], (main, result)
    if provider == "responses":
        references = [item for e in wire.entries for item in e["body"].get("input", [])
                      if isinstance(item, dict) and item.get("type") == "item_reference"]
        assert references, "the default provider (store: true) sent no item_reference"


def test_pydantic_ai(proxy: Proxy, wire: WireLog, tmp_path: Path) -> None:
    """pydantic-ai's agent loop (its OpenAI chat model, a tool), in a child process."""
    script = Path(__file__).parent / "pydantic_ai_agent.py"
    base = f"http://127.0.0.1:{wire.port}/sess/pydantic-ai/v1"
    done = run_client([sys.executable, str(script), base], cwd=tmp_path, env=base_env(tmp_path / "home"),
                      wire=wire)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(e["path"].endswith("/v1/chat/completions") for e in wire.entries), [e["path"] for e in wire.entries]
    main, steps = check_recording(proxy, "pydantic-ai", wire)
    assert result["calls"] and main["num_steps"] == len(steps) == len(wire.entries) >= 2, (main, result)


@pytest.mark.parametrize("mode", ["json", "stream"])
@pytest.mark.parametrize("api", ["chat", "responses", "anthropic"])
def test_langgraph(clients_python: Path, proxy: Proxy, wire: WireLog, tmp_path: Path, api: str, mode: str) -> None:
    """LangGraph's ReAct agent over LangChain's ChatOpenAI (chat completions or the Responses API) or ChatAnthropic,
    streamed or not, in the Python clients' venv: one main trajectory, every call of its tool loop in it."""
    session = f"langgraph-{api}-{mode}"
    base = f"http://127.0.0.1:{wire.port}/sess/{session}" + ("" if api == "anthropic" else "/v1")
    script = Path(__file__).parent / "langgraph_agent.py"
    done = run_client([str(clients_python), str(script), api, mode, base], cwd=tmp_path,
                      env=base_env(tmp_path / "home"), wire=wire)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    path = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "anthropic": "/v1/messages"}[api]
    assert all(e["path"].endswith(path) for e in wire.entries), [e["path"] for e in wire.entries]
    main, steps = check_recording(proxy, session, wire)
    assert result["calls"] and main["num_steps"] == len(steps) == len(wire.entries) >= 2, (main, result)


def test_smolagents_each_call_its_own_segment(clients_python: Path, tmp_path: Path) -> None:
    """smolagents' ToolCallingAgent, in the Python clients' venv, writes its memory back as text: the model's call
    as an assistant message "Calling tools: [...]", the tool's result as a user message "Observation: ...". The
    tokens the model sampled are in no later prompt, so every call opens a segment (``history_rewrite``)."""
    session = "smolagents"
    flags = ("--sim-tool-calls", json.dumps({"name": "read_note", "arguments": {"name": "plan"}}))
    with proxy_and_wire(tmp_path, *flags) as (proxy, wire):
        script = Path(__file__).parent / "smolagents_agent.py"
        run_client([str(clients_python), str(script), f"http://127.0.0.1:{wire.port}/sess/{session}/v1"],
                   cwd=tmp_path, env=base_env(tmp_path / "home"), wire=wire)
        assert_no_protocol_error(wire)
        segments, steps = proxy.session(session)
    echoed = [m for m in wire.entries[1]["body"]["messages"] if m["role"] == "assistant"]
    assert "Calling tools:" in json.dumps(echoed[0]["content"]) and not echoed[0].get("tool_calls"), echoed
    assert len(steps) == len(wire.entries) >= 2, (len(steps), len(wire.entries))
    assert [s["start_reason"] for s in segments] == ["session_start"] + ["history_rewrite"] * (len(steps) - 1), segments


#: mini-swe-agent's bash tool, called by the simulated model on the first turn: a command that means something.
CAT_NOTES = json.dumps({"name": "bash", "arguments": {"command": "cat notes.txt"}})


@pytest.mark.parametrize("provider", ["hosted_vllm", "anthropic"])
def test_mini_swe_agent(clients_python: Path, tmp_path: Path, provider: str) -> None:
    """mini-swe-agent through LiteLLM (docs/agents.md's recipe), in its own venv: its tool loop stays one segment
    (it sends each reply back as LiteLLM's ``model_dump()``, fields of its own included), and each reply without a
    call, which it drops from its history and answers with its format error, ends its segment: the next one starts
    with ``history_rewrite``, since the agent really did rewrite its history."""
    session = f"mini-{provider}"
    work = _workdir(tmp_path)
    # The simulated model calls after a user message, never right after a tool result: each call's reply is kept,
    # each next reply dropped (a format error, a user message, then a call again).
    flags = ("--sim-tool-calls", CAT_NOTES, "--sim-followup-tool-call-probability", "0")
    with proxy_and_wire(tmp_path, *flags) as (proxy, wire):
        base = f"http://127.0.0.1:{wire.port}/sess/{session}" + ("" if provider == "anthropic" else "/v1")
        env = base_env(tmp_path / "home")
        env.update(LITELLM_LOCAL_MODEL_COST_MAP="True", MSWEA_SILENT_STARTUP="1",
                   MSWEA_GLOBAL_CONFIG_DIR=str(tmp_path / "home" / "mini-swe-agent"))
        script = Path(__file__).parent / "mini_swe_agent.py"
        done = run_client([str(clients_python), str(script), f"{provider}/actorproxy", base, str(work), "6"],
                          cwd=work, env=env, wire=wire)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert_no_protocol_error(wire)
        path = "/v1/messages" if provider == "anthropic" else "/v1/chat/completions"
        assert all(path in e["path"] for e in wire.entries), [e["path"] for e in wire.entries]
        segments, steps = proxy.session(session)
    assert "cat notes.txt" in json.dumps(steps[0]["output"]), steps[0]["output"]  # its call ran...
    roles = result["roles"]
    assert roles[:4] == ["system", "user", "assistant", "tool"], roles  # ... and its result was sent back
    assert result["calls"] == len(steps) == len(wire.entries) == 6, (result, len(steps))
    assert [bool(step["output"]["tool_calls"]) for step in steps] == [True, False] * 3, [s["output"] for s in steps]
    dropped = roles.count("user") - 1  # a format error answers each reply it dropped (the last one's too)
    assert dropped == 3, roles
    # A step follows its predecessor in the same segment exactly when the agent kept the predecessor's reply.
    assert [step["segment_index"] for step in steps] == [0, 0, 1, 1, 2, 2], [(s["output"], s) for s in steps]
    assert [s["start_reason"] for s in segments] == ["session_start"] + ["history_rewrite"] * 2, segments
