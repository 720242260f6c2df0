"""LiveRL's in-process proxy contract, as its agent loop uses it (``LegoX/Lego-RL`` @ 58f89aa).

The facts, from ``src/verl_patch/agent_loop/builtin_cc_agent_loop.py`` and
``vllm_chat_completion_proxy.py``: per attempt the loop calls
``proxy.session_url(sid)`` and ``proxy.session_anthropic_base(sid)`` (plain
strings: ``<base>/sess/<quoted sid>/v1`` and ``<base>/sess/<quoted sid>``),
``await proxy.open_session(sid, trajectory_dir=<trials>/step_NNNN/<sid>)``, runs
the agent, then always ``await proxy.pop_session(sid)`` and builds its training
sample from the returned dict: ``traj_acc_ids``, ``initial_prompt_token_len``,
``traj_response_mask``, ``traj_response_logprobs``, ``traj_response_routing``,
``disable_proxy_trajectory``, ``min_global_steps``, ``max_global_steps``,
``messages_snapshot`` (assistant messages counted as turns), ``context_overflow``
and the counters ``num_calls``, ``num_aborts``, ``num_preempted``,
``total_prompt_tokens``, ``total_completion_tokens``, ``tool_gap_secs``. A trial
is usable when ``prompt_len <= len(ids)``, ``len(mask) == len(ids) - prompt_len``
and ``len(logprobs) == len(mask)``. ``pop_session`` writes
``<trajectory_dir>/proxy_trajectory.json`` when the session made a call, and
its dashboard (``webui/server.py``) reads ``messages_snapshot`` from it.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from actorproxy import start_proxy
from actorproxy.embed import EmbeddedProxy, EmbeddedProxyError

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

FAST = {"sim_token_interval": 0.0002, "host": "127.0.0.1"}

#: What their loop reads of the meta, and the type it needs.
META_TYPES: dict[str, type | tuple[type, ...]] = {
    "traj_acc_ids": list, "initial_prompt_token_len": (int, type(None)), "traj_response_mask": list,
    "traj_response_logprobs": list, "traj_response_routing": list, "disable_proxy_trajectory": bool,
    "min_global_steps": (int, type(None)), "max_global_steps": (int, type(None)),
    "messages_snapshot": (list, type(None)), "context_overflow": bool, "num_calls": int, "num_aborts": int,
    "num_preempted": int, "total_prompt_tokens": int, "total_completion_tokens": int, "tool_gap_secs": list,
}


def _usable(meta: dict[str, Any]) -> bool:
    """Their ``traj_ok`` (builtin_cc_agent_loop.py)."""
    ids, prompt_len = meta.get("traj_acc_ids") or [], int(meta.get("initial_prompt_token_len") or 0)
    mask, logprobs = meta.get("traj_response_mask") or [], meta.get("traj_response_logprobs") or []
    return bool(not meta.get("disable_proxy_trajectory") and ids and prompt_len <= len(ids)
                and len(mask) == len(ids) - prompt_len and len(logprobs) == len(mask))


def _typed(meta: dict[str, Any]) -> None:
    for key, kind in META_TYPES.items():
        assert isinstance(meta[key], kind), (key, meta[key])


async def _claude_code(proxy: EmbeddedProxy, sid: str, turns: int, **kwargs: Any) -> list[dict[str, Any]]:
    """A Claude Code-like agent on ``ANTHROPIC_BASE_URL`` (the SDK appends /v1/messages)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test in tests/test_io.py."}]
    async with anthropic.AsyncAnthropic(base_url=proxy.session_anthropic_base(sid), api_key="unused",
                                        max_retries=0) as client:
        for n in range(turns):
            reply = await client.messages.create(model="policy", max_tokens=24, system="You are a coder.",
                                                 messages=messages, **kwargs)
            messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
            messages.append({"role": "user", "content": f"tool output {n}"})
    return messages


def test_urls_have_their_shapes() -> None:
    with start_proxy(**FAST) as proxy:
        for sid in ("task-1-ab12cd34", "a b?c#d%e"):
            quoted = urllib.parse.quote(sid, safe="")
            assert proxy.session_url(sid) == f"{proxy.url}/sess/{quoted}/v1"
            assert proxy.session_anthropic_base(sid) == f"{proxy.url}/sess/{quoted}"


