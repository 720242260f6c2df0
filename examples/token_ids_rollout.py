"""Rollout code written for vLLM's OpenAI server, unchanged: it keeps its own token trajectory from the replies.

Such code (a tool loop on the `openai` SDK) asks every call for vLLM's ``return_token_ids`` through
``extra_body`` and builds its training sample from the replies: each turn's ``prompt_token_ids`` (the ids the
engine was given) and the choice's ``token_ids`` (the ids it sampled), with their ``logprobs``. Against
actorproxy the same code runs as it is, and what it builds is what the proxy records: the script finalizes the
session and checks that the agent's own ids, loss mask and logprobs equal the segment the trainer reads.

    python examples/token_ids_rollout.py                # serves its own proxy (simulated engine)
    python examples/token_ids_rollout.py --url http://127.0.0.1:8800   # uses a running proxy
"""

from __future__ import annotations

import argparse
import json
import uuid
from typing import Any

import openai
import trio
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from shared import WEATHER_TOOL, get_weather

from actorproxy import ProxyClient, ProxyConfig, open_proxy


def agent(base_url: str, max_turns: int) -> dict[str, list[Any]]:
    """A tool loop that keeps its own sample: the ids of the conversation as the engine saw it, 1 where the
    policy sampled, and the sampled tokens' logprobs (blocking)."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    messages: list[Any] = [
        {"role": "system", "content": "You are a travel assistant. Use tools when you need facts."},
        {"role": "user", "content": "What's the weather in Bordeaux for the next two days?"},
    ]
    with openai.OpenAI(base_url=base_url, api_key="unused") as client:
        for turn in range(max_turns):
            reply = client.chat.completions.create(
                model="policy", messages=messages, tools=[WEATHER_TOOL], logprobs=True,
                extra_body={"return_token_ids": True})
            choice = reply.choices[0]
            # vLLM's fields: the SDK's models keep what they do not declare.
            prompt, sampled = reply.prompt_token_ids, choice.token_ids  # type: ignore[attr-defined]
            assert choice.logprobs is not None and choice.logprobs.content is not None
            if prompt[:len(ids)] != ids:  # the engine's prompt no longer extends what it sampled before
                raise SystemExit(f"turn {turn}: the prompt does not extend the trajectory")
            new = len(prompt) - len(ids)
            ids += prompt[len(ids):] + sampled
            mask += [0] * new + [1] * len(sampled)
            logprobs += [0.0] * new + [entry.logprob for entry in choice.logprobs.content]
            calls = [c for c in choice.message.tool_calls or () if isinstance(c, ChatCompletionMessageFunctionToolCall)]
            print(f"turn {turn}: prompt {len(prompt)} ids ({new} new), sampled {len(sampled)}, "
                  f"{len(calls)} tool call(s)")
            messages.append(choice.message.model_dump(exclude_none=True))
            if not calls:
                break
            for call in calls:
                result = get_weather(**json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    return {"token_ids": ids, "loss_mask": mask, "logprobs": logprobs}


async def rollout(proxy_url: str, max_turns: int) -> None:
    session = f"token-ids-{uuid.uuid4().hex[:8]}"
    own = await trio.to_thread.run_sync(agent, f"{proxy_url}/sess/{session}/v1", max_turns)
    async with ProxyClient(proxy_url) as client:
        await client.finalize_session(session, reward=1.0)
        payload = await client.read_trajectory(session_id=session, drain=True)
    segments = payload["data"]
    if len(segments) != 1:  # a history rewrite would split the session: the agent above never rewrites
        raise SystemExit(f"expected one segment, got {len(segments)}")
    [segment] = segments
    print(f"the agent's own sample: {len(own['token_ids'])} ids, {sum(own['loss_mask'])} sampled")
    print(f"segment {segment['trajectory_id']}: {len(segment['token_ids'])} ids, {sum(segment['loss_mask'])} sampled")
    for field in ("token_ids", "loss_mask"):
        if own[field] != segment[field]:
            raise SystemExit(f"the agent's {field} differ from the segment's")
    sampled = [(a, b) for a, b, m in zip(own["logprobs"], segment["logprobs"], own["loss_mask"], strict=True) if m]
    if any(abs(a - b) > 1e-6 for a, b in sampled):
        raise SystemExit("the agent's logprobs differ from the segment's")
    print("the agent's ids, loss mask and logprobs equal the segment's")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running proxy (default: serve one in-process)")
    parser.add_argument("--max-turns", type=int, default=6)
    args = parser.parse_args()
    if args.url:
        await rollout(args.url.rstrip("/"), args.max_turns)
        return
    async with open_proxy(ProxyConfig.of(port=0)) as running:
        await rollout(running.url, args.max_turns)


if __name__ == "__main__":
    trio.run(main)
