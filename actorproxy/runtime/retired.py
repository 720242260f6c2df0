"""Retired sessions' counters kept off Python's small-object heap (issue 33).

The registry remembers, for each session that retired, the step and segment
numbers it would continue with (one int, ``next_step << 32 | next_segment``), so
that a session coming back continues its numbering: up to ``bound`` sessions, the
newest. Kept in dicts, each cost an id string and an int on the small-object heap,
allocated between a turn's short-lived objects; each kept pins its pool and its
arena after a drain frees what was around it (``sys.getallocatedblocks()`` grew by
two a retirement in ``benchmarks/memory_drains.py``).

Here a session is known by a 128-bit hash of its id and kept in a fixed table of
64-bit cells (open addressing, linear probing, an entry taken moves the entries
after it back: no tombstones), in anonymous memory mapped for it: nothing per
session on the heap, and the pages of a table forgotten go back to the system.
Two generations bound it as the dicts did: when the young table holds half the
bound it becomes the old one and the old one is forgotten; the newest half of the
bound is always kept. The cost is fixed: at the registry's bound of 100,000, a
table is 131,072 cells of 24 bytes, 3 MiB, resident as its pages are written (all
of them once a few thousand sessions have retired; 6 MiB with the old table),
where the dicts held ~13 MB on the heap at the bound (ids of 13 characters) and less below it.
"""

from __future__ import annotations

import hashlib
import mmap
import struct

#: A cell's three 64-bit words: the key's low and high halves, the value.
_WORDS = 3
_KEY = struct.Struct("<QQ")


def _key(session_id: str) -> tuple[int, int]:
    """The id's 128-bit BLAKE2b digest as two words, the low one odd (an empty cell's is 0).

    127 bits compared: with 100,000 sessions kept, an id never seen matches one of them with odds
    below 100,000 / 2**127, about 1 in 10**33 a lookup (it would take that session's counters).
    """
    digest = hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()
    low, high = _KEY.unpack(digest)
    return low | 1, high


class _Table:
    """A fixed open-addressing table, 64-bit keys' halves to 64-bit values, in a mapping of its own."""

    def __init__(self, slots: int) -> None:
        # Zeros, touched only where written; private: a forked process writes its own copy.
        self._map = mmap.mmap(-1, slots * _WORDS * 8, flags=mmap.MAP_PRIVATE)
        self._cells = memoryview(self._map).cast("Q")
        self._mask = slots - 1
        self.count = 0

    def _slot(self, low: int, high: int) -> int:
        """The first word of the key's cell, or of the empty cell that ends its probe chain."""
        cells, mask = self._cells, self._mask
        i = high & mask
        while True:
            at = i * _WORDS
            held = cells[at]
            if held == 0 or (held == low and cells[at + 1] == high):
                return at
            i = (i + 1) & mask

    def put(self, low: int, high: int, value: int) -> None:
        at = self._slot(low, high)
        cells = self._cells
        if cells[at] == 0:
            cells[at] = low
            cells[at + 1] = high
            self.count += 1
        cells[at + 2] = value

    def take(self, low: int, high: int) -> int | None:
        """The key's value, forgotten; ``None`` if it is not here."""
        at = self._slot(low, high)
        cells, mask = self._cells, self._mask
        if cells[at] == 0:
            return None
        value = cells[at + 2]
        self.count -= 1
        # Close the hole: an entry further on moves back into it unless its home lies between the hole and it.
        hole = at // _WORDS
        i = hole
        while True:
            i = (i + 1) & mask
            at = i * _WORDS
            if cells[at] == 0:
                break
            if (i - (cells[at + 1] & mask)) & mask >= (i - hole) & mask:
                to = hole * _WORDS
                cells[to : to + _WORDS] = cells[at : at + _WORDS]
                hole = i
        to = hole * _WORDS
        cells[to] = cells[to + 1] = cells[to + 2] = 0
        return value

    def close(self) -> None:
        self._cells.release()
        self._map.close()


class RetiredCounters:
    """Session id -> a retired session's packed counters: the newest ``bound`` at most, each taken once."""

    def __init__(self, bound: int) -> None:
        self._half = max(1, bound // 2)
        #: Cells a table has: a power of two over twice the entries it holds (probe chains stay short).
        self._slots = 1 << (2 * self._half).bit_length()
        self._young = _Table(self._slots)
        self._old = _Table(self._slots)
        self._bound = bound

    def remember(self, session_id: str, packed: int) -> None:
        """Keep ``packed`` for ``session_id`` (a 64-bit int); a full young table turns over first."""
        if self._young.count >= self._half:
            self._old.close()
            self._old, self._young = self._young, _Table(self._slots)
        low, high = _key(session_id)
        self._old.take(low, high)
        self._young.put(low, high, packed)

    def take(self, session_id: str) -> int:
        """What ``session_id`` retired with, forgotten; 0 for a session not kept."""
        low, high = _key(session_id)
        found = self._young.take(low, high)
        if found is None:
            found = self._old.take(low, high)
        return found or 0

    def load(self, items: list[tuple[str, int]]) -> None:
        """Start from ``items`` (oldest first, distinct ids, at most ``bound``: the caller keeps the newest):
        the newest half of the bound in the young table, the rest in the old one."""
        split = max(0, len(items) - self._bound // 2)
        for i, (session_id, packed) in enumerate(items):
            (self._old if i < split else self._young).put(*_key(session_id), packed)

    def __len__(self) -> int:
        return self._young.count + self._old.count
