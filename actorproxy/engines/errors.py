"""Engine failures as :class:`BackendError`, at every boundary (httpcore-style mapping).

Transport failures (:mod:`actorproxy.http.errors`) become 502 (504 on timeouts), by
the one table :data:`TRANSPORT_ERRORS`; an
engine's HTTP error or in-stream error becomes 400 when the engine calls the request
invalid, 503 when it is overloaded or starting, 504 on its timeouts, else 502.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import TracebackType
from typing import TYPE_CHECKING

import orjson

from ..http.errors import ConnectError, ConnectTimeout, ReadTimeout, TransportError
from .base import BackendError

if TYPE_CHECKING:
    from .connection import BodyResponse

_ERROR_BODY_LIMIT = 64 * 1024
# Phrases engines use when a request can never succeed (prompt too long, bad params).
_INVALID = re.compile(r"context length|too long|longer than|exceed|invalid|must be|not supported", re.I)


#: A transport failure's status and whether it means the engine is unreachable (nothing reached it; the pool marks
#: it down): the first row whose class the failure is an instance of. Only a failed connect says the engine is gone;
#: a dropped stream may be this request's.
TRANSPORT_ERRORS: tuple[tuple[type[TransportError], int, bool], ...] = (
    (ConnectTimeout, 504, True),
    (ReadTimeout, 504, False),
    (ConnectError, 502, True),
    (TransportError, 502, False),
)


class mapped_errors:  # noqa: N801 (a context manager named like the function it was)
    """Turn transport failures into :class:`BackendError` (504 for timeouts).

    A class, not a ``@contextmanager`` generator: it is entered on every engine request (a few µs less).
    """

    __slots__ = ("what",)

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None or not isinstance(exc, Exception):
            return
        if isinstance(exc, TransportError):
            raise backend_error(self.what, exc) from exc


def backend_error(what: str, exc: TransportError) -> BackendError:
    """The :class:`BackendError` a transport failure is (:data:`TRANSPORT_ERRORS`)."""
    status, unreachable = next((s, u) for failure, s, u in TRANSPORT_ERRORS if isinstance(exc, failure))
    return BackendError(f"{what}: {exc}", status=status, unreachable=unreachable)


def error_message(body: object) -> str:
    """The human message inside an engine's error body (OpenAI, FastAPI or plain)."""
    if isinstance(body, Mapping):
        err = body.get("error")
        if isinstance(err, Mapping):
            return str(err.get("message") or err)
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            if body.get(key):
                return str(body[key])
    return str(body)[:1000]


def http_status(engine_status: int, message: str) -> int:
    """Our status for an engine's HTTP error status."""
    if engine_status in (400, 413, 422):
        return 400
    if engine_status in (429, 503):
        return 503
    if engine_status in (408, 504):
        return 504
    return 502


def stream_error_status(error: object, message: str) -> int:
    """Our status for an error reported inside a 200 stream."""
    code = error.get("code") if isinstance(error, Mapping) else None
    if isinstance(code, int) and code >= 400:
        return http_status(code, message)
    return 400 if _INVALID.search(message) else 502


async def check_status(response: BodyResponse, what: str) -> None:
    """Raise :class:`BackendError` with the engine's message when ``status >= 400``."""
    if response.status_code < 400:
        return
    raw = b""
    with mapped_errors(what):
        async for chunk in response.aiter_bytes():
            raw += chunk
            if len(raw) > _ERROR_BODY_LIMIT:
                break
    await response.aclose()
    text = raw.decode("utf-8", errors="replace")
    try:
        message = error_message(orjson.loads(text))
    except ValueError:
        message = text.strip()[:1000] or response.reason_phrase
    raise BackendError(
        f"{what}: HTTP {response.status_code}: {message}",
        status=http_status(response.status_code, message),
    )


async def discard(response: BodyResponse) -> None:
    """Read a small unwanted body to its end and close it, so its connection is reused."""
    try:
        with mapped_errors("discard"):
            size = 0
            async for chunk in response.aiter_bytes():
                size += len(chunk)
                if size > _ERROR_BODY_LIMIT:
                    break
    except BackendError:
        pass
    await response.aclose()
