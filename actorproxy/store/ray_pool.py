"""``--store ray``: committed segments go to a named, detached Ray actor that many proxies share.

The proxy keeps its SQLite store (journal, steps, and the segments not yet
acknowledged) and a forwarder sends the oldest committed segments to the pool
in batches; a segment leaves the local file only once the pool acknowledged it,
so a Ray outage delays data and never loses it. A send retried after a lost
acknowledgement is deduplicated by the pool (by trajectory id).

The pool (:class:`DataPool`) holds segments by prompt group (``instance_id``)
until a trainer fetches complete groups (:mod:`actorproxy.ray`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import sys
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from typing import Any

from ..errors import StartupError
from .base import LONGEST_LEASE, MAX_LEASES, REMEMBERED
from .codec import segment_json
from .sqlite import SQLiteStore

log = logging.getLogger(__name__)

#: Segments per send to the pool.
BATCH = 64
#: Seconds a send may take before it is retried.
SEND_TIMEOUT = 30.0
#: Prompt groups the pool holds before it drops the oldest (counted and logged).
MAX_PENDING_GROUPS = 10_000
#: Why a segment ends its rollout (the session is done): other reasons are mid-session boundaries.
TERMINAL_REASONS = frozenset({"finalize", "idle_evicted", "shutdown", "recovered"})
#: The channel of a segment that names none (Claw-R1's default too).
DEFAULT_CHANNEL = "train"
#: Validation entries (``put_validate``) the pool keeps at most.
MAX_VALIDATE_ENTRIES = 1000


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError("--store ray needs Ray: pip install 'actorproxy[ray]'") from exc
    return ray


#: A ``--store ray`` proxy joined Ray from a worker thread (see :func:`exit_after_ray`).
joined_from_a_thread = False


def exit_after_ray(code: int) -> None:
    """End the process with ``code`` now if its store joined Ray; return otherwise.

    Ray's core worker, joined from a worker thread (the proxy's store is, so that the Trio
    loop never blocks on Ray), aborts the process (SIGABRT, exit -6) during interpreter
    teardown some of the time, even after ``ray.shutdown()``: seen in about half the
    SIGTERMs of ``examples/ray_data_pool.py``, after every atexit handler had run. By the
    time this is called the store is closed, Ray is shut down and the drain is done, so
    the only thing skipped is that teardown: the logs and standard streams are flushed
    first.
    """
    if not joined_from_a_thread:
        return
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def init_ray(address: str | None, namespace: str) -> Any:
    """Join (or, without an address and no cluster, start) Ray in ``namespace``."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, include_dashboard=False, log_to_driver=False,
                 ignore_reinit_error=True)
    return ray


class ForeignPool(RuntimeError):
    """The named actor exists and is neither an actorproxy data pool nor Claw-R1's DataPool."""


#: The methods that make a named actor Claw-R1's ``DataPool`` (its producer and consumer calls).
CLAW_R1_POOL_METHODS = ("submit_steps", "complete_trajectory", "fetch_batch")


def speaks_claw_r1(handle: Any) -> bool:
    """Is this pool Claw-R1's own ``DataPool`` (steps in, ``complete_trajectory``), not actorproxy's?"""
    return not hasattr(handle, "put") and all(hasattr(handle, m) for m in CLAW_R1_POOL_METHODS)


def pool_handle(name: str, namespace: str, *, max_pending_groups: int = MAX_PENDING_GROUPS) -> Any:
    """The named pool actor, created (detached, no CPU reserved) if it does not exist yet.

    An existing actor of that name is used when it is an actorproxy pool or Claw-R1's ``DataPool``
    (:func:`speaks_claw_r1`); anything else raises :class:`ForeignPool`.
    """
    ray = _ray()
    remote = ray.remote(num_cpus=0, max_concurrency=64)(DataPool)
    handle = remote.options(name=name, namespace=namespace, lifetime="detached", get_if_exists=True).remote(
        max_pending_groups=max_pending_groups
    )
    if not hasattr(handle, "put") and not speaks_claw_r1(handle):
        methods = sorted(m for m in dir(handle) if not m.startswith("_"))
        raise ForeignPool(
            f"the Ray actor {name!r} (namespace {namespace!r}) is neither an actorproxy data pool (put) nor "
            f"Claw-R1's DataPool (submit_steps, complete_trajectory); its methods: "
            f"{', '.join(methods[:8]) or 'none'}; give --data-pool-name another name"
        )
    return handle


