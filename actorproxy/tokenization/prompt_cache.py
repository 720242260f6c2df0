"""Whole prompts tokenized once per distinct prefix, not once per session (issue 12).

A turn that starts a segment (a session's first turn, a history rewrite, a tool
list change) renders and tokenizes the whole conversation. For a coding agent that
is its system prompt and tool schemas, 10-20k tokens, and tokenizing them costs
about 2.5 us a token (35 ms for 14k tokens) where rendering them costs 0.7 ms.
Yet every session of an agent starts with the same system prompt and tools, and
in RL every rollout of a prompt group starts with the very same prompt.

:class:`PromptCache` remembers, for the prompts it tokenized, the ids of some of
their prefixes: the whole text, and the text up to (not including) the first and
last few occurrences of the template's message-start token (``<|im_start|>``).
A new prompt starting with one of those prefixes is tokenized from there on only.

This is exact because of how a Hugging Face tokenizer works: it first splits the
text at its added tokens (``<|im_start|>`` never merges with a neighbour), then
normalizes, pre-tokenizes and encodes each piece alone. So cutting the text right
before such a token cuts the ids at the same place. :func:`prompt_cache` checks the
preconditions and otherwise gives ``None`` (every prompt tokenized whole, as
before): the token is a special added token matched on the raw text, with no
``lstrip``/``rstrip``/``single_word``; no added token can straddle the cut (none
has a proper suffix that begins the token, or contains it past its start); and
the tokenizer gives identical ids cut and whole on a set of probe texts (this
rules out pre-tokenizers that treat a text's start differently, such as a
Metaspace ``prepend_scheme="first"``). Ids are handed out as new arrays.

Bounded by the bytes of the prefixes kept, text and ids (two generations of 32 MB,
as the message memo): what is not used for a while is dropped, and what no prompt
used between two drains of the whole store (:meth:`PromptCache.age`, called through
``Runtime.after_drain``): a prompt holds a session's whole conversation. Prompts are tokenized
in offload threads: the generations and counts are read and written under a lock,
held for lookups and insertions only (the tokenizing itself runs outside it).
"""

from __future__ import annotations

import logging
import threading
from array import array
from collections.abc import Callable, Sequence
from typing import Any

from ..generations import Generations

log = logging.getLogger(__name__)

#: Bytes of prefixes kept, their text and their ids (twice that at most while the cache turns over).
CACHE_BYTES = 32 << 20
#: Prompts shorter than this are tokenized whole (the cache costs more than it saves).
MIN_CHARS = 1024
#: Prefixes kept per prompt: up to the first and the last few occurrences of the cut token.
CUTS_EACH_END = 4

_Entry = tuple[str, "array[int]"]


class PromptCache:
    """Prompt text -> ids, reusing the ids of a prefix an earlier prompt had (see module docstring)."""

    def __init__(self, encode: Callable[[str], array[int]], cut: str, cut_id: int,
                 max_bytes: int = CACHE_BYTES) -> None:
        self._encode = encode
        self.cut = cut
        self._cut_id = cut_id
        self._max = max_bytes
        #: Two generations of prefixes, by length (a lookup compares with ``startswith``: no hashing, no copy).
        self._young: dict[int, list[_Entry]] = {}
        self._old: dict[int, list[_Entry]] = {}
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        #: Guards the generations, the byte count and the counts: threads tokenize prompts at once.
        self._lock = threading.Lock()

    def encode(self, text: str) -> array[int]:
        """The ids of ``text``, as ``encode(text)`` gives them."""
        if len(text) < MIN_CHARS:
            return self._encode(text)
        cuts = self._cuts(text)
        with self._lock:
            found = self._find(text, [len(text), *reversed(cuts)])
            if found is None:
                self.misses += 1
            else:
                self.hits += 1
        if found is not None and len(found[0]) == len(text):
            return array("i", found[1])
        if found is None:
            ids = self._encode(text)
        else:
            ids = array("i", found[1])
            ids.extend(self._encode(text[len(found[0]):]))
        self._remember(text, ids, cuts)
        return ids

    def age(self) -> None:
        """Drop what no prompt used since the last call (or turnover): the young generation becomes the old one."""
        with self._lock:
            self._old, self._young, self._bytes = self._young, {}, 0

    def _cuts(self, text: str) -> list[int]:
        """Where the cut token occurs (after the start): the first and last few places."""
        places: list[int] = []
        at = text.find(self.cut, 1)
        while at != -1:
            places.append(at)
            at = text.find(self.cut, at + 1)
        if len(places) > 2 * CUTS_EACH_END:
            places = places[:CUTS_EACH_END] + places[-CUTS_EACH_END:]
        return places

    def _find(self, text: str, lengths: Sequence[int]) -> _Entry | None:
        """The longest kept prefix of ``text`` among ``lengths`` (promoted if old); under the lock."""
        for length in lengths:
            for generation in (self._young, self._old):
                for entry in generation.get(length, ()):
                    if text.startswith(entry[0]):
                        if generation is self._old:
                            self._add(entry)
                        return entry
        return None

    def _remember(self, text: str, ids: array[int], cuts: list[int]) -> None:
        all_places = self._all_places(text)
        # The k-th occurrence of the cut token in the text is the k-th cut id in the ids.
        positions = _positions(ids, self._cut_id)
        if len(positions) != len(all_places):  # the token is not always its own id: keep nothing
            return
        entries = [(text, ids), *((text[:place], ids[: positions[all_places.index(place)]]) for place in cuts)]
        with self._lock:
            for entry in entries:
                self._add(entry)

    def _all_places(self, text: str) -> list[int]:
        places: list[int] = []
        at = text.find(self.cut)
        while at != -1:
            places.append(at)
            at = text.find(self.cut, at + 1)
        return places

    def _add(self, entry: _Entry) -> None:
        """Keep ``entry`` in the young generation (which turns over when full); under the lock."""
        text = entry[0]
        same = self._young.setdefault(len(text), [])
        if any(other[0] == text for other in same):
            return
        size = len(text) + entry[1].itemsize * len(entry[1])  # about what the text and the ids hold in memory
        if self._bytes + size > self._max:
            self._old, self._young, self._bytes = self._young, {}, 0
            same = self._young.setdefault(len(text), [])
        same.append(entry)
        self._bytes += size


