"""The vLLM client: ``/inference/v1/generate`` when the server has it, else ``/v1/completions``.

Which routes a server has is read once from its ``/openapi.json`` (:meth:`VLLMBackend.routes`,
at start-up or on first use): the token-in/token-out ``/inference/v1/generate`` where it is
listed (``--enable-scale-out``), completions with ``return_token_ids`` otherwise. A server
without ``/openapi.json`` (``--disable-fastapi-docs``) is asked by trying the tokens route:
a 403 (vLLM 0.32 refuses it so without ``--enable-scale-out``), 404 or 405 means completions.
A listed route that answers 403/404/405 all the same is left for completions too. Which
API each engine uses, and why, is logged once. Logprobs are read in both shapes
(``{"token_id": N}`` and ``{"token": "token_id:N"}`` entries, and completions'
``token_logprobs``).

Dev mode (``VLLM_SERVER_DEV_MODE=1``) adds ``/pause``, ``/resume``, ``/abort_requests``,
``/update_weight_version`` and ``/weight_info``. Without it, each degrades with one log
line: a pause or resume is refused with a clear :class:`BackendError` (the proxy's own
pause still stops its generations), a new weight version labels this client's tokens
only (vLLM cannot hold it), and aborts close the stream when no abort route is left.

Weight versions: vLLM reports ``weight_versions`` spans only on a choice's last chunk
(and only on the tokens route), so tokens are stamped as they arrive with the best-known
version (the last one seen from this server, or given to it) and the authoritative spans
travel in ``GenerateFinish.weight_versions``.

Aborts: ``POST /inference/v1/abort_requests`` (or ``/abort_requests``) with the engine's
request ids, after which the stream ends with ``finish_reason: "abort"`` (or, when no
token was pending, just ``[DONE]``: vLLM skips token-less chunks, so a ``[DONE]`` without
a finish reason reads as an abort). A server without an abort route gets its stream
closed instead; vLLM aborts a request whose client disconnects.

``routed_experts`` arrive as base64 of an ``.npy`` file and are converted to our format
(base64 of raw little-endian int32).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Collection, Mapping, Sequence

from ...schema.converter import CONVERTER, TokenIds
from ..base import ROUTING_HEADER, BackendError, GenerateRequest, ModelInfo, SamplingParams, new_rid
from ..client_base import VersionedConnection, VersionedGeneration, first_model_card, read_tolerantly
from ..connection import EngineResponse, post_quietly, post_stream, request_json
from ..errors import check_status, discard
from ..shared_wire import ModelCard, UpdateWeightVersionReqInput, WeightVersionOutput
from . import protocol

log = logging.getLogger(__name__)
#: The ``/openapi.json`` answer that means "no route list": the client asks by trying.
_NO_ROUTE_LIST = frozenset({401, 403, 404, 405})


class VLLMGeneration(VersionedGeneration[protocol.VLLMStreamParser, "VLLMBackend"]):
    """One streamed vLLM generation (see :class:`StreamedGeneration`)."""

    what = "vLLM"

    def __init__(self, backend: VLLMBackend, request: GenerateRequest) -> None:
        parser = protocol.VLLMStreamParser(version=backend.last_version, routed_experts=request.return_routed_experts)
        super().__init__(backend, request, parser)
        self._api: protocol.Api | None = backend.api

    async def _open(self) -> EngineResponse:
        backend = self._backend
        api = self._api = await backend.detect_api()
        if api != "completions":
            response = await self._post(protocol.GENERATE_PATH, protocol.generate_tokens_bytes(self._request))
            status = response.status_code
            if status not in protocol.ROUTE_ABSENT or backend.options.api == "generate":
                await check_status(response, self.what)
                if api is None:
                    backend.settle("generate", f"{protocol.GENERATE_PATH} answered {status}")
                return response
            await discard(response)
            listed = " although /openapi.json lists it" if api == "generate" else ""
            backend.settle("completions", f"{protocol.GENERATE_PATH} answered {status}{listed}")
            self._api = "completions"
        body = protocol.completion_bytes(self._request, await self._backend.served_model())
        response = await self._post("/v1/completions", body)
        await check_status(response, self.what)
        return response

    async def _post(self, path: str, body: bytes) -> EngineResponse:
        # X-Request-Id fixes the engine's request id even where the body field is unknown.
        headers = {"X-Request-Id": self.rid}
        if self._request.routing_key:
            headers[ROUTING_HEADER] = self._request.routing_key
        return await post_stream(self._client, self._backend.url(path), body, headers)

    async def _send_abort(self) -> bool:
        # The engine's ids: the API prefixes ours ("generate-tokens-" / "cmpl-" + "-0").
        ids = {self.rid, f"generate-tokens-{self.rid}", f"cmpl-{self.rid}", f"cmpl-{self.rid}-0"}
        if self._parser.request_id:
            ids.add(self._parser.request_id)
        return await self._backend.abort_batched(sorted(ids))


class VLLMBackend(VersionedConnection):
    """One vLLM server behind the :class:`Backend` interface.

    ``options.api``: ``None`` to detect it (see module docstring), or force ``"generate"`` / ``"completions"``.
    """

    kind = "vllm"
    #: The API settled on (``api`` until then: ``options.api``).
    _detected: protocol.Api | None = None
    _models: ModelCard | None = None
    #: What ``/openapi.json`` says (``_routes_read``: it was asked; ``None`` then: no route list).
    _routes: protocol.ServerRoutes | None = None
    _routes_read = False
    #: The abort route that answered (``None``: not known yet); ``_abort_missing``: none did.
    _abort_path: str | None = None
    _abort_missing = False
    #: Dev-mode routes found missing, each logged once.
    _missing_logged: frozenset[str] = frozenset()

    @property
    def api(self) -> protocol.Api | None:
        """The generation API this server speaks (``None``: not known yet)."""
        return self._detected or self.options.api

    def settle(self, api: protocol.Api, why: str) -> None:
        """Use ``api`` from now on; logged once, with the reason."""
        if self._detected == api:
            return
        self._detected = api
        if api == "generate":
            log.info("vLLM %s: generating through %s (%s)", self.base_url, protocol.GENERATE_PATH, why)
        else:
            log.info(
                "vLLM %s: generating through /v1/completions with return_token_ids (%s; start vLLM with "
                "--enable-scale-out for the tokens route)", self.base_url, why,
            )

    async def routes(self) -> protocol.ServerRoutes | None:
        """The server's routes from ``GET /openapi.json``, asked once (``None``: it has no route list).

        An engine that cannot be reached is asked again next time.
        """
        if self._routes_read:
            return self._routes
        try:
            answer = await request_json(self.http, "GET", self.url(protocol.OPENAPI_PATH), "vLLM /openapi.json")
        except BackendError as exc:
            if exc.unreachable or not any(f"HTTP {s}:" in str(exc) for s in _NO_ROUTE_LIST):
                raise
            answer = None
        self._routes, self._routes_read = protocol.ServerRoutes.of(answer), True
        routes = self._routes
        if routes is None:
            log.info("vLLM %s has no route list at %s: its routes are learned by trying them",
                     self.base_url, protocol.OPENAPI_PATH)
        elif not routes.has(protocol.PAUSE_PATH):
            log.warning(
                "vLLM %s runs without dev mode (no %s, %s, %s or %s; VLLM_SERVER_DEV_MODE=1 adds them): "
                "engine pause and resume are refused, a new weight version labels the proxy's tokens only%s",
                self.base_url, protocol.PAUSE_PATH, protocol.RESUME_PATH, protocol.VERSION_PATH,
                protocol.WEIGHT_INFO_PATH,
                "" if routes.abort_paths else ", and with no abort route an abort closes the stream",
            )
        return routes

    async def detect_api(self) -> protocol.Api | None:
        """The API to use: forced, settled, or as ``/openapi.json`` says (``None``: try the tokens route)."""
        if self.api is not None:
            return self.api
        routes = await self.routes()
        if routes is None:
            return None
        if routes.generate:
            self.settle("generate", f"/openapi.json lists {protocol.GENERATE_PATH}")
        else:
            self.settle("completions", f"/openapi.json does not list {protocol.GENERATE_PATH}")
        return self.api

    def _lacks(self, path: str) -> bool:
        """Whether the server's route list says it has no ``path`` (unknown: ``False``)."""
        return self._routes is not None and not self._routes.has(path)

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
        await self.detect_api()  # at start-up: which API, logged once
        version = self.last_version
        if self._lacks(protocol.WEIGHT_INFO_PATH):
            return ModelInfo(card.id or "vllm", card.max_model_len, version)
        try:
            got = await request_json(self.http, "GET", self.url(protocol.WEIGHT_INFO_PATH), "vLLM weight info")
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
        if self._abort_path:
            paths = [self._abort_path]
        else:
            listed = self._routes.abort_paths if self._routes is not None else protocol.ABORT_PATHS
            paths = list(listed)
        for path in paths:
            self.abort_calls += 1
            body = CONVERTER.unstructure(protocol.AbortRequests(list(request_ids)))
            status = await post_quietly(self.control, self.url(path), body, "vLLM abort")
            if status is None:
                return False
            if status < 400:
                self._abort_path = path
                return True
            if status not in protocol.ROUTE_ABSENT:
                return False
        if self._abort_path is None and not self._abort_missing:
            self._abort_missing = True
            log.warning("vLLM %s has no abort route (%s need --enable-scale-out or VLLM_SERVER_DEV_MODE=1): "
                        "an abort closes the stream, and tokens vLLM sampled meanwhile are not received",
                        self.base_url, " and ".join(protocol.ABORT_PATHS))
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
        """``POST /pause?mode=abort|wait|keep`` (dev-mode servers; refused with a clear error elsewhere)."""
        self._dev_route(protocol.PAUSE_PATH, "the engine is not paused (the proxy's own pause stops its requests)")
        await request_json(self.http, "POST", self.url(f"{protocol.PAUSE_PATH}?mode={mode}"), "vLLM pause")

    async def resume(self) -> None:
        self._dev_route(protocol.RESUME_PATH, "nothing to resume on the engine")
        await request_json(self.http, "POST", self.url(protocol.RESUME_PATH), "vLLM resume")

    async def freeze_refusal(self) -> str | None:
        """Why this server cannot freeze generations in place (``None``: it can, with ``/pause?mode=keep``)."""
        try:
            lacks = self._lacks(protocol.PAUSE_PATH) if self._routes_read else (
                (routes := await self.routes()) is not None and not routes.has(protocol.PAUSE_PATH))
        except BackendError as exc:
            return f"vLLM {self.base_url}: {exc}"
        if lacks:
            return f"vLLM {self.base_url} has no {protocol.PAUSE_PATH} (start it with VLLM_SERVER_DEV_MODE=1)"
        return None

    async def freeze(self) -> None:
        """Freeze the generations in flight in place (``/pause?mode=keep``); :meth:`thaw` lets them go on."""
        await self.pause("keep")

    async def thaw(self) -> None:
        await self.resume()

    async def update_weight_version(self, version: str) -> None:
        """``POST /update_weight_version``; without dev mode the version labels this client's tokens only."""
        if self._lacks(protocol.VERSION_PATH):
            self.last_version = version
            self._log_missing(protocol.VERSION_PATH, f"weight version {version!r} labels the proxy's tokens only")
            return
        body = CONVERTER.unstructure(UpdateWeightVersionReqInput(version))
        await request_json(self.http, "POST", self.url(protocol.VERSION_PATH), "vLLM weight version", body=body)
        self.last_version = version

    def _dev_route(self, path: str, consequence: str) -> None:
        """Refuse a call to a dev-mode route the server does not list (the caller logs it)."""
        if self._lacks(path):
            raise BackendError(f"vLLM {self.base_url} has no {path} (start it with VLLM_SERVER_DEV_MODE=1): "
                               f"{consequence}", status=501)

    def _log_missing(self, path: str, consequence: str) -> None:
        if path not in self._missing_logged:
            self._missing_logged |= {path}
            log.warning("vLLM %s has no %s (dev mode is off; VLLM_SERVER_DEV_MODE=1 adds it): %s",
                        self.base_url, path, consequence)
