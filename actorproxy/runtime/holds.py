"""What drains read, held (no other drain reads it, nothing deleted) under a token until they are settled.

Two callers hold a drain's read until someone else says whether it arrived:

- a trainer's leased drain (``"lease": seconds`` in ``POST /trajectory/read``): what it read
  waits for the trainer's own ``POST /trajectory/ack`` (delete it, or give it back) once the
  trainer has it safe, so nothing the trainer's process lost (a crash, a read it never made) is
  deleted; the keeper is the runtime's :attr:`Runtime.leases <actorproxy.runtime.runtime.Runtime>`;
- a worker's part of a drain across workers (``workers/holds.py``), settled by the fanning worker
  once the merged reply reached the trainer; for a leased one, the fanning worker's leases keep
  the drain (``elsewhere``: settling every worker's part) until the trainer's acknowledgement.

A hold is reserved before its read (:meth:`Holds.reserve`: bounded, at most ``limit`` at a time),
kept once the read's reply was sent but for its last bytes (:meth:`Holds.keep`), and settled
(:meth:`Holds.settle`); one that no settle came for within its seconds is let go of (for the next
drain) by :meth:`Holds.run`, counted in :attr:`Holds.expired`: held data is never held for good.

A settle is idempotent: the keeper remembers how each of its last ``REMEMBERED`` settled tokens ended
(:class:`Settled`: deleted, released, expired, or its delete failed; oldest forgotten first), so an
acknowledgement that comes again (its first's reply was lost, or two raced) is answered as the first
was, once the first's settle is over (:meth:`Holds.acknowledge`); only a token never made here, or
forgotten, is unknown.
"""

from __future__ import annotations

import copy
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import attrs
import trio

from ..errors import ProxyError, TooManyLeases
from ..schema import jsonio
from ..store.base import REMEMBERED, Held

if TYPE_CHECKING:
    from .runtime import Runtime

log = logging.getLogger(__name__)

#: A hold whose data other processes hold (a leased drain across workers): it settles them, delivered or not,
#: and returns those that did not confirm their delete.
Elsewhere = Callable[[bool], Awaitable[list[int]]]


def lease_lead(lease: str, seconds: float) -> bytes:
    """The JSON member a leased drain's reply begins with (``"lease": {"id", "seconds"}``, then a comma)."""
    return b'"lease":' + jsonio.dumps({"id": lease, "seconds": seconds}) + b","


@attrs.frozen
class Settled:
    """How a settled hold ended, as its keeper remembers it (:meth:`Holds.acknowledge`)."""

    #: ``deleted`` (settled delivered), ``released`` (settled not delivered: let go of), ``expired`` (no settle
    #: came within its seconds: let go of) or ``failed`` (its delete failed: the store let go of it).
    status: str
    #: When it was settled (wall clock, seconds since the epoch).
    at: float
    #: A leased drain across workers: the workers that did not confirm their delete (their part comes again).
    unsettled: tuple[int, ...] = ()
    #: ``failed``: the store's error (``None``: it was not one the proxy names).
    error: ProxyError | None = None
    #: Answered to a settle that came after the one that settled it (or while that one was under way).
    repeated: bool = False


@attrs.define(eq=False)
class _Settling:
    """A settle under way: another settle of its token waits for its outcome."""

    done: trio.Event = attrs.Factory(trio.Event)
    outcome: Settled | None = None


@attrs.define(eq=False)
class _Hold:
    held: tuple[Held, ...] | None = None  # None: its read is under way
    deadline: float = 0.0
    #: Called when what it holds is let go of (released, or its time ran out), not when it is deleted.
    let_go: Callable[[], None] | None = None
    elsewhere: Elsewhere | None = None