def check_pool(address: str | None, namespace: str, name: str) -> None:
    """At start-up: join Ray and find (or create) the pool ``name``; a one-line
    :class:`~actorproxy.errors.StartupError` when Ray is missing or the actor is not ours (blocking)."""
    global joined_from_a_thread
    try:
        init_ray(address, namespace)
    except Exception as exc:  # no Ray installed, or no cluster at --ray-address
        raise StartupError("--store ray", f"cannot join Ray ({type(exc).__name__}: {exc})") from None
    joined_from_a_thread = True  # the store's thread uses this Ray too: end the process as such a proxy does
    try:
        handle = pool_handle(name, namespace)
    except ForeignPool as exc:
        raise StartupError("--data-pool-name", str(exc)) from None
    if speaks_claw_r1(handle):
        log.info("data pool %r is Claw-R1's DataPool: segments go to it as its steps (submit_steps, then "
                 "complete_trajectory for each finished rollout)", name)


@dataclass
class ClawR1Step:
    """One model call as Claw-R1's ``DataPool`` hands it to its ``TrainingBackend.convert`` (same fields)."""

    prompt_ids: list[int]
    response_ids: list[int]
    reward: float | None = None
    multi_modal_data: dict[str, Any] | None = None
    rollout_log_probs: list[float] | None = None
    routed_experts: Any = None
    trajectory_uid: str = ""
    prompt_uid: str = ""
    step_index: int = 0
    policy_version: int = 0
    is_last: bool = False
    metadata: dict[str, Any] | None = None


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    """The runs of loss mask 1: one model call's sampled ids each."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def segment_steps(seg: dict[str, Any], registered: dict[str, Any] | None = None) -> list[ClawR1Step]:
    """One segment (as ``/trajectory/read`` returns it) as Claw-R1 steps: each trained span is one model call.

    Its prompt is every token before the span; its response the span; its logprobs the span's; its
    metadata the step's submitted metadata (``/submit_steps``), else ``registered`` (what
    ``register_trajectory`` said of the rollout), else the segment's own.
    """
    tokens, mask, logprobs, versions = seg["token_ids"], seg["loss_mask"], seg["logprobs"], seg["versions"]
    meta = seg.get("metadata") or {}
    submitted = meta.get("step_metadata") or {}
    registered = registered or meta.get("trajectory_metadata")
    indices = list(seg.get("step_indices") or [])
    spans = _spans(mask)
    steps = []
    for n, (a, b) in enumerate(spans):
        index = indices[n] if len(indices) == len(spans) else n
        extra = submitted.get(str(index))
        steps.append(ClawR1Step(
            prompt_ids=list(tokens[:a]), response_ids=list(tokens[a:b]), rollout_log_probs=list(logprobs[a:b]),
            trajectory_uid=seg["parent_traj_id"], prompt_uid=seg.get("instance_id") or seg["parent_traj_id"],
            step_index=index, policy_version=max(versions[a:b], default=0),
            metadata={k: v for k, v in extra.items() if k not in ("source", "is_last", "policy_version")}
            if isinstance(extra, dict) else registered,
        ))
    return steps


def claw_r1_steps(rollout: str, instance_id: str, segments: list[dict[str, Any]]) -> list[ClawR1Step]:
    """A finished rollout's segments (pool payloads) as Claw-R1 steps (:func:`segment_steps`), in step order.

    The last step is ``is_last`` and carries the rollout's reward.
    """
    decoded = [decode_payload(payload) for payload in segments]
    registered = next((s["metadata"]["trajectory_metadata"] for s in decoded
                       if (s.get("metadata") or {}).get("trajectory_metadata")), None)
    steps = [step for seg in decoded for step in segment_steps(seg, registered)]
    rewards = [s["reward"] for s in decoded if s.get("reward") is not None]
    for step in steps:
        step.trajectory_uid, step.prompt_uid = rollout, instance_id
    steps.sort(key=lambda s: s.step_index)
    if steps:
        steps[-1].is_last = True
        steps[-1].reward = rewards[-1] if rewards else None
    return steps


def claw_r1_calls(payloads: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Segments as calls on Claw-R1's ``DataPool``, in order: ``(method, keyword arguments)``.

    Keywords only, named as that pool names its parameters: a process that does not have the pool's
    class sees its methods as ``(**kwargs)``, and Ray refuses positional arguments there.

    Each segment's steps go in with ``submit_steps(steps, channel=)``; a segment that ends its rollout
    has its last step ``is_last`` with the rollout's reward, and is followed by
    ``complete_trajectory(rollout, reward=, channel=)`` (which also completes a rollout whose last
    segment trained nothing). The channel is the segment's ``metadata.channel`` (``train`` when none).
    """
    calls: list[tuple[str, dict[str, Any]]] = []
    for payload in payloads:
        seg = decode_payload(payload)
        channel = str((seg.get("metadata") or {}).get("channel") or DEFAULT_CHANNEL)
        steps = segment_steps(seg)
        terminal = seg["boundary_reason"] in TERMINAL_REASONS
        if steps and terminal:
            steps[-1].is_last, steps[-1].reward = True, seg.get("reward")
        if steps:
            calls.append(("submit_steps", {"steps": steps, "channel": channel}))
        if terminal:
            calls.append(("complete_trajectory", {"trajectory_uid": seg["parent_traj_id"],
                                                  "reward": seg.get("reward"), "channel": channel}))
    return calls


