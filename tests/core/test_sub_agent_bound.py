"""A session's sub-agent children are bounded (``MAX_SUB_AGENTS``), far above what one agent run opens."""

from __future__ import annotations

import logging

import pytest

from actorproxy.core.lanes import MAX_SUB_AGENTS, Conversations

SYSTEM = {"role": "system", "content": "You are the main agent."}


def test_a_long_run_opens_a_child_for_each_named_sub_agent_up_to_the_bound() -> None:
    talks = Conversations("run", side_calls=True, sub_agents=True)
    assert talks.route([SYSTEM, {"role": "user", "content": "go"}]) is None  # the main conversation
    for n in range(1, 201):  # two hundred Task agents in one run: each its own child
        assert talks.route([{"role": "system", "content": "explore"}, {"role": "user", "content": f"task {n}"}],
                           sub_agent=f"agent-{n}") == f"run/sub-{n}"
    assert talks.route([], sub_agent="agent-7") == "run/sub-7"  # a known one keeps its child
    assert len(talks.children) == 200


def test_past_the_bound_new_sub_agents_stay_in_the_session_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    talks = Conversations("run", side_calls=True, sub_agents=True)
    for n in range(MAX_SUB_AGENTS):
        assert talks.route([], sub_agent=f"agent-{n}") == f"run/sub-{n + 1}"
    with caplog.at_level(logging.WARNING, logger="actorproxy.core.lanes"):
        assert talks.route([SYSTEM], sub_agent="one-more") is None
        assert talks.route([SYSTEM], sub_agent="and-another") is None
    assert talks.route([], sub_agent="agent-0") == "run/sub-1"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"{MAX_SUB_AGENTS} sub-agents already" in warnings[0].getMessage()
