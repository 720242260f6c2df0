"""A pydantic-ai agent with one tool against actorproxy, run by tests/agents/test_agent_clients.py.

    python pydantic_ai_agent.py <base URL ending in /v1>

Its OpenAI chat model, a tool that reads a note; the agent loops until the
model answers without a call (at most 8 model requests). Prints one JSON line.
"""

from __future__ import annotations

import json
import sys

from pydantic_ai import Agent, UsageLimits
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider


def main(base_url: str) -> None:
    model = OpenAIChatModel("actorproxy", provider=OpenAIProvider(base_url=base_url, api_key="unused"))
    agent = Agent(model, instructions="You are a careful assistant. Use the tools to answer.")
    calls: list[str] = []

    @agent.tool_plain
    def read_note(name: str) -> str:
        """Read one of the user's notes by its name."""
        calls.append(name)
        return f"Note {name!r}: the build is green; ship it on Friday."

    result = agent.run_sync("Read my notes and tell me when we ship.", usage_limits=UsageLimits(request_limit=8))
    print(json.dumps({"calls": calls, "requests": result.usage().requests, "text": str(result.output)}))


if __name__ == "__main__":
    main(sys.argv[1])
