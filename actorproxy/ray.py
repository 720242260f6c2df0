"""The trainer's side of ``--store ray``: fetch complete prompt groups from the shared data pool.

::

    from actorproxy.ray import connect

    pool = connect("actorproxy-data-pool", namespace="actorproxy")
    while training:
        batch = pool.fetch_batch(groups=8, rollouts_per_group=4, timeout_s=60)
        for group in batch:          # oldest complete groups first (FIFO by instance_id)
            train_on(group.segments)  # each segment as /trajectory/read returns it
        print(pool.stats())

Every proxy started with ``--store ray --data-pool NAME`` sends its committed
segments to the pool of that name (a detached Ray actor, created by whoever
comes first). A rollout is complete once its session ended (finalize, idle
eviction, shutdown or crash recovery); a group is complete once it holds
``rollouts_per_group`` complete rollouts. Needs ``pip install 'actorproxy[ray]'``.
"""

from __future__ import annotations

from typing import Any

import attrs

from .store.ray_pool import (
    MAX_PENDING_GROUPS,
    SEND_TIMEOUT,
    Acknowledgement,
    DataPool,
    decode_payload,
    init_ray,
    pool_handle,
)

__all__ = ["Acknowledgement", "DataPool", "DataPoolClient", "LeasedBatch", "PromptGroup", "connect"]

#: ``DataPool`` is the pool's class, for a trainer that creates the pool itself (Claw-R1's does):
#: ``DataPool = ray.remote(actorproxy.ray.DataPool)``, then ``DataPool.options(name=...).remote(config, backend)``.


@attrs.frozen
class PromptGroup:
    """One prompt's rollouts: their segments, in arrival order per rollout."""

    instance_id: str
    #: The rollouts (session ids) taken, ``rollouts_per_group`` of them.
    rollouts: tuple[str, ...]
    #: Segments as ``/trajectory/read`` returns them (``token_ids``, ``loss_mask``, ``logprobs``, ...).
    segments: tuple[dict[str, Any], ...]


@attrs.frozen
class LeasedBatch:
    """A leased fetch (:meth:`DataPoolClient.fetch_leased`): acknowledge ``lease_id`` within ``seconds``."""

    lease_id: str
    seconds: float
    groups: list[PromptGroup]


def _groups(raw: list[dict[str, Any]]) -> list[PromptGroup]:
    return [PromptGroup(g["instance_id"], tuple(g["rollouts"]), tuple(decode_payload(s) for s in g["segments"]))
            for g in raw]


class DataPoolClient:
    """A handle on a named data pool."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def fetch_batch(self, groups: int, rollouts_per_group: int, timeout_s: float = 60.0) -> list[PromptGroup]:
        """Up to ``groups`` complete prompt groups, oldest first; waits up to ``timeout_s`` for them."""
        import ray

        # The pool answers within timeout_s; the margin covers a slow or restarting actor (then GetTimeoutError).
        raw = ray.get(self._handle.fetch_batch.remote(groups, rollouts_per_group, timeout_s),
                      timeout=timeout_s + SEND_TIMEOUT)
        return _groups(raw)

    def fetch_leased(self, groups: int, rollouts_per_group: int, timeout_s: float = 60.0, *,
                     lease: float = 300.0) -> LeasedBatch:
        """As :meth:`fetch_batch`, but the groups leave the pool only once :meth:`acknowledge` is called with the
        batch's ``lease_id``; if it is not within ``lease`` seconds (the trainer died, or this call timed out
        after the pool answered), they are handed out again, first."""
        import ray

        raw = ray.get(self._handle.fetch_batch.remote(groups, rollouts_per_group, timeout_s, lease=lease),
                      timeout=timeout_s + SEND_TIMEOUT)
        return LeasedBatch(raw["lease"]["id"], float(raw["lease"]["seconds"]), _groups(raw["groups"]))

    def acknowledge(self, lease_id: str, *, release: bool = False) -> Acknowledgement:
        """The leased batch was used: its groups are gone for good (``release``: given back, first in the queue).

        The answer's ``status`` says how the lease ended, true for ``deleted`` or ``released``. It is idempotent:
        one sent again (its ``ray.get`` timed out) answers as the first did (``repeated``); false if its lease
        ended first (``expired``: its groups were handed out again) or the pool does not know it (``unknown``)."""
        import ray

        answer: Acknowledgement = ray.get(self._handle.acknowledge.remote(lease_id, release), timeout=SEND_TIMEOUT)
        return answer

    def stats(self) -> dict[str, Any]:
        """Pending groups and segments, what was received, fetched, deduplicated and dropped, per source."""
        import ray

        return dict(ray.get(self._handle.stats.remote(), timeout=SEND_TIMEOUT))


def connect(
    name: str = "actorproxy-data-pool",
    namespace: str = "actorproxy",
    *,
    address: str | None = None,
    max_pending_groups: int = MAX_PENDING_GROUPS,
) -> DataPoolClient:
    """The pool ``name`` in ``namespace`` (created if no proxy made it yet); joins Ray if needed.

    ``max_pending_groups`` applies when this call creates the pool: past it the
    oldest group is dropped, logged and counted (``dropped_groups`` in ``stats()``).
    """
    init_ray(address, namespace)
    return DataPoolClient(pool_handle(name, namespace, max_pending_groups=max_pending_groups))
