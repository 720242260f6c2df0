"""Merging the answers of every worker into one: JSON by a few rules, Prometheus text by a ``worker`` label.

JSON (``/trajectory/read``, ``/trajectory/stats``, ``/health``, ``/v1/rollout/*``, ``/sessions``,
``/ui/api/overview``): objects are merged key by key, lists are concatenated (worker 0's
items first), counts are summed (of the pause and resume counts, the largest). What every
worker must agree on (a setting, the epoch, the weight version) is kept when they agree and
becomes the list of the workers' values when they do not: a disagreement shows, it is never
averaged away. ``status`` is ``degraded`` when any worker is.

``/trajectory/read`` is spliced instead, and never held whole: each worker's answer is given to a
:class:`ReadSpool` piece by piece as it arrives, which finds its ``data`` and ``steps`` arrays (a scan that
skips strings), checks their elements one by one (msgspec ``Raw``) and spools their contents (to a temporary
file past ``SPOOL_BYTES``); :func:`read_reply` then joins them as bytes, all ``data`` then all ``steps``,
worker 0's first, as the JSON merge would order them. No answer is decoded into objects (a drain of the
whole store is hundreds of MB as objects, eight times its JSON), merged, and encoded again, and the memory
it takes does not grow with the store.

Metrics: each worker's samples get a ``worker="<i>"`` label (aggregate with ``sum by``);
each metric's ``# HELP`` and ``# TYPE`` lines appear once, before all of its samples.
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterator
from typing import Any

import msgspec

#: Numbers every worker has the same of: kept when equal, listed when not (never summed).
SAME = frozenset({
    "epoch", "max_tokens", "max_bytes", "max_sessions", "context_window", "limit",
    "vocab_size", "port", "max_model_len",
})
#: Counts of fanned-out calls each worker has seen: a worker started later has seen fewer (the largest is kept).
LARGEST = frozenset({"pauses", "resumes", "now", "last_pause_seconds"})
#: Objects whose every number is a setting (``/health``'s ``config``).
SAME_TREES = frozenset({"config"})


def merge_json(answers: list[Any], key: str = "", same: bool = False) -> Any:
    """One value from each worker's (see the module doc)."""
    first = answers[0]
    if all(isinstance(a, dict) for a in answers):
        keys: dict[str, None] = {}
        for answer in answers:
            keys.update(dict.fromkeys(answer))
        inner_same = same or key in SAME_TREES
        merged = {}
        for k in keys:
            values = [a[k] for a in answers if k in a]
            merged[k] = merge_json(values, k, inner_same)
        return merged
    if all(isinstance(a, list) for a in answers):
        return [item for answer in answers for item in answer]
    numbers = all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in answers)
    if numbers and key in LARGEST:
        return max(answers)
    if numbers and not same and key not in SAME:
        return sum(answers)
    if all(a == first for a in answers):
        return first
    if key == "status" and "degraded" in answers:
        return "degraded"
    if all(isinstance(a, bool) for a in answers) and key in ("full", "resumed", "failed"):
        return any(answers)
    return answers


