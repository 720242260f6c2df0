"""Our SGLang client held to a pinned SGLang release's own code (``_sglang_source.SGLANG_VERSION``).

No SGLang runs on a CPU machine, so the release's source stands in for it
(``scripts/sglang/install.sh`` unpacks it; ``_sglang_source`` loads the pieces):

* Requests. The client and the parse client are driven through every call they make
  against an engine that records them. Each call must hit a route ``http_server.py``
  declares with that method, and each body must be one that route takes: its fields known
  to the type the route parses it into (FastAPI ignores unknown ones, so a misspelled field
  would be silently dropped there), the required ones present, and the values accepted by
  the same pydantic validation FastAPI runs. ``/generate`` bodies also pass the release's
  JSON contract gate (``sglang/api/v1/api_types.py``, which refuses unknown sampling
  fields) and become SGLang's own ``SamplingParams``, normalized and verified. Every path
  the client's modules name must be among the calls made, so a new call cannot go unchecked.
* Replies. Streams are written as SGLang's TokenizerManager writes them (cumulative and
  ``--incremental-streaming-output``, chunks coalesced, an abort in the waiting queue,
  errors), with the release's own finish reasons, weight-version spans, meta-info slicing
  and JSON writer, each event checked against the contract's ``GenerateResponse``; the
  client must read back exactly the tokens, logprobs, versions and finish put in.
"""

from __future__ import annotations

import ast
import dataclasses
import logging
import math
import re
import sys
import time
import types
import typing
from array import array
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import msgspec
import orjson
import pydantic
import pytest
import trio
from _handler_server import start
from _sglang_source import HTTP_SERVER, SGLANG_VERSION, SGLangSource, _names_in_annotation, install

import actorproxy.engines.sglang as sglang_package
from actorproxy.engines.base import (
    BackendError,
    GenerateFinish,
    GenerateRequest,
    SamplingParams,
    TokenDelta,
)
from actorproxy.engines.connection import EngineOptions
from actorproxy.engines.sglang.client import SGLangBackend
from actorproxy.engines.sglang.cumulative import PrefixCutter
from actorproxy.engines.sglang.parse import (
    SGLANG_REASONING_PARSER,
    SGLANG_REASONING_PARSERS,
    SGLANG_TOOL_CALL_PARSERS,
    SGLangParseClient,
)
from actorproxy.engines.sglang.protocol import PauseMode

# The tier installs or starts something big: `-m "not heavy"` leaves it out (README.md).
pytestmark = [pytest.mark.heavy, pytest.mark.sglang]

PROMPT = array("i", [151644, 872, 198, 9707])
EOT, EOS = 151645, 151643
VOCAB = 151936
IO_STRUCT = "sglang/srt/managers/io_struct.py"
TOKENIZER_MANAGER = "sglang/srt/managers/tokenizer_manager.py"
#: The request types the client's calls are parsed into, from io_struct.py.
REQUEST_TYPES = (
    "BaseReq", "AbortReq", "PauseGenerationReqInput", "ContinueGenerationReqInput", "UpdateWeightVersionReqInput",
    "Function", "Tool", "ParseFunctionCallReq", "SeparateReasoningReqInput", "FinishReasonDict", "GenerateReqInput",
)  # fmt: skip


