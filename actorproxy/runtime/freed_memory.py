"""Memory freed by a drain given back to the system, not kept by the C allocator for later (issue 33).

A drain frees what the store's read built (every segment and step as objects, then as
JSON) and what the drained sessions' turns left; glibc's allocator keeps the freed
pages of its heaps for reuse, so the process's RSS stayed at its peak after each drain
and crept up from one to the next. After a drain of the whole store, once the last part
of its reply is sent (so the reply's own pages are free too), the runtime asks it
(``malloc_trim``) to return them, in a worker thread: the walk over the heap takes
milliseconds. Where the C library is not glibc there is no such call and nothing is asked.

glibc also gives each new thread a heap (an arena) of its own, up to 8 per core, and
the offload threads and the store's thread took turns in them: what a drain freed in
a thread's heap stayed resident in pieces, and RSS crept up from drain to drain (~20
MiB between turns 10,000 and 40,000 of ``benchmarks/memory_drains.py``). The runtime
bounds them at :data:`ARENAS` (``mallopt(M_ARENA_MAX)``) unless ``MALLOC_ARENA_MAX``
is set in the environment; heaps made before it opened stay.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from collections.abc import Callable

log = logging.getLogger(__name__)

#: Heaps the threads share (glibc's default is 8 per core). Two: the event loop's thread and the
#: offload threads contend little for them (memory_drains.py with MALLOC_ARENA_MAX=2: x1.08 from
#: turn 10,000 to 100,000; with 1: x1.13; unbounded: x1.20).
ARENAS = 2
#: ``mallopt``'s parameter for the number of heaps (glibc's malloc.h).
_M_ARENA_MAX = -8


@functools.cache
def _libc_call(name: str) -> Callable[..., int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        call: Callable[..., int] = getattr(libc, name)
    except (OSError, AttributeError):
        log.info("the C library has no %s: memory freed by drains stays with the allocator", name)
        return None
    return call


def give_back() -> bool:
    """Return the C allocator's free pages to the system; whether there was a way to ask."""
    trim = _libc_call("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


def limit_heaps(arenas: int = ARENAS) -> bool:
    """Bound the heaps glibc keeps for threads at ``arenas`` (``MALLOC_ARENA_MAX`` in the environment wins);
    whether it was done."""
    mallopt = _libc_call("mallopt")
    if mallopt is None or "MALLOC_ARENA_MAX" in os.environ:
        return False
    return bool(mallopt(_M_ARENA_MAX, arenas))
