"""A black-box agent through actorproxy: the `anthropic` SDK and a per-session base URL, nothing else.

The agent stands in for Claude Code: it knows nothing about actorproxy. It gets
a base URL, ``http://host:port/sess/<session>`` (what ``ANTHROPIC_BASE_URL``
would be), and runs an ordinary streamed tool loop with the official SDK (a
local fake ``get_weather`` executes the calls) until the model stops asking
for tools or ``--max-turns`` runs out. The rollout side, which does know the
proxy, then finalizes the session with ``actorproxy.ProxyClient`` and prints
the recorded training segment.

    python examples/blackbox_anthropic_agent.py                # serves its own proxy (simulated engine)
    python examples/blackbox_anthropic_agent.py --url http://127.0.0.1:8800   # uses a running proxy
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import anthropic
import trio
from shared import WEATHER_TOOL as SHARED_TOOL
from shared import blackbox_main, get_weather

WEATHER_TOOL = {  # the shared tool, in the Messages API's shape
    "name": SHARED_TOOL["function"]["name"],
    "description": SHARED_TOOL["function"]["description"],
    "input_schema": SHARED_TOOL["function"]["parameters"],
}
SYSTEM = "You are a travel assistant. Use tools when you need facts."


def run_tool(name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
    """The tool's result text, and whether it failed (sent back as ``is_error``)."""
    try:
        if name != "get_weather":
            raise LookupError(f"unknown tool {name!r}")
        return json.dumps(get_weather(**arguments), ensure_ascii=False), False
    except Exception as exc:  # the model sees the error, as agents do
        return f"{type(exc).__name__}: {exc}", True


def agent(base_url: str, max_turns: int) -> None:
    """The black box: an ordinary Anthropic tool loop against ``base_url`` (blocking)."""
    client = anthropic.Anthropic(base_url=base_url, api_key="unused")
    messages: list[Any] = [{"role": "user", "content": "What's the weather in Bordeaux for the next two days?"}]
    kwargs: dict[str, Any] = {"model": "policy", "system": SYSTEM, "tools": [WEATHER_TOOL]}
    try:
        counted = client.messages.count_tokens(messages=messages, **kwargs).input_tokens
        print(f"count_tokens: {counted}")
        for turn in range(max_turns):
            with client.messages.stream(messages=messages, max_tokens=512, **kwargs) as stream:
                reply = stream.get_final_message()
            calls = [block for block in reply.content if block.type == "tool_use"]
            kinds = [block.type for block in reply.content]
            print(f"turn {turn}: stop_reason={reply.stop_reason!r}, blocks {kinds}, "
                  f"{reply.usage.input_tokens} in + {reply.usage.output_tokens} out")
            messages.append({"role": "assistant", "content": reply.content})
            if reply.stop_reason != "tool_use":
                text = "".join(block.text for block in reply.content if block.type == "text")
                print(f"    answer: {text[:70]!r}")
                return
            results = []
            for call in calls:
                print(f"    {call.name}({json.dumps(call.input, ensure_ascii=False)})")
                output, failed = run_tool(call.name, dict(call.input))
                results.append({"type": "tool_result", "tool_use_id": call.id, "content": output, "is_error": failed})
            messages.append({"role": "user", "content": results})
    finally:
        client.close()


if __name__ == "__main__":
    trio.run(partial(blackbox_main, agent, description=__doc__.splitlines()[0], name="blackbox-anthropic",
                     base_path=""))
