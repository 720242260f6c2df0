"""A white-box agent flow through the gateway: /generate turns with a tool, /submit_steps, the hand-off.

    python examples/gateway_whitebox.py [--url URL] [--rollouts N]

N rollouts of one prompt (a GRPO group) each call ``generate`` turn by turn
(running a fake tool between turns), score themselves with ``compute_reward``
(the shipped ``gsm8k`` reward), and submit their steps with the reward on the
last one (``is_last`` completes the trajectory); the trainer takes the whole
group with a leased ``fetch_batch`` and acknowledges it once used (it leaves the
store then). Everything goes through :class:`ProxyClient`, whose
results are typed. Without ``--url`` it serves its own proxy over the
simulated engine.
"""

from __future__ import annotations

import argparse
from typing import Any

import trio

from actorproxy import ProxyClient, ProxyConfig, open_proxy
from actorproxy.client import GenerateResult, StepBody

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
}}]
TASK = "Natalia sold 48 clips in April and half as many in May. How many in all? End with '#### <number>'."


async def rollout(client: ProxyClient, index: int, prompt_uid: str) -> float:
    uid = f"{prompt_uid}-r{index}"
    messages: list[dict[str, Any]] = [{"role": "user", "content": TASK}]
    turns: list[GenerateResult] = []
    for _ in range(4):
        turn = await client.generate(uid, prompt_uid, messages, tools=TOOLS, max_tokens=96)
        # The exact ids: what the engine was given and sampled, never re-encoded.
        assert len(turn.response_ids) == len(turn.logprobs) == len(turn.versions)
        turns.append(turn)
        messages.append({"role": "assistant", "content": turn.response_text or None,
                         **({"tool_calls": turn.tool_calls} if turn.tool_calls else {})})
        if not turn.tool_calls:
            break
        for call in turn.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "72"})
    reward = (await client.compute_reward(uid, messages, {"ground_truth": "#### 72"})).reward
    # The ids sent back must be the recorded ones (else 409 naming the first differing position).
    result = await client.submit_steps([
        StepBody(trajectory_uid=uid, prompt_uid=prompt_uid, prompt_ids=t.prompt_ids, response_ids=t.response_ids,
                 step_index=t.step_index, reward=reward if t is turns[-1] else 0.0, is_last=t is turns[-1],
                 metadata={"tool_calls": len(t.tool_calls)})
        for t in turns
    ])
    assert result.attached == len(turns) and result.completed == [uid]
    return reward


async def run(url: str, rollouts: int) -> None:
    async with ProxyClient(url, timeout=120) as client:
        async with trio.open_nursery() as nursery:
            for i in range(rollouts):
                nursery.start_soon(rollout, client, i, "gsm8k-17")
        # Leased: the group stays in the store until the trainer acknowledges it (a trainer that dies before
        # then gets it handed out again after 300 s).
        batch = await client.fetch_batch(1, rollouts, timeout_s=60, lease=300)
        [group] = batch.data
        print(f"group {group.instance_id}: {len(group.trajectories)} rollouts, complete={batch.complete}")
        for trajectory in group.trajectories:
            for segment in trajectory.segments:
                print(f"  {segment['trajectory_id']}: {segment['num_tokens']} tokens, "
                      f"{segment['num_trained_tokens']} trained, reward {segment['reward']}, "
                      f"step rewards {segment['metadata'].get('step_rewards')}")
        assert batch.lease is not None
        await client.acknowledge(batch.lease.id)  # trained on (here: printed): now it leaves the store
        print(f"acknowledged: {(await client.stats())['segments']} segments left in the store")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--rollouts", type=int, default=4)
    args = parser.parse_args()
    if args.url:
        await run(args.url, args.rollouts)
        return
    config = ProxyConfig.of(port=0, reward_fn="gsm8k", sim_token_interval=0.0005)
    async with open_proxy(config) as proxy:
        await run(proxy.url, args.rollouts)


if __name__ == "__main__":
    trio.run(main)
