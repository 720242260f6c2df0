"""Sub-agents the agent names itself: opencode's ``X-Session-Id`` and ``X-Parent-Session-Id``, Claude Code's
``X-Claude-Code-Agent-Id``.

opencode's task tool runs a sub-agent with the main agent's very system prompt (its ``general``
agent has no prompt of its own) and a task as its first message. Told apart by the conversation's
content alone, its turns would read as the main conversation rewritten, and the main trajectory
would break in three. opencode says what they are: every call carries ``X-Session-Id`` (its own
session), and a sub-agent's also ``X-Parent-Session-Id`` (the one that started it). The calls
below are the ones a real run of opencode 1.18 sends, in its order, with its headers.

Claude Code's Task agents of one type, given one task, open alike (its system prompt for that agent
type, the task): by content they are one conversation, and two of them running side by side would
rewrite each other's history at every turn. Claude Code names each: every call of a Task agent
carries ``X-Claude-Code-Agent-Id`` (the main agent's none).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from _util import WEATHER_TOOL, finalized_at

from actorproxy.errors import BadRequest
from actorproxy.serve import RunningProxy
from actorproxy.server.identity import named_session, resolve_identity
from actorproxy.sim import SimConfig, SimEngine

SYSTEM = {"role": "system", "content": "You are opencode, an interactive CLI tool that helps users with software."}
TITLE = {"role": "system", "content": "You are a title generator. You output ONLY a thread title."}
TASK = {"role": "user", "content": "Look at notes.txt"}
SUB_TASK = {"role": "user", "content": "List the files here and report."}
MAIN, CHILD = "ses_main7Qw", "ses_child3Fz"


@pytest.fixture
async def engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=5, token_interval=0.0005, tool_call_probability=0.0))


def _own(session: str, parent: str | None = None) -> dict[str, str]:
    """opencode's headers: its session, and for a sub-agent the session that started it."""
    return {"X-Session-Id": session, "x-session-affinity": session,
            **({"x-parent-session-id": parent} if parent else {})}


async def _chat(http: httpx.AsyncClient, path: str, messages: list[dict[str, Any]], headers: dict[str, str],
                tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "actorproxy", "messages": messages, **({"tools": tools} if tools else {})}
    reply = await http.post(path, json=body, headers=headers)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert isinstance(answer, dict)
    return answer


async def _opencode_run(http: httpx.AsyncClient, path: str) -> list[str]:
    """Title, main turn, a sub-agent's two turns, the main turn after it; the sessions the replies name."""
    named = []
    title = await _chat(http, path, [TITLE, {"role": "user", "content": "Generate a title for this conversation:"},
                                     TASK], _own(MAIN))
    named.append(title["actorproxy"]["session_id"])
    first = await _chat(http, path, [SYSTEM, TASK], _own(MAIN), [WEATHER_TOOL])
    named.append(first["actorproxy"]["session_id"])
    sub = [SYSTEM, SUB_TASK]
    reply = await _chat(http, path, sub, _own(CHILD, MAIN))
    named.append(reply["actorproxy"]["session_id"])
    sub += [reply["choices"][0]["message"], {"role": "user", "content": "Go on."}]
    named.append((await _chat(http, path, sub, _own(CHILD, MAIN)))["actorproxy"]["session_id"])
    main = [SYSTEM, TASK, first["choices"][0]["message"], {"role": "user", "content": "And now?"}]
    named.append((await _chat(http, path, main, _own(MAIN), [WEATHER_TOOL]))["actorproxy"]["session_id"])
    return named


def _check(segments: list[dict[str, Any]], steps: list[dict[str, Any]], session: str) -> None:
    main = [s for s in segments if s["trajectory_id"].startswith(f"{session}#")]
    child = [s for s in segments if s["trajectory_id"].startswith(f"{session}/sub-1#")]
    # The main conversation is one segment of its two turns; the title call is a side call beside it.
    whole = [s for s in main if not s["metadata"].get("side_call")]
    assert [(s["num_steps"], s["start_reason"]) for s in whole] == [(2, "session_start")], whole
    assert [s["num_steps"] for s in main if s["metadata"].get("side_call")] == [1]
    # The sub-agent is a child session of its own: one segment of its two turns.
    assert [(s["num_steps"], s["metadata"]["sub_agent"], s["parent_traj_id"]) for s in child] == [
        (2, "sub-1", session)], child
    lost = {"history_rewrite", "system_changed", "tool_schema_change", "tito_failure"}
    assert not [s for s in steps if s.get("boundary_reason") in lost], steps


async def test_under_a_session_url_the_sub_agent_is_a_child(proxy: RunningProxy, http: httpx.AsyncClient) -> None:
    named = await _opencode_run(http, "/sess/rollout-7/v1/chat/completions")
    assert named == ["rollout-7", "rollout-7", "rollout-7/sub-1", "rollout-7/sub-1", "rollout-7"]
    segments, steps = await finalized_at(proxy.url, "rollout-7")
    _check(segments, steps, "rollout-7")


async def test_by_its_headers_alone_the_sub_agent_is_its_parents_child(
        proxy: RunningProxy, http: httpx.AsyncClient) -> None:
    named = await _opencode_run(http, "/v1/chat/completions")
    assert named == [MAIN, MAIN, f"{MAIN}/sub-1", f"{MAIN}/sub-1", MAIN]
    segments, steps = await finalized_at(proxy.url, MAIN)
    _check(segments, steps, MAIN)


