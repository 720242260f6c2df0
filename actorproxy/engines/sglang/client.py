"""The SGLang client: native ``/generate`` streaming, token ids in and out.

Requests carry every sampling field explicitly and ``return_logprob`` with
``logprob_start_len: -1``. The stream is read in both of SGLang's shapes: cumulative
``output_ids`` and logprobs (the default) and deltas (``--incremental-streaming-output``);
older builds without ``output_ids`` give the ids inside ``output_token_logprobs``.
Tokens are stamped with their ``weight_versions`` span when the engine reports spans,
else with the event's ``weight_version``.

An acknowledged abort is ``POST /abort_request {"rid"}``: SGLang then ends the stream
with ``finish_reason.type == "abort"`` and the partial output. Leaving the block early
closes the stream and sends the same abort (shielded, bounded by ``abort_grace``),
because SGLang alone would notice the disconnect only ~2 s later.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

import orjson
import trio

from ...http.client import HTTP11Client
from ...http.oneshot import OneShot
from ...schema.converter import CONVERTER, TokenIds
from ..aborts import AbortLanes
from ..base import (
    ROUTING_HEADER,
    AbortBatch,
    BackendError,
    GenerateRequest,
    ModelInfo,
    SamplingParams,
    new_rid,
)
from ..client_base import VersionedConnection, VersionedGeneration, first_model_card, read_tolerantly
from ..connection import (
    EngineOptions,
    EngineResponse,
    exchange_json,
    post_quietly,
    post_stream,
    request_json,
)
from ..errors import check_status
from ..shared_wire import UpdateWeightVersionReqInput, WeightVersionOutput
from . import protocol

log = logging.getLogger(__name__)

#: How an abort call's body is written (a pause writes a thousand): the converter's hook, found and made once.
_ABORT_JSON = CONVERTER.get_unstructure_hook(protocol.AbortReq)


def _abort_body(abort: protocol.AbortReq) -> bytes:
    """``abort`` as its call's JSON body."""
    return orjson.dumps(_ABORT_JSON(abort))


class SGLangGeneration(VersionedGeneration[protocol.SGLangStreamParser, "SGLangBackend"]):
    """One streamed ``/generate`` request (see :class:`StreamedGeneration`)."""

    what = "SGLang /generate"

    def __init__(self, backend: SGLangBackend, request: GenerateRequest) -> None:
        parser = protocol.SGLangStreamParser(
            stop_token_ids=request.sampling.stop_token_ids, version=backend.last_version
        )
        super().__init__(backend, request, parser)

    async def _open(self) -> EngineResponse:
        self._backend.running.add(self.rid)
        req = self._request
        body = protocol.generate_bytes(req, req.return_routed_experts and self._backend.options.routed_experts)
        headers = {ROUTING_HEADER: req.routing_key} if req.routing_key else {}
        url = self._backend.url(protocol.GENERATE_PATH)
        response = await post_stream(self._client, url, body, headers)
        await check_status(response, self.what)
        return response

    def _start_abort(self, batch: AbortBatch | None) -> Callable[[], Awaitable[None]] | None:
        if not self._backend.sends_aborts_now(batch):
            return super()._start_abort(batch)
        return self._backend.start_abort(self, batch)

    async def _send_abort(self) -> bool:
        if self._abort_requested:  # asked to stop (not leaving early): the engine must hear it at once
            return await self._backend.abort_now(self.rid)
        return await self._backend.abort(self.rid)

    async def __aexit__(self, *exc_info: object) -> None:
        try:
            await super().__aexit__(*exc_info)
        finally:
            self._backend.running.discard(self.rid)


