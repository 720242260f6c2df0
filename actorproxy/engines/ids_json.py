"""A long prompt's JSON written as its new ids only, when it extends a prompt written before (issue 12).

An agent's session sends the engine its whole prompt every turn: at turn 200 of a
tool-calling session that is ~100k ids, ~600 KB of JSON, of which a few hundred ids are
new. orjson writes 100k ids in 0.4-1 ms (from a zero-copy numpy view); most of that is
the same text as last turn's. So the JSON text of each long prompt is kept (:class:`IdsJSON`),
and a prompt that starts with one kept is written as that text, a comma and its new ids'
JSON: the same bytes, at memory speed (the prefix compared, the text copied).

Which kept prompt to try is found by content, not by session (the engine clients see no
session): :class:`~actorproxy.schema.prefixes.Prefixes` over the ids' bytes. Every candidate
is compared id for id before its text is used.
"""

from __future__ import annotations

from array import array

import numpy as np
import orjson

from ..schema.jsonio import ids_json
from ..schema.prefixes import Prefixes

#: Prompts shorter than this are written whole (orjson takes ~20 µs for 4k ids).
MIN_IDS = 4096
#: Bytes kept (each prompt's ids and its JSON text): ~64 sessions at 100k tokens.
MAX_BYTES = 64 << 20
_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


class IdsJSON:
    """The JSON text of recent long prompts: a prompt that extends one is written as its new ids."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        # Filed by the 8 ids before a power-of-two offset.
        self._kept: Prefixes[memoryview] = Prefixes(min_bytes=4 * MIN_IDS, window=32, max_bytes=max_bytes)

    def age(self) -> None:
        """Drop the prompts kept before the previous call (``Prefixes.age``): a prompt is a session's whole
        conversation, and a drained session's need not wait for the byte bound to go."""
        self._kept.age()

    @staticmethod
    def takes(ids: array[int]) -> bool:
        """Whether ``ids`` is long enough to be kept (shorter arrays: orjson over a numpy view, as before)."""
        return len(ids) >= MIN_IDS and ids.typecode == "i" and ids.itemsize == 4

    def text(self, ids: array[int]) -> bytes:
        """``ids`` as a JSON array (exactly what orjson writes for them)."""
        if not self.takes(ids):
            return ids_json(ids)
        return self.splice([b"", b""], [ids])

    def splice(self, pieces: list[bytes], arrays: list[array[int]]) -> bytes:
        """``pieces[0]``, the JSON of ``arrays[0]``, ``pieces[1]``, ... in one copy (a body written around them).

        Each array's text is kept as a view of the result, for the prompt that extends it.
        """
        parts: list[bytes | memoryview] = [pieces[0]]
        at = len(pieces[0])
        spans: list[tuple[bytes, int, int]] = []  # each array's ids and where its text is in the result
        for ids, after in zip(arrays, pieces[1:], strict=True):
            raw = ids.tobytes()
            text: list[bytes | memoryview]
            kept = self._kept.find(raw)
            if kept is None:
                text = [orjson.dumps(np.frombuffer(ids, dtype="i"), option=_OPTIONS)]
            else:
                self._kept.drop(kept)  # the session has moved on: its longer prompt replaces it
                m = len(kept) // 4
                if m == len(ids):
                    text = [kept.value]
                else:  # "<kept text but its ]>" "," "<new ids' text but its [>"
                    new = orjson.dumps(np.frombuffer(ids, dtype="i")[m:], option=_OPTIONS)
                    text = [kept.value[:-1], b",", memoryview(new)[1:]]
            size = sum(map(len, text))
            spans.append((raw, at, at + size))
            parts += text
            parts.append(after)
            at += size + len(after)
        body = b"".join(parts)
        view = memoryview(body)
        for raw, start, end in spans:
            self._kept.keep(raw, len(raw), view[start:end], len(body))
        return body

    def __len__(self) -> int:
        return len(self._kept)
