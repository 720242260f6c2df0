"""A trainer-style asyncio loop with the proxy embedded: N parallel trials, one trajectory file each.

    python examples/embedded_trainer.py [--trials N] [--turns K] [--dir DIR]

The proxy runs inside this process (``actorproxy.start_proxy``: a background
thread with its own Trio loop), bound to the host's primary IPv4 address on a
free port, exactly as an RL framework's agent loop would start it. Each trial
is an agent given nothing but its per-session base URL (here the ``openai``
SDK's ``AsyncOpenAI``; Claude Code or Codex would take the same URL). When a
trial ends the trainer finalizes it with a reward, and the proxy writes
``DIR/<trial>/proxy_trajectory.json``, which the trainer loads back.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from typing import Any

from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionToolParam

from actorproxy import start_proxy
from actorproxy.client import load_trajectory_file
from actorproxy.trajectory_file import trajectory_path

TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "description": "Run the test suite and report failures",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    }
]


async def run_trial(base_url: str, turns: int) -> float:
    """One agent episode against its own session URL; returns a (fake) reward."""
    messages: list[Any] = [{"role": "user", "content": "Fix the failing test in tests/test_io.py."}]
    async with AsyncOpenAI(base_url=base_url, api_key="unused") as client:
        for _ in range(turns):
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=64)
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": "1 failed, 12 passed"})
    return 1.0 if len(messages) > 2 else 0.0


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where trajectory files go (default: a temporary directory)")
    args = parser.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="actorproxy-trajectories-")

    async with start_proxy(trajectory_dir=directory, sim_token_interval=0.001) as proxy:
        print(f"proxy at {proxy.url}; trajectory files under {directory}")
        trials = [f"trial-{i}" for i in range(args.trials)]

        async def episode(trial: str) -> None:
            reward = await run_trial(proxy.session_url(trial), args.turns)
            await proxy.afinalize(trial, reward=reward)

        await asyncio.gather(*(episode(t) for t in trials))

        for trial in trials:
            document = load_trajectory_file(trajectory_path(directory, trial))
            for segment in document["segments"]:
                assert len(segment["token_ids"]) == len(segment["loss_mask"]) == len(segment["logprobs"])
                print(
                    f"{trial}: segment {segment['segment_index']} of {segment['num_tokens']} tokens "
                    f"({segment['num_trained_tokens']} trained), {len(document['steps'])} steps, "
                    f"reward {segment['reward']}"
                )


if __name__ == "__main__":
    asyncio.run(main())
