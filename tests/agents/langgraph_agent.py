"""LangGraph's prebuilt ReAct agent over a LangChain chat model against actorproxy, run by
tests/agents/test_agent_clients.py in the Python clients' own venv.

    python langgraph_agent.py <chat | responses | anthropic> <json | stream> <base URL>

The model is LangChain's ``ChatOpenAI`` (chat completions, or the Responses API with
``use_responses_api``; base URL ending in ``/v1``) or ``ChatAnthropic`` (base URL without it), with
one tool that reads a note; the agent loops until the model answers without a call (at most 12 graph
steps: 6 model calls). Prints one JSON line: the tool's calls and the kinds of the messages.
"""

from __future__ import annotations

import json
import sys
import warnings

from langchain_anthropic import ChatAnthropic
from langchain_core.language_models import BaseChatModel
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent

calls: list[str] = []


@tool
def read_note(name: str) -> str:
    """Read one of the user's notes by its name."""
    calls.append(name)
    return f"Note {name!r}: the build is green; ship it on Friday."


def model(api: str, stream: bool, base_url: str) -> BaseChatModel:
    if api == "anthropic":
        return ChatAnthropic(model="actorproxy", base_url=base_url, api_key="unused", streaming=stream, max_tokens=400)
    return ChatOpenAI(model="actorproxy", base_url=base_url, api_key="unused", streaming=stream,
                      use_responses_api=api == "responses")


def main(api: str, mode: str, base_url: str) -> None:
    warnings.simplefilter("ignore")  # create_react_agent's deprecation in favour of the langchain package's
    agent = create_react_agent(model(api, mode == "stream", base_url), [read_note],
                               prompt="You are a careful assistant. Use the tools.")
    try:
        out = agent.invoke({"messages": [("user", "Read my notes and tell me when we ship.")]}, {"recursion_limit": 12})
        kinds = [m.type for m in out["messages"]]
    except GraphRecursionError:  # the sampled policy called a tool six times in a row
        kinds = ["recursion_limit"]
    print(json.dumps({"calls": calls, "messages": kinds}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