def test_a_claude_code_attempt_pops_the_meta_their_loop_reads(tmp_path: Path) -> None:
    async def attempt() -> tuple[dict[str, Any], Path]:
        async with start_proxy(**FAST) as proxy:
            sid = "swe-task-0001-1a2b3c4d"
            trajectory_dir = tmp_path / "step_0003" / sid
            assert await proxy.open_session(sid, trajectory_dir=trajectory_dir) is None
            await _claude_code(proxy, sid, turns=3)
            meta = await proxy.pop_session(sid)
            again = await proxy.pop_session(sid)  # popped: forgotten, like theirs
            assert again["num_calls"] == 0 and not again["traj_acc_ids"]
            return meta, trajectory_dir

    meta, trajectory_dir = asyncio.run(attempt())
    _typed(meta)
    assert _usable(meta)
    assert meta["num_calls"] == 3 and meta["num_aborts"] == 0 and meta["num_preempted"] == 0
    assert len(meta["tool_gap_secs"]) == 2 and all(g >= 0 for g in meta["tool_gap_secs"])
    assert meta["min_global_steps"] == meta["max_global_steps"] == 0
    assert not meta["context_overflow"]
    # The sequence is the session's one segment: its prompt, then every sampled token trained with its logprob.
    [segment] = meta["segments"]
    assert meta["traj_acc_ids"] == segment["token_ids"]
    prompt_len = meta["initial_prompt_token_len"]
    assert segment["loss_mask"][:prompt_len] == [0] * prompt_len and meta["traj_response_mask"][0] == 1
    assert sum(meta["traj_response_mask"]) == meta["total_completion_tokens"]
    assert all(lp <= 0 for lp in meta["traj_response_logprobs"])
    assert all(lp == 0 for lp, m in zip(meta["traj_response_logprobs"], meta["traj_response_mask"],
                                        strict=True) if not m)
    # messages_snapshot: the conversation the model last saw, its last reply included; a turn per assistant.
    snapshot = meta["messages_snapshot"]
    assert [m["role"] for m in snapshot] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]
    assert len([m for m in snapshot if m.get("role") == "assistant"]) == meta["num_calls"]
    # The file, where their loop put the trial, read as their dashboard reads it.
    path = trajectory_dir / "proxy_trajectory.json"
    assert meta["trajectory_file"] == str(path)
    with open(path, errors="replace") as handle:
        document = json.load(handle)
    assert (document or {}).get("messages_snapshot") == snapshot
    assert document["segments"] == meta["segments"]
    assert document["trajectory_segments"] == meta["trajectory_segments"]
    assert meta["trajectory_segments"][0]["num_tokens"] == len(meta["traj_acc_ids"])


def test_an_attempt_that_never_called_gets_the_empty_meta_and_no_file(tmp_path: Path) -> None:
    async def attempt() -> dict[str, Any]:
        async with start_proxy(**FAST) as proxy:
            await proxy.open_session("env-failed", trajectory_dir=tmp_path / "env-failed")
            return await proxy.pop_session("env-failed")

    meta = asyncio.run(attempt())
    _typed(meta)
    assert not _usable(meta) and meta["num_calls"] == 0 and meta["messages_snapshot"] is None
    assert not (tmp_path / "env-failed").exists()


def test_retries_are_separate_sessions_and_the_data_is_handed_over_once(tmp_path: Path) -> None:
    async def trial() -> list[dict[str, Any]]:
        async with start_proxy(**FAST) as proxy:
            metas = []
            for attempt, turns in enumerate((1, 2)):  # each retry: a new session id, popped in `finally`
                sid = f"task-{attempt}"
                await proxy.open_session(sid, trajectory_dir=tmp_path / sid)
                try:
                    await _claude_code(proxy, sid, turns=turns)
                finally:
                    metas.append(await proxy.pop_session(sid))
            with pytest.raises(EmbeddedProxyError, match="404"):  # drained: the store keeps no copy
                await proxy.aread("task-1", include_steps=False)
            return metas

    metas = asyncio.run(trial())
    assert [m["num_calls"] for m in metas] == [1, 2] and all(_usable(m) for m in metas)


def test_context_overflow_is_reported(tmp_path: Path) -> None:
    async def attempt() -> dict[str, Any]:
        async with start_proxy(context_window=96, **FAST) as proxy:
            sid = "overlong"
            await proxy.open_session(sid, trajectory_dir=tmp_path / sid)
            with pytest.raises(anthropic.BadRequestError):
                await _claude_code(proxy, sid, turns=4)
            return await proxy.pop_session(sid)

    meta = asyncio.run(attempt())
    assert meta["context_overflow"] is True and meta["refused"] == {"context_overflow": 1}
    assert meta["num_calls"] >= 1 and _usable(meta)  # what came before the overflow is kept


def test_side_calls_and_sub_agents_stay_out_of_the_sequence_and_the_counters(tmp_path: Path) -> None:
    """Calls with another system prompt (a helper call; Claude Code's Task agent) are kept apart."""
    async def attempt() -> dict[str, Any]:
        async with start_proxy(**FAST) as proxy:
            sid = "with-sub-agent"
            await proxy.open_session(sid, trajectory_dir=tmp_path / sid)
            base = proxy.session_anthropic_base(sid)
            async with anthropic.AsyncAnthropic(base_url=base, api_key="unused", max_retries=0) as client:
                main: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
                first = await client.messages.create(model="policy", max_tokens=16, system="You are a coder.",
                                                     messages=main)
                await client.messages.create(model="policy", max_tokens=16, system="You are a search sub-agent.",
                                             messages=[{"role": "user", "content": "Find parse_date."}])
                main += [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                         {"role": "user", "content": "It is in utils.py."}]
                await client.messages.create(model="policy", max_tokens=16, system="You are a coder.",
                                             messages=main)
                # Once the main conversation continued, another one is a sub-agent's (a child session).
                await client.messages.create(model="policy", max_tokens=16, system="You are a test-finder.",
                                             messages=[{"role": "user", "content": "Find the tests."}])
            return await proxy.pop_session(sid)

    meta = asyncio.run(attempt())
    assert _usable(meta) and meta["num_calls"] == 2
    assert any("/sub-" in s["trajectory_id"] for s in meta["segments"])
    main = [s for s in meta["segments"] if not s["metadata"].get("side_call") and "/sub-" not in s["trajectory_id"]]
    assert len(meta["segments"]) == len(main) + 2  # the side call's and the sub-agent's are handed over too
    [segment] = main
    assert meta["traj_acc_ids"] == segment["token_ids"] and meta["traj_segment"] == segment["trajectory_id"]
    assert [m["role"] for m in meta["messages_snapshot"]] == ["system", "user", "assistant", "user", "assistant"]
