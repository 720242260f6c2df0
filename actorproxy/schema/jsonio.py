"""JSON bytes in and out, with the limits of the edge.

orjson, because every turn parses the agent's whole conversation (megabytes
for a long agent run) and every read writes token arrays of 100k+ numbers:
orjson does both several times faster than the standard library, and its
parser already refuses what must never get in — invalid UTF-8 and lone
surrogates (``"\\udc80"``), ``NaN``/``Infinity``, numbers that overflow a
double (a 400-digit integer) — with an error instead of a value that fails
later, deep inside the proxy.

Nesting is bounded more tightly than orjson's 1024 levels: later code (the
chat template's ``tojson``, canonical tool keys) recurses per level, and no
real request nests more than a few dozen.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson

from ..errors import BadRequest

#: Deepest nesting of arrays and objects accepted in a request body.
MAX_DEPTH = 100


def loads(raw: bytes | str, *, check: bool = True) -> Any:
    """Parse a request body; :class:`BadRequest` for anything that is not sound JSON within the limits.

    ``check=False`` leaves the nesting bound to the caller (:func:`check_depth`).
    """
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if check:
        check_depth(value)
    return value


def load_body(raw: bytes, *, check: bool = True) -> Any:
    """A request's JSON body (400 when it is empty or not JSON)."""
    if not raw:
        raise BadRequest("the request body is empty; send a JSON object")
    return loads(raw, check=check)


def too_deep(limit: int = MAX_DEPTH) -> BadRequest:
    return BadRequest(f"the request body nests deeper than {limit} levels", code="too_deep")


def check_depth(value: Any, limit: int = MAX_DEPTH) -> None:
    """Refuse ``value`` if its arrays and objects nest deeper than ``limit`` (iterative: no recursion)."""
    if nesting(value, limit) > limit:
        raise too_deep(limit)


def nesting(value: Any, cap: int) -> int:
    """Arrays and objects on the longest path into ``value`` (0 for a scalar), counted up to ``cap + 1``."""
    if not isinstance(value, dict | list):
        return 0
    level: list[Any] = [value]
    depth = 0
    while level and depth <= cap:
        depth += 1
        below: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                below.extend(v for v in item.values() if isinstance(v, dict | list))
            elif isinstance(item, list):
                below.extend(v for v in item if isinstance(v, dict | list))
        level = below
    return depth


def ids_json(ids: array[int]) -> bytes:
    """A token array as a JSON array, from a zero-copy numpy view (no Python int per token)."""
    return orjson.dumps(np.frombuffer(ids, dtype=ids.typecode), option=orjson.OPT_SERIALIZE_NUMPY)


#: Compact JSON bytes (UTF-8, not ASCII-escaped): orjson's own function, with no call around it (a streamed
#: token's frame is one).
dumps: Callable[[Any], bytes] = orjson.dumps