class Contract:
    """What the release says, loaded once."""

    def __init__(self, source: SGLangSource) -> None:
        self.source = source
        self.routes = source.routes()
        self.api = source.module("sglang/api/v1/api_types.py")
        struct_schema = source.module("sglang/srt/utils/msgspec_utils.py").msgspec_struct_pydantic_core_schema
        versions = source.definitions(
            "sglang/srt/utils/weight_versions.py",
            ["WeightVersionSpan", "WeightVersionSpans", "add_weight_versions_to_meta_info"],
            {"msgspec": msgspec, "msgspec_struct_pydantic_core_schema": struct_schema},
        )
        self.WeightVersionSpan = versions.WeightVersionSpan
        self.add_weight_versions_to_meta_info = versions.add_weight_versions_to_meta_info
        validators = source.module("sglang/srt/utils/field_validators.py")
        self.io = source.definitions(IO_STRUCT, REQUEST_TYPES, {
            "msgspec": msgspec, "msgspec_struct_pydantic_core_schema": struct_schema,
            "WeightVersionSpans": versions.WeightVersionSpans, "dataclass": dataclasses.dataclass,
            "field": dataclasses.field, "PlainValidator": pydantic.PlainValidator,
            "validate_optional_list_i64_1d_2d": validators.validate_optional_list_i64_1d_2d,
        }, fields_only=["GenerateReqInput"])  # fmt: skip
        import re._parser as sre_parse

        sampling = source.definitions("sglang/srt/sampling/sampling_params.py", None, {
            "msgspec": msgspec, "math": math, "logging": logging, "sre_parse": sre_parse,
            "normalize_watermark_request": lambda watermark: watermark,
        })  # fmt: skip
        self.SamplingParams = sampling.SamplingParams
        self.finish = source.definitions(
            "sglang/srt/managers/schedule_batch.py",
            ["BaseFinishReason", "FINISH_MATCHED_TOKEN", "FINISH_LENGTH", "FINISH_ABORT"],
        )
        self.dumps_json = source.definitions(
            "sglang/srt/utils/json_response.py", ["ORJSON_RESPONSE_OPTIONS", "dumps_json"], {"orjson": orjson}
        ).dumps_json
        keys = source.definitions(TOKENIZER_MANAGER, ["_INCREMENTAL_STREAMING_META_INFO_KEYS"])
        manager = source.definitions(TOKENIZER_MANAGER, ["_slice_streaming_output_meta_info"], {
            "_INCREMENTAL_STREAMING_META_INFO_KEYS": keys._INCREMENTAL_STREAMING_META_INFO_KEYS,
        })  # fmt: skip
        self.slice_meta_info = manager._slice_streaming_output_meta_info
        methods = source.methods(TOKENIZER_MANAGER, "TokenizerManager", [
            "detokenize_logprob_tokens", "_coalesce_streaming_chunks", "add_logprob_to_meta_info",
            "detokenize_top_logprobs_tokens",
        ], {
            "_INCREMENTAL_STREAMING_META_INFO_KEYS": keys._INCREMENTAL_STREAMING_META_INFO_KEYS,
            "logger": logging.getLogger("sglang-contract"),
        })  # fmt: skip
        self.detokenize_logprob_tokens = methods.detokenize_logprob_tokens
        #: ``TokenizerManager.add_logprob_to_meta_info`` (its ``self``: what the method calls on it).
        self.add_logprobs = partial(methods.add_logprob_to_meta_info, types.SimpleNamespace(
            detokenize_logprob_tokens=partial(methods.detokenize_logprob_tokens, None),
            detokenize_top_logprobs_tokens=partial(methods.detokenize_top_logprobs_tokens, types.SimpleNamespace(
                detokenize_logprob_tokens=partial(methods.detokenize_logprob_tokens, None)))))
        self.coalesce = methods._coalesce_streaming_chunks
        openai = source.definitions("sglang/srt/entrypoints/openai/protocol.py", ["ModelCard", "ModelList"], {
            "BaseModel": pydantic.BaseModel, "Field": pydantic.Field, "time": time,
        })  # fmt: skip
        self.ModelCard, self.ModelList = openai.ModelCard, openai.ModelList
        self.ToolCallItem = source.module("sglang/srt/function_call/core_types.py").ToolCallItem
        self.tool_call_parsers = source.module("sglang/srt/function_call/parser_names.py").TOOL_CALL_PARSER_NAMES
        self.reasoning_parsers = source.module("sglang/srt/parser/reasoning_parser_names.py").REASONING_PARSER_NAMES
        adapters = source.definitions(
            "sglang/srt/entrypoints/openai/chat_encoding_adapters.py", ["ADAPTER_OUTPUT_PARSERS"]
        ).ADAPTER_OUTPUT_PARSERS
        self.adapter_parsers = {name for names in adapters.values() for name in names}

    # -- requests ------------------------------------------------------------------

    def check_request(self, method: str, path: str, body: Any) -> None:
        """One call the client made, against the route and the type SGLang parses its body into."""
        route = self.routes.get((method, path))
        assert route is not None, f"{method} {path}: SGLang {SGLANG_VERSION}'s http_server.py has no such route"
        if route.body is None:
            assert not body, f"{method} {path} reads no body, and we sent {body!r}"
            return
        assert isinstance(body, dict), f"{method} {path}: the body must be a JSON object, not {body!r}"
        cls = getattr(self.io, route.body)
        self.check_fields(route.body, cls, body)
        pydantic.TypeAdapter(cls).validate_python(body)  # what FastAPI runs on the body
        if path == "/generate":
            self.check_generate(body)

    def check_fields(self, name: str, cls: type, body: Mapping[str, Any]) -> None:
        """``body``'s keys are fields of ``cls`` (and of the nested tools' types), the required ones present."""
        if dataclasses.is_dataclass(cls):
            fields = {f.name: f.default is f.default_factory is dataclasses.MISSING for f in dataclasses.fields(cls)}
        else:
            fields = {f.name: f.required for f in msgspec.structs.fields(cls)}
        unknown = set(body) - set(fields)
        assert not unknown, f"{name} has no field {sorted(unknown)} (SGLang would drop it without a word)"
        missing = {n for n, required in fields.items() if required} - set(body)
        assert not missing, f"{name} requires {sorted(missing)}"
        annotations: dict[str, str] = {}
        for base in reversed(cls.__mro__):
            annotations.update(getattr(base, "__annotations__", {}))
        stubbed = set(sys.modules[cls.__module__].__stubbed__)
        for key in body:
            unloaded = _names_in_annotation(ast.parse(str(annotations[key]), mode="eval").body) & stubbed
            assert not unloaded, f"{name}.{key}: its type uses {unloaded}, which the contract could not load"
        for tool in body.get("tools") or () if name == "ParseFunctionCallReq" else ():
            self.check_fields("Tool", self.io.Tool, tool)
            self.check_fields("Function", self.io.Function, tool["function"])

    def check_generate(self, body: Mapping[str, Any]) -> None:
        """The contract gate ``/generate`` runs, then SGLang's own ``SamplingParams`` built, normalized, verified."""
        gate = self.api.GenerateRequest.from_json_value(body)
        assert gate.input_ids == list(body["input_ids"])
        params = self.SamplingParams(**body["sampling_params"])  # TokenizerManager: SamplingParams(**kwargs)
        params.normalize(None)
        params.verify(VOCAB)
        sent = body["sampling_params"]
        assert params.max_new_tokens == sent["max_new_tokens"]
        assert params.stop_token_ids == (set(sent["stop_token_ids"]) or None)
        if sent["temperature"] == 0:
            assert params.top_k == 1  # SGLang's greedy
        return

    # -- replies -------------------------------------------------------------------

    def event(self, out: Mapping[str, Any]) -> bytes:
        """One stream event as ``http_server.py`` frames it, checked against the contract's reply type."""
        raw = self.dumps_json(out)
        self.api.GenerateResponse.from_json_value(orjson.loads(raw))
        return b"data: " + raw + b"\n\n"


