"""What an HTTP transport fails with (httpcore's names): the engine layer maps them to its errors in one table."""

from __future__ import annotations


class TransportError(Exception):
    """The peer could not be reached, dropped the connection, broke HTTP, or timed out."""


class ProtocolError(TransportError):
    """A message that is not well-formed HTTP/1.1 (or exceeds a size limit), from either side.

    ``status_hint``: what a server answers a request this bad with (always a 4xx: a
    request the server cannot take is the client's error); a client reading a response
    ignores it.
    """

    def __init__(self, message: str, status_hint: int = 400) -> None:
        super().__init__(message)
        self.status_hint = status_hint


class ReadTimeout(TransportError):
    """No bytes came (or none could be sent) within the read timeout."""


class ConnectError(TransportError):
    """No connection could be opened: nothing reached the peer."""


class ConnectTimeout(ReadTimeout):
    """No connection was made within the connect timeout: nothing reached the peer."""
