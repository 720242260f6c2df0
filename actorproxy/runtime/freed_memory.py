"""Memory freed by a drain given back to the system, not kept by the C allocator for later (issue 33).

A drain frees what the store's read built (every segment and step as objects, then as
JSON) and what the drained sessions' turns left; glibc's allocator keeps the freed
pages of its heaps for reuse, so the process's RSS stayed at its peak after each drain
and crept up from one to the next. After a drain of the whole store, once the last part
of its reply is sent (so the reply's own pages are free too), the runtime asks it
(``malloc_trim``) to return them, in a worker thread: the walk over the heap takes
milliseconds. Where the C library is not glibc there is no such call and nothing is asked.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        log.info("the C library has no malloc_trim: memory freed by drains stays with the allocator")
        return None
    return trim


def give_back() -> bool:
    """Return the C allocator's free pages to the system; whether there was a way to ask."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
