"""A keeper of holds settles each token once and remembers how: a settle that comes again answers as the first did.

A trainer whose acknowledgement's reply was lost (or timed out) sends it again; two acknowledgements may
race. The repeat must not be told "unknown" when the first deleted the data (it would think it lost, or
train on it twice when it comes again), and must learn that a lease that ended was given back. The keeper
here runs against a stand-in for the runtime's side of it: what it deletes and lets go of.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from trio.testing import MockClock, wait_all_tasks_blocked

from actorproxy.errors import StorageFull
from actorproxy.runtime.holds import Holds

READ: Any = (object(),)  # what a drain read (a store's Held), opaque to the keeper


class _Store:
    """The runtime's side a keeper calls: what it deleted and let go of; a delete may wait for ``gate``, or fail."""

    def __init__(self) -> None:
        self.deleted: list[Any] = []
        self.let_go_of: list[Any] = []
        self.gate: trio.Event | None = None
        self.fail: Exception | None = None

    async def drained(self, held: Any) -> None:
        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            await self.let_go(held)  # (what the store does when its delete fails)
            raise self.fail
        self.deleted.append(held)

    async def let_go(self, held: Any) -> None:
        self.let_go_of.append(held)


def _keeper(seconds: float = 60.0) -> tuple[Holds, _Store]:
    store = _Store()
    holds = Holds(store, limit=4, seconds=seconds, what="a leased drain")  # type: ignore[arg-type]
    return holds, store


def _held(holds: Holds) -> str:
    lease = holds.new_lease()
    holds.keep(lease, READ)
    return lease


async def test_an_acknowledgement_repeated_answers_as_the_first_and_deletes_once() -> None:
    holds, store = _keeper()
    lease = _held(holds)
    first = await holds.acknowledge(lease, True)
    assert first is not None and (first.status, first.repeated, first.unsettled) == ("deleted", False, ())
    again = await holds.acknowledge(lease, True)
    assert again is not None and (again.status, again.repeated) == ("deleted", True)
    released = await holds.acknowledge(lease, False)  # a release after the delete: the truth, not a change
    assert released is not None and (released.status, released.repeated) == ("deleted", True)
    assert store.deleted == [READ] and store.let_go_of == [] and len(holds) == 0


async def test_a_released_lease_stays_released() -> None:
    holds, store = _keeper()
    lease = _held(holds)
    first = await holds.acknowledge(lease, False)
    assert first is not None and first.status == "released"
    acked = await holds.acknowledge(lease, True)  # acknowledged after it was given back: deletes nothing
    assert acked is not None and (acked.status, acked.repeated) == ("released", True)
    assert store.deleted == [] and store.let_go_of == [READ]


async def test_an_acknowledgement_of_an_expired_lease_says_it_was_given_back(autojump_clock: MockClock) -> None:
    holds, store = _keeper(seconds=30)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(holds.run)
        lease = _held(holds)
        await trio.sleep(31)
        late = await holds.acknowledge(lease, True)
        assert late is not None and (late.status, late.repeated) == ("expired", True)
        assert store.deleted == [] and store.let_go_of == [READ] and holds.expired == 1
        nursery.cancel_scope.cancel()


async def test_an_acknowledgement_racing_a_delete_waits_for_it() -> None:
    """The second comes while the first's delete is under way: it is answered with the first's outcome."""
    holds, store = _keeper()
    lease = _held(holds)
    store.gate = trio.Event()
    answers: list[Any] = []

    async def acknowledge() -> None:
        answers.append(await holds.acknowledge(lease, True))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(acknowledge)
        await wait_all_tasks_blocked()
        nursery.start_soon(acknowledge)
        await wait_all_tasks_blocked()
        answered = list(answers)
        store.gate.set()  # (the delete is shielded: it ends only then)
    assert answered == []  # neither was answered before the delete was done
    assert [(a.status, a.repeated) for a in answers] == [("deleted", False), ("deleted", True)]
    assert store.deleted == [READ]


async def test_a_failed_delete_is_answered_again_and_its_data_was_let_go_of() -> None:
    holds, store = _keeper()
    lease = _held(holds)
    store.fail = StorageFull("disk I/O error")
    with pytest.raises(StorageFull):
        await holds.acknowledge(lease, True)
    again = await holds.acknowledge(lease, True)
    assert again is not None and (again.status, again.repeated) == ("failed", True)
    assert isinstance(again.error, StorageFull) and again.error.message == "disk I/O error"
    assert store.deleted == [] and store.let_go_of == [READ]


async def test_the_keeper_remembers_a_bounded_number_of_settled_leases() -> None:
    holds, _ = _keeper()
    holds.remember = 2
    leases = [_held(holds) for _ in range(3)]
    for lease in leases:
        await holds.acknowledge(lease, True)
    assert await holds.acknowledge(leases[0], True) is None  # the oldest is forgotten
    assert [getattr(await holds.acknowledge(lease, True), "status", None) for lease in leases[1:]] == [
        "deleted", "deleted"]
    assert await holds.acknowledge("never-made", True) is None


async def test_a_failed_delete_is_remembered_without_its_traceback() -> None:
    """What it read lives in the frames of the failed delete's traceback: the keeper keeps the error alone."""
    holds, store = _keeper()
    lease = _held(holds)
    store.fail = StorageFull("disk I/O error")
    with pytest.raises(StorageFull) as raised:
        await holds.acknowledge(lease, True)
    again = await holds.acknowledge(lease, True)
    assert again is not None and again.error is not raised.value and again.error.__traceback__ is None
