"""The request being served, as the access log and the metrics see it (no I/O, no framework).

The ingress sets a :class:`RequestInfo` in a context variable before a view
runs; the turn machinery, deeper down, fills in what only it knows (the
session, the token counts, the first token's time) without importing the
ingress. :mod:`actorproxy.server.observe` turns it into a log line and metrics.
"""

from __future__ import annotations

import contextvars
import time

import attrs


@attrs.define
class RequestInfo:
    """One request as the access log and the metrics see it."""

    method: str
    path: str
    route: str
    started: float
    session: str | None = None
    status: int | None = None
    error_code: str | None = None
    #: A 5xx's message (the access log's ``detail=``).
    error_detail: str | None = None
    prompt_tokens: int | None = None
    sampled_tokens: int | None = None
    first_token_at: float | None = None
    finished: bool = False
    #: A warning the reply carries in its ``X-Actorproxy-Warning`` header (what the request asked that is lost).
    warning: str | None = None

    def elapsed_ms(self, now: float) -> float:
        return (now - self.started) * 1000


#: The request being handled in this task (set before the view runs).
CURRENT: contextvars.ContextVar[RequestInfo | None] = contextvars.ContextVar("actorproxy_request", default=None)


def note_first_token(at: float | None = None) -> None:
    """The turn machinery saw its first sampled piece (for time-to-first-token), now or ``at`` (``perf_counter``)."""
    info = CURRENT.get()
    if info is not None and info.first_token_at is None:
        info.first_token_at = time.perf_counter() if at is None else at


def note_warning(text: str) -> None:
    """The request asks for something the proxy cannot give: its reply says so in a header."""
    info = CURRENT.get()
    if info is not None:
        info.warning = text


def note_turn(*, session: str | None, prompt_tokens: int, sampled_tokens: int) -> None:
    """A turn finished: who it was and how many tokens it cost."""
    info = CURRENT.get()
    if info is not None:
        info.session = session or info.session
        info.prompt_tokens, info.sampled_tokens = prompt_tokens, sampled_tokens
