"""vLLM's token routes over the simulated engine.

``/inference/v1/generate`` and ``/inference/v1/abort_requests`` (the scale-out routes:
without ``SimServerSettings.vllm_generate_endpoint`` they answer 403, as vLLM 0.32 does
without ``--enable-scale-out``), the ``/v1/completions`` fallback with a token-id prompt,
and the dev-mode routes (``/abort_requests``, the RL pause routes, ``/weight_info``;
absent without ``SimServerSettings.vllm_dev_mode``). Errors are
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import base64
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import attrs
from quart import Blueprint, Response, request

from ..engines.base import ROUTING_HEADER, BackendError, GenerateFinish, GenerateRequest, SamplingParams
from ..engines.shared_wire import WeightVersionOutput
from ..engines.vllm.protocol import (
    GENERATE_PATH,
    AbortRequests,
    CompletionRequest,
    GenerateTokensRequest,
    SamplingFields,
    npy_base64,
)
from ..errors import BadRequest
from ..schema.converter import CONVERTER
from . import wire
from .policy import alternatives
from .state import Chunk, SimState, check_sampling, collect, default_max_tokens, run_generation


@attrs.frozen
class _Call:
    """One parsed vLLM request: what to run and how to answer."""

    req: GenerateRequest
    response_id: str
    stream: bool
    include_usage: bool
    logprobs: int | None
    prompt_logprobs: int | None
    skip_special: bool
    include_stop: bool
    return_token_ids: bool
    tokens_as_ids: bool
    experts_start: int


def _error(message: str, status: int = 400, param: str | None = None) -> Response:
    kinds = {400: "BadRequestError", 403: "PermissionDeniedError", 404: "NotFoundError",
             503: "ServiceUnavailableError"}
    kind = kinds.get(status, "InternalServerError")
    return wire.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _invalid(exc: BadRequest) -> Response:
    # vLLM answers a body its pydantic model refuses with a 400 naming the parameter.
    return _error(exc.message, 400, exc.param)


def _parse(state: SimState, body: CompletionRequest | GenerateTokensRequest) -> _Call:
    completions = isinstance(body, CompletionRequest)
    if isinstance(body, CompletionRequest):
        params: SamplingFields = body
        ids = wire.token_prompt(body.prompt, "prompt", vocab_size=state.engine.tokenizer.vocab_size)
        if body.echo:
            raise wire.BadField("echo is not supported by the simulated engine")
    else:
        params = body.sampling_params or SamplingFields()
        ids = wire.token_prompt(body.token_ids, "token_ids", vocab_size=state.engine.tokenizer.vocab_size)
    check_sampling(params.stop)
    if params.n != 1:
        raise wire.BadField("the simulated engine supports n=1 only")
    if body.stream and params.prompt_logprobs is not None and params.prompt_logprobs != 0:
        raise wire.BadField("`prompt_logprobs` are not available when `stream=True`.")
    default_max = 16 if completions else default_max_tokens(state, len(ids))
    sampling = SamplingParams(
        max_new_tokens=default_max if params.max_tokens is None else params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=-1 if params.top_k == 0 else params.top_k,
        min_p=params.min_p,
        stop_token_ids=tuple(params.stop_token_ids or ()),
        seed=params.seed,
        min_tokens=params.min_tokens,
        ignore_eos=bool(params.ignore_eos),
    )
    if sampling.min_tokens > sampling.max_new_tokens:  # vLLM's SamplingParams refuses it, as it words it
        raise wire.BadField(f"min_tokens must be less than or equal to max_tokens={sampling.max_new_tokens}, "
                            f"got {sampling.min_tokens}.")
    rid = body.request_id or uuid.uuid4().hex
    req = GenerateRequest(
        ids,
        sampling,
        rid=rid,
        routing_key=request.headers.get(ROUTING_HEADER),
        return_routed_experts=state.settings.enable_return_routed_experts,
    )
    return _Call(
        req=req,
        response_id=("cmpl-" if completions else "generate-tokens-") + rid,
        stream=body.stream,
        include_usage=body.stream_options is not None and body.stream_options.include_usage,
        logprobs=params.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        skip_special=params.skip_special_tokens,
        include_stop=params.include_stop_str_in_output,
        return_token_ids=body.return_token_ids if isinstance(body, CompletionRequest) else True,
        tokens_as_ids=isinstance(body, CompletionRequest) and body.return_tokens_as_token_ids,
        experts_start=body.routed_experts_prompt_start if isinstance(body, CompletionRequest) else 0,
    )


class _Writer:
    """Builds the response bodies of one call; remembers what it already sent."""

    def __init__(self, state: SimState, call: _Call) -> None:
        self.state, self.call = state, call
        tok = state.engine.tokenizer
        self.skip = tok.special_ids if call.skip_special else frozenset()
        self.text = wire.IncrementalText(tok, self.skip)
        self.count = 0
        self.versions: list[str] = []
        self.offset = 0  # characters of text sent (completions' text_offset)

    def _visible(self, ids: list[int], finish: GenerateFinish | None) -> list[int]:
        # vLLM's detokenizer leaves out the token that stopped the generation (EOS or stop id).
        if finish is not None and finish.matched_stop is not None and not self.call.include_stop and ids:
            return ids[:-1]
        return ids

    def _token_str(self, token_id: int) -> str:
        if self.call.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.state.engine.tokenizer.token_text(token_id)

    def tokens_logprobs(self, ids: tuple[int, ...], lps: tuple[float, ...]) -> dict[str, Any] | None:
        if self.call.logprobs is None:
            return None
        content = []
        for token_id, lp in zip(ids, lps, strict=True):
            # As vLLM 0.32 writes them: the sampled token's rank, and its alternatives (``logprobs: 0`` too lists
            # the sampled one there), each with its rank; no text.
            listed = self._listed(token_id, lp)
            ranks = {t: rank for rank, (t, _) in enumerate(sorted(listed, key=lambda pair: -pair[1]), 1)}
            top = [{"token_id": t, "logprob": v, "rank": ranks[t]} for t, v in listed]
            content.append({"token_id": token_id, "logprob": lp, "rank": ranks[token_id], "top_logprobs": top})
        return {"content": content}

    def _listed(self, token_id: int, logprob: float) -> list[tuple[int, float]]:
        """What vLLM lists for ``logprobs: k``: the sampled token first, then the k likeliest but it
        (``policy.alternatives``: the simulator's sampled token is always among them; ``k`` 0: it alone)."""
        k = self.call.logprobs or 0
        return [(token_id, logprob)] + [(t, v) for t, v in alternatives(token_id, logprob, k) if t != token_id]

    def completion_logprobs(self, ids: tuple[int, ...], lps: tuple[float, ...]) -> dict[str, Any] | None:
        if self.call.logprobs is None:
            return None
        tokens = [self._token_str(i) for i in ids]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {
            "text_offset": offsets,
            "token_logprobs": list(lps),
            "tokens": tokens,
            "top_logprobs": [{self._token_str(t): v for t, v in self._listed(i, lp)}
                             for i, lp in zip(ids, lps, strict=True)],
        }

    def finish_fields(self, finish: GenerateFinish) -> dict[str, Any]:
        experts = None
        if finish.routed_experts is not None:
            raw = base64.b64decode(finish.routed_experts)
            cfg = self.state.engine.config
            width = cfg.num_layers * cfg.moe_topk
            skip = min(self.call.experts_start, len(raw) // (4 * width))
            raw = raw[skip * width * 4 :]
            experts = npy_base64(raw, (len(raw) // (4 * width), cfg.num_layers, cfg.moe_topk))
        return {"routed_experts": experts, "weight_versions": wire.weight_spans(self.versions)}

    def usage(self) -> dict[str, int]:
        prompt = len(self.call.req.input_ids)
        return {"prompt_tokens": prompt, "completion_tokens": self.count, "total_tokens": prompt + self.count}

    def stop_reason(self, finish: GenerateFinish) -> int | None:
        matched = finish.matched_stop
        return matched if matched is not None and matched in self.call.req.sampling.stop_token_ids else None

    def generate_chunk(self, chunk: Chunk) -> dict[str, Any]:
        self.count += len(chunk.token_ids)
        self.versions += chunk.versions
        # vLLM 0.32's chunk, every field it writes (a plain token's ``null``s included).
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": None if chunk.finish is None else chunk.finish.reason,
            "stop_reason": None if chunk.finish is None else self.stop_reason(chunk.finish),
            "token_ids": list(chunk.token_ids),
            "routed_experts": None,
            "sampling_mask": None,
            "weight_versions": None,
            "logprobs": self.tokens_logprobs(chunk.token_ids, chunk.logprobs),
        }
        if chunk.finish is not None:
            choice |= self.finish_fields(chunk.finish)
        return {"request_id": self.call.response_id, "usage": None, "output_mode": "tokens", "choices": [choice]}

    def completion_chunk(self, chunk: Chunk, *, created: int) -> dict[str, Any]:
        first = self.count == 0 and not self.versions
        self.count += len(chunk.token_ids)
        self.versions += chunk.versions
        visible = self._visible(list(chunk.token_ids), chunk.finish)
        choice: dict[str, Any] = {
            "index": 0,
            "text": self.text.push(visible, final=chunk.finish is not None),
            "logprobs": self.completion_logprobs(chunk.token_ids, chunk.logprobs),
            "finish_reason": None if chunk.finish is None else chunk.finish.reason,
            "stop_reason": None if chunk.finish is None else self.stop_reason(chunk.finish),
        }
        if self.call.return_token_ids:
            if first:
                choice["prompt_token_ids"] = list(self.call.req.input_ids)
            choice["token_ids"] = list(chunk.token_ids)
        model = self.state.settings.model_path
        return {"id": self.call.response_id, "object": "text_completion", "created": created, "model": model,
                "choices": [choice], "usage": None}


async def _prompt_logprobs(state: SimState, call: _Call) -> list[Any] | None:
    if call.prompt_logprobs is None:
        return None
    tok = state.engine.tokenizer
    lps = await state.engine.prompt_logprobs(call.req.input_ids)
    return [
        None if lp is None else {str(i): {"logprob": lp, "rank": 1, "decoded_token": tok.decode([i])}}
        for lp, i in zip(lps, call.req.input_ids, strict=True)
    ]


async def _stream(
    state: SimState, call: _Call, drop_after: int | None, *, completions: bool
) -> AsyncGenerator[bytes, None]:
    writer, created = _Writer(state, call), int(time.time())
    names = (call.response_id,)
    try:
        gen = run_generation(state, call.req, protocol="vllm", stream=True, names=names, drop_after=drop_after)
        async with aclosing(gen) as chunks:
            async for chunk in chunks:
                data = writer.completion_chunk(chunk, created=created) if completions else writer.generate_chunk(chunk)
                yield wire.sse(data)
        if call.include_usage:
            head = {"id": call.response_id, "object": "text_completion", "created": created,
                    "model": state.settings.model_path} if completions else {"request_id": call.response_id}
            yield wire.sse(head | {"choices": [], "usage": writer.usage()})
    except BackendError as exc:
        error = {"message": str(exc), "type": "InternalServerError", "param": None, "code": exc.status}
        yield wire.sse({"error": error})
    yield wire.DONE


async def _answer(state: SimState, *, completions: bool) -> Response:
    kind: type[CompletionRequest | GenerateTokensRequest] = CompletionRequest if completions else GenerateTokensRequest
    call = _parse(state, await wire.read_body(kind))
    state.check_new(call.req)
    if state.take_failure(call.req, "vllm", stream=call.stream):
        return _error(wire.INJECTED_FAILURE, 500)
    if call.stream:
        return wire.event_stream(_stream(state, call, state.faults.take_drop(), completions=completions), call.req.rid)
    headers = wire.rid_headers(call.req.rid)
    prompt_lps = await _prompt_logprobs(state, call)
    ids, lps, versions, finish = await collect(state, call.req, protocol="vllm")
    writer = _Writer(state, call)
    chunk = Chunk(tuple(ids), tuple(lps), tuple(versions), finish)
    if not completions:
        data = writer.generate_chunk(chunk)
        return wire.json_response(data | {"usage": writer.usage(), "prompt_logprobs": prompt_lps}, headers=headers)
    data = writer.completion_chunk(chunk, created=int(time.time()))
    data["choices"][0]["text"] = wire.decode_text(state.engine.tokenizer, writer._visible(ids, finish), writer.skip)
    data["choices"][0] |= writer.finish_fields(finish) | {"prompt_logprobs": prompt_lps}
    if not call.return_token_ids:
        data["choices"][0] |= {"token_ids": None, "prompt_token_ids": None}
    data["choices"][0].pop("weight_versions")
    return wire.json_response(data | {"usage": writer.usage()}, headers=headers)


#: vLLM 0.32's answer on a scale-out route when ``--enable-scale-out`` is off.
SCALE_OUT_DISABLED = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to enable them."


def vllm_blueprint(state: SimState) -> Blueprint:
    """vLLM's routes: generate and its abort (or their 403), completions, the dev-mode routes if enabled."""
    bp = wire.engine_blueprint("vllm", __name__, _error, _invalid)
    settings = state.settings

    @bp.post("/v1/completions")
    async def completions() -> Response:
        return await _answer(state, completions=True)

    if not settings.vllm_generate_endpoint:

        @bp.post(GENERATE_PATH)
        @bp.post("/inference/v1/abort_requests")
        async def scale_out_disabled() -> Response:
            return _error(SCALE_OUT_DISABLED, 403)

        state.unlisted |= {GENERATE_PATH, "/inference/v1/abort_requests"}
    else:

        @bp.post(GENERATE_PATH)
        async def generate() -> Response:
            return await _answer(state, completions=False)

        @bp.post("/inference/v1/abort_requests")
        async def abort_tokens_requests() -> Response:
            ids = (await wire.read_body(AbortRequests)).request_ids
            if ids is None:
                raise wire.BadField("Missing 'request_ids' in request body")
            state.abort_calls += 1
            await state.faults.abort_wait()
            state.abort_ids(ids)
            return Response("", status=200)

    if settings.vllm_dev_mode:
        _dev_routes(bp, state)
    return bp


def _dev_routes(bp: Blueprint, state: SimState) -> None:
    """The routes of a ``VLLM_SERVER_DEV_MODE=1`` server."""

    @bp.post("/abort_requests")
    async def abort_requests() -> Response:
        ids = (await wire.read_body(AbortRequests, optional=True)).request_ids or []
        state.abort_calls += 1
        await state.faults.abort_wait()
        count = state.abort_ids(ids) if ids else state.abort_matching(lambda names: True)
        return wire.json_response({"status": "aborted", "aborted": count})

    @bp.post("/pause")
    async def pause() -> Response:
        mode = request.args.get("mode", "abort")
        if mode not in ("abort", "wait", "keep"):
            raise wire.BadField(f"mode must be abort, wait or keep, got {mode!r}")
        state.gate.close()
        if mode == "keep":  # in-flight requests freeze and go on after /resume
            state.engine.pause("server-pause")
        else:
            if mode == "abort":
                state.abort_matching(lambda names: True)
            await state.wait_idle()
        return wire.json_response({"status": "paused"})

    @bp.post("/resume")
    async def resume() -> Response:
        state.gate.open()
        state.engine.resume("server-pause")
        return wire.json_response({"status": "resumed"})

    @bp.get("/is_paused")
    async def is_paused() -> Response:
        return wire.json_response({"is_paused": state.gate.paused})

    @bp.get("/weight_info")
    async def weight_info() -> Response:
        return wire.json_response(CONVERTER.unstructure(WeightVersionOutput(state.engine.weight_version)))
