"""A bounded memo in two generations: what was not used for a while is dropped, with no per-entry bookkeeping.

Lookups hit the young generation or promote from the old one; when the young one
weighs its bound it becomes the old one, and whatever the old one still held (not
used since) is dropped. :meth:`Generations.age` turns it over at once: called after a
drain, it drops what no lookup used between two of them. The message memo
(``protocols/memo.py``) and the fragment memo (``tokenization/prompt_cache.py``) keep
their entries this way; neither locks (a caller used from threads holds its own lock).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Generations(Generic[K, V]):
    """Key -> value, at most about twice ``max_bytes`` as ``weigh`` counts an entry (see the module)."""

    __slots__ = ("young", "old", "_weigh", "_max", "bytes")

    def __init__(self, weigh: Callable[[K, V], int], max_bytes: int) -> None:
        #: The entries used since the last turnover: read it directly for a hit (:meth:`promote` for a miss).
        self.young: dict[K, V] = {}
        #: The entries of the generation before, each moved to :attr:`young` when found again.
        self.old: dict[K, V] = {}
        self._weigh = weigh
        self._max = max_bytes
        #: What :attr:`young`'s entries weigh.
        self.bytes = 0

    def promote(self, key: K) -> V | None:
        """The old generation's entry for ``key``, moved to the young one; ``None`` if it has none."""
        value = self.old.pop(key, None) if self.old else None
        if value is not None:
            self._add(key, value)
        return value

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` for ``key`` in the young generation, unless it holds one already."""
        if key not in self.young:
            self._add(key, value)

    def age(self) -> None:
        """Drop what no lookup used since the last call (or turnover): the young generation becomes the old one."""
        self.old, self.young, self.bytes = self.young, {}, 0

    def _add(self, key: K, value: V) -> None:
        size = self._weigh(key, value)
        if self.bytes + size > self._max:
            self.old, self.young, self.bytes = self.young, {}, 0
        self.young[key] = value
        self.bytes += size

    def __len__(self) -> int:
        return len(self.young) + len(self.old)