@pytest.fixture(scope="module")
def sgl() -> Contract:
    source = install()
    if isinstance(source, str):
        pytest.skip(f"SGLang {SGLANG_VERSION}'s source cannot be installed: {source}")
    return Contract(source)


def test_the_pinned_release_is_the_one_checked(sgl: Contract) -> None:
    assert sgl.source.version() == SGLANG_VERSION
    docs = (Path(__file__).resolve().parents[2] / "docs" / "engines" / "sglang.md").read_text()
    assert f"SGLang {SGLANG_VERSION}" in docs, "docs/engines/sglang.md names the version checked"


# -- a recording engine -----------------------------------------------------------------


class Recorder:
    """An engine answering like SGLang: a path or method it does not declare is FastAPI's 404/405."""

    def __init__(self, sgl: Contract, replies: Mapping[tuple[str, str], Callable[[Any], httpx.Response]]) -> None:
        self.sgl, self.replies = sgl, replies
        self.calls: list[tuple[str, str, Any]] = []
        self.url: str | None = None

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        raw = await request.aread()
        body = orjson.loads(raw) if raw else None
        key = (request.method, request.url.path)
        self.calls.append((*key, body))
        if key not in self.sgl.routes:
            if any(path == key[1] for _, path in self.sgl.routes):
                return httpx.Response(405, json={"detail": "Method Not Allowed"})
            return httpx.Response(404, json={"detail": "Not Found"})
        reply = self.replies.get(key)
        return reply(body) if reply is not None else httpx.Response(200, json={"message": "ok", "status": "ok"})

    async def serve(self, nursery: trio.Nursery) -> str:
        """This engine on a real server on port 0 (once, for the test's lifetime); its URL."""
        if self.url is None:
            self.url = await start(nursery, self)
        return self.url


def model_info_reply(sgl: Contract, version: str) -> Callable[[Any], httpx.Response]:
    """``/model_info`` as ``http_server.py`` writes it (its keys read from the handler), checked by the contract."""
    reply = {
        "model_path": "/models/Qwen3-8B", "served_model_name": "Qwen/Qwen3-8B", "tokenizer_path": "/models/Qwen3-8B",
        "is_generation": True, "preferred_sampling_params": None, "weight_version": version, "load_format": "auto",
        "reasoning_parser": "qwen3", "tool_call_parser": "qwen25", "disaggregation_mode": "null",
        "has_image_understanding": False, "has_audio_understanding": False, "model_type": "qwen3",
        "architectures": ["Qwen3ForCausalLM"],
    }  # fmt: skip
    written = set(re.findall(r'^\s+"(\w+)":', _handler_source(sgl, "model_info"), re.M))
    assert set(reply) == written, f"/model_info writes {sorted(written)}"
    sgl.api.GetModelInfoResponse.from_json_value(reply)
    return lambda body: httpx.Response(200, json=reply)


def _handler_source(sgl: Contract, name: str) -> str:
    text = sgl.source.text(HTTP_SERVER)
    start = text.index(f"async def {name}(")
    return text[start : text.index("\n\n\n", start)]


def models_reply(sgl: Contract) -> Callable[[Any], httpx.Response]:
    """``/v1/models`` as ``available_models`` writes it: the release's ``ModelList`` of ``ModelCard``."""
    card = sgl.ModelCard(id="Qwen/Qwen3-8B", root="Qwen/Qwen3-8B", max_model_len=40960)
    reply = sgl.ModelList(data=[card]).model_dump(mode="json")
    return lambda body: httpx.Response(200, json=reply)