class Holds:
    """The holds of one keeper, by token (see the module doc); :meth:`run` lets the expired ones go.

    ``what``: how the log names them when one expires (``"a leased drain"``).
    """

    def __init__(self, runtime: Runtime, *, limit: int, seconds: float, what: str) -> None:
        self.runtime, self.limit, self.seconds, self.what = runtime, limit, seconds, what
        #: What every token :meth:`token` makes begins with: a worker of ``--workers N`` names itself there
        #: (``w<i>.``), so that an acknowledgement reaching another worker finds the one that holds its lease.
        self.prefix = ""
        self._holds: dict[str, _Hold] = {}
        self._kept = trio.Event()
        #: Settles under way, and how the last ``remember`` settled tokens ended (oldest first).
        self._settling: dict[str, _Settling] = {}
        self._settled: OrderedDict[str, Settled] = OrderedDict()
        #: How many settled tokens are remembered, at most.
        self.remember = REMEMBERED
        #: Holds let go of because no settle came in time.
        self.expired = 0

    def __len__(self) -> int:
        return len(self._holds)

    def token(self) -> str:
        """A new token, unguessable, beginning with :attr:`prefix`."""
        return self.prefix + secrets.token_urlsafe(18)

    def reserve(self, token: str) -> bool:
        """Room for a read that holds under ``token`` (False: the token is taken, or ``limit`` holds are)."""
        if token in self._holds or len(self._holds) >= self.limit:
            return False
        self._holds[token] = _Hold()
        return True

    def new_lease(self) -> str:
        """A fresh token, reserved for a trainer's leased drain; :class:`TooManyLeases` (429) at ``limit``."""
        token = self.token()
        if not self.reserve(token):
            raise TooManyLeases(f"{len(self)} leased drains are not acknowledged yet (at most {self.limit}): "
                                "acknowledge or release them (POST /trajectory/ack)", param="lease")
        return token

    def sending(self, token: str) -> bool:
        """Whether ``token``'s read is reserved and its reply still on its way (nothing kept yet)."""
        hold = self._holds.get(token)
        return hold is not None and hold.held is None

    def keep(self, token: str, held: tuple[Held, ...], seconds: float | None = None,
             let_go: Callable[[], None] | None = None, *, elsewhere: Elsewhere | None = None) -> None:
        """The read's reply was sent but for its last bytes: what it read waits, held, for its settle (at most
        ``seconds``, by default the keeper's). ``let_go`` is called if it is let go of instead of deleted (a
        batch's groups put back in the hand-off queue); ``elsewhere``: what it read is held by other processes,
        which that settles (``held`` is empty then)."""
        deadline = trio.current_time() + (self.seconds if seconds is None else seconds)
        self._holds[token] = _Hold(held, deadline, let_go, elsewhere)
        self._kept.set()

    def drop(self, token: str) -> None:
        """Forget ``token``'s hold, settling nothing (its reply was given up, and lets go of what it read)."""
        self._holds.pop(token, None)

    def unreserve(self, token: str, answered: bool) -> None:
        """The read under ``token`` ended without keeping anything: ``answered`` (its answer went out whole: it
        held nothing, a read that drains nothing), an empty hold waits for its settle; else its room is free."""
        hold = self._holds.get(token)
        if hold is not None and hold.held is None:
            if answered:
                self.keep(token, ())
            else:
                del self._holds[token]

    async def settle(self, token: str, delivered: bool) -> int | None:
        """Delete what ``token`` holds (``delivered``) or let it go; ``None`` if it holds nothing (settled already,
        expired, unknown, or its read is still under way).

        Returns how many reads it held. A delete that fails raises the store's error: what it read was let go
        of (the store's ``Settle``), for the next drain."""
        hold = self._take(token)
        if hold is None:
            return None
        await self._settle_as(token, hold, delivered)
        return len(hold.held or ())

    async def acknowledge(self, token: str, delivered: bool) -> Settled | None:
        """A lease's :meth:`settle`, idempotent: how it ended (``unsettled``: for a leased drain across workers, the
        workers that did not confirm their delete).

        A token settled already answers how it ended then (``repeated``), whatever this one asks: a settle still
        under way is waited for. ``None``: a token never made here, forgotten (see :attr:`remember`), or whose
        read is under way. A delete that fails raises the store's error, and a repeat answers it again
        (``failed``)."""
        hold = self._take(token)
        if hold is not None:
            return await self._settle_as(token, hold, delivered)
        settling = self._settling.get(token)
        if settling is not None:
            await settling.done.wait()
            ended = settling.outcome
        else:
            ended = self._settled.get(token)
        return None if ended is None else attrs.evolve(ended, repeated=True)

    def _take(self, token: str) -> _Hold | None:
        hold = self._holds.get(token)
        if hold is None or hold.held is None:
            return None
        del self._holds[token]
        return hold

    async def _settle_as(self, token: str, hold: _Hold, delivered: bool, status: str | None = None) -> Settled:
        """:meth:`_settle` ``hold`` (taken out under ``token``), and remember how it ended (``status``, or
        ``deleted`` / ``released`` by ``delivered``); a settle of ``token`` meanwhile waits for it."""
        settling = self._settling[token] = _Settling()
        outcome = Settled("failed", time.time())
        try:
            unsettled = await self._settle(hold, delivered)
            outcome = Settled(status or ("deleted" if delivered else "released"), time.time(), tuple(unsettled))
        except Exception as exc:  # (a copy kept: no traceback, whose frames would hold what it read)
            outcome = Settled("failed", time.time(), error=copy.copy(exc) if isinstance(exc, ProxyError) else None)
            raise
        finally:
            del self._settling[token]
            self._settled[token] = settling.outcome = outcome
            while len(self._settled) > self.remember:
                self._settled.popitem(last=False)
            settling.done.set()
        return outcome

    async def _settle(self, hold: _Hold, delivered: bool) -> list[int]:
        """Settle ``hold`` (taken out already); the workers that did not confirm their delete (``elsewhere``)."""
        if hold.elsewhere is not None:
            return await hold.elsewhere(delivered)
        if not delivered:
            await self._let_go(hold)
        elif hold.held:
            with trio.CancelScope(shield=True):  # (a settle is answered once deleted, never left half done)
                try:
                    await self.runtime.drained(hold.held)
                except BaseException:  # (let go of by the store: so is what waits with it)
                    if hold.let_go is not None:
                        hold.let_go()
                    raise
        return []

    async def _let_go(self, hold: _Hold) -> None:
        assert hold.held is not None
        if hold.let_go is not None:
            hold.let_go()
        await self.runtime.let_go(hold.held)

    async def run(self) -> None:
        """Let go of each kept hold whose settle did not come within its seconds."""
        while True:
            deadlines = [h.deadline for h in self._holds.values() if h.held is not None]
            with trio.move_on_at(min(deadlines, default=float("inf"))):
                await self._kept.wait()
                self._kept = trio.Event()
                continue
            now = trio.current_time()
            for token, hold in list(self._holds.items()):
                if hold.held is not None and hold.deadline <= now:
                    del self._holds[token]
                    self.expired += 1
                    log.warning("%s was not settled in time: what it read is let go of, for the next drain",
                                self.what)
                    await self._settle_as(token, hold, False, "expired")
