"""The vLLM client: ``/inference/v1/generate`` when the server has it, else ``/v1/completions``.

Which API a server speaks is learned on first use and cached: the first generation tries
the token-in/token-out ``/inference/v1/generate`` and falls back to completions (with
``return_token_ids``) when the route is missing (404/405) or disabled. Logprobs are read
in both shapes (``{"token_id": N}`` and ``{"token": "token_id:N"}`` entries, and
completions' ``token_logprobs``).

Weight versions: vLLM reports ``weight_versions`` spans only on a choice's last chunk,
so tokens are stamped as they arrive with the best-known version (the last one seen from
this server) and the authoritative spans travel in ``GenerateFinish.weight_versions``.

Aborts: ``POST /inference/v1/abort_requests`` (or ``/abort_requests``) with the engine's
request ids, after which the stream ends with ``finish_reason: "abort"`` (or, when no
token was pending, just ``[DONE]``: vLLM skips token-less chunks, so a ``[DONE]`` without
a finish reason reads as an abort). A server without an abort route gets its stream
closed instead; vLLM aborts a request whose client disconnects.

``routed_experts`` arrive as base64 of an ``.npy`` file and are converted to our format
(base64 of raw little-endian int32).
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from ...wire.converter import CONVERTER, TokenIds
from ..base import ROUTING_HEADER, BackendError, GenerateRequest, ModelInfo, SamplingParams, new_rid
from ..client_base import VersionedConnection, VersionedGeneration, first_model_card, read_tolerantly
from ..connection import EngineResponse, post_quietly, post_stream, request_json
from ..errors import check_status, discard
from ..shared_wire import ModelCard, UpdateWeightVersionReqInput, WeightVersionOutput
from . import protocol


class VLLMGeneration(VersionedGeneration[protocol.VLLMStreamParser, "VLLMBackend"]):
    """One streamed vLLM generation (see :class:`StreamedGeneration`)."""

    what = "vLLM"

    def __init__(self, backend: VLLMBackend, request: GenerateRequest) -> None:
        parser = protocol.VLLMStreamParser(version=backend.last_version, routed_experts=request.return_routed_experts)
        super().__init__(backend, request, parser)
        self._api: protocol.Api | None = backend.api

    async def _open(self) -> EngineResponse:
        if self._api in (None, "generate"):
            response = await self._post(protocol.GENERATE_PATH, self._generate_body())
            if self._api == "generate" or response.status_code < 400:
                self._backend.api = self._api = "generate"
                await check_status(response, self.what)
                return response
            if response.status_code not in (404, 405):
                try:
                    await check_status(response, self.what)
                except BackendError as exc:
                    if "generate tokens" not in str(exc):  # the route exists but is disabled
                        raise
            await discard(response)
            self._backend.api = self._api = "completions"
        body = await self._completions_body()
        response = await self._post("/v1/completions", body)
        await check_status(response, self.what)
        return response

    async def _post(self, path: str, body: Mapping[str, Any]) -> EngineResponse:
        # X-Request-Id fixes the engine's request id even where the body field is unknown.
        headers = {"X-Request-Id": self.rid}
        if self._request.routing_key:
            headers[ROUTING_HEADER] = self._request.routing_key
        return await post_stream(self._client, self._backend.url(path), body, headers)

    def _generate_body(self) -> dict[str, Any]:
        req = self._request
        body = protocol.GenerateTokensRequest(
            token_ids=TokenIds(req.input_ids),
            request_id=req.rid,
            stream=True,
            stream_options=protocol.StreamOptions(include_usage=True),
            sampling_params=protocol.SamplingFields.of(req.sampling),
        )
        return CONVERTER.unstructure(body)  # type: ignore[no-any-return]

    async def _completions_body(self) -> dict[str, Any]:
        req = self._request
        model = await self._backend.served_model()
        body = protocol.CompletionRequest.of_tokens(req.input_ids, req.sampling, rid=req.rid, model=model)
        return CONVERTER.unstructure(body)  # type: ignore[no-any-return]

    async def _send_abort(self) -> bool:
        # The engine's ids: the API prefixes ours ("generate-tokens-" / "cmpl-" + "-0").
        ids = {self.rid, f"generate-tokens-{self.rid}", f"cmpl-{self.rid}", f"cmpl-{self.rid}-0"}
        if self._parser.request_id:
            ids.add(self._parser.request_id)
        return await self._backend.abort_batched(sorted(ids))


class VLLMBackend(VersionedConnection):
    """One vLLM server behind the :class:`Backend` interface.

    ``options.api``: ``None`` to detect on first use, or force ``"generate"`` / ``"completions"``.
    """

    kind = "vllm"
    #: The API detected (``api`` until then: ``options.api``).
    _detected: protocol.Api | None = None
    _models: ModelCard | None = None
    #: The abort route that answered (``None``: not known yet); ``_abort_missing``: none did.
    _abort_path: str | None = None
    _abort_missing = False

    @property
    def api(self) -> protocol.Api | None:
        """The generation API this server speaks (``None``: not known yet)."""
        return self._detected or self.options.api

    @api.setter
    def api(self, value: protocol.Api) -> None:
        self._detected = value

    def open_generation(self, request: GenerateRequest) -> VLLMGeneration:
        return VLLMGeneration(self, request)

    async def _model_card(self) -> ModelCard:
        if self._models is None:
            self._models = await first_model_card(self, "vLLM models")
        return self._models

    async def served_model(self) -> str | None:
        """The served model name from ``/v1/models`` (cached; ``None`` if unknown)."""
        try:
            model = (await self._model_card()).id
        except BackendError:
            return None
        return model if isinstance(model, str) else None

    async def model_info(self) -> ModelInfo:
        card = await self._model_card()
        version = self.last_version
        try:
            got = await request_json(self.http, "GET", self.url("/weight_info"), "vLLM weight info")
            current = read_tolerantly(got, WeightVersionOutput).weight_version
            if current is not None:
                version = self.last_version = str(current)
        except BackendError:
            pass  # only dev-mode servers have it
        return ModelInfo(card.id or "vllm", card.max_model_len, version)

    async def abort_batched(self, request_ids: Sequence[str]) -> bool:
        """:meth:`abort_requests`, with the aborts asked together (a pause) sent as one call."""
        return await self.batcher.abort(request_ids)

    async def _abort_batch(self, request_ids: list[str]) -> Collection[str]:
        return request_ids if await self.abort_requests(request_ids) else ()

    async def abort_requests(self, request_ids: Sequence[str]) -> bool:
        """Abort by engine request id; ``False`` if the server has no abort route or fails."""
        if self._abort_missing:
            return False
        paths = [self._abort_path] if self._abort_path else list(protocol.ABORT_PATHS)
        for path in paths:
            self.abort_calls += 1
            body = CONVERTER.unstructure(protocol.AbortRequests(list(request_ids)))
            status = await post_quietly(self.control, self.url(path), body, "vLLM abort")
            if status is None:
                return False
            if status < 400:
                self._abort_path = path
                return True
            if status not in (404, 405):
                return False
        self._abort_missing = self._abort_path is None
        return False

    async def prompt_logprobs(self, input_ids: array[int]) -> list[float | None]:
        """Non-streamed, one token, ``prompt_logprobs: 1``; entry 0 is ``None``."""
        one = SamplingParams(max_new_tokens=1)
        if self.api == "generate":
            sampling = protocol.SamplingFields.of(one, logprobs=None, prompt_logprobs=1)
            generate = protocol.GenerateTokensRequest(
                token_ids=TokenIds(input_ids), request_id=new_rid(), sampling_params=sampling
            )
            body = CONVERTER.unstructure(generate)
            out = await request_json(
                self.http, "POST", self.url(protocol.GENERATE_PATH), "vLLM prompt logprobs", body=body
            )
            entries = out.get("prompt_logprobs") if isinstance(out, Mapping) else None
        else:
            model = await self.served_model()
            completion = protocol.CompletionRequest.of_tokens(
                input_ids, one, rid=new_rid(), model=model, stream=False, prompt_logprobs=1
            )
            body = CONVERTER.unstructure(completion)
            out = await request_json(self.http, "POST", self.url("/v1/completions"), "vLLM prompt logprobs", body=body)
            choices = out.get("choices") if isinstance(out, Mapping) else None
            entries = choices[0].get("prompt_logprobs") if isinstance(choices, list) and choices else None
            if entries is None and isinstance(out, Mapping):
                entries = out.get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != len(input_ids):
            raise BackendError(f"vLLM: expected {len(input_ids)} prompt_logprobs, got {entries!r:.200}")
        result: list[float | None] = [None]
        for token, entry in zip(input_ids[1:], entries[1:], strict=True):
            value = entry.get(str(token), entry.get(token)) if isinstance(entry, Mapping) else None
            value = value.get("logprob") if isinstance(value, Mapping) else value
            if not isinstance(value, int | float):
                raise BackendError(f"vLLM: no prompt logprob for token {token}: {entry!r:.200}")
            result.append(float(value))
        return result

    async def pause(self, mode: str = "abort") -> None:
        """``POST /pause?mode=abort|wait|keep`` (dev-mode servers)."""
        await request_json(self.http, "POST", self.url(f"/pause?mode={mode}"), "vLLM pause")

    async def resume(self) -> None:
        await request_json(self.http, "POST", self.url("/resume"), "vLLM resume")

    async def update_weight_version(self, version: str) -> None:
        body = CONVERTER.unstructure(UpdateWeightVersionReqInput(version))
        await request_json(self.http, "POST", self.url("/update_weight_version"), "vLLM weight version", body=body)
        self.last_version = version
