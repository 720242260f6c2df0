"""The turn routes at the ASGI level, in front of the Quart app: the lean path a model call takes.

Every turn (``POST`` to ``/v1/chat/completions``, ``/v1/messages``,
``/v1/responses`` under each of their mounts, and the gateway's ``/generate``)
is served here, straight from the ASGI messages; every other request,
and any other method on these paths, falls through to the Quart app. Quart cost
0.5-0.9 ms of CPU per request (werkzeug request and response objects, routing,
app and request contexts, hooks: see ``benchmarks/http_floor.py`` and
docs/decisions.md); a turn needs none of it.

A turn is admitted or refused by the same step as a Quart route (:mod:`.admission`:
the access policy, the admin token on ``/generate``, the body limits: 413 past
``max_body``, 408 past ``body_timeout``; every error as JSON in the caller's
format); an empty body is a 400 of the handler's; the request's :class:`~actorproxy.telemetry.RequestInfo`
for the access log and the metrics (:class:`.observe.Observer`), and the client
hanging up cancels the turn (its generation is aborted at the engine).
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import attrs
import trio
from werkzeug.exceptions import RequestTimeout

from ..errors import release
from ..http.cycle import (
    BODY_EXTENSION,
    DISCONNECT_EXTENSION,
    PROCESSING_EXTENSION,
    SEND_NOW_EXTENSION,
    SLOW_BODY_EXTENSION,
)
from ..protocols.format import Headers
from ..schema import jsonio
from ..telemetry import CURRENT, RequestInfo
from .admission import Admission, RequestHeaders
from .drain import ASGIApp, Receive, Send
from .identity import url_mount
from .observe import Observer
from .turns import EarlyStart, SSEReply, TurnReply

#: A turn route's handler: (body bytes, headers, URL session, URL prompt group, the key's session, the client
#: that opens a session: ``AccessPolicy.client_of``, what starts a streamed reply before its turn starts:
#: ``server/turns.py: EarlyStart``) -> reply.
TurnHandler = Callable[[bytes, Headers, str | None, str | None, str | None, str | None, EarlyStart | None],
                       Awaitable[TurnReply]]

#: Where the model routes are mounted: plain, per session, and Claw-R1 style (session, prompt group).
MOUNTS = ("", "/sess/<url_session>", "/<url_session>/<url_instance>")

_JSON = (b"content-type", b"application/json")
#: The User-Agents of the HTTP clients known to skip an interim ``102 Processing`` and start their read timeout
#: over with it (``--processing-heartbeats auto``; each is run against the proxy by
#: ``tests/server/test_processing_heartbeats.py`` and ``tests/agents/test_agents_wait_out_a_pause.py``): httpx
#: (its own, and the OpenAI and Anthropic Python SDKs', sync and async), aiohttp, and Node's fetch (undici: its
#: own ``node``, and the Vercel AI SDK's on Node). Python's ``http.client`` (``urllib``, ``requests``) takes a
#: 102 for the answer.
_TAKES_PROCESSING = re.compile(
    r"python-httpx/|\b(?:Async)?(?:OpenAI|Anthropic)/Python\b|\baiohttp/|^node$|\bai-sdk-provider-utils/\S+ node\.js/")
_SSE_HEADERS = [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"),
                (b"content-type", b"text/event-stream; charset=utf-8")]


@attrs.frozen
class Match:
    """A turn route matched: its handler, its rule (the metrics' label) and the URL's session and prompt group."""

    handler: TurnHandler
    rule: str
    url_session: str | None = None
    url_instance: str | None = None


class TurnLane:
    """ASGI app: the turn routes served directly, everything else by ``app``."""

    def __init__(self, app: ASGIApp, *, observer: Observer, admission: Admission,
                 processing: Literal["auto", "always", "never"] = "auto") -> None:
        self.app = app
        self.observer = observer
        #: Who gets a ``102 Processing`` while a call that does not stream waits (``--processing-heartbeats``).
        self.processing = processing
        #: Who may call, how big a body may be, how a refusal reads: the Quart app's own step.
        self.admission = admission
        self._suffixes: dict[str, TurnHandler] = {}
        self._paths: dict[str, TurnHandler] = {}

    def mount(self, suffix: str, handler: TurnHandler) -> None:
        """Serve ``POST suffix`` under every mount (``/``, ``/sess/<id>``, ``/<trajectory>/<prompt>``)."""
        self._suffixes[suffix] = handler

    def route(self, path: str, handler: TurnHandler) -> None:
        """Serve ``POST path`` (that path only)."""
        self._paths[path] = handler

    def takes_processing(self, user_agent: str | None) -> bool:
        """Whether a client of this ``User-Agent`` gets ``102 Processing`` heartbeats (``--processing-heartbeats``)."""
        if self.processing == "auto":
            return user_agent is not None and _TAKES_PROCESSING.search(user_agent) is not None
        return self.processing == "always"

    def match(self, path: str) -> Match | None:
        """The turn route ``path`` names, as the Quart app's URL map would match it; ``None``: not a turn route."""
        handler = self._paths.get("/" + path.lstrip("/"))  # the URL map ignores extra leading slashes
        if handler is not None:
            return Match(handler, "/" + path.lstrip("/"))
        found = url_mount(path, self._suffixes)
        if found is None:
            return None
        suffix, session, instance = found
        rule = suffix if session is None else (MOUNTS[1] if instance is None else MOUNTS[2]) + suffix
        return Match(self._suffixes[suffix], rule, session, instance)

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and not scope.get("root_path"):
            found = self.match(scope["path"])
            if found is not None:
                await _Turn(self, found, scope, receive, send).serve()
                return
        await self.app(scope, receive, send)


class _Turn:
    """One turn request on the lane."""

    def __init__(self, lane: TurnLane, found: Match, scope: Any, receive: Receive, send: Send) -> None:
        self.lane, self.found, self.receive, self.send = lane, found, receive, send
        self.path: str = scope["path"]
        self.headers = RequestHeaders(scope["headers"])
        self.gone = False  # the client went away
        self.confined: str | None = None  # the session an agent's key confines the call to
        self.client: str | None = None  # who opens a session (the per-client session bound)
        self.remote: str | None = (scope.get("client") or (None,))[0]
        self.started = False  # the response has started
        self.last_sent = 0.0  # when a streamed reply last sent something (``trio.current_time``)
        self.info = RequestInfo("POST", self.path, found.rule, time.perf_counter())
        self.info.session = found.url_session or self.headers.get("X-Session-Id")
        extensions = scope.get("extensions") or {}
        self.on_disconnect: Callable[[Callable[[], None]], None] | None = extensions.get(DISCONNECT_EXTENSION)
        self.body_now: Callable[[], bytes | None] | None = extensions.get(BODY_EXTENSION)
        self.too_slow: Callable[[], Exception | None] | None = extensions.get(SLOW_BODY_EXTENSION)
        self.send_now: Callable[[bytes], Awaitable[None] | None] | None = extensions.get(SEND_NOW_EXTENSION)
        self.processing: Callable[[], Awaitable[None]] | None = extensions.get(PROCESSING_EXTENSION)

    async def serve(self) -> None:
        token = CURRENT.set(self.info)
        try:
            try:
                raw = await self.request()
            except Exception as error:
                await self.fail(error)
                return
            if self.gone:
                return
            if self.on_disconnect is not None:  # our server calls back, then cancels this task, when the client leaves
                self.on_disconnect(self.hung_up)
                await self.run(raw)
                return
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.watch, nursery.cancel_scope)
                await self.run(raw)
                nursery.cancel_scope.cancel()
        finally:
            if self.gone and not self.info.finished:  # it left before any answer, or after an early start
                self.left()
                self.lane.observer.finish(self.info)
            CURRENT.reset(token)  # the server runs the next request of the connection in this task

    async def run(self, raw: bytes) -> None:
        """The handler, and its reply written (its error, in the caller's format)."""
        found = self.found
        try:
            reply = await found.handler(raw, self.headers, found.url_session, found.url_instance, self.confined,
                                        self.client, self)
            if isinstance(reply, bytes):
                await self.answer(200, reply)
            else:
                await self.stream(reply)
        except Exception as error:
            if self.started:  # a stream already under way: as under Quart, the server ends the connection
                raise
            await self.fail(error)

    def hung_up(self) -> None:
        self.gone = True

    def left(self) -> None:
        """The client left before the whole answer: counted and logged all the same, as nginx's 499 (the
        client closed the request), not silently dropped, whatever status a streamed reply's head said."""
        self.info.status, self.info.error_code = 499, "client_disconnected"

    async def request(self) -> bytes:
        """Admit the caller, then read the body (the Quart app's hook and checks, in their order)."""
        self.confined, self.client = self.lane.admission.admit(self.path, self.headers, self.remote,
                                                               url_session=self.found.url_session)
        return await self.read_body()

    async def fail(self, error: Exception) -> None:
        """Every error in the caller's format, as the Quart app's error handlers answer it."""
        if self.gone:
            release(error)
            return
        failed = self.lane.admission.refusal(error, method="POST", path=self.path)
        self.info.error_code = failed.code  # the proxy's own, whatever the body's shape (a streamed refusal's too)
        self.info.error_detail = failed.detail
        extra = [(name.lower().encode(), value.encode("latin-1")) for name, value in failed.headers]
        await self.answer(failed.status, jsonio.dumps(failed.data), extra)

    async def read_body(self) -> bytes:
        """The request body (413 past the limit, 408 when it does not arrive in time)."""
        admission = self.lane.admission
        admission.check_length(self.headers)
        if self.body_now is not None:  # the whole body is there already (the common case): no timeout to set
            whole = self.body_now()
            if whole is not None:
                admission.check_size(len(whole))
                return whole
        chunks: list[bytes] = []
        size = 0
        with trio.move_on_after(admission.body_timeout):
            while True:
                message = await self.receive()
                if message["type"] != "http.request":
                    slow = self.too_slow() if self.too_slow is not None else None
                    if slow is not None:  # not gone: the body came too slowly (the server's bound), a 408
                        raise slow
                    self.gone = True
                    return b""
                chunk = message.get("body", b"")
                size += len(chunk)
                admission.check_size(size)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
        raise RequestTimeout()

    async def watch(self, scope: trio.CancelScope) -> None:
        """Cancel the turn when the client hangs up (its generation is then aborted)."""
        while (await self.receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        scope.cancel()

    async def answer(self, status: int, body: bytes, extra: list[tuple[bytes, bytes]] | None = None) -> None:
        """A whole JSON reply (counted and logged before it is sent, as the Quart app's hook did)."""
        info = self.info
        info.status = status
        self.lane.observer.finish(info)
        headers = [_JSON, (b"content-length", str(len(body)).encode()), *(extra or ()), *_warning(info)]
        await self.send({"type": "http.response.start", "status": status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def stream(self, reply: SSEReply) -> None:
        """An SSE reply, chunk by chunk, with its heartbeat after each ``interval`` of silence.

        Under the own server the deltas that come while no chunk is pending are written by
        the session's task itself (:meth:`SSEReply.relay`). Counted and logged when it ends,
        however it ends; one that ends with an error frame (its turn refused after an early
        start, or failed mid-stream) as that error: the status a plain refusal would have had
        and the error's code, though its head said 200; one whose client left before its end
        as a 499 (:meth:`left`).
        """
        send = self.send
        whole = False  # the body's end went out
        try:
            if not self.started:
                await self.start()
            if self.send_now is not None:
                reply.relay(self.send_now)
            ended = False
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.heartbeats, reply)
                clock = trio.lowlevel.current_clock()
                async for chunk in reply:
                    ended = reply.ended  # the reply's last frames: the body's end leaves with them, in one write
                    await send({"type": "http.response.body", "body": chunk, "more_body": not ended})
                    self.last_sent = clock.current_time()
                nursery.cancel_scope.cancel()
            if not ended:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            whole = True
        finally:
            if self.gone and not whole:
                self.left()
            elif reply.failed is not None:
                failed = self.lane.admission.refusal(reply.failed, method="POST", path=self.path)
                self.info.status, self.info.error_code = failed.status, failed.code
                self.info.error_detail = failed.detail
            self.lane.observer.finish(self.info)
            await reply.aclose()

    async def start(self) -> None:
        """The streamed reply's head (sent with what follows it)."""
        self.info.status = 200
        self.started = True
        await self.send({"type": "http.response.start", "status": 200,
                         "headers": [*_SSE_HEADERS, *_warning(self.info)] if self.info.warning else _SSE_HEADERS})
        self.last_sent = trio.current_time()

    async def start_now(self, heartbeat: bytes) -> None:
        """Start the streamed reply before its turn starts (``server/turns.py: EarlyStart``), and send ``heartbeat``."""
        if not self.started:
            await self.start()
        await self.beat(heartbeat)

    async def beat(self, heartbeat: bytes) -> None:
        """A heartbeat of the streamed reply under way (the silence it breaks starts over)."""
        self.last_sent = trio.current_time()
        await self.send({"type": "http.response.body", "body": heartbeat, "more_body": True})

    @property
    def informs(self) -> bool:
        """Whether this call's client gets a ``102 Processing`` each interval it waits (not streamed)."""
        return self.processing is not None and self.lane.takes_processing(self.headers.get("User-Agent"))

    async def still_working(self) -> None:
        """A ``102 Processing`` to the client of a call that does not stream, still waiting for its answer."""
        if self.processing is not None:
            await self.processing()

    async def heartbeats(self, reply: SSEReply) -> None:
        """The reply's heartbeat whenever nothing was sent for ``reply.interval`` seconds.

        One task per streamed reply, asleep until the next heartbeat could be due: a chunk
        sent meanwhile only moves ``last_sent`` (no timer per chunk).
        """
        while True:
            due = max(self.last_sent, reply.last_write) + reply.interval
            if trio.current_time() < due:
                await trio.sleep_until(due)
                continue
            await self.beat(reply.heartbeat())


def _warning(info: RequestInfo) -> list[tuple[bytes, bytes]]:
    """The reply's ``X-Actorproxy-Warning`` header, when the turn noted one (``telemetry.note_warning``)."""
    return [(b"x-actorproxy-warning", info.warning.encode("latin-1", "replace"))] if info.warning else []


async def served_by_the_lane(**_: Any) -> Any:
    """The Quart view of a turn route, never called: the lane answers every POST to it first.

    The rule is registered so that the URL map answers the other methods (405
    with ``Allow``, ``OPTIONS``) and ``/openapi.json`` lists the route.
    """
    raise RuntimeError("a turn route reached the Quart app: the turn lane serves it")