@dataclass
class _Taken:
    """A group's rollouts a leased fetch took: put back as they were if the lease is not acknowledged."""

    key: str
    rollouts: dict[str, list[dict[str, Any]]]
    channel: str


@dataclass(frozen=True)
class Acknowledgement:
    """What :meth:`DataPool.acknowledge` answers: how the lease ended. True when a trainer's acknowledgement settled
    it (this one, or the earlier one it repeats: ``status`` says whether its groups were used or given back)."""

    lease: str
    #: ``deleted`` (its groups gone for good), ``released`` (given back, first in the queue), ``expired`` (not
    #: acknowledged in time: its groups were handed out again) or ``unknown`` (never made by this pool, or forgotten:
    #: it remembers the last ``REMEMBERED`` leases that ended).
    status: str
    #: An acknowledgement came before this one, or the lease expired before it: ``status`` is how it ended then.
    repeated: bool = False
    #: When it ended (wall clock, seconds since the epoch); ``None`` if unknown.
    at: float | None = None

    def __bool__(self) -> bool:
        return self.status in ("deleted", "released")


class DataPool:
    """The pool's state: segments by prompt group, FIFO; runs as a Ray actor (asyncio).

    Rollouts are kept apart by channel (a segment's ``metadata.channel``, ``train`` when it has none;
    a rollout's channel is its last segment's): a fetch takes one channel's rollouts only.

    Claw-R1's trainer can use it in place of its own ``DataPool``: the constructor takes that pool's
    ``(config, training_backend, max_queue_size=)``, and ``fetch_batch(batch_size=, n_rollouts=, channel=)``,
    ``get_statistics``, ``put_validate``/``get_validate`` and ``shutdown`` behave as that pool's do
    (the batch is ``training_backend.convert`` of the steps, grouped by prompt uid).
    """

    def __init__(self, config: Any = None, training_backend: Any = None, max_queue_size: int | None = None, *,
                 max_pending_groups: int = MAX_PENDING_GROUPS) -> None:
        self._max_groups = min(max_pending_groups, max_queue_size) if max_queue_size else max_pending_groups
        self._n_rollouts = int(getattr(config, "n_rollouts", 1) or 1)
        self._backend = training_backend
        #: group key -> rollout (session) -> its segments, in arrival order.
        self._groups: OrderedDict[str, dict[str, list[dict[str, Any]]]] = OrderedDict()
        #: Rollouts whose last segment arrived, and their channel.
        self._done: dict[str, str] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._counts: Counter[str] = Counter()
        self._sources: Counter[str] = Counter()
        self._changed: asyncio.Event | None = None
        self._shut: set[str | None] = set()
        self._validate: deque[Any] = deque(maxlen=MAX_VALIDATE_ENTRIES)
        self._last_fetch: dict[str, Any] | None = None
        #: Leased fetches: lease id -> (when it ends, monotonic; the groups taken, to put back if not acknowledged).
        self._leases: dict[str, tuple[float, list[_Taken]]] = {}
        #: How the last ``REMEMBERED`` leases ended (``deleted``, ``released``, ``expired``; when), oldest first.
        self._ended: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    async def put(self, segments: list[dict[str, Any]], source: str = "") -> int:
        """Take segments (``encode_row`` payloads); returns how many were new (the acknowledgement)."""
        new = 0
        for seg in segments:
            trajectory_id = seg["meta"]["trajectory_id"]
            if trajectory_id in self._seen:
                self._counts["duplicates"] += 1
                continue
            self._seen[trajectory_id] = None
            while len(self._seen) > 10 * self._max_groups + 100_000:
                self._seen.popitem(last=False)
            meta = seg["meta"]
            rollout = meta["parent_traj_id"]
            group = meta.get("instance_id") or rollout
            self._groups.setdefault(group, {}).setdefault(rollout, []).append(seg)
            if meta["boundary_reason"] in TERMINAL_REASONS:
                self._done[rollout] = str((meta.get("metadata") or {}).get("channel") or DEFAULT_CHANNEL)
            new += 1
        self._counts["segments_received"] += new
        self._sources[source] += new
        while len(self._groups) > self._max_groups:
            key, dropped = self._groups.popitem(last=False)
            count = sum(len(s) for s in dropped.values())
            self._counts["dropped_groups"] += 1
            self._counts["dropped_segments"] += count
            for rollout in dropped:
                self._done.pop(rollout, None)
            logging.getLogger(__name__).warning(
                "data pool full (%d groups): dropped the oldest group %r (%d segments); fetch faster or raise "
                "max_pending_groups", self._max_groups, key, count)
        self._event().set()
        return new

    def _complete(self, rollouts_per_group: int, channel: str = DEFAULT_CHANNEL) -> list[str]:
        """Every group holding ``rollouts_per_group`` finished rollouts of ``channel``, oldest first.

        A group that never fills does not hold the others back: it waits in place until it fills or
        ``max_pending_groups`` newer groups push it out (dropped oldest first, logged and counted).
        """
        return [key for key, rollouts in self._groups.items()
                if sum(self._done.get(r) == channel for r in rollouts) >= rollouts_per_group]

    def _take(self, key: str, rollouts_per_group: int, channel: str,
              leased: list[_Taken] | None = None) -> tuple[list[str], list[dict[str, Any]]]:
        """Take a complete group's ``rollouts_per_group`` rollouts of ``channel`` (``leased``: what was taken is
        noted there too, to be put back if the lease is not acknowledged)."""
        rollouts = self._groups[key]
        taken = [r for r in rollouts if self._done.get(r) == channel][:rollouts_per_group]
        kept = {r: rollouts.pop(r) for r in taken}
        segments = [seg for r in taken for seg in kept[r]]
        for r in taken:
            self._done.pop(r, None)
        if not rollouts:
            del self._groups[key]
        if leased is not None:
            leased.append(_Taken(key, kept, channel))
        self._counts["groups_fetched"] += 1
        self._counts["segments_fetched"] += len(segments)
        return taken, segments

    def _put_back(self, taken: list[_Taken]) -> None:
        """Groups a lease took, first in the queue again, with their rollouts finished (what arrived for the same
        groups meanwhile stays with them; a rollout that went on meanwhile keeps its taken segments first, and is
        finished as its newer ones say)."""
        for item in reversed(taken):
            group = self._groups.pop(item.key, {})
            self._done.update({r: item.channel for r in item.rollouts if r not in group})
            self._groups[item.key] = {r: [*segments, *group.pop(r, ())] for r, segments in item.rollouts.items()}
            self._groups[item.key].update(group)
            self._groups.move_to_end(item.key, last=False)
        self._event().set()

    def _expire(self) -> None:
        """Put back the groups of every lease that ended unacknowledged (asked at each call: a trainer that died
        finds its batch again at its next fetch)."""
        now = time.monotonic()
        for lease, (deadline, taken) in list(self._leases.items()):
            if deadline <= now:
                del self._leases[lease]
                self._end(lease, "expired")
                self._counts["leases_expired"] += 1
                logging.getLogger(__name__).warning(
                    "a leased fetch (%d groups) was not acknowledged in time: its groups are handed out again",
                    len(taken))
                self._put_back(taken)

    def acknowledge(self, lease: str, release: bool = False) -> Acknowledgement:
        """A leased fetch used (its groups gone for good) or, ``release``, given back (first in the queue again).

        Idempotent: a lease that ended already answers how (``repeated``), whatever this call asks, and changes
        nothing: ``deleted`` or ``released`` by an earlier acknowledgement, ``expired`` (false: its groups were
        handed out again); ``unknown`` (false) for one never made here or forgotten."""
        self._expire()
        found = self._leases.pop(lease, None)
        if found is None:
            ended = self._ended.get(lease)
            if ended is None:
                return Acknowledgement(lease, "unknown")
            return Acknowledgement(lease, ended[0], repeated=True, at=ended[1])
        if release:
            self._counts["leases_released"] += 1
            self._put_back(found[1])
        status, at = self._end(lease, "released" if release else "deleted")
        return Acknowledgement(lease, status, at=at)

    def _end(self, lease: str, status: str) -> tuple[str, float]:
        """Remember that ``lease`` ended so (the last ``REMEMBERED``), and when."""
        ended = self._ended[lease] = (status, time.time())
        while len(self._ended) > REMEMBERED:
            self._ended.popitem(last=False)
        return ended

    async def _wait_for(self, groups: int, rollouts_per_group: int, channel: str, deadline: float | None) -> bool:
        """Wait until ``groups`` groups of ``channel`` are complete; False at the deadline or a shutdown."""
        while True:
            self._expire()  # (a lease that ends while this fetch waits gives its groups to it)
            if len(self._complete(rollouts_per_group, channel)) >= groups:
                return True
            if channel in self._shut or None in self._shut:
                return False
            event = self._event()
            event.clear()
            now = time.monotonic()
            if deadline is not None and deadline <= now:
                return False
            wakes = [end for end, _ in self._leases.values()] + ([deadline] if deadline is not None else [])
            if not wakes:
                await event.wait()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), max(min(wakes) - now, 0.0))

    async def fetch_batch(self, groups: int | None = None, rollouts_per_group: int | None = None,
                          timeout_s: float | None = None, *, batch_size: int | None = None,
                          n_rollouts: int | None = None, channel: str = DEFAULT_CHANNEL,
                          lease: float | None = None) -> Any:
        """The first ``groups`` complete prompt groups (``rollouts_per_group`` finished rollouts each).

        Waits up to ``timeout_s`` for enough of them; then returns what is complete (maybe fewer), as
        ``[{"instance_id", "rollouts", "segments"}]``.

        ``lease`` (seconds): the answer is ``{"lease": {"id", "seconds"}, "groups": [...]}``, and the groups are
        gone for good only once :meth:`acknowledge` is called with the id; else, after ``lease`` seconds, they
        are handed out again, first (a trainer that died, or whose ``ray.get`` timed out, loses nothing).

        Claw-R1's call, ``fetch_batch(batch_size=B, n_rollouts=N, channel=C)``, waits (without a deadline)
        for B complete groups of N (default: the config's ``n_rollouts``) and returns
        ``training_backend.convert(steps)`` (the steps themselves without a backend); ``None`` once the
        channel is shut down.
        """
        if batch_size is not None:
            return await self._fetch_steps(batch_size, n_rollouts or self._n_rollouts, channel)
        if groups is None or rollouts_per_group is None:
            raise TypeError("fetch_batch needs groups and rollouts_per_group (or Claw-R1's batch_size=)")
        if lease is not None and not 1 <= lease <= LONGEST_LEASE:
            raise ValueError(f"a lease is 1 to {LONGEST_LEASE:g} seconds, not {lease!r}")
        self._room_for(lease)
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else 60.0)
        await self._wait_for(groups, rollouts_per_group, channel, deadline)
        self._room_for(lease)  # (again: other leased fetches that waited meanwhile may have taken the room)
        leased: list[_Taken] | None = [] if lease is not None else None
        out: list[dict[str, Any]] = []
        for key in self._complete(rollouts_per_group, channel)[:groups]:
            taken, segments = self._take(key, rollouts_per_group, channel, leased)
            out.append({"instance_id": key, "rollouts": taken, "segments": segments})
        if lease is None or leased is None:
            return out
        lease_id = secrets.token_urlsafe(18)
        self._leases[lease_id] = (time.monotonic() + lease, leased)
        return {"lease": {"id": lease_id, "seconds": lease}, "groups": out}

    def _room_for(self, lease: float | None) -> None:
        """Raise if a leased fetch (``lease``) would open more than ``MAX_LEASES`` leases."""
        self._expire()
        if lease is not None and len(self._leases) >= MAX_LEASES:
            raise RuntimeError(f"{len(self._leases)} leased fetches are not acknowledged yet (at most "
                               f"{MAX_LEASES}): acknowledge or release them first")

    async def _fetch_steps(self, batch_size: int, n_rollouts: int, channel: str) -> Any:
        if not await self._wait_for(batch_size, n_rollouts, channel, None):
            return None
        steps: list[ClawR1Step] = []
        keys = self._complete(n_rollouts, channel)[:batch_size]
        for key in keys:
            taken, segments = self._take(key, n_rollouts, channel)
            by_rollout: dict[str, list[dict[str, Any]]] = {}
            for seg in segments:
                by_rollout.setdefault(seg["meta"]["parent_traj_id"], []).append(seg)
            for rollout in sorted(taken):
                steps += claw_r1_steps(rollout, key, by_rollout.get(rollout, []))
        self._counts["fetch_count"] += 1
        self._last_fetch = {"fetch_count": self._counts["fetch_count"], "batch_size": batch_size,
                            "n_rollouts": n_rollouts, "prompt_uids": keys, "step_count": len(steps),
                            "fetched_at": time.time()}
        return self._backend.convert(steps) if self._backend is not None else steps

    def shutdown(self, channel: str | None = None) -> None:
        """Claw-R1's: stop serving ``channel`` (all channels: ``None``); its waiting fetches return ``None``."""
        self._shut.add(channel)
        self._event().set()

    def put_validate(self, data: Any) -> None:
        """Claw-R1's: queue validation results for the trainer (the oldest of more than 1000 is dropped, counted)."""
        if len(self._validate) == self._validate.maxlen:
            self._counts["validate_dropped"] += 1
        self._validate.append(data)

    def get_validate(self) -> Any:
        """Claw-R1's: the oldest queued validation entry, or ``None``."""
        return self._validate.popleft() if self._validate else None

    def get_statistics(self, channel: str = DEFAULT_CHANNEL) -> dict[str, Any]:
        """Claw-R1's statistics keys (for ``channel``), then this pool's own."""
        pending = sum(any(self._done.get(r, channel) == channel for r in g) for g in self._groups.values())
        return {
            "total_steps": self._counts["segments_received"],
            "total_produced": self._counts["segments_received"],
            "total_consumed": self._counts["groups_fetched"],
            "total_dropped": self._counts["dropped_groups"],
            "fetch_count": self._counts["fetch_count"],
            "last_fetch": self._last_fetch,
            "queue_size": pending,
            "ready_prompt_groups": len(self._complete(self._n_rollouts, channel)),
            "max_queue_size": self._max_groups,
            "shutdown": channel in self._shut or None in self._shut,
            **self.stats(),
        }

    def stats(self) -> dict[str, Any]:
        self._expire()
        return {
            "pending_groups": len(self._groups),
            "open_leases": len(self._leases),
            "pending_segments": sum(len(s) for g in self._groups.values() for s in g.values()),
            "complete_rollouts": len(self._done),
            "max_pending_groups": self._max_groups,
            "sources": dict(self._sources),
            **{k: self._counts[k] for k in ("segments_received", "duplicates", "groups_fetched",
                                            "segments_fetched", "dropped_groups", "dropped_segments",
                                            "leases_released", "leases_expired")},
        }


