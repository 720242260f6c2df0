"""A worker's part of a drain across workers: what it read, held under a token until the drain is settled.

A draining read of the whole store is fanned out (:mod:`.fanout`). The fanning worker asks each
worker's private socket with a hold token (the ``x-actorproxy-hold`` header); that worker answers
in full but deletes nothing: once its answer was sent but for its last bytes, what it read is kept
here, still held (no other drain reads it), under the token. The fanning worker then sends the
merged reply to the trainer but for its last byte and settles every worker
(``POST /_workers/settle``, ``{"token": ..., "delivered": true|false}``): delivered, the worker
deletes what it holds and answers once it is deleted; not delivered, it lets it go, for the next drain.

Only the private socket serves this (:class:`PrivateApp` sits in front of the app there alone): the
public socket's app neither knows the settle route (404) nor reads the header, and the fan-out
never forwards a caller's ``x-actorproxy-hold``. The holds are bounded: at most ``MAX_HOLDS`` at a
time (another is refused, ``503 too_many_holds``), each let go of ``HOLD_SECONDS`` after it was
kept if no settle came (the fanning worker died): held data is never held for good. A leased drain's
part (the ``x-actorproxy-hold-lease`` header beside the token: its lease's seconds, at most
``LONGEST_LEASE``) is held that many seconds longer, so that it outlives the trainer's lease,
which the fanning worker keeps.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..errors import ProxyError
from ..runtime.holds import Holds
from ..runtime.runtime import Runtime
from ..schema import jsonio
from ..server.app import HOLD_EXTENSION
from ..server.drain import ASGIApp, Message, Receive, Send
from ..store.base import LONGEST_LEASE
from .fanout import HOLD_HEADER, LEASE_HEADER, SETTLE_PATH, error_body, read_body, reply

#: Holds a worker keeps at a time (each fanned-out drain in flight takes one on every worker).
MAX_HOLDS = 16
#: Seconds a kept hold waits for its settle before it is let go of (for the next drain).
HOLD_SECONDS = 600.0
#: The longest token taken.
_TOKEN_CHARS = 64


def worker_holds(runtime: Runtime, *, limit: int = MAX_HOLDS, seconds: float = HOLD_SECONDS) -> Holds:
    """A worker's holds of its parts of drains across workers (see the module doc)."""
    return Holds(runtime, limit=limit, seconds=seconds,
                 what=f"a drain across workers held here for {seconds:.0f} s (its fanning worker is gone?)")


def _lease_seconds(headers: list[tuple[bytes, bytes]]) -> float | None:
    """The seconds of the lease :data:`.fanout.LEASE_HEADER` names (0: none; ``None``: not a lease's seconds)."""
    value = next((v for k, v in headers if k == LEASE_HEADER), None)
    if value is None:
        return 0.0
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 1 <= seconds <= LONGEST_LEASE else None


class HoldMetrics:
    """A worker's drains across workers in its ``/metrics`` (a collector of its app's registry): the holds it keeps
    (open now, let go of unsettled) and, as the fanning worker, the deletes of a delivered drain that a worker did
    not confirm (counted by :meth:`.fanout.FanOut.settle_all`: what that worker answered comes again)."""

    def __init__(self, holds: Holds) -> None:
        self.holds = holds
        self.settles_failed = 0

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("actorproxy_drain_holds_open",
                                "Parts of drains across workers held here, waiting for their settle",
                                value=len(self.holds))
        yield CounterMetricFamily("actorproxy_drain_holds_expired",
                                  f"Holds let go of because no settle came within {self.holds.seconds:.0f} s",
                                  value=self.holds.expired)
        yield CounterMetricFamily("actorproxy_drain_settles_failed",
                                  "Workers that did not confirm the delete of a delivered drain this worker fanned out",
                                  value=self.settles_failed)


class PrivateApp:
    """ASGI middleware of a worker's private socket alone: the settle route and the hold header (module doc)."""

    def __init__(self, app: ASGIApp, holds: Holds) -> None:
        self.app, self.holds = app, holds

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if scope["path"] == SETTLE_PATH:
            await self.settle(scope, receive, send)
            return
        token = next((value for name, value in scope["headers"] if name == HOLD_HEADER), None)
        if token is None:
            await self.app(scope, receive, send)
            return
        name = token.decode("ascii", "replace")
        seconds = _lease_seconds(scope["headers"])
        if not (0 < len(name) <= _TOKEN_CHARS and name.isascii() and name.isprintable()) or seconds is None:
            await reply(send, 400, error_body(
                f"a hold token is 1 to 64 printable ASCII characters; its lease, 1 to {LONGEST_LEASE:.0f} seconds",
                "invalid_hold", "invalid_request_error"))
            return
        if not self.holds.reserve(name):
            await reply(send, 503, error_body(
                f"this worker holds {len(self.holds)} drains (at most {self.holds.limit}) or that token already: "
                "retry once they are settled", "too_many_holds", "server_error"), retry_after=True)
            return
        # (a leased drain's part: held while the trainer's lease runs, and as long as a plain drain's part besides)
        keep = partial(self.holds.keep, name, seconds=self.holds.seconds + seconds)
        extensions = {**(scope.get("extensions") or {}), HOLD_EXTENSION: keep}
        answered = False

        async def sending(message: Message) -> None:
            nonlocal answered
            await send(message)
            answered = message["type"] == "http.response.body" and not message.get("more_body", False)

        try:
            await self.app({**scope, "extensions": extensions}, receive, sending)
        finally:
            self.holds.unreserve(name, answered)

    async def settle(self, scope: Any, receive: Receive, send: Send) -> None:
        body = await read_body(receive, 4096)
        try:
            asked = jsonio.loads(body or b"")
            token, delivered = asked["token"], asked["delivered"]
            if not (scope["method"] == "POST" and isinstance(token, str) and isinstance(delivered, bool)):
                raise ValueError
        except Exception:
            await reply(send, 400, error_body('POST {"token": "<hold token>", "delivered": true|false}',
                                              "invalid_settle", "invalid_request_error"))
            return
        try:
            settled = await self.holds.settle(token, delivered)
        except Exception as exc:  # the delete failed (the disk): what it held was let go of, for the next drain
            status, code = (exc.status, exc.code) if isinstance(exc, ProxyError) else (503, "store_unavailable")
            await reply(send, status, error_body(f"not deleted, let go of for the next drain: {exc}", code,
                                                 "server_error"))
            return
        if settled is None:
            await reply(send, 404, error_body(f"no drain held under {token!r} (its hold expired?)", "unknown_hold",
                                              "invalid_request_error"))
            return
        await reply(send, 200, jsonio.dumps({"settled": "deleted" if delivered else "let_go", "reads": settled}))
