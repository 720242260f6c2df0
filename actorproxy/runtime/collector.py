"""The cyclic garbage collector held while an ``abort`` pause waits for its generations (issue 33).

A serving process collects its young objects every ``serve.GC_THRESHOLD`` allocations
(``serve.tune_gc``). A pause at 1,000 streams allocates about that many as each stream
reads its abort finish, so a young collection fell inside nearly every pause, and at
that size it stopped the loop for 45-49 ms of a 180-220 ms acknowledgement
(``benchmarks/pause_latency.py``). While an ``abort`` pause waits, the collector is held
(:func:`held`): reference counting still frees everything acyclic at once; the cycles made
meanwhile wait, for the pause's few hundred milliseconds (its generations end at the
engine's next step; ``ABORT_LIMIT`` bounds the worst), and are collected right after the
pause's answer is written (the collector comes back in a later scheduling round than
the one that writes it).

Only where the proxy owns the collector (:func:`hold_in_pauses`, called by ``serve.tune_gc``):
an embedded proxy's host owns its collector, and a collector already disabled stays so.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import trio

_hold = False  # this process's collector is the proxy's own (serve.tune_gc)
_holders = 0  # pauses holding it now
_disabled_by_us = False  # it was enabled when the first of them held it


def hold_in_pauses(hold: bool = True) -> None:
    """Whether an ``abort`` pause holds the collector (the process that serves owns it)."""
    global _hold
    _hold = hold


@contextmanager
def held() -> Iterator[None]:
    """No cyclic collection within the block (when this process holds it in pauses); back in a later round."""
    global _holders, _disabled_by_us
    if not _hold:
        yield
        return
    if _holders == 0 and gc.isenabled():
        gc.disable()
        _disabled_by_us = True
    _holders += 1
    try:
        yield
    finally:
        _holders -= 1
        if _holders == 0 and _disabled_by_us:
            # Not now: the pause's answer is written in this task step, after the block, and the
            # young objects of the whole pause would be collected before it leaves.
            trio.lowlevel.current_trio_token().run_sync_soon(_give_back)


def _give_back() -> None:
    global _disabled_by_us
    if _holders == 0 and _disabled_by_us:
        _disabled_by_us = False
        gc.enable()
