"""Byte strings kept with what was worked out from them, found again by a longer string that starts with one.

An agent's session sends its whole history every turn, and the proxy sends the engine its
whole prompt: each turn's bytes start with the previous turn's. What was worked out from
those bytes last turn (the JSON text of a prompt, the parsed messages of a body) then only
needs its new end worked out, once this turn's bytes are known to start with them — a
compare at memory speed instead of work at JSON speed over the whole history (issue 12).

Which kept string to try is found by content (no session is needed): a string of ``n``
bytes is filed under ``level = floor(log2 n)`` and its ``window`` bytes just before offset
``2**level``; a longer string that starts with it has those same bytes there, and a level
as high or higher, so :meth:`Prefixes.find` tries its own level, then the ones below. Every
candidate is compared byte for byte before it is used: strings that share their start
(sessions of one task) only cost a compare each.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

T = TypeVar("T")

#: Kept strings filed under one key (sessions that share their start); the oldest is dropped past this.
PER_KEY = 64


class Kept(Generic[T]):
    """One kept string (``length`` bytes of ``raw``, referenced, not copied) and its value."""

    __slots__ = ("prefix", "value", "key", "size", "serial")

    def __init__(self, prefix: memoryview, value: T, key: tuple[int, bytes], size: int, serial: int) -> None:
        self.prefix = prefix
        self.value = value
        self.key = key
        self.size = size
        #: The how-manyth string kept (the oldest kept have the lowest): :meth:`Prefixes.age` reads it.
        self.serial = serial

    def __len__(self) -> int:
        return len(self.prefix)


class Prefixes(Generic[T]):
    """Kept byte strings with a value each, at most ``max_bytes`` of them (the oldest dropped first).

    :meth:`age` drops the strings kept before its previous call (the young generation becomes the
    old one, as in ``MessageMemo.age``): a session that runs keeps its longer string every turn.
    """

    def __init__(self, *, min_bytes: int, window: int, max_bytes: int) -> None:
        assert window <= min_bytes
        self._min = min_bytes
        self._window = window
        self._max = max_bytes
        self._bytes = 0
        self._kept: OrderedDict[int, Kept[T]] = OrderedDict()  # by id(), oldest first
        self._index: dict[tuple[int, bytes], list[Kept[T]]] = {}
        self._serial = 0  # strings kept so far
        self._young_from = 0  # the serial of the first string kept since the last age

    def find(self, raw: bytes) -> Kept[T] | None:
        """A kept string ``raw`` starts with (the most recent filed under the longest level), or ``None``."""
        if len(raw) < self._min:
            return None
        level = len(raw).bit_length() - 1
        window, index = self._window, self._index
        while (1 << level) >= self._min:
            end = 1 << level
            for kept in reversed(index.get((level, raw[end - window : end]), ())):
                if raw.startswith(kept.prefix):
                    return kept
            level -= 1
        return None

    def keep(self, raw: bytes, length: int, value: T, size: int = 0) -> None:
        """Keep ``raw[:length]`` with ``value`` (``size``: bytes the value holds, counted with the string's).

        Too short a string (below ``min_bytes``) is not kept.
        """
        if length < self._min:
            return
        level = length.bit_length() - 1
        end = 1 << level
        key = (level, raw[end - self._window : end])
        kept = Kept(memoryview(raw)[:length], value, key, len(raw) + size, self._serial)
        self._serial += 1
        bucket = self._index.setdefault(key, [])
        if len(bucket) >= PER_KEY:
            self.drop(bucket[0])
        bucket.append(kept)
        self._kept[id(kept)] = kept
        self._bytes += kept.size
        while self._bytes > self._max:
            self.drop(next(iter(self._kept.values())))

    def drop(self, kept: Kept[T]) -> None:
        """Forget ``kept`` (a session that moved on: its longer string replaces it)."""
        if self._kept.pop(id(kept), None) is None:
            return
        bucket = self._index[kept.key]
        bucket.remove(kept)
        if not bucket:
            del self._index[kept.key]
        self._bytes -= kept.size

    def age(self) -> None:
        """Forget the strings kept before the previous call (none since is dropped: they are the old ones now)."""
        kept = self._kept
        while kept:
            oldest = next(iter(kept.values()))
            if oldest.serial >= self._young_from:
                break
            self.drop(oldest)
        self._young_from = self._serial

    def __len__(self) -> int:
        return len(self._kept)
