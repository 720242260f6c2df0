"""How the proxy talks to one engine over HTTP: options, connection pools, JSON calls.

:class:`EngineOptions` holds what every engine client is built with; :class:`EngineConnection`
owns the base URL and its client, the floor's :class:`~actorproxy.http.client.HTTP11Client`
(a keep-alive pool sized to the engine's concurrency) for every call: generation streams
and the rarely used calls (model info, health, prompt logprobs, pause) alike; aborts may
get a pool of their own (``control_pool``). :func:`request_json` and :func:`post_quietly`
make one call, with request bodies written by orjson (:func:`json_body`).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from typing import Any, Literal, Protocol

import attrs
import numpy as np
import orjson

from ..http.client import HTTP11Client
from .base import BackendError
from .errors import check_status, discard, mapped_errors
from .ids_json import MIN_IDS, IdsJSON

log = logging.getLogger(__name__)


@attrs.frozen
class EngineOptions:
    """How the proxy talks to one engine: the settings every engine client shares."""

    connect_timeout: float = 10.0
    read_timeout: float = 600.0
    #: Bound on cleanup (an abort call, draining or closing a stream), in seconds.
    abort_grace: float = 2.0
    #: Generations run on this engine at once (the pool's limit): the keep-alive
    #: pool keeps that many connections, so no turn opens one in steady state.
    concurrency: int = 256
    #: Seconds an idle connection is kept: below the engines' own keep-alive timeout
    #: (5 s in SGLang's and vLLM's uvicorn), so a connection the engine is closing is never reused.
    keepalive_expiry: float = 4.0
    #: The engine serves this proxy alone: when every generation it runs there is
    #: aborted at once (a pause), one SGLang ``abort_all`` call stops them all.
    abort_all: bool = False
    #: The engine runs with ``--enable-return-routed-experts``: only then are requests
    #: asking for routed experts sent ``return_routed_experts`` (SGLang).
    routed_experts: bool = False
    #: The generation API to use (vLLM: ``generate`` or ``completions``); ``None``: detect it on first use.
    api: Literal["generate", "completions"] | None = None


class BodyResponse(Protocol):
    """A streamed HTTP response read as bytes."""

    @property
    def status_code(self) -> int: ...

    @property
    def reason_phrase(self) -> str: ...

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    async def aclose(self) -> None: ...


class EngineResponse(BodyResponse, Protocol):
    """A streamed HTTP response (an :class:`~actorproxy.http.client.Response`, or a test's stand-in).

    Reading fails with :class:`~actorproxy.http.errors.TransportError`.
    """

    async def receive_into(self, out: bytearray) -> bool:
        """Append the body bytes that have arrived to ``out`` (waiting for some); ``False`` at the body's end."""
        ...

    def cut(self) -> None:
        """Abandon the body now: a read waiting on it fails with ``TransportError``."""
        ...


class EngineHTTP(Protocol):
    """What the hot path needs of an HTTP client: one streamed request."""

    async def stream(
        self, method: str, url: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> EngineResponse: ...


def make_streams(base_url: str, options: EngineOptions) -> HTTP11Client:
    """The hot-path client of one engine: idle connections kept up to its concurrency."""
    return HTTP11Client(
        base_url,
        max_idle=options.concurrency,
        keepalive_expiry=options.keepalive_expiry,
        connect_timeout=options.connect_timeout,
        read_timeout=options.read_timeout,
    )


class EngineConnection:
    """The HTTP plumbing every engine client shares: base URL, its client, cleanup.

    ``http`` (also ``streams``) carries every call; ``control`` the aborts: with
    ``control_pool``, a pool of its own with a shorter read timeout, so an abort is
    bounded by it and never waits on the 600 s a generation's read may take.
    """

    def __init__(self, base_url: str, options: EngineOptions | None = None, *, control_pool: bool = False) -> None:
        self.base_url = base_url.rstrip("/")
        self.options = options = options or EngineOptions()
        #: The engine's client: generation streams and the rare calls (model info, health, prompt logprobs, the
        #: tokenizer check) on the same keep-alive connections.
        self.http = make_streams(self.base_url, options)
        self.streams: EngineHTTP = self.http
        self._control = make_streams(self.base_url, attrs.evolve(options, read_timeout=30.0)) if control_pool else None
        self.control: EngineHTTP = self._control or self.http
        self.abort_grace = options.abort_grace

    def url(self, path: str) -> str:
        return self.base_url + path

    async def health(self) -> bool:
        """``GET /health``: 200 means up (SGLang runs a one-token probe behind it).

        Raises :class:`BackendError` when no answer comes (connection or read failure):
        the pool tells that apart from an engine answering that it is not healthy.
        """
        with mapped_errors(f"{self.base_url} health"):
            response = await self.http.stream("GET", self.url("/health"))
        await discard(response)
        return response.status_code == 200

    async def aclose(self) -> None:
        await self.http.aclose()
        if self._control is not None:
            await self._control.aclose()


def json_body(body: object) -> bytes:
    """An engine request body as JSON bytes; token arrays (``array('i')``) are serialized whole.

    orjson, with each ``array`` passed as a zero-copy numpy view: a 97k-token prompt
    costs about 0.3 ms instead of 18 ms for ``tolist()`` then ``json.dumps`` (one
    Python int per token, then Python's encoder walking them). A long prompt that
    extends one written before is its JSON text and the new ids' (:mod:`.ids_json`).
    """
    long: list[array[int]] = []

    def array_json(value: object) -> Any:
        if isinstance(value, array):
            if _IDS_JSON.takes(value):
                long.append(value)
                return _MARK
            return np.frombuffer(value, dtype=value.typecode)
        raise TypeError(f"{type(value).__name__} is not JSON serializable")

    out = orjson.dumps(body, default=array_json, option=orjson.OPT_SERIALIZE_NUMPY)
    # The long arrays' text goes where their marks are, in one copy (orjson escapes a NUL byte in a string).
    return _IDS_JSON.splice(out.split(b"\0"), long) if long else out


_IDS_JSON = IdsJSON()


def age_prompt_json() -> None:
    """Let the prompts' JSON kept for engine requests drop what no request used since the last call
    (:meth:`IdsJSON.age`; ``Runtime.after_drain`` calls it)."""
    _IDS_JSON.age()

#: Where a long token array's JSON goes: a NUL byte, which orjson writes nowhere else.
_MARK = orjson.Fragment(b"\0")


_NUMPY = orjson.OPT_SERIALIZE_NUMPY
#: Body templates an engine keeps (one per sampling setting seen; all dropped when full).
_MAX_TEMPLATES = 256


class BodyTemplate:
    """A request body's JSON, written once with holes: a request's bytes are its pieces and the holes' JSON.

    An engine's generation bodies differ, turn to turn, only in the prompt's ids and the
    request id (a session's turns sample alike): the rest is written once per sampling
    setting (each engine's ``protocol.py`` keeps its templates) and a request's body is
    one join of the pieces with the ids' JSON (a long prompt's through :mod:`.ids_json`)
    and the strings'. No body value is made per request.
    """

    __slots__ = ("holes", "_pieces")

    def __init__(self, body: Mapping[str, Any], holes: Collection[str]) -> None:
        #: The holes' keys, in the order :meth:`fill` takes their values (the body's).
        self.holes = tuple(key for key in body if key in holes)
        marked = {key: _MARK if key in holes else value for key, value in body.items()}
        self._pieces = orjson.dumps(marked).split(b"\0")

    @staticmethod
    def kept(templates: dict[Any, BodyTemplate], key: object, make: Callable[[], Mapping[str, Any]],
             holes: Collection[str]) -> BodyTemplate:
        """The template of ``key`` in ``templates`` (an engine's, bounded), written from ``make()`` the first time.

        Settings that cannot be a key (a list where a tuple is typed) get a template of their own, not kept.
        """
        try:
            template = templates.get(key)
        except TypeError:
            return BodyTemplate(make(), holes)
        if template is None:
            if len(templates) >= _MAX_TEMPLATES:
                templates.clear()
            template = templates[key] = BodyTemplate(make(), holes)
        return template

    def fill(self, *values: array[int] | str) -> bytes:
        """The body with each hole's value, in the holes' order in the body: token ids (``array('i')``) or a string."""
        pieces = self._pieces
        parts: list[bytes] = [pieces[0]]
        spliced: list[bytes] = []  # the pieces around long prompts, which IdsJSON writes (and keeps)
        longs: list[array[int]] = []
        for value, after in zip(values, pieces[1:], strict=True):
            if isinstance(value, str) or not isinstance(value, array):  # (ids given as a list: written as one)
                parts.append(orjson.dumps(value))
            elif len(value) < MIN_IDS or not _IDS_JSON.takes(value):
                parts.append(orjson.dumps(np.frombuffer(value, dtype=value.typecode), option=_NUMPY))
            else:
                spliced.append(b"".join(parts))
                longs.append(value)
                parts = []
            parts.append(after)
        if not longs:
            return b"".join(parts)
        spliced.append(b"".join(parts))
        return _IDS_JSON.splice(spliced, longs)


#: The header of a request with a :func:`json_body` body.
_JSON = {"content-type": "application/json"}


async def exchange_json(
    client: HTTP11Client, method: str, url: str, what: str, *, body: object = None, accept: Collection[int] = ()
) -> tuple[int, Any]:
    """One non-streamed call: its status and decoded JSON body (``None`` for an empty body).

    A status of 400 or more is a :class:`BackendError` with the engine's message, unless
    ``accept`` holds it (a route the engine may not have): its body is then ``None`` if it
    is no JSON.
    """
    with mapped_errors(what):
        response = await client.stream(method, url, None if body is None else json_body(body),
                                       None if body is None else _JSON)
        try:
            status = response.status_code
            if status >= 400 and status not in accept:
                await check_status(response, what)
            raw = await response.aread()
        finally:
            await response.aclose()
    if not raw.strip():
        return status, None
    try:
        return status, orjson.loads(raw)
    except ValueError as exc:
        if status >= 400:
            return status, None
        raise BackendError(f"{what}: response is not JSON: {raw[:200]!r}") from exc


async def request_json(client: HTTP11Client, method: str, url: str, what: str, *, body: object = None) -> Any:
    """One non-streamed call; the decoded JSON body (``None`` for an empty body); a status >= 400 is an error."""
    return (await exchange_json(client, method, url, what, body=body))[1]


async def post_stream(
    client: EngineHTTP, url: str, body: object, headers: Mapping[str, str] | None = None
) -> EngineResponse:
    """POST a JSON body (bytes as they are, e.g. a :class:`BodyTemplate`'s; else :func:`json_body`'s); the streamed
    response."""
    data = body if type(body) is bytes else json_body(body)
    return await client.stream("POST", url, data, {**_JSON, **headers} if headers else _JSON)


async def post_quietly(client: EngineHTTP, url: str, body: object, what: str) -> int | None:
    """POST best-effort (cleanup paths): the HTTP status, or ``None`` if it never answered."""
    try:
        with mapped_errors(what):
            response = await post_stream(client, url, body)
            await discard(response)
    except BackendError as exc:
        log.debug("%s failed: %s", what, exc)
        return None
    return response.status_code
