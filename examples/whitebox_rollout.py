"""A white-box, tool-using rollout through actorproxy, then the recorded training sample.

The agent loop is ours: it calls the model through ``actorproxy.ProxyClient``,
executes the tool calls it gets back with a local fake ``get_weather``, appends
the tool results and calls again, until the model answers in text or the turn
budget runs out. Then it finalizes the session (with a reward), reads the
segment back with ``drain=True`` and prints what was recorded.

    python examples/whitebox_rollout.py                # serves its own proxy (simulated engine)
    python examples/whitebox_rollout.py --url http://127.0.0.1:8800   # uses a running proxy
"""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Callable
from typing import Any

import trio
from shared import WEATHER_TOOL, get_weather

from actorproxy import ProxyClient, ProxyConfig, open_proxy

Decode = Callable[[list[int]], str]

TOOLS = {"get_weather": get_weather}


def run_tool(call: dict[str, Any]) -> str:
    """Execute one tool call; errors go back to the model as the tool's result, as agents do."""
    function = call["function"]
    try:
        result = TOOLS[function["name"]](**json.loads(function["arguments"]))
    except Exception as exc:  # unknown tool, bad arguments: the model sees the error
        result = {"error": f"{type(exc).__name__}: {exc}"}
    return json.dumps(result)


async def rollout(
    client: ProxyClient, session_id: str, *, instance_id: str, max_turns: int
) -> list[dict[str, Any]]:
    """One episode; returns the conversation (the agent's own view of it)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a travel assistant. Use tools when you need facts."},
        {"role": "user", "content": "What's the weather in Bordeaux for the next two days?"},
    ]
    for turn in range(max_turns):
        reply = await client.chat_completions(
            {"model": "policy", "messages": messages, "tools": [WEATHER_TOOL], "max_tokens": 512},
            session_id=session_id,
            instance_id=instance_id,
            turn_id=f"{session_id}/{turn}",
        )
        choice, usage = reply["choices"][0], reply["usage"]
        message = choice["message"]
        calls = message.get("tool_calls") or []
        print(
            f"turn {turn}: finish_reason={choice['finish_reason']!r}, "
            f"{usage['prompt_tokens']} prompt + {usage['completion_tokens']} sampled tokens, "
            f"{len(calls)} tool call(s)"
        )
        # Echo the reply as we got it; the proxy matches it by meaning (ids, parsed arguments).
        messages.append(message)
        if not calls:
            break  # a text answer ends the episode
        for call in calls:
            print(f"    {call['function']['name']}({call['function']['arguments']})")
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": run_tool(call)})
    return messages


def summarize(payload: dict[str, Any], decode: Decode | None = None) -> None:
    """Print the recorded segment(s) and steps; check the layout the trainer relies on.

    With ``decode`` (only when the proxy runs in this process, so we hold its
    tokenizer) each step's context fragment is shown as text too.
    """
    steps = {s["step_index"]: s for s in payload["steps"]}
    for seg in payload["data"]:
        ids, mask = seg["token_ids"], seg["loss_mask"]
        assert len(ids) == len(mask) == len(seg["logprobs"]) == len(seg["versions"])
        # The segment is its steps' context fragments and sampled ids, back to back.
        stitched = [t for i in seg["step_indices"] for t in steps[i]["concat_token_ids"]]
        assert stitched == ids, "segment does not equal its steps' fragments"
        reasons = f"{seg['start_reason']} -> {seg['boundary_reason']}"
        print(f"\nsegment {seg['trajectory_id']}  ({reasons})")
        print(f"  instance_id     {seg['instance_id']}   reward {seg['reward']}")
        trained = seg["num_trained_tokens"]
        print(f"  tokens          {seg['num_tokens']} ({trained} sampled, loss_mask=1)")
        print(f"  first ids       {ids[:8]}")
        print(f"  last ids        {ids[-8:]}")
        print(f"  versions        {sorted(set(seg['versions']))} (-1 = context)")
        print(f"  steps           {seg['step_indices']}")
    print("\nsteps:")
    for s in payload["steps"]:
        output = s.get("output") or {}
        calls = [c["function"]["name"] for c in output.get("tool_calls", [])]
        print(
            f"  #{s['step_index']} {s['status']:<10} finish={s['finish_reason']!s:<7} "
            f"context+{s['concat_context_token_count']:<4} "
            f"sampled {s['concat_output_token_count']:<4} "
            f"in_segment={s['in_segment']} tool_calls={calls}"
        )
        if decode is not None:
            fragment = decode(s["concat_token_ids"][: s["concat_context_token_count"]])
            shown = fragment if len(fragment) <= 160 else fragment[:60] + " ... " + fragment[-90:]
            print(f"      context fragment: {shown!r}")


async def run(client: ProxyClient, *, max_turns: int, decode: Decode | None = None) -> None:
    session_id = f"weather-{uuid.uuid4().hex[:8]}"
    messages = await rollout(
        client, session_id, instance_id="weather-bordeaux", max_turns=max_turns
    )
    last = messages[-1]
    answered = last["role"] == "assistant" and not last.get("tool_calls")
    # A real reward model or checker goes here.
    print(await client.finalize_session(session_id, reward=1.0 if answered else 0.0))
    payload = await client.read_trajectory(session_id=session_id, drain=True, include_steps=True)
    summarize(payload, decode)


async def main(url: str | None, max_turns: int) -> None:
    if url is not None:
        async with ProxyClient(url) as client:
            await run(client, max_turns=max_turns)
        return
    # No proxy given: serve one in this process (simulated engine, a free port).
    async with open_proxy(ProxyConfig.of(port=0)) as proxy:
        print(f"proxy at {proxy.url}")
        async with ProxyClient(proxy.url) as client:
            await run(client, max_turns=max_turns, decode=proxy.runtime.tokenizer.decode)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="A white-box tool-using rollout via actorproxy.")
    parser.add_argument("--url", help="base URL of a running proxy (default: serve one in-process)")
    parser.add_argument("--max-turns", type=int, default=6, help="model calls at most")
    args = parser.parse_args()
    trio.run(main, args.url, args.max_turns)
