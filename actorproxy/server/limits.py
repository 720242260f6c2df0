"""What a client may hold of the HTTP server: connections, and a request body's time (sans-IO).

Every connection is a file descriptor, and the process has a fixed number of them
(``RLIMIT_NOFILE``; 1024 under a common ``ulimit -n``). Idle connections alone
could take them all: then ``accept`` fails, nothing new is served, ``/health``
included. So :func:`raise_open_files_limit` lifts the soft limit to the hard one at
start, and the server holds at most ``max_connections`` (``--max-connections``; by
default what the descriptor limit leaves after a reserve for the engines' connections,
the store and the logs, :func:`default_max_connections`):

- at the bound, a new connection closes the longest-idle one (an idle keep-alive
  connection, or one that never sent a whole head) and is served;
- when none is idle (every connection is serving a request), up to ``HEADROOM`` more are
  taken for a health probe only: ``GET``/``HEAD`` of ``/health`` or ``/ready`` is
  answered, anything else gets a 503 (``overloaded``, ``Retry-After``) and the
  connection closes; past the headroom a connection is closed as soon as it is accepted.

A failing ``accept`` (out of descriptors all the same) is logged once per
``LOG_EVERY`` seconds with the count of failures since, not ten times a second.
"""

from __future__ import annotations

import logging
import resource

from ..http import h1
from ..schema import jsonio

log = logging.getLogger("actorproxy.http")

#: Connections taken past ``max_connections`` for health probes only (see the module doc).
HEADROOM = 16
#: Descriptors left to the rest of the process (engine connections, the store, logs) by the default bound.
RESERVE = 256
#: Seconds between two log lines about ``accept`` failing.
LOG_EVERY = 10.0
#: The paths a connection taken in the headroom may ask for.
PROBES = frozenset({b"/health", b"/ready"})


def raise_open_files_limit() -> int:
    """Lift the soft ``RLIMIT_NOFILE`` to the hard limit (as nginx's ``worker_rlimit_nofile``); the soft limit after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as error:  # a container may refuse it: the bound below follows the soft one
            log.warning("could not raise the open files limit from %d to %d: %s", soft, target, error)
    return soft


def default_max_connections() -> int:
    """The default ``--max-connections``: the soft descriptor limit less a reserve (a quarter, 256 at least)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(32, soft - max(RESERVE, soft // 4))


def is_probe(request: h1.RequestHead) -> bool:
    """Whether ``request`` is a health probe (what a connection in the headroom may ask)."""
    return request.method in (b"GET", b"HEAD") and request.target.partition(b"?")[0] in PROBES


def overloaded_response(max_connections: int, date: bytes) -> bytes:
    """The 503 for a request on a connection taken past the bound: JSON, ``Retry-After``, the connection closes."""
    body = jsonio.dumps({"error": {
        "message": f"the proxy serves {max_connections} connections (--max-connections), each busy with a "
                   "request; retry",
        "type": "server_error", "param": None, "code": "overloaded"}})
    return (h1.status_line(503) + b"content-type: application/json\r\ncontent-length: %d\r\nretry-after: 1\r\n"
            b"connection: close\r\ndate: %s\r\n\r\n%s" % (len(body), date, body))


class Repeated:
    """A log line a client can cause again and again: written once per ``LOG_EVERY`` seconds, with a count."""

    def __init__(self, level: int, text: str) -> None:
        self.level, self.text = level, text + " (%d time(s) since the last such line)"
        self.count = 0  # since the last line
        self.logged_at: float | None = None

    def note(self, now: float, *args: object) -> None:
        self.count += 1
        if self.logged_at is not None and now - self.logged_at < LOG_EVERY:
            return
        log.log(self.level, self.text, *args, self.count)
        self.count, self.logged_at = 0, now


def accept_failures() -> Repeated:
    """``accept`` failing for want of descriptors (or memory)."""
    return Repeated(logging.ERROR, "accept failed: %s; closing idle connections, retrying (see --max-connections, "
                                   "ulimit -n)")


def slow_bodies() -> Repeated:
    """A request body given up for its rate (on a route whose app did not answer the 408 itself)."""
    return Repeated(logging.INFO, "%s %s: the request body came slower than %g bytes/s; 408, the connection closes")
