"""The Dressage proxy's trainer API over ours (``--api-dialect dressage``; docs/migrating.md).

Dressage's rollout clients (its ``ProxyClient``, the white-box and black-box
generate paths, Harbor) finalize with a ``label``, read a session back with
``trajectory_id`` = the session id, and turn each record into a training sample
with its own ``expand_segments_to_samples``. This module answers them in their
shapes, from what we record: a segment becomes their record (``tokens``,
``full_loss_mask``, ``full_logprobs``, ``full_versions`` as the engine's
labels, ``messages`` rebuilt from the steps, ``extra_info``); a finalize
answers their counts, and a repeated one its first answer; ``/session/discard``
drops a rejected attempt; ``/integration/capabilities`` describes the proxy.
Facts from Accio-Lab/Dressage at de8e869 (``dressage/proxy/server.py``); the
code is ours.

Agents' errors change shape too: a context overflow is their 413 with a
top-level ``code`` and ``details``, and a rollout their sandbox proxy must
abandon is a 502 whose ``detail.error`` names why.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from typing import Any

import attrs
import trio

from ..config import ProxyConfig
from ..core.records import CONTEXT_VERSION
from ..errors import BadRequest, ContextOverflow, NotFound, ProxyError
from ..protocols.trainer import FinalizeBody, PauseBody, ReadBody, ResumeBody
from ..runtime.runtime import Runtime
from ..schema.converter import CONVERTER
from ..store.base import Held, ReadQuery
from .replies import ErrorReply

#: ``schema_version`` of ``GET /integration/capabilities`` (Dressage's integration schema).
CAPABILITIES_SCHEMA = "dressage.proxy.integration/v1"
#: What Dressage writes for a token the policy did not sample.
_INPUT_VERSION = "-1"
#: Our codes that mean "this rollout is void: start another", as Dressage's sandbox proxy knows them.
_INVALIDATED = {"trajectory_version_changed": "trajectory_version_changed",
                "generation_interrupted": "generation_preempted",
                "weight_version_mismatch": "weight_version_mismatch",
                "partial_rollout_staleness_exceeded": "partial_rollout_staleness_exceeded"}
#: Segment starts that mean the agent rewrote its history (Dressage's ``history_rewritten``).
_REWRITES = frozenset({"history_rewrite", "system_changed", "tool_schema_change", "tito_failure"})


def token_build_mode(config: ProxyConfig) -> str:
    """Dressage's name for the build mode: ``tito`` (exact per-turn ids) or ``snapshot`` (re-rendered)."""
    return "tito" if config.trajectory.trajectory_build_mode == "concat" else "snapshot"


def token_build_model(config: ProxyConfig) -> str | None:
    family = config.trajectory.tito_model
    return None if family == "auto" else family