class Stream:
    """The events SGLang's TokenizerManager writes for one streamed ``/generate``.

    A model of its ``_handle_batch_output`` (a scheduler batch of new tokens becomes an
    ``out`` dict: cumulative, or a delta with ``--incremental-streaming-output``) and of
    ``_stream_one_response`` (outputs queued before the client reads are coalesced, or
    the last one taken), built from the release's own pieces: ``detokenize_logprob_tokens``,
    the finish reasons' ``to_json``, ``add_weight_versions_to_meta_info``,
    ``_slice_streaming_output_meta_info``, ``_coalesce_streaming_chunks`` and ``dumps_json``.
    """

    def __init__(self, sgl: Contract, *, incremental: bool, version: str = "default", top: int = 0) -> None:
        self.sgl, self.incremental, self.version = sgl, incremental, version
        self.ids: list[int] = []
        self.entries: list[Any] = []  # the state's output_token_logprobs
        #: ``top_logprobs_num``; when set, the logprobs are added by the release's ``add_logprob_to_meta_info``,
        #: from this request state (a ``ReqState``'s logprob fields).
        self.top = top
        self.state = types.SimpleNamespace(
            obj=types.SimpleNamespace(return_flat_raw_top_logprobs=False, return_flat_raw_output_top_logprobs=False),
            **{f"{side}_{kind}": [] for side in ("input", "output") for kind in (
                "token_logprobs_val", "token_logprobs_idx", "token_logprobs", "top_logprobs_val", "top_logprobs_idx",
                "top_logprobs")})
        self.offset = 0  # last_output_offset
        self.queued: list[dict[str, Any]] = []
        self.frames: list[bytes] = []

    def batch(self, ids: list[int], lps: list[float], *, finish: Any = None, spans: list[Any] | None = None,
              top: list[tuple[list[float], list[int]]] = ()) -> None:
        """One scheduler output for this request (not yet read by the client); ``top``: each token's alternatives
        (their logprobs and ids), when the stream's ``top`` asks for them."""
        meta: dict[str, Any] = {
            "id": "rid", "finish_reason": finish.to_json() if finish is not None else None,
            "prompt_tokens": len(PROMPT), "weight_version": self.version, "num_retractions": 0,
        }  # fmt: skip
        if self.top:
            state = self.state
            state.output_token_logprobs_val += lps
            state.output_token_logprobs_idx += ids
            state.output_top_logprobs_val += [values for values, _ in top]
            state.output_top_logprobs_idx += [alternatives for _, alternatives in top]
            self.sgl.add_logprobs(meta, state, self.top, None, False, finish is not None)
        else:
            self.entries.extend(self.sgl.detokenize_logprob_tokens(None, lps, ids, False))
            meta.update({"input_token_logprobs": [], "output_token_logprobs": self.entries,
                         "output_token_logprobs_length": len(self.entries)})  # fmt: skip
        self.ids.extend(ids)
        meta.update({"reasoning_tokens": 0, "completion_tokens": len(self.ids), "cached_tokens": 2})
        if spans is not None:
            self.sgl.add_weight_versions_to_meta_info(meta, spans, num_output_tokens=len(self.ids))
        if finish is not None:
            meta["e2e_latency"] = 0.25
        text = "".join(f"<{t}>" for t in ids)
        if self.incremental:
            self.sgl.slice_meta_info(meta, self.offset, ())
            self.offset = len(self.ids)
            out = {"text": text, "output_ids": list(ids), "meta_info": meta}
        else:
            out = {"text": "".join(f"<{t}>" for t in self.ids), "output_ids": list(self.ids), "meta_info": meta}
        self.queued.append(orjson.loads(orjson.dumps(out)))  # the state lists go on growing

    def abort_in_waiting_queue(self) -> None:
        """``_handle_abort_req``: SGLang's abort of a request its scheduler holds in the waiting queue."""
        meta: dict[str, Any] = {"id": "rid", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                                "weight_version": self.version, "e2e_latency": 0.5}  # fmt: skip
        meta.update({"input_token_logprobs": [], "output_token_logprobs": self.entries,
                     "output_token_logprobs_length": len(self.entries)})  # fmt: skip
        meta["completion_tokens"] = len(self.ids)
        ids = (self.ids[-1:] if self.ids else []) if self.incremental else self.ids
        self.queued.append(orjson.loads(orjson.dumps({"text": "", "output_ids": ids, "meta_info": meta})))

    def read(self) -> None:
        """The client's turn: what was queued goes out as one event."""
        if len(self.queued) > 1 and self.incremental:
            out = self.sgl.coalesce(None, self.queued, "rid", ())
        else:
            out = self.queued[-1]
        self.queued = []
        self.frames.append(self.sgl.event(out))

    def error(self, message: str, code: int = 400) -> None:
        """``http_server.py``'s in-stream error (a ValueError while streaming)."""
        error = {"message": message, "type": "invalid_request_error", "code": code, "retryable": False}
        self.frames.append(b"data: " + self.sgl.dumps_json({"error": error}) + b"\n\n")

    def body(self) -> bytes:
        return b"".join(self.frames) + b"data: [DONE]\n\n"