#: What a :class:`FragmentMemo` keeps: fragment texts and their ids (twice that at most while it turns over).
FRAGMENT_BYTES = 4 << 20
#: Fragments longer than this are tokenized every time (kept, a few would fill the memo).
FRAGMENT_MAX_CHARS = 4096
#: What an entry weighs beyond its text and ids: the text's and the array's object headers, its slot.
FRAGMENT_ENTRY_BYTES = 200


def fragment_weight(text: str, ids: array[int]) -> int:
    """What a :class:`FragmentMemo` entry weighs in memory, about (a character counted as four bytes)."""
    return 4 * len(text) + ids.itemsize * len(ids) + FRAGMENT_ENTRY_BYTES


class FragmentMemo:
    """Fragment text -> ids: a text tokenized before is not tokenized again (the same ids, a new array).

    A continuing turn tokenizes the fragment the template writes for its new messages,
    often a text an earlier turn sent too (the same tool result or user message in the
    rollouts of one prompt group, an environment's canned reply, the benchmarks' questions).
    Keyed by the whole text, so exact for any tokenizer: the ids are what ``encode`` gave
    for that very text. Two generations bounded by :data:`FRAGMENT_BYTES`, aged with the
    prompt cache (:meth:`age`); read and written under a lock (offload threads tokenize too).
    """

    def __init__(self, encode: Callable[[str], array[int]], max_bytes: int = FRAGMENT_BYTES) -> None:
        self._encode = encode
        self.entries: Generations[str, array[int]] = Generations(fragment_weight, max_bytes)
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def encode(self, text: str) -> array[int]:
        """The ids of ``text``, as ``encode(text)`` gives them, in an array of the caller's own."""
        entries = self.entries
        with self._lock:
            ids = entries.young.get(text)
            if ids is None:
                ids = entries.promote(text)
            if ids is not None:
                self.hits += 1
                return ids[:]
            self.misses += 1
        ids = self._encode(text)
        if len(text) <= FRAGMENT_MAX_CHARS:
            with self._lock:
                entries.put(text, ids[:])
        return ids

    def age(self) -> None:
        """Drop what no turn used since the last call (or turnover): the young generation becomes the old one."""
        with self._lock:
            self.entries.age()

    def __len__(self) -> int:
        return len(self.entries)


#: Texts the cut must leave alone: ids cut before the token equal the ids of the whole.
_PROBES = ["", "Hello", "Hello ", "line\n", " \n\n", "end.\n  ", "café", "e\u0301", "日本語", "\t", "x!", "1 2 3 "]


def prompt_cache(encode: Callable[[str], array[int]], added: dict[int, Any], sample: str) -> PromptCache | None:
    """A :class:`PromptCache` cutting before the special token ``sample`` (a rendered conversation) uses most,
    or ``None`` when cutting might change the ids (see module docstring).

    ``added`` is the tokenizer's ``added_tokens_decoder`` (id -> ``AddedToken``).
    """
    special = {token.content: int(i) for i, token in added.items() if getattr(token, "special", False)}
    counts = {content: sample.count(content) for content in special if content and content in sample}
    if not counts:
        return None
    cut = max(counts, key=lambda content: (counts[content], -sample.find(content)))
    token = added[special[cut]]
    if token.normalized or token.lstrip or token.rstrip or token.single_word:
        return None
    for other in added.values():
        content = other.content
        raw_matched = not other.normalized
        if raw_matched and (other.lstrip or other.rstrip):
            return None
        if raw_matched and _straddles(content, cut):
            return None
    cut_id = special[cut]
    for before in _PROBES:
        for after in _PROBES:
            whole = encode(before + cut + after)
            if list(whole) != [*encode(before), *encode(cut + after)] or encode(cut)[:1].tolist() != [cut_id]:
                log.debug("prompts are tokenized whole: cutting before %r changes the ids", cut)
                return None
    return PromptCache(encode, cut, cut_id)


def _positions(ids: array[int], token_id: int) -> list[int]:
    """Where ``token_id`` occurs in ``ids`` (a byte search: ``array.index`` boxes every element it passes)."""
    data = ids.tobytes()
    pattern = array(ids.typecode, [token_id]).tobytes()
    size = len(pattern)
    found: list[int] = []
    at = data.find(pattern)
    while at != -1:
        if at % size == 0:
            found.append(at // size)
            at = data.find(pattern, at + size)
        else:
            at = data.find(pattern, at + 1)
    return found


def _straddles(token: str, cut: str) -> bool:
    """Whether an occurrence of ``token`` could begin before a cut before ``cut`` and end after it."""
    for k in range(1, len(token)):
        rest = token[k:]
        if cut.startswith(rest) or rest.startswith(cut):
            return True
    return False