@attrs.define(eq=False)
class DressageApi:
    """The dialect's state: the first answer of each finalize (bounded) and the reason of the pause."""

    runtime: Runtime
    #: session id -> its finalize answer, repeated to a repeated finalize; the oldest goes past the bound.
    finalized: OrderedDict[str, dict[str, Any]] = attrs.field(factory=OrderedDict)
    pause_reason: str | None = None

    @property
    def config(self) -> ProxyConfig:
        return self.runtime.config

    # -- finalize, read, discard ----------------------------------------------------------

    async def finalize(self, body: FinalizeBody) -> dict[str, Any]:
        """Close the session; answer Dressage's counts (a repeated finalize: the first answer)."""
        sid = body.session_id
        result = await self.runtime.finalize(sid, reward=body.reward, instance_id=body.instance_id, label=body.label)
        first = self.finalized.get(sid)
        if first is not None and result.segments == 0 and result.steps == 0:
            return first
        try:
            stored = CONVERTER.unstructure(await self.runtime.read(session_id=sid, include_steps=True))
        except NotFound:
            stored = {"data": [], "steps": []}
        segments = [s for s in stored["data"] if _session_of(s) == sid]
        steps = [s for s in stored.get("steps") or [] if s.get("session_id") == sid and s.get("status") == "completed"]
        instance = body.instance_id or next((s["instance_id"] for s in segments if s.get("instance_id")), None)
        turns = {s.get("turn_id") or f"step-{s['step_index']}" for s in steps}
        answer = {
            "success": True,
            "status": "ok",
            "session_id": sid,
            "trajectory_id": sid,
            "instance_id": instance,
            "finalization_id": finalization_id(sid, segments),
            "num_steps": len(steps),
            "num_turns": len(turns),
            "num_segments": len(segments),
            "num_timeline_segments": len(segments),
            "history_rewritten": any(s.get("start_reason") in _REWRITES for s in segments),
            "token_build_mode": token_build_mode(self.config),
            "token_build_model": token_build_model(self.config),
            "record_token_versions": True,
            "mask_nonlast_version_tokens": self.config.trajectory.mask_nonlast_version_tokens,
            "segments": result.segments,
            "steps": result.steps,
        }
        self.finalized[sid] = answer
        self.finalized.move_to_end(sid)
        while len(self.finalized) > self.config.limits.max_sessions:
            self.finalized.popitem(last=False)
        return answer

    async def read(self, body: ReadBody) -> tuple[dict[str, Any], list[Held]]:
        """``trajectory_id`` (or ``session_id``): that session's records; neither: ready prompt groups.

        With what the read drains held, not yet deleted: the route deletes it once its reply was sent
        (``Runtime.delivered_reply``); an error here lets it go.
        """
        if body.include_steps:
            raise BadRequest("'include_steps' is not a Dressage read field: its records carry the conversation "
                             "('messages'); read the steps with --api-dialect actorproxy", param="include_steps")
        sid = body.trajectory_id or body.session_id
        held: list[Held] = []
        try:
            stats = await self.runtime.store_stats()
            if sid is None:
                groups = await self._read_groups(body.max_groups, held)
                return {"success": bool(groups), "mode": "batch", "data": groups, "meta_info": _meta(stats)}, held
            records = await self._read_session(sid, body.instance_id, held if body.drain else None)
        except BaseException:
            await self.runtime.let_go(tuple(held))
            raise
        return {"success": bool(records), "mode": "trajectory", "data": records, "meta_info": _meta(stats),
                "drained": body.drain}, held

    async def _read_session(self, sid: str, instance_id: str | None,
                            held: list[Held] | None) -> list[dict[str, Any]]:
        """The session's records; with ``held``, what they are read from is drained: held there, for the reply."""
        try:
            stored = CONVERTER.unstructure(await self.runtime.read(session_id=sid, include_steps=True))
        except NotFound:
            return []
        mine = [s for s in stored["data"] if _session_of(s) == sid]
        wanted = [s for s in mine if instance_id is None or s.get("instance_id") == instance_id]
        if held is not None and wanted:
            if len(wanted) == len(stored["data"]):
                result, holding = await self.runtime.hold_read(ReadQuery(sid, drain=True, include_steps=True))
                held.append(holding)
                stored = CONVERTER.unstructure(result)  # what is returned is what is drained
                wanted = [s for s in stored["data"] if _session_of(s) == sid
                          and (instance_id is None or s.get("instance_id") == instance_id)]
            else:  # other prompt groups' segments of this session stay
                kept: list[dict[str, Any]] = []
                for segment in wanted:
                    result, holding = await self.runtime.hold_read(
                        ReadQuery(trajectory_id=segment["trajectory_id"], drain=True))
                    held.append(holding)
                    kept.extend(CONVERTER.unstructure(result)["data"])  # (none: another drain delivers it)
                wanted = kept
        return dressage_records(sid, wanted, stored.get("steps") or [], self.config)

    async def _read_groups(self, max_groups: int | None, held: list[Held]) -> list[list[dict[str, Any]]]:
        """Dressage's batch read: prompt groups with enough finalized sessions (or waiting long enough), drained."""
        try:
            stored = CONVERTER.unstructure(await self.runtime.read())
        except NotFound:
            return []
        groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for segment in stored["data"]:
            sid = _session_of(segment)
            groups.setdefault(segment.get("instance_id") or sid, {}).setdefault(sid, []).append(segment)
        now = time.time()  # segments' created_at is wall-clock time
        server = self.config.server
        ready = [
            sessions for sessions in groups.values()
            if len(sessions) >= server.min_group_size
            or now - max(s["created_at"] for segs in sessions.values() for s in segs) > server.group_timeout
        ]
        out: list[list[dict[str, Any]]] = []
        for sessions in ready[: max_groups or len(ready)]:
            group: list[dict[str, Any]] = []
            for sid in sorted(sessions):
                group.extend(await self._read_session(sid, None, held))
            if group:
                out.append(group)
        return out

    async def discard(self, session_id: str) -> dict[str, Any]:
        removed, segments = await self.runtime.discard(session_id)
        removed = self.finalized.pop(session_id, None) is not None or removed  # a finalized session counts
        return {"success": True, "session_id": session_id, "session_removed": removed,
                "segments_removed": segments, "tool_call_hook_keys_purged": 0}

    # -- the controller -------------------------------------------------------------------

    async def pause(self, body: PauseBody) -> dict[str, Any]:
        state = self.runtime.controller.state()
        already = state.state == "paused"
        self.pause_reason = body.reason or "weight_update"
        quiesced = True
        ack = None
        if body.timeout_seconds is None:
            ack = await self.runtime.pause(body.mode)
        else:
            with trio.move_on_after(body.timeout_seconds):
                ack = await self.runtime.pause(body.mode)
            quiesced = ack is not None  # else paused, with generations still stopping
        state = self.runtime.controller.state()
        answer = CONVERTER.unstructure(ack) if ack is not None else {"mode": body.mode, "aborted": None,
                                                                      "partial_tokens": None}
        return {**answer, "status": "already_paused" if already else "paused", "reason": self.pause_reason,
                "quiesced": quiesced, "preempted": bool(ack is not None and ack.aborted),
                "version": state.weight_version, "weight_version": state.weight_version, "epoch": state.epoch,
                "active_sglang_generations": state.in_flight, "suspended_generations": state.waiting}

    async def resume(self, body: ResumeBody) -> dict[str, Any]:
        given = body.weight_version if body.weight_version is not None else body.version
        version = None if given is None else str(given)
        # Dressage: every resume after a pause starts a new rollout epoch (a rollout that spans it is void
        # without partial rollout), whether or not the trainer names the new version.
        was_paused = self.runtime.controller.state().state == "paused"
        ack = await self.runtime.resume(weight_version=version, bump_epoch=body.bump_epoch or was_paused)
        self.pause_reason = None
        state = self.runtime.controller.state()
        return {**CONVERTER.unstructure(ack), "status": "resumed" if ack.resumed else "already_running",
                "reason": body.reason or "weight_update", "version": ack.weight_version,
                "rollout_epoch": ack.epoch, "shutting_down": self.runtime.draining,
                "active_sglang_generations": state.in_flight, "suspended_generations": state.waiting}

    def pause_state(self, ours: dict[str, Any]) -> dict[str, Any]:
        return {**ours, "paused": ours["state"] == "paused", "reason": self.pause_reason,
                "version": ours["weight_version"], "rollout_epoch": ours["epoch"],
                "shutting_down": self.runtime.draining,
                "partial_rollout": self.config.preemption.partial_rollout,
                "active_sglang_generations": ours["in_flight"], "suspended_generations": ours["waiting"]}

    # -- health and capabilities -----------------------------------------------------------

    def health_config(self) -> dict[str, Any]:
        """Dressage's ``/health`` ``config`` block (ours stays beside it, by section)."""
        config = self.config
        return {
            "sglang_router_url": config.engines.backend_urls[0] if config.engines.backend_urls else None,
            "token_build_mode": token_build_mode(config),
            "token_build_model": token_build_model(config),
            "record_token_versions": True,
            "mask_nonlast_version_tokens": config.trajectory.mask_nonlast_version_tokens,
            "max_output_tokens": config.limits.max_output_tokens,
            "rollout_temperature": config.limits.default_temperature,
            "context_window": self.runtime.context_window,
            "dynamic_max_tokens": config.limits.dynamic_max_tokens,
            "use_rollout_routing_replay": config.engines.use_rollout_routing_replay,
            "partial_rollout": config.preemption.partial_rollout,
            "max_partial_rollout_preempts": config.preemption.max_partial_rollout_preempts,
            "stream_heartbeat_interval_seconds": config.server.heartbeat_interval,
        }

    async def capabilities(self) -> dict[str, Any]:
        """``GET /integration/capabilities``: what a Dressage integration checks before it trains."""
        runtime, config = self.runtime, self.config
        cached = runtime.controller.weight_version
        current: str | None = cached
        source, authoritative, workers = "generation_observation", False, 0
        try:
            info = await runtime.backend.model_info()
        except Exception:  # an engine that does not answer now: the controller's version, not authoritative
            source = "unavailable"
        else:
            if info.weight_version == cached:
                authoritative, source = True, "worker_snapshot"
                workers = len(config.engines.backend_urls) or 1
            else:
                current = None  # the engine and the proxy disagree until the next resume installs a version
        template = str(getattr(runtime.tokenizer.hf, "chat_template", None) or "")
        return {
            "schema_version": CAPABILITIES_SCHEMA,
            "token_build_mode": token_build_mode(config),
            "token_build_model": token_build_model(config),
            "tokenizer_id": config.engines.tokenizer_path or runtime.tokenizer.name,
            "chat_template_fingerprint": hashlib.sha256(template.encode()).hexdigest() if template else None,
            "record_token_versions": True,
            "mask_nonlast_version_tokens": config.trajectory.mask_nonlast_version_tokens,
            "max_output_tokens": config.limits.max_output_tokens,
            "partial_rollout": config.preemption.partial_rollout,
            "max_partial_rollout_preempts": config.preemption.max_partial_rollout_preempts,
            "current_weight_version": current,
            "cached_weight_version": cached,
            "weight_version_authoritative": authoritative,
            "weight_versions_consistent": authoritative,
            "weight_version_source": source,
            "weight_version_worker_count": workers,
            "supports_expected_version": True,
        }


