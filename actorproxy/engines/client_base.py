"""What the engine clients share above the HTTP plumbing: the generation's backend, versions, model cards.

:class:`EngineGeneration` is a :class:`~.streaming.StreamedGeneration` that knows its
backend and its request (every engine client's generation is one).
:class:`VersionedConnection` is an engine that stamps weight versions and acknowledges
aborts (SGLang, vLLM): it keeps the newest version any answer reported (tokens that
carry none are stamped with it), counts its abort calls and gives control calls a
connection pool of their own; its generations (:class:`VersionedGeneration`) keep that
version up to date. :func:`first_model_card` reads ``GET /v1/models``; :func:`read_tolerantly`
structures the answer of such an info call.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Generic, TypeVar

from ..core.turn_events import TopLogprobs
from ..errors import BadRequest
from ..schema.converter import structure
from .aborts import AbortBatcher
from .base import GenerateRequest
from .connection import EngineConnection, EngineOptions, request_json
from .deltas import DEFAULT_VERSION
from .shared_wire import ModelCard, ModelList
from .streaming import P, StreamedGeneration

B = TypeVar("B", bound=EngineConnection)
T = TypeVar("T")


class EngineGeneration(StreamedGeneration[P], Generic[P, B]):
    """One streamed generation of ``request`` on ``backend``, read by ``parser``."""

    def __init__(self, backend: B, request: GenerateRequest, parser: P) -> None:
        super().__init__(backend.streams, request.rid, parser, abort_grace=backend.abort_grace)
        self._backend = backend
        self._request = request
        if request.sampling.top_logprobs:
            parser.top = []

    @property
    def top_logprobs(self) -> list[TopLogprobs] | None:
        """Each token handed out's alternatives, when the request asked for them (``Generation``)."""
        return self._parser.top


class VersionedConnection(EngineConnection):
    """An engine that reports weight versions and acknowledges aborts (see module docstring).

    Engine-specific settings are in ``options`` (:class:`EngineOptions`).
    """

    def __init__(self, base_url: str, options: EngineOptions | None = None) -> None:
        super().__init__(base_url, options, control_pool=True)
        #: The newest weight version seen in any answer (stamps tokens that carry none).
        self.last_version = DEFAULT_VERSION
        #: Abort calls made (statistics, tests).
        self.abort_calls = 0
        #: Request ids of the generations open on this engine.
        self.running: set[str] = set()
        #: Aborts asked in the same scheduling round, sent together (:meth:`_abort_batch`).
        self.batcher = AbortBatcher(self._abort_batch)

    async def _abort_batch(self, rids: list[str]) -> Collection[str]:
        """Abort ``rids`` in as few calls as the engine allows; the ids acknowledged."""
        raise NotImplementedError


V = TypeVar("V", bound=VersionedConnection)


class VersionedGeneration(EngineGeneration[P, V]):
    """A generation on a :class:`VersionedConnection`: each event's version becomes the backend's newest."""

    def _after_read(self) -> None:
        self._backend.last_version = self._parser.version


def read_tolerantly(answer: object, cls: type[T]) -> T:
    """An info call's answer as ``cls``; an empty ``cls()`` when it is not one (these are read tolerantly)."""
    try:
        return structure(answer, cls)
    except BadRequest:
        return cls()


async def first_model_card(connection: EngineConnection, what: str) -> ModelCard:
    """The first model of ``GET /v1/models`` (an empty card when the list is empty or malformed)."""
    models = read_tolerantly(await request_json(connection.http, "GET", connection.url("/v1/models"), what), ModelList)
    return models.data[0] if models.data else ModelCard()
