"""A black-box agent through actorproxy: the `openai` SDK and a per-session base URL, nothing else.

The agent stands in for OpenHands, opencode or Terminus: it knows nothing about
actorproxy. It gets a base URL, ``http://host:port/sess/<session>/v1``, and runs
an ordinary tool loop with the official SDK (a local fake ``get_weather``
executes the calls) until the model answers in text or ``--max-turns`` runs
out. The rollout side, which does know the proxy, then finalizes the session
with ``actorproxy.ProxyClient`` and prints the recorded training segment.

    python examples/blackbox_openai_agent.py                # serves its own proxy (simulated engine)
    python examples/blackbox_openai_agent.py --url http://127.0.0.1:8800   # uses a running proxy
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import openai
import trio
from openai.types.chat import ChatCompletionMessageFunctionToolCall
from shared import WEATHER_TOOL, blackbox_main, get_weather


def run_tool(name: str, arguments: str) -> str:
    try:
        if name != "get_weather":
            raise LookupError(f"unknown tool {name!r}")
        result: Any = get_weather(**json.loads(arguments))
    except Exception as exc:  # the model sees the error, as agents do
        result = {"error": f"{type(exc).__name__}: {exc}"}
    return json.dumps(result, ensure_ascii=False)


def agent(base_url: str, max_turns: int) -> None:
    """The black box: an ordinary OpenAI tool loop against ``base_url`` (blocking)."""
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    messages: list[Any] = [
        {"role": "system", "content": "You are a travel assistant. Use tools when you need facts."},
        {"role": "user", "content": "What's the weather in Bordeaux for the next two days?"},
    ]
    try:
        for turn in range(max_turns):
            reply = client.chat.completions.create(model="policy", messages=messages, tools=[WEATHER_TOOL])
            choice = reply.choices[0]
            calls = choice.message.tool_calls or []
            print(f"turn {turn}: finish_reason={choice.finish_reason!r}, {len(calls)} tool call(s)")
            messages.append(choice.message.model_dump(exclude_none=True))
            if not calls:
                print(f"    answer: {(choice.message.content or '')[:70]!r}")
                return
            for call in calls:
                if not isinstance(call, ChatCompletionMessageFunctionToolCall):
                    continue  # a custom tool: this agent offers none
                print(f"    {call.function.name}({call.function.arguments})")
                result = run_tool(call.function.name, call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    finally:
        client.close()


if __name__ == "__main__":
    trio.run(partial(blackbox_main, agent, description=__doc__.splitlines()[0], name="blackbox-openai",
                     base_path="/v1"))
