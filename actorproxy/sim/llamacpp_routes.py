"""llama.cpp server's native ``POST /completion`` over the simulated engine.

A token-id ``prompt`` only (no BOS is added, as llama.cpp does for token
prompts). Streaming sends one ``data:`` line per token and a final one with
``"stop": true``; there is no ``[DONE]``. Cancelling is closing the connection.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from quart import Blueprint, Response, request

from ..engines.base import ROUTING_HEADER, BackendError, GenerateFinish, GenerateRequest, SamplingParams
from ..engines.llamacpp.protocol import (
    COMPLETION_PATH,
    STOP_TYPES,
    CompletionRequest,
    CompletionResult,
    CompletionTimings,
)
from ..schema.converter import CONVERTER
from . import wire
from .policy import alternatives
from .state import SimState, check_sampling, collect, default_max_tokens, run_generation


def _error(message: str, status: int = 400) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return wire.json_response({"error": {"code": status, "message": message, "type": kind}}, status)


class _Completion:
    """One ``/completion`` call: its request, options and response building."""

    def __init__(self, state: SimState, body: CompletionRequest) -> None:
        self.state = state
        self.body = body
        ids = wire.token_prompt(body.prompt, "prompt", vocab_size=state.engine.tokenizer.vocab_size)
        check_sampling(body.stop)
        limit = default_max_tokens(state, len(ids)) if body.n_predict < 0 else body.n_predict
        sampling = SamplingParams(
            max_new_tokens=limit,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k or -1,
            min_p=body.min_p,
            seed=None if body.seed < 0 else body.seed,
            ignore_eos=bool(body.ignore_eos),
        )
        rid = uuid.uuid4().hex
        self.req = GenerateRequest(ids, sampling, rid=rid, routing_key=request.headers.get(ROUTING_HEADER))
        self.stream = body.stream
        self.started = time.monotonic()
        self.settings = {
            "n_predict": body.n_predict, "temperature": body.temperature, "top_k": body.top_k, "top_p": body.top_p,
            "min_p": body.min_p, "seed": body.seed, "n_probs": body.n_probs,
            # As the engine runs it: the request's, else the server's own setting.
            "ignore_eos": sampling.ignore_eos or state.engine.config.ignore_eos,
            "stream": body.stream, "cache_prompt": body.cache_prompt,
        }  # fmt: skip

    def piece(self, token_id: int) -> str:
        if token_id in self.state.engine.tokenizer.special_ids:
            return ""  # control tokens render empty, as llama.cpp's token_to_piece does by default
        return self.state.engine.tokenizer.token_text(token_id)

    def spelled(self, token_id: int) -> dict[str, Any]:
        text = self.piece(token_id)
        return {"id": token_id, "token": text, "bytes": list(text.encode())}

    def probability(self, token_id: int, logprob: float) -> dict[str, Any]:
        """A ``completion_probabilities`` entry: the sampled token and its ``n_probs`` likeliest alternatives."""
        top = alternatives(token_id, logprob, self.body.n_probs)
        if self.body.post_sampling_probs:
            return self.spelled(token_id) | {
                "prob": math.exp(logprob), "top_probs": [self.spelled(t) | {"prob": math.exp(lp)} for t, lp in top]}
        return self.spelled(token_id) | {
            "logprob": logprob, "top_logprobs": [self.spelled(t) | {"logprob": lp} for t, lp in top]}

    def partial(self, token_id: int, logprob: float, index: int) -> dict[str, Any]:
        data: dict[str, Any] = {
            "index": 0,
            "content": self.piece(token_id),
            "tokens": [token_id],
            "stop": False,
            "id_slot": 0,
            "tokens_predicted": index + 1,
            "tokens_evaluated": len(self.req.input_ids),
        }
        if self.body.n_probs:
            data["completion_probabilities"] = [self.probability(token_id, logprob)]
        return data

    def final(self, ids: list[int], lps: list[float], finish: GenerateFinish) -> dict[str, Any]:
        elapsed_ms = (time.monotonic() - self.started) * 1000
        content = "" if self.stream else "".join(self.piece(i) for i in ids)
        probabilities = None
        if self.body.n_probs and not self.stream:
            probabilities = [self.probability(i, lp) for i, lp in zip(ids, lps, strict=True)]
        result = CompletionResult(
            content=content,
            tokens=[] if self.stream or not self.body.return_tokens else ids,
            model=self.state.settings.model_path,
            tokens_predicted=len(ids),
            tokens_evaluated=len(self.req.input_ids),
            generation_settings=self.settings | {"model": self.state.settings.model_path},
            prompt=self.state.engine.tokenizer.decode(list(self.req.input_ids)),
            has_new_line="\n" in content,
            stop_type=STOP_TYPES[finish.reason],
            timings=CompletionTimings(
                prompt_n=len(self.req.input_ids),
                predicted_n=len(ids),
                predicted_ms=elapsed_ms,
                predicted_per_second=len(ids) / (elapsed_ms / 1000) if elapsed_ms > 0 else 0.0,
            ),
            completion_probabilities=probabilities,
        )
        data: dict[str, Any] = CONVERTER.unstructure(result)
        return data


async def _stream(call: _Completion, drop_after: int | None) -> AsyncGenerator[bytes, None]:
    ids: list[int] = []
    lps: list[float] = []
    try:
        gen = run_generation(call.state, call.req, protocol="llamacpp", stream=True, drop_after=drop_after)
        async with aclosing(gen) as chunks:
            async for chunk in chunks:
                lines = []  # one event a token, as llama.cpp; a burst (--stream-interval) in one write
                for token_id, logprob in zip(chunk.token_ids, chunk.logprobs, strict=True):
                    lines.append(wire.sse(call.partial(token_id, logprob, len(ids))))
                    ids.append(token_id)
                    lps.append(logprob)
                if chunk.finish is not None:
                    lines.append(wire.sse(call.final(ids, lps, chunk.finish)))
                yield b"".join(lines)
    except BackendError as exc:
        yield wire.sse({"error": {"code": exc.status, "message": str(exc), "type": "server_error"}})


def llamacpp_blueprint(state: SimState) -> Blueprint:
    """llama.cpp's ``/completion``."""
    bp = wire.engine_blueprint("llamacpp", __name__, _error)

    @bp.post(COMPLETION_PATH)
    async def completion() -> Response:
        call = _Completion(state, await wire.read_body(CompletionRequest))
        state.check_new(call.req)
        if state.take_failure(call.req, "llamacpp", stream=call.stream):
            return _error(wire.INJECTED_FAILURE, 500)
        if call.stream:
            return wire.event_stream(_stream(call, state.faults.take_drop()), call.req.rid)
        ids, lps, _versions, finish = await collect(state, call.req, protocol="llamacpp")
        return wire.json_response(call.final(ids, lps, finish), headers=wire.rid_headers(call.req.rid))

    return bp