def streamed(stream: Stream) -> Callable[[Any], httpx.Response]:
    return lambda body: httpx.Response(200, content=stream.body(), headers={"content-type": "text/event-stream"})


def request(**sampling: Any) -> GenerateRequest:
    settings = {"max_new_tokens": 64, "stop_token_ids": (EOS, EOT), **sampling}
    return GenerateRequest(PROMPT, SamplingParams(**settings), routing_key="session-1", return_routed_experts=True)


async def generate(backend: SGLangBackend, req: GenerateRequest) -> tuple[list[TokenDelta], GenerateFinish]:
    deltas: list[TokenDelta] = []
    finishes: list[GenerateFinish] = []
    async with backend.open_generation(req) as gen:
        async for event in gen:
            (finishes if isinstance(event, GenerateFinish) else deltas).append(event)  # type: ignore[arg-type]
    assert len(finishes) == 1
    return deltas, finishes[0]


def tokens(deltas: list[TokenDelta]) -> tuple[list[int], list[float], list[str]]:
    return (
        [t for d in deltas for t in d.token_ids],
        [lp for d in deltas for lp in d.logprobs],
        [d.weight_version for d in deltas for _ in d.token_ids],
    )


IDS = [151667, 1234, 88, 9, 77, EOT]
LPS = [-0.5, -0.25, -1.0, -0.125, -2.0, -0.0625]


def three_reads(stream: Stream, finish: Any) -> None:
    """Six tokens in four scheduler batches, read by the client three times (two batches coalesced)."""
    stream.batch(IDS[:1], LPS[:1])
    stream.read()
    stream.batch(IDS[1:3], LPS[1:3])
    stream.batch(IDS[3:4], LPS[3:4])
    stream.read()
    stream.batch(IDS[4:], LPS[4:], finish=finish)
    stream.read()


# -- requests ---------------------------------------------------------------------------


async def test_every_request_the_clients_send_is_one_sglang_takes(sgl: Contract, nursery: trio.Nursery) -> None:
    stream = Stream(sgl, incremental=False, version="7")
    three_reads(stream, sgl.finish.FINISH_MATCHED_TOKEN(matched=EOT))
    # The prefill-only /generate of prompt_logprobs: not streamed, the prompt's logprobs (none for the first token).
    prompt_lps = [None, -2.5, -0.75, -1.5]
    entries = sgl.detokenize_logprob_tokens(None, prompt_lps, list(PROMPT), False)
    meta = {"id": "rid", "finish_reason": sgl.finish.FINISH_LENGTH(length=0).to_json(), "prompt_tokens": len(PROMPT),
            "weight_version": "7", "input_token_logprobs": entries, "output_token_logprobs": [],
            "completion_tokens": 0, "cached_tokens": 0}  # fmt: skip
    prefill = orjson.loads(sgl.dumps_json({"text": "", "output_ids": [], "meta_info": meta}))
    sgl.api.GenerateResponse.from_json_value(prefill)
    engine = Recorder(sgl, {
        ("GET", "/model_info"): model_info_reply(sgl, "7"),
        ("GET", "/get_model_info"): model_info_reply(sgl, "7"),
        ("GET", "/v1/models"): models_reply(sgl),
        ("GET", "/health"): lambda body: httpx.Response(200),
        ("POST", "/generate"): lambda body: (
            streamed(stream)(body) if body["stream"] else httpx.Response(200, json=prefill)
        ),
        ("POST", "/update_weight_version"): lambda body: httpx.Response(
            200, json={"success": True, "message": "ok", "new_version": body["new_version"]}
        ),
        ("POST", "/parse_function_call"): lambda body: httpx.Response(200, json={"normal_text": "", "calls": [
            sgl.ToolCallItem(tool_index=0, name="ls", parameters='{"path": "."}').model_dump(),
        ]}),
        ("POST", "/separate_reasoning"): lambda body: httpx.Response(200, json={"reasoning_text": "r", "text": "t"}),
    })  # fmt: skip
    backend = SGLangBackend(await engine.serve(nursery), EngineOptions(routed_experts=True))
    await backend.model_info()
    assert await backend.health()
    for sampling in ({}, {"temperature": 0.0, "seed": 11}, {"temperature": 0.7, "top_p": 0.9, "top_k": 20,
                     "min_p": 0.05, "max_new_tokens": 1}):  # fmt: skip
        await generate(backend, request(**sampling))
    assert await backend.prompt_logprobs(PROMPT) == prompt_lps
    assert await backend.abort("a" * 32)
    for mode in ("abort", "retract", "in_place"):
        await backend.pause(mode)  # type: ignore[arg-type]
    await backend.continue_generation()
    await backend.update_weight_version("8")
    # A keep pause: frozen in place, the version pushed without aborting, then continued.
    assert await backend.freeze_refusal() is None
    frozen_from = len(engine.calls)
    await backend.freeze()
    await backend.update_weight_version("9")
    await backend.thaw()
    assert [(p, b) for _, p, b in engine.calls[frozen_from:]] == [
        ("/pause_generation", {"mode": "in_place"}),
        ("/update_weight_version", {"new_version": "9", "abort_all_requests": False}),
        ("/continue_generation", {}),
    ]
    # Several aborts at once, covering every generation this proxy runs there: one abort_all.
    pooled = SGLangBackend(await engine.serve(nursery), EngineOptions(abort_all=True))
    pooled.running.update({"b" * 32, "c" * 32})
    async with trio.open_nursery() as aborts:
        for rid in pooled.running:
            aborts.start_soon(pooled.abort, rid)
    parse = SGLangParseClient(await engine.serve(nursery))
    tools = [{"type": "function", "function": {"name": "ls", "description": "list", "parameters": {"type": "object"},
                                               "strict": True}}]  # fmt: skip
    parsed = await parse.parse("<think>r</think><tool_call>{}</tool_call>", tools, tool_call_parser="qwen25")
    assert (parsed.reasoning, parsed.content, parsed.calls) == ("r", "", (("ls", '{"path": "."}'),))
    for method, path, body in engine.calls:
        sgl.check_request(method, path, body)
    bodies = {(method, path, orjson.dumps(body, option=orjson.OPT_SORT_KEYS)) for method, path, body in engine.calls}
    assert (b'{"abort_all":true,"rid":""}') in {b for m, p, b in bodies if p == "/abort_request"}
    # Every path the client's modules name was called (a new call cannot go unchecked).
    named = set()
    for module in Path(sglang_package.__file__).parent.glob("*.py"):
        if not module.name.startswith("sim_"):
            named |= set(re.findall(r'"(/[a-z0-9_/]+)"', module.read_text()))
    assert named - set(LEGACY) <= {path for _, path, _ in engine.calls}, named - {path for _, path, _ in engine.calls}
    assert not set(LEGACY) & {path for _, path, _ in engine.calls}, "the release has what the client needs"


