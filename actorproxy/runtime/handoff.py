"""The trainer's hand-off by prompt group: GRPO-style trainers need all N rollouts of a prompt together.

Completed trajectories are announced with :meth:`GroupHandoff.complete`;
:meth:`GroupHandoff.wait_ready` waits until B prompt groups (by
``instance_id``) each hold N, and :meth:`GroupHandoff.peek` names the first B
complete ones, oldest first (by when their first trajectory completed; after
a timeout: those complete, saying the batch is not complete; a group that
never fills never holds back the complete ones behind it) without taking them:
the caller reads and serialises their segments first, and only then
:meth:`GroupHandoff.remove` s them (and deletes them from the store once the reply
was sent), so a reply that cannot be built loses nothing; one that is not
delivered puts them back (:meth:`GroupHandoff.restore`). A group that never fills is bounded by ``max_pending_groups``:
past it the oldest pending group is dropped, counted and logged, never silently.

All methods run on the Trio thread; state changes happen between awaits, so
concurrent callers never see half a change.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import attrs
import trio

log = logging.getLogger(__name__)


@attrs.frozen
class Completed:
    """One completed trajectory waiting in its group."""

    trajectory_id: str
    reward: float | None


@attrs.frozen
class Group:
    instance_id: str
    trajectories: tuple[Completed, ...]


@attrs.define
class GroupHandoff:
    """Completed trajectories grouped by prompt, waiting for the trainer."""

    max_pending_groups: int = 10_000
    _groups: OrderedDict[str, list[Completed]] = attrs.field(factory=OrderedDict, init=False)
    _changed: trio.Event = attrs.field(factory=trio.Event, init=False)
    _known: set[str] = attrs.field(factory=set, init=False)
    dropped_groups: int = attrs.field(default=0, init=False)
    dropped_trajectories: int = attrs.field(default=0, init=False)
    handed_over: int = attrs.field(default=0, init=False)

    def complete(self, trajectory_id: str, instance_id: str, reward: float | None) -> bool:
        """Announce a completed trajectory; False when it was already announced (each counts once)."""
        if trajectory_id in self._known:
            return False
        self._known.add(trajectory_id)
        self._groups.setdefault(instance_id, []).append(Completed(trajectory_id, reward))
        while len(self._groups) > self.max_pending_groups:
            oldest, waiting = self._groups.popitem(last=False)
            self.dropped_groups += 1
            self.dropped_trajectories += len(waiting)
            for item in waiting:
                self._known.discard(item.trajectory_id)
            log.warning(
                "prompt group %r dropped from the hand-off with %d trajectories: more than %d groups pending "
                "(--max-pending-groups); its segments stay readable with /trajectory/read",
                oldest,
                len(waiting),
                self.max_pending_groups,
            )
        self._changed.set()
        self._changed = trio.Event()
        return True

    def _ready(self, groups: int, per_group: int) -> tuple[list[str], bool]:
        """The first ``groups`` complete groups (oldest first), and whether there are that many.

        A group that is not complete (a rollout crashed) never holds back the complete ones behind it.
        """
        full = []
        for key, waiting in self._groups.items():
            if len(waiting) >= per_group:
                full.append(key)
                if len(full) == groups:
                    break
        return full, len(full) == groups

    async def wait_ready(self, groups: int, per_group: int) -> None:
        """Return once ``groups`` groups hold ``per_group`` each (bound it with a cancel scope)."""
        while not self._ready(groups, per_group)[1]:
            await self._changed.wait()

    def peek(self, groups: int, per_group: int) -> tuple[list[Group], bool]:
        """The first ``groups`` complete groups, left in place; whether there were that many.

        Each group holds exactly ``per_group`` trajectories, in completion order;
        extra ones stay for the next fetch.
        """
        ready, complete = self._ready(groups, per_group)
        return [Group(g, tuple(self._groups[g][:per_group])) for g in ready], complete

    def remove(self, taken: list[Group]) -> None:
        """Take groups named by :meth:`peek` out (once their reply is built): each trajectory is handed over once."""
        for group in taken:
            leaving = {item.trajectory_id for item in group.trajectories}
            rest = [item for item in self._groups.get(group.instance_id, ()) if item.trajectory_id not in leaving]
            if rest:
                self._groups[group.instance_id] = rest
            else:
                self._groups.pop(group.instance_id, None)
            self._known.difference_update(leaving)
            self.handed_over += len(leaving)

    def restore(self, taken: list[Group]) -> None:
        """Put groups :meth:`remove` took back, first in the queue (their reply was not delivered)."""
        for group in reversed(taken):
            back = [item for item in group.trajectories if item.trajectory_id not in self._known]
            self._groups[group.instance_id] = [*back, *self._groups.get(group.instance_id, ())]
            self._groups.move_to_end(group.instance_id, last=False)
            self._known.update(item.trajectory_id for item in back)
            self.handed_over -= len(back)
        self._changed.set()
        self._changed = trio.Event()

    def take(self, groups: int, per_group: int) -> tuple[list[Group], bool]:
        """:meth:`peek` and :meth:`remove` at once."""
        taken, complete = self.peek(groups, per_group)
        self.remove(taken)
        return taken, complete

    def statistics(self) -> dict[str, int]:
        return {
            "pending_groups": len(self._groups),
            "pending_trajectories": sum(len(v) for v in self._groups.values()),
            "handed_over_trajectories": self.handed_over,
            "dropped_groups": self.dropped_groups,
            "dropped_trajectories": self.dropped_trajectories,
            "max_pending_groups": self.max_pending_groups,
        }
