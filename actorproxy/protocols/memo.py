"""The one memo every agent body's fast path reads its history through (chat, Anthropic, Responses; issue 12).

An agent sends its whole conversation every turn: at turn 200 of a tool-calling
session that is 400 messages of a few hundred KB, of which two are new. So a body
is read as raw JSON text first (msgspec hands out each top-level field's and each
array item's bytes without building them, at C speed), and each item is looked
up in a :class:`MessageMemo`: bytes a turn already sent, byte for byte, map to
what they were checked and converted to then — the same frozen objects every
turn, so later per-turn work (``MessageCut``, the append-only match) is an
identity check too. Only items not seen before are parsed (by orjson, as the
whole body would be) and converted. What an item converts to depends on nothing
but its own text, so equal bytes mean equal verdicts: editing an old item
changes its bytes and it is converted again.

Each format says what an item converts to (raising where the full check refuses
it); :func:`load` decides: anything the fast path cannot vouch for is loaded and
checked the ordinary way, whole (``jsonio.load_body`` and the format's parse), so
what is accepted is what was accepted before and every error is the one the full
check gives, word for word.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from operator import itemgetter
from typing import Any, Generic, TypeVar

import attrs
import msgspec
import numpy as np
import orjson

from ..errors import release
from ..generations import Generations
from ..schema.jsonio import MAX_DEPTH, load_body, nesting
from ..schema.prefixes import Kept, Prefixes

#: What the items kept weigh in memory (:func:`weight`; twice that at most while the memo turns over).
MEMO_BYTES = 64 << 20
#: What an entry weighs beyond its text and the strings parsed from it: the key's and the value's
#: object headers, the checked object (a dict of a few fields), the entry's tuple and its slot.
ENTRY_BYTES = 640
#: What the memos of a body's other fields keep (``system``, ``tools``, the options: the same every turn of an agent).
FIELD_MEMO_BYTES = 16 << 20
#: Bodies shorter than this are read whole every time (a 4 KB body costs a few µs).
BODY_PREFIX_BYTES = 4096

#: What a memo keeps for an item's text: the checked item, or what it converts to.
T = TypeVar("T")
#: What a format keeps for a body's items up to where its prefix is kept (:class:`Seen`).
V = TypeVar("V")

#: A body's top-level fields, and an array's items, as raw JSON text (msgspec skips over them in C).
TOP = msgspec.json.Decoder(dict[str, msgspec.Raw])
ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_converted = itemgetter(0)
_depth = itemgetter(1)


def weight(key: bytes) -> int:
    """What an entry for the item text ``key`` weighs in memory, about: the text kept as the key, the
    strings parsed from it (no longer than the text), and :data:`ENTRY_BYTES` of objects around them.

    A short message weighs ten times its text: a bound on text alone let the memo hold
    gigabytes (issue 33).
    """
    return 2 * len(key) + ENTRY_BYTES


def _weigh(key: bytes, entry: object) -> int:
    return weight(key)


class MessageMemo(Generic[T]):
    """Item JSON text -> what it was checked or converted to (with its nesting), for every recent session.

    Two generations: lookups hit the young one or promote from the old one;
    when the young one weighs ``max_bytes`` (:func:`weight`) it becomes the old
    one, and what was not used since is dropped. Bounded, no per-entry bookkeeping.
    """

    def __init__(self, max_bytes: int = MEMO_BYTES) -> None:
        self._entries: Generations[bytes, tuple[T, int]] = Generations(_weigh, max_bytes)
        #: Recent long bodies up to the end of an item (:func:`read`): a body that starts with one has only
        #: its new end read.
        self.bodies: Prefixes[Seen[Any]] = Prefixes(min_bytes=BODY_PREFIX_BYTES, window=64, max_bytes=max_bytes)

    def find(self, keys: list[bytes]) -> list[Any]:
        """The entry of each key (``None`` where there is none), in order."""
        entries = self._entries
        found: list[Any] = list(map(entries.young.get, keys))
        if entries.old and None in found:
            for i, entry in enumerate(found):
                if entry is None:
                    found[i] = entries.promote(keys[i])
        return found

    def put(self, key: bytes, message: T, depth: int) -> None:
        self._entries.put(key, (message, depth))

    def age(self) -> None:
        """Drop what no lookup used since the last call (or turnover): the young generation becomes the old one.

        Called after each drain of the whole store (``Runtime.after_drain``): the messages of
        sessions finalized and drained before it go, where they stayed until the memo reached
        its bound, each drain's entries pinning the allocator's arenas (issue 33). A session
        still running finds its messages again (promoted at its next turn); one idle over two
        drains has them parsed again once. The kept bodies (:attr:`bodies`) age alike.
        """
        self._entries.age()
        self.bodies.age()

    def __len__(self) -> int:
        return len(self._entries)


def load(raw: bytes, from_memo: Callable[[bytes], object | None]) -> Any:
    """What ``from_memo`` reads from ``raw``, or, where it cannot vouch for the body, its JSON value.

    Raises what :func:`~actorproxy.schema.jsonio.load_body` raises (empty, not JSON,
    too deep), with the same words: any body the fast path does not take whole is
    loaded that way, and its JSON value goes through the format's full check.
    """
    try:
        body = from_memo(raw)
    except Exception as refused:  # anything a conversion refuses: the full check says what, in its order
        # A converter's error (cattrs collects each field's error in its own frame) and its traceback
        # form a cycle that holds the body until the collector runs: drop the tracebacks now.
        release(refused)
        body = None
    return body if body is not None else load_body(raw)


def split(raw: bytes, field: str) -> tuple[dict[str, msgspec.Raw], list[msgspec.Raw]] | None:
    """A body's top-level fields and the items of its array ``field``, as raw JSON text.

    ``None`` where the fast path does not read it: not an object, no such array, not
    JSON (orjson's error says what is wrong), an empty array, a non-ASCII key.
    """
    try:
        top = TOP.decode(raw)
        texts = ITEMS.decode(top[field])
    except Exception:
        return None
    if not texts or not all(map(str.isascii, top)):
        return None
    return top, texts


def others(top: dict[str, msgspec.Raw], skip: Iterable[str]) -> dict[str, Any]:
    """The top-level fields but those in ``skip``, each parsed by orjson as the whole body would be."""
    return {key: orjson.loads(bytes(part)) for key, part in top.items() if key not in skip}


def items(memo: MessageMemo[T], keys: list[bytes], convert: Callable[[Any], T]) -> tuple[list[T], int]:
    """Items from their JSON texts, from the memo or parsed and converted (and kept).

    Also the deepest item's nesting (0 for none). Raises what ``orjson`` or
    ``convert`` raises on a new item.
    """
    found = memo.find(keys)
    for i, hit in enumerate(found):
        if hit is None:
            parsed = orjson.loads(keys[i])
            found[i] = (convert(parsed), nesting(parsed, MAX_DEPTH))
            memo.put(keys[i], *found[i])
    return list(map(_converted, found)), max(map(_depth, found), default=0)


def field(memo: MessageMemo[T], key: bytes, convert: Callable[[Any], T]) -> tuple[T, int]:
    """A top-level field converted (from the memo when its text was seen), with its nesting."""
    (converted,), depth = items(memo, [key], convert)
    return converted, depth


def options(memo: MessageMemo[T], fields: Iterable[tuple[str, bytes]], convert: Callable[[Any], T]) -> tuple[T, int]:
    """Top-level fields (name, JSON text) as one object converted, from the memo when the same text was seen.

    ``convert`` gets the object of those fields, as orjson parses it; also its nesting
    (the object's own level included). An agent sends the same model, sampling and
    tools every turn: they are typed once, and the same typed object serves each turn.
    """
    key = b"{" + b",".join([orjson.dumps(name) + b":" + text for name, text in fields]) + b"}"
    return field(memo, key, convert)


# -- a long body read from the end of one read before ------------------------------------------------------


@attrs.frozen
class Seen(Generic[V]):
    """What a body's bytes up to the end of one of its items gave (kept in ``MessageMemo.bodies``)."""

    #: The top-level fields before the array: name and JSON text.
    head: tuple[tuple[str, bytes], ...]
    #: What the format made of the items up to there.
    items: V
    #: The deepest nesting of an item read with them (those after the kept end included: a bound, never less).
    depth: int


@attrs.define
class Read(Generic[V]):
    """A body split at its array: the other fields, and the items not read before (all of them when nothing was)."""

    #: The top-level fields but the array: name and JSON text, as a dict built from the whole body has them.
    fields: dict[str, bytes]
    #: The items after the kept part (every item when ``seen`` is ``None``), as raw JSON text.
    texts: list[msgspec.Raw]
    #: What the kept part the body starts with gave, or ``None``.
    seen: Seen[V] | None
    _raw: bytes
    #: The fields before the array (``None``: the body is not kept, being short or naming a field twice).
    _head: tuple[tuple[str, bytes], ...] | None
    #: Where the buffer ``texts`` point into is in memory, and where in ``raw`` that buffer's start stands.
    _base: int
    _shift: int
    _kept: Kept[Seen[V]] | None

    def keep(self, bodies: Prefixes[Seen[V]], count: int, items: V, depth: int) -> None:
        """Keep the body up to the end of its ``count``-th new item with what its items up to there gave.

        ``count`` 0 keeps nothing new (a kept part the body starts with stays). The format chooses
        ``count`` so that the next body can be read on from there as it would be whole (an item that
        nothing after it changes the reading of). The kept part it extends is dropped: the session
        has moved on.
        """
        if count == 0 or self._head is None:
            return
        last = self.texts[count - 1]
        if self._kept is not None:
            bodies.drop(self._kept)
        bodies.keep(self._raw, self._shift + _address(last) - self._base + len(last), Seen(self._head, items, depth))


def read(raw: bytes, field: str, bodies: Prefixes[Seen[V]]) -> Read[V] | None:
    """A body's fields and the items of its array ``field``: only those after a kept part it starts with.

    ``None`` where :func:`split` would give ``None``. A body of :data:`BODY_PREFIX_BYTES` or more may
    be kept (:meth:`Read.keep`) for the next turn, whose body starts with its bytes.
    """
    kept = bodies.find(raw)
    if kept is not None:
        after = _after(raw, field, kept)
        if after is not None:
            return after
    parts = split(raw, field)
    if parts is None:
        return None
    top, texts = parts
    fields = {name: bytes(part) for name, part in top.items() if name != field}
    base = _address(raw)
    head = _head(top, field, base) if len(raw) >= BODY_PREFIX_BYTES else None
    return Read(fields, texts, None, raw, head, base, 0, None)


def _after(raw: bytes, field: str, kept: Kept[Seen[V]]) -> Read[V] | None:
    """The body read from the end of a kept one: its top-level fields after those items and its new items.

    The bytes up to ``len(kept)`` are those of a body read before, up to the end of one of its
    items: the parser's state there was "in the array, after an element". So ``{"field":[0``
    and the rest of this body read as JSON exactly when the whole body does, with the new items
    after the ``0`` and the fields that follow the array. ``None`` (read it whole) for anything
    else: not JSON, another ``field`` after the array. A field named again after the array takes
    its place with its new value, as in a dict built from the whole body.
    """
    seen = kept.value
    resume = b'{"' + field.encode() + b'":[0'
    tail = resume + raw[len(kept) :]
    parts = split(tail, field)
    if parts is None:
        return None
    top, texts = parts
    base = _address(tail)
    if _address(top[field]) - base != len(resume) - 2:
        return None  # a second array of that name after this one: the last one counts, read the body whole
    fields = dict(seen.head)
    fields.update((name, bytes(part)) for name, part in top.items() if name != field)
    return Read(fields, texts[1:], seen, raw, seen.head, base, len(kept) - len(resume), kept)


def _head(top: dict[str, msgspec.Raw], field: str, base: int) -> tuple[tuple[str, bytes], ...] | None:
    """The fields before the array ``field``, unless a field is named both before and after it."""
    at = _address(top[field]) - base
    names = list(top)
    split = names.index(field)
    # A dict keeps a name where it came first, with the value that came last: a name on the wrong side is named twice.
    if any(_address(top[name]) - base > at for name in names[:split]):
        return None
    if any(_address(top[name]) - base < at for name in names[split + 1 :]):
        return None
    return tuple((name, bytes(top[name])) for name in names[:split])


def _address(buffer: Any) -> int:
    """Where a buffer's bytes are in memory (msgspec's ``Raw`` parts point into the body they were read from)."""
    return int(np.frombuffer(buffer, np.uint8).__array_interface__["data"][0])
