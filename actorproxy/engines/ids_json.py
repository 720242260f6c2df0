"""A long prompt's JSON written as its new ids only, when it extends a prompt written before (issue 12).

An agent's session sends the engine its whole prompt every turn: at turn 200 of a
tool-calling session that is ~100k ids, ~600 KB of JSON, of which a few hundred ids are
new. orjson writes 100k ids in 0.4-1 ms (from a zero-copy numpy view); most of that is
the same text as last turn's. So the JSON text of each long prompt is kept (:class:`IdsJSON`),
and a prompt that starts with one kept is written as that text, a comma and its new ids'
JSON: the same bytes, at memory speed (the prefix compared, the text copied).

Which kept prompt to try is found by content, not by session (the engine clients see no
session): :class:`~actorproxy.wire.prefixes.Prefixes` over the ids' bytes. Every candidate
is compared id for id before its text is used.
"""

from __future__ import annotations

from array import array

import numpy as np
import orjson

from ..wire.prefixes import Prefixes

#: Prompts shorter than this are written whole (orjson takes ~20 µs for 4k ids).
MIN_IDS = 4096
#: Bytes kept (each prompt's ids and its JSON text): ~64 sessions at 100k tokens.
MAX_BYTES = 64 << 20
_OPTIONS = orjson.OPT_SERIALIZE_NUMPY


class IdsJSON:
    """The JSON text of recent long prompts: a prompt that extends one is written as its new ids."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        # Filed by the 8 ids before a power-of-two offset.
        self._kept: Prefixes[bytes] = Prefixes(min_bytes=4 * MIN_IDS, window=32, max_bytes=max_bytes)

    def text(self, ids: array[int]) -> bytes:
        """``ids`` as a JSON array (exactly what orjson writes for them)."""
        view = np.frombuffer(ids, dtype=ids.typecode)
        if len(ids) < MIN_IDS or ids.typecode != "i" or ids.itemsize != 4:
            return orjson.dumps(view, option=_OPTIONS)
        raw = ids.tobytes()
        found = self._kept.find(raw)
        if found is None:
            text = orjson.dumps(view, option=_OPTIONS)
        else:
            self._kept.drop(found)  # the session has moved on: its longer prompt replaces it
            m = len(found) // 4
            text = found.value
            if m < len(ids):
                new = orjson.dumps(view[m:], option=_OPTIONS)  # "[a,b]": joined as "<kept text but ]>,a,b]"
                text = b"".join((memoryview(text)[:-1], b",", memoryview(new)[1:]))
        self._kept.keep(raw, len(raw), text, len(text))
        return text

    def __len__(self) -> int:
        return len(self._kept)