def decode_payload(seg: dict[str, Any]) -> dict[str, Any]:
    """A pool payload as the segment JSON ``/trajectory/read`` returns."""
    tokens, mask, logprobs, versions = seg["arrays"]
    return segment_json(seg["meta"], (tokens, mask, logprobs, versions))


class RayStore(SQLiteStore):
    """SQLite locally; committed segments forwarded to the pool and deleted once acknowledged."""

    name = "ray"

    def __init__(self, data_dir: str, *, address: str | None, namespace: str, pool: str) -> None:
        super().__init__(data_dir)
        self._address, self._namespace, self._pool_name = address, namespace, pool
        self._pool: Any = None
        #: The pool is Claw-R1's own DataPool (:func:`speaks_claw_r1`): segments go in as its steps.
        self._claw_r1 = False
        self.source = f"{socket.gethostname()}:{os.getpid()}"
        self._forward_counts: Counter[str] = Counter()

    def connect(self) -> None:
        """Join Ray and find (or create) the pool; blocking: called from a worker thread."""
        global joined_from_a_thread
        if self._pool is None:
            joined_from_a_thread = True
            init_ray(self._address, self._namespace)
            self._pool = pool_handle(self._pool_name, self._namespace)
            self._claw_r1 = speaks_claw_r1(self._pool)

    def outbox(self, limit: int = BATCH) -> list[tuple[int, dict[str, Any]]]:
        """The oldest committed segments not yet acknowledged: ``(seq, payload)``."""
        rows = self._db.execute(
            "SELECT seq, meta, token_ids, loss_mask, logprobs, versions FROM segments ORDER BY seq LIMIT ?", (limit,)
        ).fetchall()
        return [(r[0], {"meta": json.loads(r[1]), "arrays": [r[2], r[3], r[4], r[5]]}) for r in rows]

    def send(self, payloads: list[dict[str, Any]]) -> int:
        """Send to the pool and wait for its acknowledgement (blocking; outside the writer's limiter)."""
        self.connect()
        ray = _ray()
        if self._claw_r1:
            # Their pool is an async actor: calls may run out of order, so every step is in before any
            # completion is sent. It does not deduplicate: a send that timed out after it applied is applied again.
            calls = claw_r1_calls(payloads)
            for phase in ("submit_steps", "complete_trajectory"):
                refs = [getattr(self._pool, method).remote(**kwargs) for method, kwargs in calls if method == phase]
                ray.get(refs, timeout=SEND_TIMEOUT)
            return len(payloads)
        return int(ray.get(self._pool.put.remote(payloads, self.source), timeout=SEND_TIMEOUT))

    def acknowledged(self, seqs: list[int]) -> None:
        """The pool has these: drop them from the local file (one transaction)."""
        self._begin()
        try:
            rows = [self._db.execute("SELECT seq, session_id, tokens, bytes FROM segments WHERE seq = ?",
                                     (s,)).fetchone() for s in seqs]
            self._delete("segments", [r for r in rows if r is not None])
            self.commit()
        except BaseException:
            self.rollback()  # kept: sent again later (the pool deduplicates)
            raise
        self._forward_counts["segments_forwarded"] += len(seqs)

    def failed(self) -> None:
        self._forward_counts["send_failures"] += 1
        self._pool = None  # look the pool up again next time (it may have been restarted)

    def close(self) -> None:
        """Close the local file, then leave Ray (its core worker aborts the process at exit otherwise)."""
        super().close()
        self._pool = None
        ray = sys.modules.get("ray")  # joined only once a segment was sent
        if ray is not None and ray.is_initialized():
            ray.shutdown()

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "pool": self._pool_name, "namespace": self._namespace,
                **{k: self._forward_counts[k] for k in ("segments_forwarded", "send_failures")}}
