"""The llama.cpp client: ``POST /completion`` with a token-id prompt, streamed.

Every sampling field is sent explicitly (llama.cpp's defaults are not neutral: top-k 40,
repeat penalty 1.1, min-p 0.05, DRY/XTC samplers). The stream's ``tokens`` and
``completion_probabilities`` give ids and logprobs (older builds give ``probs`` with
probabilities: their log is taken; a token missing from them gets ``nan``). Note that
llama.cpp's logprobs come from a plain softmax of the logits, before temperature.

llama.cpp only stops on end-of-generation tokens and stop strings, so the request's
``stop_token_ids`` and ``max_new_tokens`` are also enforced here: the stream stops at
the first sampled stop id (reason ``"stop"``) or at the token limit (``"length"``). The
rest of the stream is then read only while it holds no more tokens (llama.cpp's own
final event, after an end-of-generation token), so the connection is kept; a token
means the engine is still decoding, and the connection is closed, which cancels the
request in llama.cpp.

``ignore_eos`` is sent as asked; ``min_tokens`` is refused (400): llama-server has no such setting.

llama.cpp has no abort call: :meth:`Generation.abort` closes the stream and reports
``GenerateFinish("abort")`` after the tokens already received; it cannot acknowledge,
so tokens the engine sampled but had not sent are lost. It has no weight versions
either: tokens carry the backend's ``weight_version`` label.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Any

from ..base import BackendError, GenerateFinish, GenerateRequest, ModelInfo
from ..client_base import EngineGeneration, first_model_card
from ..connection import EngineConnection, EngineResponse, post_stream, request_json
from ..deltas import DEFAULT_VERSION
from ..errors import check_status
from .protocol import COMPLETION_PATH, LlamaCppStreamParser, completion_bytes


class LlamaCppGeneration(EngineGeneration[LlamaCppStreamParser, "LlamaCppBackend"]):
    """One streamed ``/completion`` (see :class:`StreamedGeneration`)."""

    what = "llama.cpp /completion"

    def __init__(self, backend: LlamaCppBackend, request: GenerateRequest) -> None:
        sampling = request.sampling
        parser = LlamaCppStreamParser(
            stop_token_ids=sampling.stop_token_ids,
            max_new_tokens=sampling.max_new_tokens,
            prompt_len=len(request.input_ids),
            version=backend.weight_version,
        )
        super().__init__(backend, request, parser)

    async def _open(self) -> EngineResponse:
        if self._request.sampling.min_tokens:
            # llama-server has no such setting, and its ignore_eos masks the end-of-text ids for the whole reply.
            raise BackendError("min_tokens is not supported by llama.cpp (llama-server has no minimum length)",
                               status=400)
        body = completion_bytes(self._request)
        response = await post_stream(self._client, self._backend.url(COMPLETION_PATH), body)
        await check_status(response, self.what)
        return response

    def _local_finish(self, message: str) -> GenerateFinish:
        return self._parser.finish_event("abort", message=message)

    def _tail_ok(self, payload: Mapping[str, Any]) -> bool:
        # After a client-side stop, the engine's own final event may follow (it stops
        # at end-of-generation tokens too): read on. A token means it is still
        # decoding: hang up, which is how llama.cpp cancels a request.
        return payload.get("stop") is True or not payload.get("tokens")


class LlamaCppBackend(EngineConnection):
    """One ``llama-server`` behind the :class:`Backend` interface (see module docstring)."""

    kind = "llamacpp"
    #: The label its tokens carry: llama.cpp has no weight versions.
    weight_version = DEFAULT_VERSION

    def open_generation(self, request: GenerateRequest) -> LlamaCppGeneration:
        return LlamaCppGeneration(self, request)

    async def model_info(self) -> ModelInfo:
        """From ``GET /props`` (model path, ``n_ctx``), else ``GET /v1/models``."""
        try:
            props = await request_json(self.http, "GET", self.url("/props"), "llama.cpp props")
        except BackendError:
            props = None  # builds or proxies without /props
        if isinstance(props, Mapping):
            settings = props.get("default_generation_settings")
            n_ctx = settings.get("n_ctx") if isinstance(settings, Mapping) else props.get("n_ctx")
            model = props.get("model_alias") or props.get("model_path") or "llama.cpp"
        else:
            card = await first_model_card(self, "llama.cpp models")
            n_ctx = card.max_model_len if card.max_model_len is not None else (card.meta or {}).get("n_ctx_train")
            model = card.id or "llama.cpp"
        return ModelInfo(str(model), n_ctx if isinstance(n_ctx, int) else None, self.weight_version)

    async def prompt_logprobs(self, input_ids: array[int]) -> list[float | None]:
        raise BackendError("llama.cpp cannot recompute prompt logprobs", status=502)


