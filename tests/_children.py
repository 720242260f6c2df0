"""Child processes that die with the test run.

A test run killed from outside (SIGTERM, SIGKILL, a CI timeout) runs no
fixture teardown, so the ``actorproxy run`` and ``llama-server`` processes it
started would live on, holding ports and CPU. Started with
``preexec_fn=die_with_parent`` they get SIGTERM the moment the test process
ends (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing changes).
"""

from __future__ import annotations

import ctypes
import signal
import sys
from collections.abc import Iterable

import pytest

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for :class:`subprocess.Popen`: the child is sent SIGTERM when its parent exits."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def lines_through(output: Iterable[str] | None, marker: str) -> list[str]:
    """A child's output lines up to and including the first that holds ``marker``; the test fails if the
    output ends first."""
    assert output is not None, "the child's output is not a pipe"
    seen = []
    for line in output:
        seen.append(line)
        if marker in line:
            return seen
    pytest.fail(f"the child's output ended before a line with {marker!r}:\n" + "".join(seen))
