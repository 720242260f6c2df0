"""A finalized session as an in-process agent loop reads it (LiveRL's ``pop_session``), sans IO.

LiveRL's agent loop (``LegoX/Lego-RL``, ``builtin_cc_agent_loop.py``) builds its
training sample from one dict per trial: the whole token sequence
(``traj_acc_ids``), the first prompt's length, a mask and logprobs for every
token after it, the conversation the model saw (``messages_snapshot``), and
counters (calls, aborts, preemptions, token totals, the tool gaps, the weight
versions seen, whether a call overflowed the context). :func:`session_meta`
builds that dict from what ``/trajectory/read`` returns for the session (with
its steps) and the finalize's refusal counts.

Their sample is one sequence per trial. A session whose history was rewritten
holds several segments: the sequence fields then describe the last one (the
conversation as it ended) and ``traj_segment`` says which; every segment, with
its arrays, is in ``segments``, so nothing read is lost. Sub-agents (Claude
Code's Task, in child sessions) and side calls (one-shot helper calls with
another system prompt) are in ``segments`` only, never in the sequence fields,
the snapshot or the counters: LiveRL's proxy keeps calls with another system
prompt apart and never trains them either.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def fresh_meta() -> dict[str, Any]:
    """The meta of a session that never ran a turn (every field present, empty)."""
    return {
        "session_id": None,
        "num_calls": 0,
        "num_aborts": 0,
        "num_preempted": 0,
        "total_prompt_tokens": 0,
        "total_completion_tokens": 0,
        "min_global_steps": None,
        "max_global_steps": None,
        "messages_snapshot": None,
        "message_snap_debug": [],
        "last_tools": None,
        "initial_prompt_token_len": None,
        "traj_acc_ids": [],
        "traj_response_mask": [],
        "traj_response_logprobs": [],
        "traj_response_routing": [],
        "traj_segment": None,
        "disable_proxy_trajectory": False,
        "context_overflow": False,
        "tool_gap_secs": [],
        "proxy_model_inference_sec": 0.0,
        "proxy_tool_call_sec": 0.0,
        "trajectory_dir": None,
        "trajectory_file": None,
        "segments": [],
        "trajectory_segments": [],
        "refused": {},
    }


def own_steps(steps: Sequence[Mapping[str, Any]], session_id: str) -> list[Mapping[str, Any]]:
    """The session's own steps (not its sub-agents'), in order, without those a retry replaced."""
    mine = [s for s in steps if s.get("session_id") == session_id and s.get("status") != "superseded"]
    return sorted(mine, key=lambda s: int(s["step_index"]))


def assistant_message(output: Mapping[str, Any]) -> dict[str, Any]:
    """A step's ``output`` (as a step record holds it) as the OpenAI assistant message the agent got."""
    calls = list(output.get("tool_calls") or [])
    content = output.get("content") or ""
    message: dict[str, Any] = {"role": "assistant", "content": content if (content or not calls) else None}
    if output.get("reasoning_content"):
        message["reasoning_content"] = output["reasoning_content"]
    if calls:
        message["tool_calls"] = calls
    return message


def messages_snapshot(steps: Sequence[Mapping[str, Any]], session_id: str) -> list[dict[str, Any]] | None:
    """The conversation as the model last saw it, its last reply included; ``None`` without steps.

    Each step holds the messages it added (``new_messages``) and how many its
    request carried (``message_count``): the request is the conversation so far
    cut to ``message_count - len(new_messages)`` messages, then the new ones (a
    rewritten history sends them all again), then the reply when there was one.
    """
    mine = own_steps(steps, session_id)
    if not mine:
        return None
    conversation: list[dict[str, Any]] = []
    for step in mine:
        new = [dict(m) for m in step.get("new_messages") or []]
        kept = max(0, int(step.get("message_count") or 0) - len(new))
        conversation = conversation[:kept] + new
        if step.get("status") == "completed" and step.get("output") is not None:
            conversation.append(assistant_message(step["output"]))
    return conversation