def _meta(stats: dict[str, Any]) -> dict[str, Any]:
    """Dressage's ``meta_info``: its store counters, from ours."""
    return {"total_items": stats.get("segments", 0), "total_sessions": stats.get("sessions", 0), "store": stats}


def _session_of(segment: dict[str, Any]) -> str:
    """The session a segment belongs to (its id is ``<session>#<index>``)."""
    return str(segment["trajectory_id"]).rpartition("#")[0]


def finalization_id(session_id: str, segments: list[dict[str, Any]]) -> str:
    """One id for the segments a session has in the store (the same in the finalize answer and every read)."""
    digest = hashlib.sha256(session_id.encode())
    for segment in sorted(segments, key=lambda s: s["segment_index"]):
        digest.update(f"|{segment['segment_index']}:{segment['created_at']!r}".encode())
    return digest.hexdigest()[:32]


def _assistant(step: dict[str, Any]) -> dict[str, Any] | None:
    output = step.get("output")
    if output is None:
        return None
    message: dict[str, Any] = {"role": "assistant", "content": output.get("content")}
    if output.get("reasoning_content"):
        message["reasoning_content"] = output["reasoning_content"]
    if output.get("tool_calls"):
        message["tool_calls"] = output["tool_calls"]
    return message


def _messages(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation a segment was sampled from: each step's new messages, then its reply."""
    messages: list[dict[str, Any]] = []
    for position, step in enumerate(steps):
        if position == 0 or step.get("prefix_rebuilt"):
            messages = []  # this step's prompt was the whole conversation
        messages.extend(step.get("new_messages") or [])
        reply = _assistant(step)
        if reply is not None:
            messages.append(reply)
    return messages


def dressage_records(
    session_id: str, segments: list[dict[str, Any]], steps: list[dict[str, Any]], config: ProxyConfig
) -> list[dict[str, Any]]:
    """Our segments (their JSON) as Dressage's records, in segment order."""
    ordered = sorted(segments, key=lambda s: s["segment_index"])
    by_index = {s["step_index"]: s for s in steps if s.get("session_id") == session_id}
    fin = finalization_id(session_id, ordered)
    records = []
    for segment in ordered:
        seg_steps = [by_index[i] for i in segment["step_indices"] if i in by_index]
        last = seg_steps[-1] if seg_steps else {}
        metadata = segment.get("metadata") or {}
        labels: dict[str, str] = metadata.get("version_labels") or {}
        mask = segment["loss_mask"]
        start = next((i for i, bit in enumerate(mask) if bit), len(mask))
        extra = {
            "token_build_mode": token_build_mode(config),
            "segment_view": "lineage",
            "record_token_versions": True,
            "mask_nonlast_version_tokens": config.trajectory.mask_nonlast_version_tokens,
            "finalization_complete": True,
            "finalization_id": fin,
            "start_reason": segment["start_reason"],
            "boundary_reason": segment["boundary_reason"],
            "actorproxy_trajectory_id": segment["trajectory_id"],
        }
        records.append({
            "uid": segment["trajectory_id"],
            "session_id": session_id,
            "trajectory_id": session_id,
            "turn_id": last.get("turn_id") or str(last.get("step_index", segment["segment_index"])),
            "instance_id": segment.get("instance_id") or session_id,
            "segment_index": segment["segment_index"],
            "segment_count": len(ordered),
            "messages": _messages(seg_steps),
            "tools": None,
            "tokens": segment["token_ids"],
            "full_logprobs": segment["logprobs"],
            "full_loss_mask": mask,
            "full_versions": [
                _INPUT_VERSION if v == CONTEXT_VERSION else labels.get(str(v), str(v)) for v in segment["versions"]
            ],
            "aligned_response_length": len(mask) - start,
            "label": metadata.get("label"),
            "reward": segment.get("reward"),
            "finish_reason": last.get("finish_reason") or "stop",
            "timestamp": segment["created_at"],
            "extra_info": extra,
        })
    return records


class WeightVersionMismatch(ProxyError):
    """A turn sent ``X-Dressage-Expected-Version`` and the policy serves another version."""

    status = 502
    default_code = "weight_version_mismatch"
    openai_type = "server_error"


def check_expected_version(runtime: Runtime, headers: Any) -> None:
    """Refuse a turn that expects another weight version than the one installed (Dressage's header)."""
    expected = (headers.get("x-dressage-expected-version") or "").strip()
    current = runtime.controller.weight_version
    if expected and expected != current:
        raise WeightVersionMismatch(
            f"the turn expects weight version {expected!r}, the policy serves {current!r}; start a new rollout"
        )


def reshape_error(error: Exception, failed: ErrorReply) -> ErrorReply:
    """An agent's error as Dressage's sandbox proxy classifies it (others keep our shape)."""
    if isinstance(error, ContextOverflow):
        data = {"error": "context_overflow", "code": "context_overflow", "message": error.message,
                "details": error.details, "detail": failed.data.get("error")}
        return ErrorReply(413, data, failed.headers, code=failed.code)
    if isinstance(error, ProxyError) and error.code in _INVALIDATED:
        detail = {"error": _INVALIDATED[error.code], "message": error.message}
        return ErrorReply(502, {**failed.data, "detail": detail}, failed.headers, code=failed.code)
    return failed
