"""A black-box agent given nothing but a gateway base URL: /init_trajectory, the agent, complete_trajectory.

    python examples/gateway_blackbox.py [--url URL]

The trainer asks ``POST /init_trajectory`` for a trajectory and its base URL
(``http://<host>/<trajectory_uid>/<prompt_uid>``); the agent (here the
``openai`` SDK) is pointed at ``<base_url>/v1`` and knows nothing else; the
trainer completes the trajectory with a reward and reads its segment.
"""

from __future__ import annotations

import argparse

import httpx
import trio
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletionMessageParam

from actorproxy import ProxyConfig, open_proxy


async def run(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=120) as trainer:
        init = (await trainer.post("/init_trajectory", json={"prompt_uid": "task-3"})).json()
        print("base_url:", init["base_url"])
        await trainer.post(init["base_url"] + "/v1/register_trajectory", json={"metadata": {"task": "demo"}})
        async with AsyncOpenAI(base_url=init["base_url"] + "/v1", api_key="unused") as agent:  # a black box
            messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Write a haiku about tokens."}]
            reply = await agent.chat.completions.create(model="policy", messages=messages, max_tokens=48)
            print("agent got:", reply.choices[0].message.content)
        done = (await trainer.post(init["base_url"] + "/v1/complete_trajectory", json={"reward": 1.0})).json()
        print(f"completed: {done['steps']} step(s), queued for training: {done['queued_for_training']}")
        batch = (await trainer.post("/trajectory/fetch_batch", json={"groups": 1, "rollouts_per_group": 1})).json()
        [trajectory] = batch["data"][0]["trajectories"]
        segment = trajectory["segments"][0]
        print(f"segment {segment['trajectory_id']}: {segment['num_tokens']} tokens, "
              f"{segment['num_trained_tokens']} trained, prompt group {segment['instance_id']}")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None)
    args = parser.parse_args()
    if args.url:
        await run(args.url)
        return
    async with open_proxy(ProxyConfig.of(port=0, sim_token_interval=0.0005)) as proxy:
        await run(proxy.url)


if __name__ == "__main__":
    trio.run(main)
