"""smolagents' ToolCallingAgent against actorproxy, run by tests/agents/test_agent_clients.py in the Python
clients' own venv.

    python smolagents_agent.py <base URL ending in /v1>

Its OpenAI-compatible model (``OpenAIServerModel``) and one tool that reads a note; at most 4 steps.
Prints one JSON line: how the run ended (its answer, or the error that ended it).
"""

from __future__ import annotations

import json
import sys

from smolagents import OpenAIServerModel, ToolCallingAgent, tool


@tool
def read_note(name: str) -> str:
    """Read one of the user's notes by its name.

    Args:
        name: the note's name.
    """
    return f"Note {name!r}: the build is green; ship it on Friday."


def main(base_url: str) -> None:
    model = OpenAIServerModel(model_id="actorproxy", api_base=base_url, api_key="unused")
    agent = ToolCallingAgent(tools=[read_note], model=model, max_steps=4, verbosity_level=0)
    answer = agent.run("Read my notes and tell me when we ship.")
    print(json.dumps({"answer": str(answer), "steps": len(agent.memory.steps)}))


if __name__ == "__main__":
    main(sys.argv[1])
