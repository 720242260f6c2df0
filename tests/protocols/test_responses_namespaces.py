"""Namespace tools on the Responses API: Codex offers its sub-agent tools as the ``multi_agent_v1`` namespace.

The proxy never runs a tool; the agent does. A namespace's function tools are offered to the model
by their own names, and a call of one goes back as a ``function_call`` item with its ``namespace``,
as Codex reads it; the call's item, sent back in the next request's input, renders as it was sampled.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from _util import finalized_at
from test_responses import sse

from actorproxy.errors import BadRequest
from actorproxy.protocols.responses_api import convert_tools, tool_namespaces
from actorproxy.protocols.responses_types import Tool
from actorproxy.schema.converter import structure
from actorproxy.serve import RunningProxy
from actorproxy.sim import SimEngine

SPAWN = {"type": "function", "name": "spawn_agent", "description": "Spawn a sub-agent.", "strict": False,
         "parameters": {"type": "object", "properties": {"message": {"type": "string"}}}}
WAIT = {"type": "function", "name": "wait_agent", "parameters": {"type": "object", "properties": {}}}
EXEC = {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {}}}
#: What Codex 0.171 sends (abridged): flat functions, its sub-agent namespace, a hosted tool.
TOOLS: list[dict[str, Any]] = [
    EXEC,
    {"type": "namespace", "name": "multi_agent_v1", "description": "Tools for sub-agents.", "tools": [SPAWN, WAIT]},
    {"type": "web_search"}]
CALL = '<tool_call>\n{"name": "spawn_agent", "arguments": {"message": "Read notes.txt."}}\n</tool_call>'


def test_a_namespaces_functions_are_offered_by_their_own_names() -> None:
    chat, skipped = convert_tools(TOOLS, structure(TOOLS, list[Tool], where="tools"))
    assert [t["function"]["name"] for t in chat] == ["exec_command", "spawn_agent", "wait_agent"]
    assert chat[1]["function"] == {k: SPAWN[k] for k in ("name", "description", "parameters", "strict")}
    assert skipped == ["web_search"] and tool_namespaces(TOOLS) == {"spawn_agent": "multi_agent_v1",
                                                                    "wait_agent": "multi_agent_v1"}
    # One name for two functions, one of them a namespace's: a call could not say which.
    twice = [{**EXEC, "name": "spawn_agent"}, TOOLS[1]]
    with pytest.raises(BadRequest, match=r"tools\[1\]\.tools\[0\]\.name: 'spawn_agent' is offered twice"):
        convert_tools(twice, structure(twice, list[Tool], where="tools"))
    inside = [{"type": "namespace", "name": "ns", "tools": [WAIT, WAIT]}]
    with pytest.raises(BadRequest, match=r"tools\[0\]\.tools\[1\]\.name: 'wait_agent' is offered twice"):
        convert_tools(inside, structure(inside, list[Tool], where="tools"))
    # Two flat functions of one name are no namespace's: offered as sent, as before.
    assert len(convert_tools([EXEC, EXEC], structure([EXEC, EXEC], list[Tool], where="tools"))[0]) == 2
    # A namespace's other tools (a custom one) are not offered, and say so.
    custom = [{"type": "namespace", "name": "ns", "tools": [{"type": "custom", "name": "c"}]}]
    assert convert_tools(custom, structure(custom, list[Tool], where="tools")) == ([], ["ns.custom"])


@pytest.mark.parametrize("stream", [False, True])
async def test_a_call_of_a_namespaces_function_names_its_namespace(
        proxy: RunningProxy, http: httpx.AsyncClient, engine: SimEngine, stream: bool) -> None:
    session = f"codex-ns-{stream}"
    engine.script(CALL, "Done.", routing_key=session)
    body: dict[str, Any] = {"model": "m", "input": [{"role": "user", "content": "Read the notes."}], "tools": TOOLS,
                            "stream": stream, "store": False}
    reply = await http.post(f"/sess/{session}/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    if stream:
        events = sse(reply.text)
        done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
        added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
        assert [(i["type"], i.get("namespace")) for i in added] == [("function_call", "multi_agent_v1")]
        output = events[-1]["response"]["output"]
    else:
        output = reply.json()["output"]
        done = output
    calls = [i for i in done if i["type"] == "function_call"]
    assert [(c["name"], c["namespace"], json.loads(c["arguments"])) for c in calls] == [
        ("spawn_agent", "multi_agent_v1", {"message": "Read notes.txt."})]
    assert [i for i in output if i["type"] == "function_call"] == calls
    # Codex sends the call back with its namespace, and the tool's output: the same conversation, one segment.
    back = {k: calls[0][k] for k in ("type", "call_id", "name", "namespace", "arguments")}
    body["input"] += [back, {"type": "function_call_output", "call_id": back["call_id"], "output": "agent a1"}]
    body["stream"] = False
    assert (await http.post(f"/sess/{session}/v1/responses", json=body)).status_code == 200
    segments, _ = await finalized_at(proxy.url, session)
    assert [(s["num_steps"], s["start_reason"]) for s in segments] == [(2, "session_start")]
