"""Error replies in the caller's own format, for the Quart app and the turn lane alike (no framework).

Every error leaves as JSON with a 4xx/5xx status: Anthropic's shape
(``{"type": "error", "error": {...}}``) on ``/v1/messages`` routes, OpenAI's
(``{"error": {"message", "type", "param", "code"}}``) elsewhere. A
:class:`~actorproxy.errors.ProxyError` keeps its status and code (and says
``Retry-After`` when it has one); an HTTP error of the framework (404, 405,
413, 408...) is an ``invalid_request_error`` named after its status; anything
else is a logged 500 that shows only the exception's type.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from ..errors import ProxyError
from ..protocols import anthropic

log = logging.getLogger("actorproxy.server.app")


@attrs.frozen
class ErrorReply:
    """An error response: status, JSON value, extra headers, and the proxy's own code for it.

    ``code`` is what the access log says (``error=``), whatever shape the body takes (Anthropic's
    names only an error *type*): the :class:`~actorproxy.errors.ProxyError`'s code, an HTTP error's
    name (``request_timeout``), or ``internal_error``; a fixed set, never the caller's text.
    """

    status: int
    data: Any
    headers: tuple[tuple[str, str], ...] = ()
    code: str = attrs.field(kw_only=True)
    #: A server-side failure's message (5xx), for the access log (``detail=``): its ``error=`` alone does not say
    #: what failed.
    detail: str | None = attrs.field(default=None, kw_only=True)


def is_anthropic_route(path: str) -> bool:
    """Whether ``path`` is Anthropic's (its errors then take Anthropic's shape)."""
    return "/v1/messages" in path


def _shaped(status: int, message: str, openai_body: Any, anthropic_shape: bool) -> Any:
    return anthropic.error_json(status, message) if anthropic_shape else openai_body


def error_reply(error: Exception, *, anthropic_shape: bool, method: str, path: str) -> ErrorReply:
    """The reply to ``error`` raised while serving ``method path`` (an unexpected one is logged)."""
    if isinstance(error, ProxyError):
        headers = (("Retry-After", str(int(error.retry_after))),) if error.retry_after is not None else ()
        return ErrorReply(error.status, _shaped(error.status, error.anthropic_message, error.to_openai(),
                                                anthropic_shape),
                          headers, code=error.code, detail=error.message if error.status >= 500 else None)
    if isinstance(error, HTTPException):
        status = error.code or 500
        kind = "not_found_error" if status == 404 else "invalid_request_error"
        message = error.description or error.name
        code = error.name.lower().replace(" ", "_")
        body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
        allow: tuple[tuple[str, str], ...] = ()
        if isinstance(error, MethodNotAllowed) and error.valid_methods:
            allow = (("Allow", ", ".join(error.valid_methods)),)
        return ErrorReply(status, _shaped(status, message, body, anthropic_shape), allow, code=code)
    log.exception("unexpected error handling %s %s", method, path, exc_info=error)
    message = f"internal error: {type(error).__name__}"
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "internal_error"}}
    return ErrorReply(500, _shaped(500, message, body, anthropic_shape), code="internal_error", detail=message)
