"""Wire helpers shared by the simulated engines' routes (no Trio, no app state).

A route reads its body with :func:`read_body`: the JSON structured by the wire
converter into the attrs class the engine's client sends (``engines/<engine>/protocol.py``),
so client and simulated server share one schema. Unknown keys are tolerated, as
the real servers do; a wrong type or value raises :class:`~actorproxy.errors.BadRequest`
naming the field. What the engine would accept but the simulator cannot honour raises
:class:`BadField`. Each engine's blueprint answers both in that engine's own error format.

Replies that come once per request (a whole completion, a stream's final event, model
info, the parsing endpoints' answers) are rendered from the protocol's attrs classes too.
The per-token stream events stay plain dicts built in place: rendering one through an
attrs class and the converter measured about 27 us more per event here (7 us to build
the object, 24 us to unstructure it, against 4 us for the dict), more than half again
what its JSON encoding costs (47 us with ``json``; orjson now), on every token of every stream.

A streamed generation served by the project's HTTP server (:func:`event_stream`) writes each
event straight to the socket from the generation's task (the server's ``actorproxy.send_now``
scope extension, as the proxy's relay writes its deltas): no ASGI message and no pass
through Quart's response loop per event.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

import trio
from quart import Blueprint, Response, request

from ..engines.base import BackendError, WeightVersionSpan
from ..errors import BadRequest
from ..http.cycle import SEND_NOW_EXTENSION
from ..schema import jsonio
from ..schema.converter import CONVERTER, TokenIds, structure
from ..tokenization.detokenize import IncrementalDetokenizer
from ..tokenization.tokenizer import ChatTokenizer

T = TypeVar("T")


class BadField(ValueError):
    """A request the engine would reject with HTTP 400 (or ``status``)."""

    def __init__(self, message: str, *, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def engine_blueprint(
    name: str,
    import_name: str,
    error: Callable[[str, int], Response],
    invalid: Callable[[BadRequest], Response] | None = None,
) -> Blueprint:
    """A blueprint for one engine's routes: a malformed body (:class:`BadRequest`, answered by
    ``invalid``, else ``error``), a refused request (:class:`BadField`) and an engine failure
    (:class:`BackendError`) answer in that engine's error shapes."""
    bp = Blueprint(name, import_name)

    @bp.errorhandler(BadRequest)
    async def _invalid(exc: BadRequest) -> Response:
        return invalid(exc) if invalid is not None else error(exc.message, exc.status)

    @bp.errorhandler(BadField)
    async def _bad(exc: BadField) -> Response:
        return error(exc.message, exc.status)

    @bp.errorhandler(BackendError)
    async def _engine(exc: BackendError) -> Response:
        return error(str(exc), exc.status)

    return bp


def dumps(data: Any) -> str:
    """Compact JSON, as orjson / pydantic write it."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def json_response(data: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> Response:
    return Response(dumps(data), status=status, mimetype="application/json", headers=dict(headers or {}))


#: The message of a generation failed by an armed fault (``/sim/faults`` ``fail_next``), answered with a 500.
INJECTED_FAILURE = "simulated engine failure (injected fault)"


def rid_headers(rid: str) -> dict[str, str]:
    """The headers of a generation's answer: its request id, for tests to find its record."""
    return {"X-Sim-Rid": rid}


def event_stream(events: AsyncGenerator[bytes, None], rid: str) -> Response:
    """A generation's server-sent events, with no time limit on the response (a generation may run long).

    On the project's server the head goes out at once (as the engines' servers send it) and
    every event after it is written straight to the socket (:func:`_written`); elsewhere (an
    in-process test client) each event passes through Quart.
    """
    extensions: dict[str, Any] = request.scope.get("extensions") or {}
    send_now: Callable[[bytes], Awaitable[None] | None] | None = extensions.get(SEND_NOW_EXTENSION)
    body = events if send_now is None else _written(events, send_now)
    response = Response(body, mimetype="text/event-stream", headers=rid_headers(rid))
    response.timeout = None
    return response


async def _written(
    events: AsyncGenerator[bytes, None], send_now: Callable[[bytes], Awaitable[None] | None]
) -> AsyncIterator[bytes]:
    """The response body of :func:`event_stream` on the project's server: the head, then each event written by
    ``send_now`` (waiting only when the client's socket is full); a client gone ends the generation."""
    yield b""  # the head, now
    async with aclosing(events):
        try:
            async for data in events:
                pending = send_now(data)
                if pending is not None:  # the client reads slower than the events come
                    await pending
        except trio.BrokenResourceError:
            return  # the client is gone: the generation is left (recorded as disconnected)


#: The end of an SGLang or vLLM stream.
DONE = b"data: [DONE]\n\n"


def sse(data: Any) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n`` (compact JSON, as orjson writes it for the engines)."""
    return b"data: " + jsonio.dumps(data) + b"\n\n"


async def read_json(*, optional: bool = False) -> Any:
    """The request body's JSON, else :class:`BadRequest`; ``optional``: an empty body is ``{}``."""
    raw = await request.get_data(cache=False, as_text=False)
    if optional and not raw.strip():
        return {}
    try:
        return json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc}") from None


async def read_body(cls: type[T], *, optional: bool = False) -> T:
    """The request body as ``cls`` (the wire converter); :class:`BadRequest` naming what is wrong."""
    return structure(await read_json(optional=optional), cls)


def token_prompt(prompt: TokenIds | str, name: str, *, vocab_size: int) -> array[int]:
    """A token-id prompt, checked against the vocabulary; text is refused (the simulator is token-in only)."""
    if isinstance(prompt, str):
        raise BadField(
            f"'{name}' is text: the simulated engine is token-in only; send token ids "
            "(tokenize with the model's tokenizer first)"
        )
    if not prompt:
        raise BadField(f"'{name}' is required: a non-empty list of token ids")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise BadField(f"'{name}' holds a token id outside the vocabulary")
    return prompt


class IncrementalText:
    """Detokenize a growing id list into stable text deltas (as engines' detokenizers do): the proxy's own
    :class:`IncrementalDetokenizer`, which holds back an incomplete UTF-8 sequence until it completes (or
    the end); ``skip`` ids (special tokens, for ``skip_special_tokens``) are left out. ``text``: all so far.
    """

    def __init__(self, tokenizer: ChatTokenizer, skip: frozenset[int] = frozenset()) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer)
        self._skip = skip
        self.text = ""

    def push(self, ids: Sequence[int], *, final: bool = False) -> str:
        """Add ids; return the new text (possibly empty)."""
        skip = self._skip
        delta = self._detokenizer.feed([i for i in ids if i not in skip] if skip else ids)
        if final:
            delta += self._detokenizer.flush()
        self.text += delta
        return delta


def decode_text(tokenizer: ChatTokenizer, ids: Sequence[int], skip: frozenset[int] = frozenset()) -> str:
    return tokenizer.decode([i for i in ids if i not in skip])


def weight_spans(versions: Sequence[str]) -> list[dict[str, Any]]:
    """Half-open ``[start, end)`` spans of output indexes sampled by each weight version, as JSON
    (the ``weight_versions`` the clients read back into :class:`WeightVersionSpan`\\ s)."""
    spans: list[WeightVersionSpan] = []
    start = 0
    for i in range(1, len(versions) + 1):
        if i == len(versions) or versions[i] != versions[start]:
            spans.append(WeightVersionSpan(versions[start], start, i))
            start = i
    unstructured: list[dict[str, Any]] = CONVERTER.unstructure(spans)
    return unstructured
