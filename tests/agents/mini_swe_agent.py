"""mini-swe-agent against actorproxy, run by tests/agents/test_agent_clients.py in the clients' own venv.

    python mini_swe_agent.py <LiteLLM model> <api_base> <work dir> <step limit>

mini-swe-agent's default agent and configuration (its shipped ``default.yaml``), its LiteLLM model
(``LitellmModel``: ``litellm.completion`` with its bash tool) and its local environment in ``work dir``,
as its users run it, on one task. Prints one JSON line: how the run ended and the roles of the
messages the agent kept (``user`` after ``assistant`` without a ``tool`` between: a reply without a
call, which the agent drops and answers with its format error).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import minisweagent
import yaml
from minisweagent.agents.default import DefaultAgent
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.litellm_model import LitellmModel


def main(model_name: str, api_base: str, work: str, step_limit: int) -> None:
    config = yaml.safe_load((Path(minisweagent.__path__[0]) / "config" / "default.yaml").read_text())
    model = LitellmModel(model_name=model_name, cost_tracking="ignore_errors",
                         model_kwargs={"api_base": api_base, "api_key": "unused", "max_tokens": 400})
    agent = DefaultAgent(model, LocalEnvironment(cwd=work), **{**config["agent"], "step_limit": step_limit})
    result = agent.run("notes.txt has a typo. Fix it.")
    print(json.dumps({"exit_status": result.get("exit_status"), "calls": agent.n_calls,
                      "roles": [m.get("role") for m in agent.messages]}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