#: Paths the client asks only of builds older than the release (bodiless GETs), and why.
LEGACY = {
    "/get_model_info": "builds without /model_info (404/405 there)",
    "/get_weight_version": "builds whose model info has no weight_version",
}


def test_a_misspelled_field_is_caught(sgl: Contract) -> None:
    """The checks above can fail: a field SGLang does not know, a missing one, a wrong type, a refused value."""
    with pytest.raises(AssertionError, match="no field"):
        sgl.check_request("POST", "/abort_request", {"rid": "x", "abort_everything": True})
    with pytest.raises(AssertionError, match="requires"):
        sgl.check_request("POST", "/update_weight_version", {"abort_all_requests": False})
    with pytest.raises(pydantic.ValidationError):
        sgl.check_request("POST", "/pause_generation", {"mode": "keep"})
    with pytest.raises(sgl.api.JsonContractError):
        sgl.check_generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "seed": 3}})
    with pytest.raises(ValueError, match="top_p"):
        sgl.check_generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 1, "top_p": 0.0,
                                                                  "stop_token_ids": []}})  # fmt: skip
    with pytest.raises(AssertionError, match="no such route"):
        sgl.check_request("GET", "/get_weight_versions", None)


def test_parser_names_are_sglangs(sgl: Contract) -> None:
    """The parse API's ``tool_call_parser``/``reasoning_parser`` names we send are registered there,
    and none is one only a served model's own encoding adapter parses (a 400 otherwise)."""
    for ours, theirs in SGLANG_TOOL_CALL_PARSERS.items():
        assert theirs in sgl.tool_call_parsers and theirs not in sgl.adapter_parsers, (ours, theirs)
    for ours, theirs in {**SGLANG_REASONING_PARSERS, "default": SGLANG_REASONING_PARSER}.items():
        assert theirs in sgl.reasoning_parsers and theirs not in sgl.adapter_parsers, (ours, theirs)


