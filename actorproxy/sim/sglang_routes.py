"""SGLang's native API over the simulated engine: ``/generate`` and the RL control routes.

Token in, token out: ``input_ids`` is required and ``text`` is refused. Errors are
``{"error": {"message": ...}}`` with HTTP 400 (500 for an injected failure), as
SGLang's ``/generate`` answers a ``ValueError``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from http import HTTPStatus
from typing import Any

import attrs
from quart import Blueprint, Response, request

from ..engines.base import ROUTING_HEADER, BackendError, GenerateFinish, GenerateRequest, SamplingParams
from ..engines.sglang.protocol import (
    ABORT_PATH,
    GENERATE_PATH,
    LEGACY_MODEL_INFO_PATH,
    MODEL_INFO_PATH,
    AbortReq,
    GenerateReqInput,
    ModelInfoOutput,
    PauseGenerationReq,
    SGLangSamplingParams,
    finish_reason_json,
)
from ..engines.shared_wire import WeightVersionOutput
from ..errors import BadRequest
from ..same_named import build_from
from ..schema import jsonio
from ..schema.converter import CONVERTER
from . import wire
from .policy import alternatives
from .state import Chunk, SimState, check_sampling, collect, run_generation


@attrs.frozen
class _Options:
    """How to write the response (the request's output options)."""

    stream: bool
    return_logprob: bool
    logprob_start_len: int
    top_logprobs_num: int
    skip_special: bool
    no_stop_trim: bool
    max_new_tokens: int


def _error(message: str, status: int = 400) -> Response:
    return wire.json_response({"error": {"message": message}}, status)


def _invalid(exc: BadRequest) -> Response:
    # A body SGLang's request model refuses: its validation handler's ``ErrorResponse``, 400.
    status = HTTPStatus(exc.status)
    body = {"object": "error", "message": exc.message, "type": status.phrase, "param": exc.param, "code": exc.status}
    return wire.json_response(body, exc.status)


def _parse(state: SimState, body: GenerateReqInput) -> tuple[GenerateRequest, _Options]:
    if not body.input_ids:
        if body.text is not None:
            raise wire.BadField("'text' is not supported: the simulated engine is token-in only; send 'input_ids'")
        raise wire.BadField("Either text, input_ids or input_embeds should be provided.")
    ids = wire.token_prompt(body.input_ids, "input_ids", vocab_size=state.engine.tokenizer.vocab_size)
    params = body.sampling_params or SGLangSamplingParams()
    check_sampling(params.stop)
    sampling = build_from(SamplingParams, params, stop_token_ids=tuple(params.stop_token_ids or ()),
                          seed=params.sampling_seed, min_tokens=params.min_new_tokens,
                          ignore_eos=bool(params.ignore_eos))
    if sampling.min_tokens > sampling.max_new_tokens:  # SGLang's SamplingParams.verify refuses it, as it words it
        raise wire.BadField(f"min_new_tokens must be in [0, max_new_tokens({sampling.max_new_tokens})], "
                            f"got {sampling.min_tokens}.")
    if body.return_routed_experts and not state.settings.enable_return_routed_experts:
        raise wire.BadField("return_routed_experts needs the server flag --enable-return-routed-experts")
    generate = GenerateRequest(
        ids,
        sampling,
        rid=body.rid or uuid.uuid4().hex,
        routing_key=request.headers.get(ROUTING_HEADER),
        return_routed_experts=body.return_routed_experts,
    )
    options = build_from(_Options, body, skip_special=params.skip_special_tokens, no_stop_trim=params.no_stop_trim,
                         max_new_tokens=sampling.max_new_tokens)
    return generate, options


class _Writer:
    """Builds ``/generate`` outputs (whole, cumulative stream events, or incremental ones)."""

    def __init__(self, state: SimState, req: GenerateRequest, options: _Options, prompt_lps: list[Any]) -> None:
        self.state, self.req, self.options = state, req, options
        skip = state.engine.tokenizer.special_ids if options.skip_special else frozenset()
        self.skip = skip
        self.text = wire.IncrementalText(state.engine.tokenizer, skip)
        self.ids: list[int] = []
        self.lps: list[float] = []
        self.versions: list[str] = []
        self.stamped = False  # the first event's ``response_sent_to_client_ts`` was written
        self.input_lps = prompt_lps
        # A cumulative stream's growing lists, kept as their JSON (``encoded``): every id, every logprob entry.
        self.ids_json = bytearray()
        self.lps_json = bytearray()

    def _trimmed(self, ids: list[int], finish: GenerateFinish | None) -> list[int]:
        # SGLang drops a matched stop token from the text (not from output_ids) unless no_stop_trim.
        if finish is not None and finish.matched_stop is not None and not self.options.no_stop_trim and ids:
            return ids[:-1]
        return ids

    def meta(self, finish: GenerateFinish | None, version: str, start: int) -> dict[str, Any]:
        opts = self.options
        meta: dict[str, Any] = {
            "id": self.req.rid,
            "finish_reason": None if finish is None else finish_reason_json(finish, len(self.ids)),
            "prompt_tokens": len(self.req.input_ids),
            "completion_tokens": len(self.ids),
            "cached_tokens": 0,
            # SGLang 0.5.23 writes these too: the cache's split (null without a cache hit) on every event, the
            # time the first event was sent on that one.
            "cached_tokens_details": None,
            "weight_version": version,
        }
        if not self.stamped:
            self.stamped = True
            meta["response_sent_to_client_ts"] = time.time()
        if opts.return_logprob:
            meta["input_token_logprobs"] = self.input_lps
            pairs = zip(self.lps[start:], self.ids[start:], strict=True)
            meta["output_token_logprobs"] = [[lp, i, None] for lp, i in pairs]
            if opts.top_logprobs_num > 0:
                # The prompt's: only the token's own logprob is known to the simulator. The output's: its
                # likeliest ``top_logprobs_num`` (``policy.alternatives``), the sampled one not added (as SGLang).
                k = opts.top_logprobs_num
                meta["input_top_logprobs"] = [None if e[0] is None else [e] for e in self.input_lps]
                meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in alternatives(i, token_lp, k)]
                                               for token_lp, i, _ in meta["output_token_logprobs"]]
        if finish is not None:
            meta["weight_versions"] = wire.weight_spans(self.versions)
            if finish.routed_experts is not None:
                meta["routed_experts"] = finish.routed_experts
        return meta

    def _add(self, chunk: Chunk) -> tuple[int, str, str]:
        """``chunk`` added to the reply so far: where its tokens start, its text delta and its weight version."""
        start = len(self.ids)
        self.ids += chunk.token_ids
        self.lps += chunk.logprobs
        self.versions += chunk.versions
        new = self._trimmed(list(chunk.token_ids), chunk.finish)
        delta = self.text.push(new, final=chunk.finish is not None)
        version = chunk.versions[-1] if chunk.versions else self.state.engine.weight_version
        if chunk.finish is not None:
            version = chunk.finish.weight_version
        return start, delta, version

    def event(self, chunk: Chunk) -> dict[str, Any]:
        start, delta, version = self._add(chunk)
        if self.state.settings.incremental_streaming_output:
            meta = self.meta(chunk.finish, version, start)
            return {"text": delta, "output_ids": list(chunk.token_ids), "meta_info": meta}
        meta = self.meta(chunk.finish, version, 0)
        return {"text": self.text.text, "output_ids": list(self.ids), "meta_info": meta}

    def encoded(self, chunk: Chunk) -> bytes:
        """``chunk``'s server-sent event: :meth:`event` as JSON, but a cumulative event's growing lists (every
        id so far, every logprob entry so far) are kept encoded and appended to, not built and encoded again
        for every event (which made an event of a 2,000-token reply cost as much as its whole history)."""
        if self.state.settings.incremental_streaming_output or self.options.top_logprobs_num > 0:
            return wire.sse(self.event(chunk))
        start, _, version = self._add(chunk)
        meta = self.meta(chunk.finish, version, len(self.ids))  # no logprob entries: they are appended below
        _extend(self.ids_json, jsonio.dumps(chunk.token_ids))
        meta_json = jsonio.dumps(meta)
        if self.options.return_logprob:
            pairs = zip(self.lps[start:], self.ids[start:], strict=True)
            _extend(self.lps_json, jsonio.dumps([[lp, i, None] for lp, i in pairs]))
            meta_json = meta_json.replace(b'"output_token_logprobs":[]',
                                          b'"output_token_logprobs":[' + self.lps_json + b"]", 1)
        return (b'data: {"text":' + jsonio.dumps(self.text.text) + b',"output_ids":[' + self.ids_json
                + b'],"meta_info":' + meta_json + b"}\n\n")

    def whole(self, ids: list[int], lps: list[float], versions: list[str], finish: GenerateFinish) -> dict[str, Any]:
        self.ids, self.lps, self.versions = ids, lps, versions
        text = wire.decode_text(self.state.engine.tokenizer, self._trimmed(ids, finish), self.skip)
        return {"text": text, "output_ids": ids, "meta_info": self.meta(finish, finish.weight_version, 0)}


