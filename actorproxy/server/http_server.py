"""The proxy's HTTP server: the floor's (:mod:`actorproxy.http.server`) with the proxy's policy.

What the floor leaves to the application: which requests a connection taken past
``--max-connections`` may make (health probes), the 503 the others get, the 408 for a
body slower than ``--body-min-rate`` (JSON in the caller's format), and the log lines a
client can cause again and again (written once per ``LOG_EVERY`` seconds with a count).
"""

from __future__ import annotations

import trio
from werkzeug.exceptions import RequestTimeout

from ..http import h1, server
from ..http.server import ASGIApp, ConnectionLimits, Router, Tracker
from ..schema import jsonio
from .limits import HEADROOM, accept_failures, is_probe, overloaded_response, slow_bodies
from .replies import error_reply, is_anthropic_route


class ProxyPolicy(server.ServerPolicy):
    """The proxy's answers above HTTP (see the module doc)."""

    headroom = HEADROOM

    def __init__(self, limits: ConnectionLimits) -> None:
        super().__init__(limits)
        self.bounds = limits
        self.accept_failures = accept_failures()
        self.slow_bodies = slow_bodies()

    def is_probe(self, request: h1.RequestHead) -> bool:
        return is_probe(request)

    def overloaded(self, date: bytes) -> bytes:
        return overloaded_response(self.bounds.max_connections or 0, date)

    def slow_body_error(self) -> Exception:
        limits = self.bounds
        return RequestTimeout(f"the request body did not arrive in time: after {limits.body_grace:g} s it must "
                              f"arrive at {limits.body_min_rate:g} bytes/s at least")

    def slow_body_response(self, method: str, path: str, error: Exception, date: bytes) -> bytes:
        """JSON in the caller's format; the connection closes."""
        reply = error_reply(error, anthropic_shape=is_anthropic_route(path), method=method, path=path)
        body = jsonio.dumps(reply.data)
        self.slow_bodies.note(trio.current_time(), method, path, self.bounds.body_min_rate)
        return (h1.status_line(408) + b"content-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\ndate: %s\r\n\r\n%s" % (len(body), date, body))

    def accept_failed(self, now: float, reason: str) -> None:
        self.accept_failures.note(now, reason)


class HTTPServer(server.HTTPServer):
    """Serves ``app`` with the proxy's policy (``limits``: its bounds, the defaults when not given)."""

    def __init__(self, app: ASGIApp, *, keep_alive_timeout: float = server.KEEP_ALIVE, router: Router | None = None,
                 tracker: Tracker | None = None, limits: ConnectionLimits | None = None) -> None:
        super().__init__(app, policy=ProxyPolicy(limits or ConnectionLimits()), keep_alive_timeout=keep_alive_timeout,
                         router=router, tracker=tracker)