# -- replies ----------------------------------------------------------------------------


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_streams_as_sglang_writes_them(sgl: Contract, incremental: bool, nursery: trio.Nursery) -> None:
    stream = Stream(sgl, incremental=incremental, version="7")
    three_reads(stream, sgl.finish.FINISH_MATCHED_TOKEN(matched=EOT))
    engine = Recorder(sgl, {("POST", "/generate"): streamed(stream)})
    deltas, finish = await generate(SGLangBackend(await engine.serve(nursery)), request())
    assert tokens(deltas) == (IDS, LPS, ["7"] * len(IDS))
    assert (finish.reason, finish.matched_stop, finish.weight_version) == ("stop", EOT, "7")
    assert (finish.prompt_tokens, finish.cached_tokens) == (len(PROMPT), 2)


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_alternatives_as_sglang_writes_them(sgl: Contract, incremental: bool, nursery: trio.Nursery) -> None:
    # ``top_logprobs_num`` asked: each event's meta_info as the release's ``add_logprob_to_meta_info`` writes it
    # (the alternatives after the logprobs, each token's ``[[logprob, id, null], ...]``). Ten reads of one token
    # each: the cumulative stream's events are cut (the alternatives' array too) from its third on.
    stream = Stream(sgl, incremental=incremental, version="7", top=2)
    ids = [100 + i for i in range(10)]
    lps = [-i / 4 for i in range(10)]
    top = [([-i / 8, -i / 2 - 1], [200 + i, 300 + i]) for i in range(10)]
    for i in range(10):
        stream.batch(ids[i : i + 1], lps[i : i + 1], top=top[i : i + 1],
                     finish=sgl.finish.FINISH_LENGTH(length=10) if i == 9 else None)
        stream.read()
    meta = orjson.loads(stream.frames[-1].removeprefix(b"data: "))["meta_info"]
    assert list(meta).index("output_top_logprobs") > list(meta).index("output_token_logprobs")
    engine = Recorder(sgl, {("POST", "/generate"): streamed(stream)})
    backend = SGLangBackend(await engine.serve(nursery))
    async with backend.open_generation(request(top_logprobs=2)) as gen:
        events = [event async for event in gen]
        alternatives = gen.top_logprobs
    assert tokens([e for e in events if isinstance(e, TokenDelta)]) == (ids, lps, ["7"] * 10)
    assert alternatives == [((200 + i, -i / 8), (300 + i, -i / 2 - 1)) for i in range(10)]
    assert [body for _, path, body in engine.calls if path == "/generate"][-1]["top_logprobs_num"] == 2
    if not incremental:  # the release's layout is the one the cutter cuts: each event after the first, to its new token
        cutter, cut = PrefixCutter(), []
        for frame in stream.frames:
            raw = frame.removeprefix(b"data: ").rstrip(b"\n")
            cut.append(cutter.cut(raw, top=True)[1])
            cutter.tokens = len(orjson.loads(raw)["output_ids"])
        assert cut == list(range(10))


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
@pytest.mark.parametrize("finish", ["length", "abort", "eos-list"])
async def test_finish_reasons_as_sglang_writes_them(
    sgl: Contract, incremental: bool, finish: str, nursery: trio.Nursery
) -> None:
    made = {
        "length": sgl.finish.FINISH_LENGTH(length=len(IDS)),
        "abort": sgl.finish.FINISH_ABORT(),
        # A stop token SGLang matched among several (its FINISH_MATCHED_TOKEN takes a list too).
        "eos-list": sgl.finish.FINISH_MATCHED_TOKEN(matched=[EOT]),
    }[finish]
    stream = Stream(sgl, incremental=incremental)
    three_reads(stream, made)
    engine = Recorder(sgl, {("POST", "/generate"): streamed(stream)})
    deltas, got = await generate(SGLangBackend(await engine.serve(nursery)), request())
    assert tokens(deltas)[:2] == (IDS, LPS)
    expected = {"length": ("length", None), "abort": ("abort", None), "eos-list": ("stop", EOT)}[finish]
    assert (got.reason, got.matched_stop) == expected
    assert got.weight_version == "default"


@pytest.mark.parametrize(("incremental", "unread"), [(False, False), (True, False), (True, True)],
                         ids=["cumulative", "incremental", "incremental-unread"])
async def test_an_abort_in_the_waiting_queue_as_sglang_writes_it(
    sgl: Contract, incremental: bool, unread: bool, nursery: trio.Nursery
) -> None:
    """A request retracted to the waiting queue (a ``retract`` pause) and aborted there: SGLang repeats
    the last token (incremental) or all of them (cumulative) with every logprob entry so far.

    ``unread``: tokens still queued for the client when the abort comes are coalesced with it, and the
    abort repeats the last token, with every logprob entry so far after the unread ones. What
    ``completion_tokens`` counts is what is new; the repeat is checked."""
    stream = Stream(sgl, incremental=incremental)
    stream.batch(IDS[:2], LPS[:2])
    stream.read()
    stream.batch(IDS[2:4], LPS[2:4])
    if not unread:
        stream.read()
    stream.abort_in_waiting_queue()
    stream.read()
    engine = Recorder(sgl, {("POST", "/generate"): streamed(stream)})
    deltas, finish = await generate(SGLangBackend(await engine.serve(nursery)), request())
    assert tokens(deltas)[:2] == (IDS[:4], LPS[:4])
    assert (finish.reason, finish.message) == ("abort", "Abort in waiting queue")