def _extend(encoded: bytearray, array_json: bytes) -> None:
    """Append the items of a JSON array (``array_json``) to the items kept in ``encoded``."""
    if len(array_json) > 2:
        if encoded:
            encoded += b","
        encoded += array_json[1:-1]


async def _input_logprobs(state: SimState, req: GenerateRequest, options: _Options) -> list[Any]:
    if not options.return_logprob or options.logprob_start_len < 0:
        return []
    lps = await state.engine.prompt_logprobs(req.input_ids)
    start = options.logprob_start_len
    return [[lp, tok, None] for lp, tok in zip(lps[start:], req.input_ids[start:], strict=True)]


async def _stream(
    state: SimState, req: GenerateRequest, writer: _Writer, drop_after: int | None
) -> AsyncGenerator[bytes, None]:
    try:
        gen = run_generation(state, req, protocol="sglang", stream=True, drop_after=drop_after)
        async with aclosing(gen) as chunks:
            async for chunk in chunks:
                yield writer.encoded(chunk)
    except BackendError as exc:
        yield wire.sse({"error": {"message": str(exc)}})
    yield wire.DONE


def sglang_blueprint(state: SimState) -> Blueprint:
    """SGLang's routes: generate, abort, weight version, pause/continue, model info."""
    bp = wire.engine_blueprint("sglang", __name__, _error, _invalid)

    @bp.post(GENERATE_PATH)
    async def generate() -> Response:
        req, options = _parse(state, await wire.read_body(GenerateReqInput))
        if not options.stream:  # a stream reports these as an error event, as SGLang does
            state.check_new(req)
        if state.take_failure(req, "sglang", stream=options.stream):
            return _error(wire.INJECTED_FAILURE, 500)
        writer = _Writer(state, req, options, await _input_logprobs(state, req, options))
        if options.stream:
            return wire.event_stream(_stream(state, req, writer, state.faults.take_drop()), req.rid)
        ids, lps, versions, finish = await collect(state, req, protocol="sglang")
        return wire.json_response(writer.whole(ids, lps, versions, finish), headers=wire.rid_headers(req.rid))

    @bp.post(ABORT_PATH)
    async def abort_request() -> Response:
        abort = await wire.read_body(AbortReq)
        state.abort_calls += 1
        await state.faults.abort_wait()
        state.abort_prefix(abort.rid, abort_all=abort.abort_all)
        return Response("", status=200)

    @bp.get(MODEL_INFO_PATH)
    @bp.get(LEGACY_MODEL_INFO_PATH)
    async def get_model_info() -> Response:
        info = ModelInfoOutput(
            model_path=state.settings.model_path,
            tokenizer_path=state.tokenizer_path,
            weight_version=state.engine.weight_version,
        )
        return wire.json_response(CONVERTER.unstructure(info))

    @bp.get("/get_weight_version")
    async def get_weight_version() -> Response:
        return wire.json_response(CONVERTER.unstructure(WeightVersionOutput(state.engine.weight_version)))

    @bp.post("/pause_generation")
    async def pause_generation() -> Response:
        pause = await wire.read_body(PauseGenerationReq, optional=True)
        state.gate.close()
        if pause.mode == "abort":  # SGLang returns once the running requests are gone
            state.abort_matching(lambda names: True)
            await state.wait_idle()
        else:  # the running requests keep their state and go on after /continue_generation
            state.engine.pause("server-pause")
        return wire.json_response({"message": "Generation paused successfully.", "status": "ok"})

    @bp.post("/continue_generation")
    async def continue_generation() -> Response:
        state.gate.open()
        state.engine.resume("server-pause")
        return wire.json_response({"message": "Generation continued successfully.", "status": "ok"})

    return bp