def main_segments(segments: Sequence[Mapping[str, Any]], session_id: str) -> list[Mapping[str, Any]]:
    """The segments of the session's main conversation, in order: not its side calls', not its sub-agents'.

    A sub-agent's segments belong to a child session (``<session>/sub-<n>#<i>``; their
    ``parent_traj_id`` is the session); a side call's carry ``metadata.side_call``.
    """
    mine = [s for s in segments if str(s.get("trajectory_id", "")).rpartition("#")[0] == session_id
            and not (s.get("metadata") or {}).get("side_call")]
    return sorted(mine, key=lambda s: int(s["segment_index"]))


def main_steps(read_result: Mapping[str, Any], session_id: str) -> list[Mapping[str, Any]]:
    """The steps of the session's main conversation (those of :func:`main_segments`), in order."""
    numbers = {int(s["segment_index"]) for s in main_segments(read_result.get("data") or [], session_id)}
    return [s for s in own_steps(read_result.get("steps") or [], session_id) if int(s["segment_index"]) in numbers]


def segment_index(segments: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Where a session's segments start and end, without their arrays (``trajectory_segments``)."""
    keys = ("trajectory_id", "parent_traj_id", "segment_index", "num_tokens", "num_trained_tokens", "step_indices",
            "start_reason", "boundary_reason", "reward")
    return [{k: segment.get(k) for k in keys} for segment in segments]


def session_meta(
    session_id: str, read_result: Mapping[str, Any], refused: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """The dict LiveRL's ``pop_session`` returns, from ``/trajectory/read`` (``include_steps``) of the session."""
    meta = fresh_meta()
    segments = list(read_result.get("data") or [])
    own = main_segments(segments, session_id)
    steps = main_steps(read_result, session_id)
    meta["session_id"] = session_id
    meta["segments"] = segments
    meta["trajectory_segments"] = segment_index(segments)
    meta["refused"] = dict(refused or {})
    meta["context_overflow"] = bool((refused or {}).get("context_overflow"))
    meta["messages_snapshot"] = messages_snapshot(steps, session_id)
    meta["num_calls"] = len(steps)
    meta["num_aborts"] = sum(1 for s in steps if s.get("status") == "aborted")
    meta["num_preempted"] = sum(int(s.get("preemptions") or 0) for s in steps)
    meta["total_prompt_tokens"] = sum(int(s.get("prompt_tokens") or 0) for s in steps)
    meta["total_completion_tokens"] = sum(int(s.get("completion_tokens") or 0) for s in steps)
    meta["tool_gap_secs"] = _gaps(steps)
    meta["proxy_tool_call_sec"] = sum(meta["tool_gap_secs"])
    meta["proxy_model_inference_sec"] = sum(
        float(s["finished_at"]) - float(s["created_at"]) for s in steps if s.get("finished_at") and s.get("created_at")
    )
    sampled = [v for s in own for v, m in zip(s.get("versions") or [], s.get("loss_mask") or [], strict=False)
               if m and v >= 0]
    if sampled:
        meta["min_global_steps"], meta["max_global_steps"] = min(sampled), max(sampled)
    if own:
        _sequence(meta, own[-1], steps)
    return meta


def _sequence(meta: dict[str, Any], segment: Mapping[str, Any], steps: Sequence[Mapping[str, Any]]) -> None:
    """The sequence fields from one segment: its ids, its first prompt's length, mask and logprobs after it."""
    first = [s for s in steps if s.get("segment_index") == segment["segment_index"]]
    ids = list(segment.get("token_ids") or [])
    prompt_len = int(first[0].get("prompt_tokens") or 0) if first else 0
    prompt_len = min(prompt_len, len(ids))
    meta["traj_segment"] = segment.get("trajectory_id")
    meta["traj_acc_ids"] = ids
    meta["initial_prompt_token_len"] = prompt_len
    meta["traj_response_mask"] = list(segment.get("loss_mask") or [])[prompt_len:]
    meta["traj_response_logprobs"] = list(segment.get("logprobs") or [])[prompt_len:]


def _gaps(steps: Sequence[Mapping[str, Any]]) -> list[float]:
    """Seconds between one call's end and the next call's start (the agent's tools and thinking)."""
    gaps = []
    for before, after in zip(steps, steps[1:], strict=False):
        if before.get("finished_at") and after.get("created_at"):
            gaps.append(max(0.0, float(after["created_at"]) - float(before["finished_at"])))
    return gaps
