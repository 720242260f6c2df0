"""Side calls and a sub-agent: an agent that asks a title generator, runs its loop and starts a sub-agent (as
opencode does).

The title call has its own system prompt and is answered once; the agent loop
goes on. The session's main trajectory is the loop, the title call a separate
segment flagged ``metadata.side_call`` (``--side-calls train``; ``log`` keeps it
as a step only). The first agent call also asks for ``logprobs`` and
``top_logprobs``: the reply carries each sampled token with the logprob the
trainer will read, and the engine's two likeliest tokens at its place.

After its first turn the agent runs a sub-agent, as opencode's task tool does:
with the main agent's very system prompt and the task as its first message,
naming itself and its parent in the headers opencode sends (every call's
``X-Session-Id``, and the sub-agent's ``X-Parent-Session-Id``). Its two turns go
to the child session ``<session>/sub-1`` (``metadata.sub_agent``), and the main
loop stays one segment.

    python examples/side_calls.py                  # serves its own proxy (simulated engine)
    python examples/side_calls.py --url http://127.0.0.1:8800
"""

from __future__ import annotations

import argparse
import json
import uuid
from typing import Any

import openai
import trio
from openai.types.chat import ChatCompletionFunctionToolParam

from actorproxy import ProxyClient, ProxyConfig, open_proxy

TOOL: ChatCompletionFunctionToolParam = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
TASK = "Look at notes.txt and tell me what it says."
SYSTEM = "You are a coding agent. Use tools to read files."


def sub_agent(base_url: str, parent: str) -> None:
    """A sub-agent: the main agent's system prompt, a task of its own, two turns; named as opencode names one."""
    own = f"ses_{uuid.uuid4().hex[:12]}"
    client = openai.OpenAI(base_url=base_url, api_key="unused",
                           default_headers={"X-Session-Id": own, "X-Parent-Session-Id": parent})
    messages: list[Any] = [{"role": "system", "content": SYSTEM},
                           {"role": "user", "content": "List the files here and report."}]
    for turn in range(2):
        reply = client.chat.completions.create(model="policy", messages=messages)
        print(f"sub-agent turn {turn}: session {reply.model_extra['actorproxy']['session_id']}")  # type: ignore[index]
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "Go on."}]


def agent(base_url: str, max_turns: int) -> None:
    """The black box: a title call, then a tool loop that starts a sub-agent after its first turn (blocking)."""
    main = f"ses_{uuid.uuid4().hex[:12]}"  # (the agent's own name for its session, as opencode sends it)
    client = openai.OpenAI(base_url=base_url, api_key="unused", default_headers={"X-Session-Id": main})
    title = client.chat.completions.create(model="policy", messages=[
        {"role": "system", "content": "You are a title generator. Output only a short title."},
        {"role": "user", "content": f"Generate a title for this conversation:\n{TASK}"}])
    print(f"title call: {(title.choices[0].message.content or '')[:50]!r}")
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    for turn in range(max_turns):
        asked: dict[str, Any] = {"logprobs": True, "top_logprobs": 2} if turn == 0 else {}
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[TOOL], **asked)
        choice = reply.choices[0]
        if choice.logprobs is not None and choice.logprobs.content:
            first = choice.logprobs.content[:3]
            print(f"turn 0 logprobs: {len(choice.logprobs.content)} tokens, first "
                  + ", ".join(f"{t.token!r}:{t.logprob:.3f}" for t in first))
            alternatives = first[0].top_logprobs
            print(f"turn 0 top_logprobs of the first token: {len(alternatives)}, "
                  + ", ".join(f"{t.token!r}:{t.logprob:.3f}" for t in alternatives))
        messages.append(choice.message.model_dump(exclude_none=True))
        calls = choice.message.tool_calls or []
        print(f"turn {turn}: {len(calls)} tool call(s)")
        if turn == 0:
            sub_agent(base_url, main)
        if not calls:
            return
        for call in calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "The build is green."})


async def main(url: str | None, max_turns: int) -> None:
    session = f"side-calls-{uuid.uuid4().hex[:8]}"
    if url is None:
        async with open_proxy(ProxyConfig.of(port=0)) as proxy:
            await run(proxy.url, session, max_turns)
    else:
        await run(url, session, max_turns)


async def run(url: str, session: str, max_turns: int) -> None:
    await trio.to_thread.run_sync(agent, f"{url}/sess/{session}/v1", max_turns)
    async with ProxyClient(url) as client:
        print(await client.finalize_session(session))
        payload = await client.read_trajectory(session_id=session)
        stats = await client.stats()
    for seg in payload["data"]:
        kind = "side call" if seg["metadata"].get("side_call") else (
            "sub-agent" if seg["metadata"].get("sub_agent") else "main")
        print(f"segment {seg['trajectory_id']}  {kind}: {seg['num_steps']} step(s), steps {seg['step_indices']}, "
              f"{seg['num_tokens']} tokens")
    print("stats:", json.dumps({k: stats[k] for k in ("side_call_segments", "echo_tolerated", "boundaries")}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running proxy (default: serve one with the simulated engine)")
    parser.add_argument("--max-turns", type=int, default=4)
    args = parser.parse_args()
    trio.run(main, args.url, args.max_turns)
