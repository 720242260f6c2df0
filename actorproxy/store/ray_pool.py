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
import json
import logging
import os
import socket
import sys
import time
from collections import Counter, OrderedDict
from typing import Any

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


def pool_handle(name: str, namespace: str, *, max_pending_groups: int = MAX_PENDING_GROUPS) -> Any:
    """The named pool actor, created (detached, no CPU reserved) if it does not exist yet."""
    ray = _ray()
    remote = ray.remote(num_cpus=0, max_concurrency=64)(DataPool)
    return remote.options(name=name, namespace=namespace, lifetime="detached", get_if_exists=True).remote(
        max_pending_groups
    )


class DataPool:
    """The pool's state: segments by prompt group, FIFO; runs as a Ray actor (asyncio)."""

    def __init__(self, max_pending_groups: int = MAX_PENDING_GROUPS) -> None:
        self._max_groups = max_pending_groups
        #: group key -> rollout (session) -> its segments, in arrival order.
        self._groups: OrderedDict[str, dict[str, list[dict[str, Any]]]] = OrderedDict()
        #: Rollouts whose last segment arrived.
        self._done: set[str] = set()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._counts: Counter[str] = Counter()
        self._sources: Counter[str] = Counter()
        self._changed: asyncio.Event | None = None

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
                self._done.add(rollout)
            new += 1
        self._counts["segments_received"] += new
        self._sources[source] += new
        while len(self._groups) > self._max_groups:
            key, dropped = self._groups.popitem(last=False)
            count = sum(len(s) for s in dropped.values())
            self._counts["dropped_groups"] += 1
            self._counts["dropped_segments"] += count
            self._done.difference_update(dropped)
            logging.getLogger(__name__).warning(
                "data pool full (%d groups): dropped the oldest group %r (%d segments); fetch faster or raise "
                "max_pending_groups", self._max_groups, key, count)
        self._event().set()
        return new

    def _complete(self, rollouts_per_group: int) -> list[str]:
        return [key for key, rollouts in self._groups.items()
                if sum(r in self._done for r in rollouts) >= rollouts_per_group]

    async def fetch_batch(self, groups: int, rollouts_per_group: int, timeout_s: float) -> list[dict[str, Any]]:
        """The oldest ``groups`` complete prompt groups (``rollouts_per_group`` finished rollouts each).

        Waits up to ``timeout_s`` for enough of them; then returns what is complete (maybe fewer).
        """
        deadline = time.monotonic() + timeout_s
        while len(self._complete(rollouts_per_group)) < groups:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            event = self._event()
            event.clear()
            try:
                await asyncio.wait_for(event.wait(), left)
            except TimeoutError:
                break
        out: list[dict[str, Any]] = []
        for key in self._complete(rollouts_per_group)[:groups]:
            rollouts = self._groups[key]
            taken = [r for r in rollouts if r in self._done][:rollouts_per_group]
            segments = [seg for r in taken for seg in rollouts.pop(r)]
            self._done.difference_update(taken)
            if not rollouts:
                del self._groups[key]
            out.append({"instance_id": key, "rollouts": taken, "segments": segments})
            self._counts["groups_fetched"] += 1
            self._counts["segments_fetched"] += len(segments)
        return out

    def stats(self) -> dict[str, Any]:
        return {
            "pending_groups": len(self._groups),
            "pending_segments": sum(len(s) for g in self._groups.values() for s in g.values()),
            "complete_rollouts": len(self._done),
            "max_pending_groups": self._max_groups,
            "sources": dict(self._sources),
            **{k: self._counts[k] for k in ("segments_received", "duplicates", "groups_fetched",
                                            "segments_fetched", "dropped_groups", "dropped_segments")},
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
        self.source = f"{socket.gethostname()}:{os.getpid()}"
        self._forward_counts: Counter[str] = Counter()

    def connect(self) -> None:
        """Join Ray and find (or create) the pool; blocking: called from a worker thread."""
        global joined_from_a_thread
        if self._pool is None:
            joined_from_a_thread = True
            init_ray(self._address, self._namespace)
            self._pool = pool_handle(self._pool_name, self._namespace)

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
