"""The session registry actor: finds or spawns the session actor for a session id.

It owns the nursery the session actors live in and the map from session id to
mailbox. A retiring session tells the registry first (``SessionRetired``); a
sender that still holds the old mailbox finds it closed and asks again, and
gets a fresh actor that continues the step and segment numbering.

Room is made per client (``Identity.client``: an agent's session key, else its
remote address; ``None``, the trainer or an embedding program, is one client
too). At ``max_sessions`` a new session takes the least recently used idle
session of its own client, or of a client holding more live sessions than it
does, never a session of a client holding as many or fewer: one client opening
session after session evicts its own, not an idle agent's conversation. With
``max_sessions_per_client`` a client at that bound makes room among its own
sessions only. A client that cannot make room is refused with 429
(:class:`~actorproxy.errors.TooManySessions`); when every session is busy, 503.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import attrs
import trio

from ..errors import Overloaded, ShuttingDown, TooManySessions
from .actor import ActorGone, answer, answer_error, ask
from .messages import (
    Census,
    CloseAll,
    Evict,
    FinalizeSession,
    ListLive,
    Lookup,
    RegistryMessage,
    SessionCounters,
    SessionMessage,
    SessionRetired,
)
from .retired import RetiredCounters
from .session import SESSION_MAILBOX, SessionActor

log = logging.getLogger(__name__)

#: How many retired sessions' counters are remembered at most (so a returning session keeps numbering): the
#: last half of this many always, in two generations (:class:`~actorproxy.runtime.retired.RetiredCounters`).
_RETIRED_MEMORY = 100_000
#: A retired session's counters as one int: ``next_step << _STEP_SHIFT | next_segment``.
_STEP_SHIFT = 32


@attrs.frozen
class _Live:
    mailbox: trio.MemorySendChannel[SessionMessage]
    token: object
    #: The client that opened it (its share of the sessions is counted by this).
    client: str | None = None


SessionFactory = Callable[[str, SessionCounters], SessionActor]


class SessionRegistry:
    """Maps session ids to live session actors; spawns and forgets them."""

    def __init__(
        self,
        factory: SessionFactory,
        *,
        max_sessions: int,
        known: dict[str, SessionCounters] | None = None,
        max_sessions_per_client: int | None = None,
    ) -> None:
        self._factory = factory
        self._max_sessions = max_sessions
        self._per_client = max_sessions_per_client
        #: Live sessions per client, those asked to retire (``_evicting``) left out: their slots count as free.
        self._held: Counter[str | None] = Counter()
        #: Live sessions, least recently looked up first.
        self._live: OrderedDict[str, _Live] = OrderedDict()
        #: Sessions asked to retire to make room (``Evict``) that have not retired yet.
        self._evicting: set[str] = set()
        #: Retired sessions' counters (one int each, :func:`_packed`), off the small-object heap: a returning
        #: session continues its numbering. ``known``: sessions the store holds (or recovered after a crash) too.
        self._retired = RetiredCounters(_RETIRED_MEMORY)
        self._know(known or {})
        self._closing = False
        self._spawned = 0
        self._evicted = 0
        self._made_room = 0
        self._failed = 0
        self._refused = 0
        #: The nursery the session actors run in, while the registry runs.
        self._sessions: trio.Nursery | None = None

    async def run(
        self, *, task_status: trio.TaskStatus[trio.MemorySendChannel[RegistryMessage]] = trio.TASK_STATUS_IGNORED
    ) -> None:
        send, inbox = trio.open_memory_channel[RegistryMessage](64)
        async with trio.open_nursery() as sessions, inbox:
            self._sessions = sessions
            task_status.started(send)
            async for msg in inbox:
                match msg:
                    case Lookup():
                        self._lookup(msg)
                    case SessionRetired():
                        self._retire(msg)
                    case Census():
                        answer(msg.reply, self.census())
                    case ListLive():
                        ids = list(reversed(self._live))  # least recently used first
                        answer(msg.reply, (len(ids), ids[msg.offset : msg.offset + msg.limit]))
                    case CloseAll():
                        sessions.start_soon(self._close_all, msg, dict(self._live))
            self._sessions = None
            sessions.cancel_scope.cancel()

    def census(self) -> dict[str, Any]:
        return {
            "active_sessions": len(self._live),
            "max_sessions": self._max_sessions,
            "sessions_started": self._spawned,
            "sessions_evicted": self._evicted,
            "sessions_evicted_for_room": self._made_room,
            "sessions_failed": self._failed,
            "sessions_refused_to_clients": self._refused,
        }

    def mailbox_for_turn(
        self, session_id: str, client: str | None = None
    ) -> trio.MemorySendChannel[SessionMessage] | None:
        """The mailbox of ``session_id``'s actor, spawned if none is live, without a message round trip.

        For the turn path (``None`` while the registry does not run: then ask it). It
        runs on the Trio thread and never awaits, so it sees the registry between two of
        its messages, as a ``Lookup`` would; a session with no live entry has no
        retirement queued here either (an actor leaves ``_live`` only when its
        ``SessionRetired`` is handled), so its counters are final. Through the mailbox,
        under load a new session waited a scheduler round per queued message: at c = 256
        with a new session every ten turns, 1.7 s for the lookup of every session's
        first turn while later turns took 77 ms. Raises ``Overloaded`` or
        ``ShuttingDown`` as a ``Lookup`` answers them.
        """
        if self._sessions is None:
            return None
        live = self._live.get(session_id)
        if live is not None:
            self._live.move_to_end(session_id)
            return live.mailbox
        return self._spawn(session_id, self._sessions, client)

    def _lookup(self, msg: Lookup) -> None:
        live = self._live.get(msg.session_id)
        if live is not None:
            self._live.move_to_end(msg.session_id)
            answer(msg.reply, live.mailbox)
            return
        if not msg.create or self._sessions is None:  # (it is set while the registry runs)
            answer(msg.reply, None)
            return
        try:
            answer(msg.reply, self._spawn(msg.session_id, self._sessions, msg.client))
        except Overloaded as exc:
            answer_error(msg.reply, exc)

    def _spawn(
        self, session_id: str, sessions: trio.Nursery, client: str | None
    ) -> trio.MemorySendChannel[SessionMessage]:
        if self._closing:
            raise ShuttingDown("the proxy is shutting down")
        held = self._held[client]
        if client is not None and self._per_client is not None and held >= self._per_client:
            if not self._make_room(client, own_only=True):
                self._refused += 1
                raise TooManySessions(
                    f"this client ({_shown(client)}) holds {held} live sessions, every one busy "
                    "(--max-sessions-per-client); finalize one or wait for one to finish"
                )
        elif len(self._live) - len(self._evicting) >= self._max_sessions and not self._make_room(client):
            if self._any_idle():  # idle sessions, but of clients holding no more than this one
                self._refused += 1
                raise TooManySessions(
                    f"{len(self._live)} sessions are live (--max-sessions) and this client ({_shown(client)}) "
                    f"holds {held} of them, none idle; another client's session is not evicted for it: finalize "
                    "one of yours, or retry later"
                )
            raise Overloaded(f"{len(self._live)} sessions are live and busy (--max-sessions); retry later")
        actor = self._factory(session_id, self._counters(session_id))
        # The mailbox is made here and the actor started without waiting for it to run:
        # waiting (``nursery.start``) cost a scheduler round per new session.
        mailbox: trio.MemorySendChannel[SessionMessage]
        inbox: trio.MemoryReceiveChannel[SessionMessage]
        mailbox, inbox = trio.open_memory_channel(SESSION_MAILBOX)  # (not the subscripted call: see start_turn)
        sessions.start_soon(self._supervise, actor, inbox)
        self._live[session_id] = _Live(mailbox, actor.token, client)
        self._held[client] += 1
        self._spawned += 1
        return mailbox

    def _make_room(self, client: str | None, *, own_only: bool = False) -> bool:
        """Ask the least recently used idle session ``client`` may take to retire into the store.

        ``client`` may take its own sessions and (unless ``own_only``) those of a
        client holding more live sessions than it does; ``False`` if none of these
        is idle. A session is idle when its actor waits on an empty mailbox (no
        turn running or queued). Its slot counts as free at once; the actor
        flushes its segment and steps to the store and retires (``capacity_evicted``).
        """
        held = self._held[client]
        for session_id, live in self._live.items():
            if session_id in self._evicting or not _idle(live):
                continue
            if live.client != client and (own_only or self._held[live.client] <= held):
                continue  # another client's, which holds no more sessions than this one
            try:
                live.mailbox.send_nowait(Evict())
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                continue
            self._evicting.add(session_id)
            self._release(live.client)
            self._made_room += 1
            return True
        return False

    def _release(self, client: str | None) -> None:
        """One session fewer for ``client`` (a client holding none is forgotten: the map stays bounded)."""
        self._held[client] -= 1
        if self._held[client] <= 0:
            del self._held[client]

    def _any_idle(self) -> bool:
        return any(_idle(live) for session_id, live in self._live.items() if session_id not in self._evicting)

    async def _supervise(self, actor: SessionActor, inbox: trio.MemoryReceiveChannel[SessionMessage]) -> None:
        """Run a session actor; whatever escapes it ends that session alone, never the registry."""
        try:
            await actor.run(inbox)  # it closes the inbox however it ends
        except Exception:
            log.exception("session %s crashed; it is dropped (the other sessions keep running)", actor.session_id)
            counters = SessionCounters(actor.state.next_step, actor.state.next_segment)
            self._retire(SessionRetired(actor.session_id, actor.token, counters, failed=True))

    def _retire(self, msg: SessionRetired) -> None:
        if msg.failed:
            self._failed += 1
        live = self._live.get(msg.session_id)
        if live is not None and live.token is msg.token:
            del self._live[msg.session_id]
            if msg.session_id not in self._evicting:  # (an evicted one's share was given back when asked)
                self._release(live.client)
            self._evicted += 1
        self._evicting.discard(msg.session_id)
        self._retired.remember(msg.session_id, _packed(msg.counters))

    def _know(self, known: dict[str, SessionCounters]) -> None:
        """Take the counters of the sessions the store holds at start (oldest first), as retired ones.

        The newest :data:`_RETIRED_MEMORY` of them at most, in the two generations (the newest half
        the young one): the memory is bounded from the start, not from the first retirement on.
        """
        items = list(known.items())
        if len(items) > _RETIRED_MEMORY:
            log.warning("the store holds %d sessions; the step and segment numbering of the oldest %d is not "
                        "kept (the last %d are): such a session, if it comes back, starts again at step 0",
                        len(items), len(items) - _RETIRED_MEMORY, _RETIRED_MEMORY)
            items = items[-_RETIRED_MEMORY:]
        self._retired.load([(sid, _packed(counters)) for sid, counters in items])

    def _counters(self, session_id: str) -> SessionCounters:
        """The counters ``session_id`` retired with (forgotten once taken), or zeros for one never seen."""
        packed = self._retired.take(session_id)
        return SessionCounters(packed >> _STEP_SHIFT, packed & ((1 << _STEP_SHIFT) - 1))

    async def _close_all(self, msg: CloseAll, live: dict[str, _Live]) -> None:
        self._closing = True
        async with trio.open_nursery() as nursery:
            for entry in live.values():
                nursery.start_soon(_finalize_quietly, entry.mailbox, msg.reason)
        answer(msg.reply, len(live))


def _packed(counters: SessionCounters) -> int:
    """Counters as one int (a session's segments are fewer than 2**32: each starts with a step)."""
    return counters.next_step << _STEP_SHIFT | counters.next_segment


def _idle(live: _Live) -> bool:
    """Whether the session's actor waits on an empty mailbox (no turn running or queued)."""
    stats = live.mailbox.statistics()
    return not stats.current_buffer_used and bool(stats.tasks_waiting_receive)


def _shown(client: str | None) -> str:
    """A client as an error names it (a session key's session, or an address; never a key)."""
    return "the trainer" if client is None else client


async def _finalize_quietly(mailbox: trio.MemorySendChannel[SessionMessage], reason: str) -> None:
    try:
        await ask(mailbox, lambda reply: FinalizeSession(reward=None, reason=reason, reply=reply))
    except ActorGone:
        pass
