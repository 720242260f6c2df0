"""Kept byte strings found again by a longer string that starts with one (schema/prefixes.py)."""

from __future__ import annotations

from actorproxy.schema.prefixes import PER_KEY, Prefixes


def test_prefixes_find_the_kept_string_a_longer_one_starts_with() -> None:
    kept: Prefixes[str] = Prefixes(min_bytes=64, window=8, max_bytes=10_000)
    a = bytes(range(200))
    kept.keep(a + b"tail", len(a), "a")
    assert kept.find(a) is not None and kept.find(a + b"more" * 100).value == "a"  # type: ignore[union-attr]
    assert kept.find(a[:-1]) is None and kept.find(b"x" + a) is None
    changed = bytearray(a + b"more")
    changed[150] ^= 1
    assert kept.find(bytes(changed)) is None
    kept.keep(b"short", 5, "too short")
    assert len(kept) == 1


def test_prefixes_stay_within_their_bytes_and_their_bucket() -> None:
    kept: Prefixes[int] = Prefixes(min_bytes=64, window=8, max_bytes=100 * 200)
    for i in range(200):
        kept.keep(bytes(100) + i.to_bytes(4, "big"), 104, i)
    assert len(kept) <= PER_KEY  # all under one key (the same bytes before offset 64)
    kept = Prefixes(min_bytes=64, window=8, max_bytes=3 * 104)
    for i in range(10):
        kept.keep(i.to_bytes(1, "big") * 104, 104, i)
    assert len(kept) == 3 and kept.find(bytes([9]) * 200).value == 9  # type: ignore[union-attr]
    assert kept.find(bytes([0]) * 200) is None


def test_prefixes_age_drops_what_was_kept_before_the_previous_age() -> None:
    """After a drain of the whole store the bodies kept for sessions that left must go (as the message memo's
    entries do), not stay until the byte bound pushes them out."""
    kept: Prefixes[str] = Prefixes(min_bytes=64, window=8, max_bytes=1 << 20)
    gone, stays = bytes(range(100)), bytes(range(100, 200))
    kept.keep(gone, len(gone), "gone")
    kept.age()
    assert kept.find(gone) is not None  # kept since the age before: it lives one more
    kept.keep(stays, len(stays), "stays")
    kept.age()
    assert kept.find(gone) is None and len(kept) == 1
    assert kept.find(stays + b"more").value == "stays"  # type: ignore[union-attr]
    kept.age()
    assert len(kept) == 0
