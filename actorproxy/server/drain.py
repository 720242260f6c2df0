"""The ASGI types the server, the turn lane and the Quart app's wrapper share.

A response may start before its request's body has arrived (a 404, a 405, a 401
from the access check, a 413 or a 400 decided from the headers): the server
answers at once and reads the rest of the body after the answer, within the
body's rate bound, to serve the connection's next request; a rest too large to
be worth reading closes the connection (``connection: close``) instead. See
:meth:`actorproxy.http.cycle.Cycle.discard_rest`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]