def test_what_the_headers_name() -> None:
    sub = httpx.Headers(_own(CHILD, MAIN))  # (as the app's, not case-sensitive)
    assert named_session(sub) == MAIN and named_session(sub, "rollout-7") == "rollout-7"
    identity = resolve_identity(sub)
    assert (identity.session_id, identity.sub_agent) == (MAIN, CHILD)
    claude = httpx.Headers({"X-Claude-Code-Session-Id": "c", "x-claude-code-agent-id": "a12",
                            "x-claude-code-parent-agent-id": "a7"})
    assert named_session(claude) == "c" and resolve_identity(claude).sub_agent == "a12"
    # Codex: a thread that is not its session's, on a call with Codex's own header (not on another client's).
    assert resolve_identity(httpx.Headers(_codex("t2")), url_session="r").sub_agent == "t2"
    assert resolve_identity(httpx.Headers(_codex("cx-conversation")), url_session="r").sub_agent is None
    assert resolve_identity(httpx.Headers({"session-id": "s", "thread-id": "t"}), url_session="r").sub_agent is None
    assert resolve_identity(sub, url_session="r").sub_agent == CHILD
    # No sub-agent: no parent, a parent naming the session itself, or no session of its own to key it by.
    for headers in (_own(MAIN), _own(MAIN, MAIN)):
        assert resolve_identity(httpx.Headers(headers)).sub_agent is None
    assert named_session(httpx.Headers({"x-parent-session-id": MAIN})) is None
    # A bad value is refused as every session header's is.
    for bad in ("x" * 300, "a\tb"):
        with pytest.raises(BadRequest):
            resolve_identity(httpx.Headers(_own(CHILD, bad)))


CC_SYSTEM = "You are a Claude agent. You read the files you are asked about and report briefly."


async def _message(http: httpx.AsyncClient, messages: list[dict[str, Any]], agent: str | None) -> dict[str, Any]:
    headers = {"X-Claude-Code-Session-Id": "cc-conversation", **({"x-claude-code-agent-id": agent} if agent else {})}
    body = {"model": "claude", "max_tokens": 64, "system": CC_SYSTEM, "messages": messages}
    reply = await http.post("/sess/cc-7/v1/messages", json=body, headers=headers)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert isinstance(answer, dict)
    return answer


async def test_two_task_agents_that_open_alike_are_two_children(
        proxy: RunningProxy, http: httpx.AsyncClient) -> None:
    main = [{"role": "user", "content": "Look at notes.txt"}]
    first = await _message(http, main, None)
    task = [{"role": "user", "content": "Read notes.txt and report."}]
    talks = {"a1": list(task), "a2": list(task)}
    named = []
    for _ in range(2):  # side by side: a turn of each in turn
        for agent, messages in talks.items():
            reply = await _message(http, messages, agent)
            named.append(reply["actorproxy"]["session_id"])
            messages += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "Go on."}]
    main += [{"role": "assistant", "content": first["content"]}, {"role": "user", "content": "And?"}]
    named.append((await _message(http, main, None))["actorproxy"]["session_id"])
    assert named == ["cc-7/sub-1", "cc-7/sub-2", "cc-7/sub-1", "cc-7/sub-2", "cc-7"]
    segments, steps = await finalized_at(proxy.url, "cc-7")
    assert sorted((s["trajectory_id"], s["num_steps"], s["start_reason"]) for s in segments) == [
        ("cc-7#0", 2, "session_start"), ("cc-7/sub-1#0", 2, "session_start"), ("cc-7/sub-2#0", 2, "session_start")]
    assert len(steps) == 6


def _codex(thread: str) -> dict[str, str]:
    """Codex's headers: its conversation, the calling agent's thread, its turn metadata."""
    source = "user" if thread == "cx-conversation" else "subagent"
    metadata = f'{{"thread_source": "{source}"}}'
    return {"session-id": "cx-conversation", "thread-id": thread, "x-codex-turn-metadata": metadata}


async def test_a_codex_sub_agents_thread_is_a_child(proxy: RunningProxy, http: httpx.AsyncClient) -> None:
    """Codex's spawn_agent with fork_context: the sub-agent's thread starts with the parent's very history."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "Look at notes.txt"}]
    named = []

    async def turn(thread: str, items: list[dict[str, Any]]) -> dict[str, Any]:
        body = {"model": "m", "input": items, "store": False, "instructions": "You are Codex."}
        reply = await http.post("/sess/cx-7/v1/responses", json=body, headers=_codex(thread))
        assert reply.status_code == 200, reply.text
        answer: dict[str, Any] = reply.json()
        named.append(answer["actorproxy"]["session_id"])
        return answer

    first = await turn("cx-conversation", history)
    history += [{"role": "assistant", "content": first["output"][-1]["content"][0]["text"]}]
    fork = [*history, {"role": "user", "content": "Read notes.txt and report."}]
    await turn("thread-b", fork)
    await turn("cx-conversation", [*history, {"role": "user", "content": "And?"}])
    assert named == ["cx-7", "cx-7/sub-1", "cx-7"]
    segments, _ = await finalized_at(proxy.url, "cx-7")
    assert sorted((s["trajectory_id"], s["num_steps"], s["start_reason"]) for s in segments) == [
        ("cx-7#0", 2, "session_start"), ("cx-7/sub-1#0", 1, "session_start")]