async def test_a_refusal_as_sglang_writes_it(sgl: Contract, nursery: trio.Nursery) -> None:
    """The scheduler's abort with an error status (prompt too long), and the in-stream error."""
    stream = Stream(sgl, incremental=False)
    too_long = sgl.finish.FINISH_ABORT(
        message="The input (41000 tokens) is longer than the model's context length (40960 tokens).",
        status_code=400, err_type="BadRequestError",
    )
    stream.batch([], [], finish=too_long)
    stream.read()
    engine = Recorder(sgl, {("POST", "/generate"): streamed(stream)})
    with pytest.raises(BackendError) as refused:
        await generate(SGLangBackend(await engine.serve(nursery)), request())
    assert refused.value.status == 400 and "context length" in str(refused.value)
    failing = Stream(sgl, incremental=True)
    failing.batch(IDS[:1], LPS[:1])
    failing.read()
    failing.error("Request is disconnected from the client side", code=500)
    engine = Recorder(sgl, {("POST", "/generate"): streamed(failing)})
    with pytest.raises(BackendError) as failed:
        await generate(SGLangBackend(await engine.serve(nursery)), request())
    assert failed.value.status == 502


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
async def test_weight_version_spans_as_sglang_writes_them(
    sgl: Contract, incremental: bool, nursery: trio.Nursery
) -> None:
    """A version pushed mid-generation (``in_place`` pause, ``/update_weight_version``, continue):
    SGLang reports spans over output indexes, each token stamped with its own."""
    span = sgl.WeightVersionSpan
    stream = Stream(sgl, incremental=incremental, version="7")
    stream.batch(IDS[:3], LPS[:3], spans=[span(version="7", start=0, end=2**62)])
    stream.read()
    stream.version = "8"
    spans = [span(version="7", start=0, end=3), span(version="8", start=3, end=2**62)]
    stream.batch(IDS[3:], LPS[3:], spans=spans, finish=sgl.finish.FINISH_MATCHED_TOKEN(matched=EOT))
    stream.read()
    engine = Recorder(sgl, {("POST", "/generate"): streamed(stream)})
    deltas, finish = await generate(SGLangBackend(await engine.serve(nursery)), request())
    assert tokens(deltas) == (IDS, LPS, ["7"] * 3 + ["8"] * 3)
    assert finish.weight_version == "8"
    assert [(s.version, s.start, s.end) for s in finish.weight_versions] == [("7", 0, 3), ("8", 3, len(IDS))]


async def test_model_info_as_sglang_answers_it(sgl: Contract, nursery: trio.Nursery) -> None:
    """The version from ``/model_info``; the length from ``/v1/models`` (SGLang's model info has none)."""
    engine = Recorder(sgl, {
        ("GET", "/model_info"): model_info_reply(sgl, "step-12"),
        ("GET", "/get_model_info"): model_info_reply(sgl, "step-12"),
        ("GET", "/v1/models"): models_reply(sgl),
    })  # fmt: skip
    info = await SGLangBackend(await engine.serve(nursery)).model_info()
    assert (info.model_id, info.max_model_len, info.weight_version) == ("/models/Qwen3-8B", 40960, "step-12")
    assert all(sgl.routes.get((m, p)) for m, p, _ in engine.calls), engine.calls


def test_pause_modes_are_sglangs(sgl: Contract) -> None:
    """``/pause_generation``'s modes are the release's: ``abort``, ``retract`` (requests back to the
    waiting queue, recomputed after ``/continue_generation``) and ``in_place`` (requests held in the
    running batch with their KV cache, continued as they were)."""
    (mode,) = [f for f in msgspec.structs.fields(sgl.io.PauseGenerationReqInput) if f.name == "mode"]
    assert typing.get_args(mode.type) == typing.get_args(PauseMode) == ("abort", "retract", "in_place")
    assert mode.default == "abort"
    continued = {f.name: f.default for f in msgspec.structs.fields(sgl.io.ContinueGenerationReqInput)}
    assert continued == {"rid": None, "http_worker_ipc": None, "torch_empty_cache": True}


def test_its_logprobs_are_of_the_tempered_distribution(sgl: Contract) -> None:
    """What docs/trajectories.md says of SGLang's logprobs, held to the release's sampler: on its standard path the
    logits are divided by the temperature before the softmax the returned logprobs are the log of, unless the
    server's environment sets ``SGLANG_RETURN_ORIGINAL_LOGPROB``; a greedy batch's are of the logits themselves."""
    sampler = sgl.source.text("sglang/srt/layers/sampler.py")
    tree = ast.parse(sampler)
    env = [node for node in ast.walk(tree) if isinstance(node, ast.Assign)
           and [getattr(t, "id", None) for t in node.targets] == ["SGLANG_RETURN_ORIGINAL_LOGPROB"]]
    assert [ast.unparse(node.value) for node in env] == ["get_bool_env_var('SGLANG_RETURN_ORIGINAL_LOGPROB')"]
    standard = sampler.index("# Standard path: do softmax and sample from probs.")
    divided = sampler.index("logits.div_(sampling_info.temperatures)", standard)
    probs = sampler.index("probs = logits", divided)
    returned = sampler.index("else torch.log(probs)", probs)
    assert standard < divided < probs < returned
    greedy = sampler.index("if sampling_info.is_all_greedy:")
    assert "original_logprobs = logprobs = torch.nn.functional.log_softmax(\n                    logits, dim=-1" \
        in sampler[greedy:standard]
    docs = (Path(__file__).resolve().parents[2] / "docs" / "trajectories.md").read_text()
    assert "`SGLANG_RETURN_ORIGINAL_LOGPROB=1`" in docs and f"SGLang ({SGLANG_VERSION})" in docs