class SGLangBackend(VersionedConnection):
    """One SGLang server (or sgl-model-gateway) behind the :class:`Backend` interface.

    ``options.routed_experts``: the server runs with ``--enable-return-routed-experts``;
    only then are requests asking for routed experts sent ``return_routed_experts``.
    """

    kind = "sglang"

    def __init__(self, base_url: str, options: EngineOptions | None = None) -> None:
        super().__init__(base_url, options)
        #: Where an acknowledged abort goes on a connection of its own (plain HTTP to an address, our own pools).
        self._origin = self.control.one_shot_origin() if isinstance(self.control, HTTP11Client) else None
        #: Where the model info is read (:meth:`_model_info_json`; ``None``: not known yet).
        self._info_path: str | None = None

    async def abort(self, rid: str) -> bool:
        """``POST /abort_request`` for ``rid``; ``True`` if acknowledged (status below 400).

        With ``options.abort_all``, aborts asked together (a pause) are one call when
        they cover every generation open here, else one call each, concurrently.
        """
        if self.options.abort_all:
            return await self.batcher.abort([rid])
        return await self._post_abort(protocol.AbortReq(rid))

    async def abort_now(self, rid: str) -> bool:
        """:meth:`abort` for a generation asked to stop (a pause, an agent gone): sent without a scheduling round.

        A pause asks a thousand of these at once, and the engine streams on until each
        arrives. With no kept-alive control connection free, each goes on a connection
        of its own opened and written in the asking task (:class:`OneShot`), not one
        round later (tens of milliseconds, with a thousand streams to read) when a
        connect through the pool would complete.
        """
        control = self.control
        if self.options.abort_all or self._origin is None or not isinstance(control, HTTP11Client) or control.idle:
            return await self.abort(rid)
        return _acknowledged(await self._one_shot(protocol.AbortReq(rid)).status())

    def sends_aborts_now(self, batch: AbortBatch | None) -> bool:
        """Whether :meth:`start_abort` can send an abort asked now (else it is sent from a task)."""
        if self._origin is None:
            return False
        return not self.options.abort_all or (batch is not None and batch.open)

    def start_abort(
        self, generation: SGLangGeneration, batch: AbortBatch | None
    ) -> Callable[[], Awaitable[None]] | None:
        """Send ``generation``'s abort now (:meth:`sends_aborts_now`); reading the answer is left (or ``None``).

        A pause's (an open ``batch``) share a few connections of their own, pipelined,
        written together when the pause has asked them all (:class:`AbortLanes`); one
        asked alone goes on a connection of its own (:class:`OneShot`). The pause reads the answers of
        its pipelined calls (``batch.rest``): nothing is left for the generation's task. An abort whose
        connection failed or closed before answering it is sent once more on its own.
        With ``options.abort_all``, the pause's first sends one ``abort_all`` for all of
        its batch instead: everything this proxy runs on the engine, since a pause asks
        every generation in flight (a generation still opening sends its own as it opens).
        """
        if not self.options.abort_all and batch is not None and batch.open:
            self._pipelined_abort(generation, batch)
            return None
        if self.options.abort_all:
            assert batch is not None
            joined: list[SGLangGeneration] | None = batch.shared.get(self)
            if joined is not None:
                joined.append(generation)
                return None  # the batch's call is sent; the pause reads its answer for everyone
            joined = batch.shared[self] = [generation]
            abort = protocol.AbortReq("", abort_all=True)
        else:
            joined, abort = [generation], protocol.AbortReq(generation.rid)
        call = self._one_shot(abort)

        async def answer() -> None:
            acknowledged = _acknowledged(await call.status())
            for each in joined:
                each.abort_answered(acknowledged)

        if batch is not None and self.options.abort_all:
            batch.rest.append(answer)  # read by the pause for everyone who joined, however their attempts end
            return None
        return answer

    def _pipelined_abort(self, generation: SGLangGeneration, batch: AbortBatch) -> None:
        """``generation``'s abort on the pause's shared connections (:meth:`start_abort`); its answer is read by
        the pause (``batch.rest``), nothing is left to the turn."""
        assert self._origin is not None and isinstance(self.control, HTTP11Client)
        lanes: AbortLanes | None = batch.shared.get(self)
        if lanes is None:
            lanes = batch.shared[self] = AbortLanes(self._origin, protocol.ABORT_PATH, self.control.read_timeout, batch)
        self.abort_calls += 1
        abort = protocol.AbortReq(generation.rid)

        async def answered(got: int | None) -> None:
            if got is None:  # the shared connection failed or closed first: once more, on its own
                got = await self._one_shot(abort).status()
            generation.abort_answered(_acknowledged(got))

        lanes.add(_abort_body(abort), answered)

    def _one_shot(self, abort: protocol.AbortReq) -> OneShot:
        """``abort`` on a connection of its own, sent now (``_origin`` is known)."""
        assert self._origin is not None and isinstance(self.control, HTTP11Client)
        self.abort_calls += 1
        return self._origin.post(protocol.ABORT_PATH, _abort_body(abort), self.control.read_timeout)

    async def _post_abort(self, abort: protocol.AbortReq) -> bool:
        self.abort_calls += 1
        body = CONVERTER.unstructure(abort)
        return _acknowledged(await post_quietly(self.control, self.url(protocol.ABORT_PATH), body, "SGLang abort"))

    async def _abort_batch(self, rids: list[str]) -> Collection[str]:
        if len(rids) > 1 and self.running <= set(rids):
            # Everything this proxy runs on the engine: SGLang stops it all in one call.
            return rids if await self._post_abort(protocol.AbortReq("", abort_all=True)) else ()
        acknowledged: list[str] = []

        async def one(rid: str) -> None:
            if await self._post_abort(protocol.AbortReq(rid)):
                acknowledged.append(rid)

        async with trio.open_nursery() as nursery:
            for rid in rids:
                nursery.start_soon(one, rid)
        return acknowledged

    def open_generation(self, request: GenerateRequest) -> SGLangGeneration:
        return SGLangGeneration(self, request)

    async def model_info(self) -> ModelInfo:
        """From SGLang's model info (:meth:`_model_info_json`; ``/v1/models`` for the length).

        Its ``weight_version`` is the engine's current one (``/update_weight_version`` moves
        it). Only a build whose model info has none is asked ``/get_weight_version``, a route
        SGLang had for a while and has dropped (0.5.23 answers it 404).
        """
        info = read_tolerantly(await self._model_info_json(), protocol.ModelInfoOutput)
        version = info.weight_version
        if version is None:
            try:
                got = await request_json(self.http, "GET", self.url("/get_weight_version"), "SGLang weight version")
                version = read_tolerantly(got, WeightVersionOutput).weight_version
            except BackendError as exc:
                log.warning("SGLang at %s reports no weight version (%s); keeping %r", self.base_url, exc,
                            self.last_version)
        max_len = info.max_model_len if info.max_model_len is not None else info.context_length
        if max_len is None:
            max_len = await self._max_len_from_models()
        if version is not None:
            self.last_version = str(version)
        model = info.model_path or info.served_model_name or "sglang"
        return ModelInfo(model, max_len, str(version if version is not None else self.last_version))

    async def _model_info_json(self) -> Any:
        """``GET /model_info``, or ``/get_model_info`` where the engine has no ``/model_info``.

        SGLang 0.5.23 serves ``/model_info`` and keeps ``/get_model_info`` as a deprecated
        alias that logs a warning on every call; older builds (and gateways) have only
        ``/get_model_info``. The first answer decides, by its status alone (404/405: the
        route is absent), once per engine, and the choice is logged.
        """
        what = "SGLang model info"
        if self._info_path is None:
            status, info = await exchange_json(self.http, "GET", self.url(protocol.MODEL_INFO_PATH), what,
                                               accept=_ROUTE_ABSENT)
            if status not in _ROUTE_ABSENT:
                self._info_path = protocol.MODEL_INFO_PATH
                return info
            self._info_path = protocol.LEGACY_MODEL_INFO_PATH
            log.info("SGLang at %s has no %s (HTTP %d): reading its model info from %s", self.base_url,
                     protocol.MODEL_INFO_PATH, status, self._info_path)
        return await request_json(self.http, "GET", self.url(self._info_path), what)

    async def _max_len_from_models(self) -> int | None:
        try:
            return (await first_model_card(self, "SGLang models")).max_model_len
        except BackendError:
            return None

    async def prompt_logprobs(self, input_ids: array[int]) -> list[float | None]:
        """A prefill-only ``/generate`` (``max_new_tokens: 0``, ``logprob_start_len: 0``)."""
        body = protocol.GenerateReqInput(
            rid=new_rid(),
            input_ids=TokenIds(input_ids),
            stream=False,
            sampling_params=protocol.SGLangSamplingParams.of(SamplingParams(max_new_tokens=0)),
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=0,
        )
        url, what = self.url(protocol.GENERATE_PATH), "SGLang prompt logprobs"
        out = await request_json(self.http, "POST", url, what, body=CONVERTER.unstructure(body))
        if isinstance(out, list) and len(out) == 1:
            out = out[0]
        meta = out.get("meta_info") if isinstance(out, Mapping) else None
        entries = meta.get("input_token_logprobs") if isinstance(meta, Mapping) else None
        if not isinstance(entries, list) or len(entries) != len(input_ids):
            raise BackendError(f"SGLang: expected {len(input_ids)} input_token_logprobs, got {entries!r:.200}")
        result: list[float | None] = []
        for i, entry in enumerate(entries):
            value = entry[0] if isinstance(entry, list | tuple) and entry else None
            result.append(None if i == 0 or value is None else float(value))
        return result

    async def pause(self, mode: protocol.PauseMode = "abort") -> None:
        """``POST /pause_generation``: ``abort``, ``retract`` or ``in_place``."""
        body = CONVERTER.unstructure(protocol.PauseGenerationReq(mode))
        await request_json(self.http, "POST", self.url("/pause_generation"), "SGLang pause", body=body)

    async def continue_generation(self) -> None:
        await request_json(self.http, "POST", self.url("/continue_generation"), "SGLang continue", body={})

    async def freeze_refusal(self) -> str | None:
        """Every SGLang server can freeze its generations in place (``/pause_generation`` ``in_place``)."""
        return None

    async def freeze(self) -> None:
        """A ``keep`` pause: the scheduler stops stepping; the running requests stay in its batch, KV cache kept.

        :meth:`thaw` lets them go on in the same request; a version pushed meanwhile
        (:meth:`update_weight_version`, which aborts nothing) stamps the tokens after it.
        """
        await self.pause("in_place")

    async def thaw(self) -> None:
        await self.continue_generation()

    async def update_weight_version(self, version: str, *, abort_all_requests: bool = False) -> None:
        body = CONVERTER.unstructure(UpdateWeightVersionReqInput(version, abort_all_requests))
        await request_json(self.http, "POST", self.url("/update_weight_version"), "SGLang weight version", body=body)
        self.last_version = version


#: An engine's answer to a route it does not have (FastAPI: 404 for the path, 405 for the method).
_ROUTE_ABSENT = frozenset({404, 405})


def _acknowledged(status: int | None) -> bool:
    """An abort call's answer: acknowledged when the engine answered below 400."""
    return status is not None and status < 400