def merge_history(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The dashboard's per-second samples of every worker as one per second: counts summed, latency the worst."""
    by_second: dict[Any, dict[str, Any]] = {}
    for sample in history:
        into = by_second.get(sample["t"])
        if into is None:
            by_second[sample["t"]] = dict(sample)
            continue
        for key, value in sample.items():
            if key in ("p50_ms", "p99_ms"):
                into[key] = max((v for v in (into[key], value) if v is not None), default=None)
            elif key != "t" and isinstance(value, (int, float)):
                into[key] = into.get(key, 0) + value
    return [by_second[t] for t in sorted(by_second)]


def merge_metrics(texts: list[str]) -> str:
    """Prometheus text of every worker, each sample labelled with its worker."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for index, text in enumerate(texts):
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    comments, _ = families.setdefault(family, ([], []))
                    if index == 0:
                        comments.append(line)
                continue
            name_end = min((i for i in (line.find("{"), line.find(" ")) if i >= 0), default=len(line))
            name = line[:name_end]
            if not (family and name.startswith(family)):
                family = name
            label = f'worker="{index}"'
            if line[name_end:name_end + 1] == "{":
                closing = line[name_end + 1:name_end + 2] == "}"
                sample = f"{name}{{{label}{'' if closing else ','}{line[name_end + 1:]}"
            else:
                sample = f"{name}{{{label}}}{line[name_end:]}"
            families.setdefault(family, ([], []))[1].append(sample)
    lines = []
    for comments, samples in families.values():
        lines += comments + samples
    return "\n".join(lines) + "\n"


#: The keys of a ``/trajectory/read`` answer (``runtime/store_messages.py: encode_parts``), in their order.
_READ_KEYS = ("data", "steps")
_QUOTED_KEYS = tuple((key, b'"' + key.encode() + b'"') for key in _READ_KEYS)
#: Bytes of an array's contents a spool keeps in memory before it moves them to a temporary file.
SPOOL_BYTES = 1 << 20
#: Bytes of a spool read back at a time into the reply.
PIECE_BYTES = 1 << 20
_WS = re.compile(rb"[ \t\n\r]*")
#: What an array's contents hold between two brackets: anything else, and whole strings (their brackets skipped).
_FLAT = re.compile(rb'(?:[^"\[\]{}]+|"[^"\\]*(?:\\.[^"\\]*)*")*', re.S)
#: Bytes between two elements past which an array's contents are not a read's (a comma and spaces there).
_GAP_BYTES = 4096
_OBJECT, _KEY, _COLON, _OPEN, _ARRAY, _NEXT, _DONE = range(7)


class ReadSpool:
    """One worker's ``/trajectory/read`` answer, given in pieces as it arrives (:meth:`feed`, then :meth:`end`):
    the contents of its ``data`` and ``steps`` arrays are spooled (a temporary file past ``SPOOL_BYTES``), as
    they are, for :func:`read_reply` (see the module doc).

    Checked as it goes: the answer must be an object of those arrays and nothing else, their elements objects,
    each valid JSON (checked by msgspec one element at a time, as ``Raw``: never decoded into objects). Holds
    in memory one piece and the element it is in, whatever the answer's size. Raises ``ValueError`` for an
    answer that is not a read's."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory  # where a spool's temporary file is made (None: the system's)
        self.arrays: dict[str, tempfile.SpooledTemporaryFile[bytes]] = {}
        #: The arrays that hold an element (an empty one adds nothing to the reply, not even its comma).
        self.filled: set[str] = set()
        self._buf = bytearray()
        self._pos = 0  # where the scan is in _buf
        self._start = 0  # where the array's contents not yet spooled start in _buf
        self._state = _OBJECT
        self._key = ""
        self._depth = 0
        self._open = 0  # where the element being scanned starts in _buf
        self._ended = False

    def feed(self, piece: bytes) -> None:
        self._buf += piece
        self._scan()
        done = self._start if self._state == _ARRAY else self._pos
        if done:
            del self._buf[:done]
            self._pos, self._start, self._open = self._pos - done, self._start - done, self._open - done

    def end(self) -> None:
        """The answer ended: it must be whole."""
        self._ended = True
        self._scan()
        if self._state != _DONE:
            raise ValueError("not a read's answer: it ends before its object does")
        if "data" not in self.arrays:
            raise ValueError("not a read's answer: no 'data'")

    def close(self) -> None:
        for spool in self.arrays.values():
            spool.close()

    def _scan(self) -> None:
        buf = self._buf
        while True:
            if self._state == _ARRAY:
                if not self._array():
                    return
                continue
            pos = self._pos = _WS.match(buf, self._pos).end()  # type: ignore[union-attr]  # (matches always)
            if pos == len(buf):
                return
            state, byte = self._state, buf[pos]
            if state == _OBJECT and byte == 0x7B:  # {
                self._state = _KEY
            elif state == _KEY:
                if not self._key_at(pos):
                    return
                continue
            elif state == _COLON and byte == 0x3A:  # :
                self._state = _OPEN
            elif state == _OPEN and byte == 0x5B:  # [
                self._state, self._start, self._depth = _ARRAY, pos + 1, 0
                self.arrays[self._key] = tempfile.SpooledTemporaryFile(SPOOL_BYTES, dir=self.directory)
            elif state == _NEXT and byte in b",}":
                self._state = _KEY if byte == 0x2C else _DONE
            else:
                raise ValueError(f"not a read's answer: {bytes(buf[pos:pos + 20])!r} where it is not one")
            self._pos = pos + 1

    def _key_at(self, pos: int) -> bool:
        """The key at ``pos`` taken (False: not all of it has arrived yet)."""
        for key, quoted in _QUOTED_KEYS:
            if self._buf.startswith(quoted, pos):
                if key in self.arrays:
                    raise ValueError(f"not a read's answer: {key!r} twice")
                self._key, self._state, self._pos = key, _COLON, pos + len(quoted)
                return True
        rest = bytes(self._buf[pos:pos + 8])
        if not self._ended and any(quoted.startswith(rest) for _, quoted in _QUOTED_KEYS):
            return False
        raise ValueError(f"not a read's answer: a key {rest!r}...")

    def _array(self) -> bool:
        """Scan the array's contents; True once its ``]`` was found (every element spooled)."""
        buf, pos, depth = self._buf, self._pos, self._depth
        try:
            while True:
                pos = _FLAT.match(buf, pos).end()  # type: ignore[union-attr]  # (matches always)
                if pos == len(buf) or buf[pos] == 0x22:  # all scanned, or a string that has not all arrived
                    if not depth and pos - self._start > _GAP_BYTES:
                        raise ValueError(f"not a read's answer: {self._key!r} holds what is not an object")
                    return False
                byte = buf[pos]
                if depth:
                    depth += 1 if byte in b"[{" else -1
                    if not depth:
                        self._element(pos + 1)
                elif byte == 0x7B or byte == 0x5D:  # { or ]
                    gap = bytes(buf[self._start:pos]).strip(b" \t\n\r")
                    if gap != (b"," if self._key in self.filled and byte == 0x7B else b""):
                        raise ValueError(f"not a read's answer: {self._key!r} holds {gap[:20]!r} between elements")
                    if byte == 0x5D:
                        self.arrays[self._key].write(buf[self._start:pos])
                        self._state, pos = _NEXT, pos + 1
                        return True
                    self._open, depth = pos, 1
                else:
                    raise ValueError(f"not a read's answer: {self._key!r} holds what is not an object")
                pos += 1
        finally:
            self._pos, self._depth = pos, depth

    def _element(self, end: int) -> None:
        """Check the element that ends at ``end`` (msgspec, as ``Raw``) and spool it, with the comma before it."""
        try:
            msgspec.json.decode(memoryview(self._buf)[self._open:end], type=msgspec.Raw)
        except msgspec.DecodeError as exc:
            raise ValueError(f"not a read's answer: {self._key!r}: {exc}") from exc
        self.arrays[self._key].write(self._buf[self._start:end])
        self.filled.add(self._key)
        self._start = end


def read_reply(spools: list[ReadSpool], lead: bytes = b"") -> Iterator[bytes]:
    """The workers' ``/trajectory/read`` answers as one answer, in pieces of at most ``PIECE_BYTES``, but for its
    closing ``}`` (see the module doc): ``{"data":[...]`` with every worker's segments, worker 0's first, then
    ``,"steps":[...]`` when they were asked for. An empty array adds nothing. ``lead``: members (each ending in
    ``,``) that come first (a leased drain's ``"lease"``)."""
    for key in _READ_KEYS:
        if not any(key in spool.arrays for spool in spools):
            continue
        head = b"{" + lead + b'"data":[' if key == "data" else b',"' + key.encode() + b'":['
        for spool in spools:
            if key not in spool.filled:
                continue
            contents = spool.arrays[key]
            contents.seek(0)
            while piece := contents.read(PIECE_BYTES):
                yield head + piece if head else piece
                head = b""
            head = b","
        yield b"]" if head == b"," else head + b"]"
