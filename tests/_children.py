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

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for :class:`subprocess.Popen`: the child is sent SIGTERM when its parent exits."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
