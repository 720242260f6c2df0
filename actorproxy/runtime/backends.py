"""What the actors run on, built before they start: the engine, the store backend, and what the engine implies.

:func:`open_runtime <actorproxy.runtime.runtime.open_runtime>` builds the
engine (:func:`make_backend`), waits for it (:func:`wait_for_engine`), fits the
context window to it (:func:`context_window_for`), picks the output format the
tokenizer's chat template writes (:func:`output_format_for`) and opens the
store backend (:func:`open_store_backend`). :func:`forward_to_engines` is the
engine control ``Runtime.pause``/``resume`` add to the controller's pause.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import trio

from ..config import ProxyConfig
from ..config.sim_engine import parse_tool_calls
from ..core.parser import default_tool_call_format
from ..core.template_probe import probe_template
from ..engines.base import Backend, BackendError, ModelInfo
from ..engines.connection import EngineOptions
from ..engines.factory import make_engine_pool
from ..sim import SimConfig, SimEngine
from ..store.base import StoreBackend
from ..store.memory import MemoryStore
from ..store.ray_pool import RayStore
from ..store.sqlite import SQLiteStore
from ..tokenization.tokenizer import ChatTokenizer
from .output import OutputFormat
from .replies import EngineAck

if TYPE_CHECKING:
    from ..config.sections import EngineSettings

log = logging.getLogger(__name__)

#: Engine-control method names per action, in the order tried (the clients differ).
ENGINE_METHODS = {
    "pause": ("pause",),
    "resume": ("resume", "continue_generation"),
    "set_weight_version": ("set_weight_version", "update_weight_version"),
    "freeze": ("freeze",),
    "thaw": ("thaw",),
}


async def forward_to_engines(backend: Backend, action: str, *args: Any) -> list[EngineAck]:
    """Call an optional engine-control method on the backend (or on every engine of a pool)."""
    engines = getattr(backend, "engines", None)
    targets = list(engines()) if callable(engines) else [backend]
    results: list[EngineAck] = []
    for target in targets:
        if action in ("pause", "resume") and target.kind == "sim":
            continue  # the in-process engine is stopped by the controller's aborts alone
        method = next((getattr(target, n) for n in ENGINE_METHODS[action] if hasattr(target, n)), None)
        if method is None:
            continue
        try:
            outcome = method(*args)
            if hasattr(outcome, "__await__"):
                outcome = await outcome
            results.append(EngineAck(getattr(target, "kind", "?"), True))
        except BackendError as exc:
            log.warning("%s on an engine failed: %s", action, exc)
            results.append(EngineAck(getattr(target, "kind", "?"), False, str(exc)))
    return results


def sim_config(engines: EngineSettings) -> SimConfig:
    """The built-in simulated engine's settings from the ``--sim-*`` flags."""
    return SimConfig(
        seed=engines.sim_seed,
        token_interval=engines.sim_token_interval,
        decode_steps=engines.sim_decode_steps,
        tool_call_probability=engines.sim_tool_call_probability,
        followup_tool_call_probability=engines.sim_followup_tool_call_probability,
        tool_calls=() if engines.sim_tool_calls is None else parse_tool_calls(engines.sim_tool_calls),
    )


async def freeze_refusal(backend: Backend) -> str | None:
    """Why an engine behind ``backend`` cannot freeze its generations in place (``None``: every one can).

    An engine that can has ``freeze``/``thaw`` and a ``freeze_refusal()`` saying whether this server can.
    """
    engines = getattr(backend, "engines", None)
    for target in list(engines()) if callable(engines) else [backend]:
        check = getattr(target, "freeze_refusal", None)
        if check is None:
            return f"{target.kind} engines cannot freeze a generation in place (use abort with --partial-rollout)"
        reason = await check()
        if reason is not None:
            return str(reason)
    return None


def make_backend(config: ProxyConfig, tokenizer: ChatTokenizer) -> Backend:
    """The engine ``config.engines.backend`` names: the in-process sim, or a pool of engine clients."""
    if config.engines.backend == "sim":
        return SimEngine(tokenizer, sim_config(config.engines))

    options = EngineOptions(
        connect_timeout=config.engines.engine_connect_timeout,
        read_timeout=config.engines.engine_read_timeout,
        concurrency=config.engines.engine_max_concurrency,
        abort_all=config.engines.engine_abort_all,
    )
    return make_engine_pool(
        config.engines.backend,
        config.engines.backend_urls,
        options,
        health_interval=config.engines.engine_health_interval,
        routed_experts=config.engines.use_rollout_routing_replay,
    )


def open_store_backend(config: ProxyConfig) -> StoreBackend:
    """The store ``config.store.store`` names (a durable one reads its file: call it off the event loop).

    ``auto`` is SQLite for ``actorproxy run`` (the CLI resolves it) and memory for a proxy embedded in a program.
    """
    settings = config.store
    if settings.store_kind in ("memory", "auto"):
        return MemoryStore()
    if settings.store_kind == "ray":
        return RayStore(settings.data_dir, address=settings.ray_address, namespace=settings.ray_namespace,
                        pool=settings.data_pool)

    return SQLiteStore(settings.data_dir)


async def wait_for_engine(engine: Backend) -> ModelInfo:
    """The engine's model info, retrying while it starts up (engines take minutes to load)."""
    delay = 0.5
    while True:
        try:
            return await engine.model_info()
        except BackendError as exc:
            log.warning("waiting for the inference engine: %s", exc)
        await trio.sleep(delay)
        delay = min(delay * 2, 5.0)




def context_window_for(config: ProxyConfig, info: ModelInfo) -> int:
    """``--context-window``, or the engine's max length; never more than the engine's max length."""
    window = config.limits.context_window or info.max_model_len or 32768
    if info.max_model_len and window > info.max_model_len:
        # Past the engine's own limit a prompt would fail there as an engine error.
        log.warning("--context-window %d exceeds the engine's %d; using %d", window, info.max_model_len,
                    info.max_model_len)
        window = info.max_model_len
    return window


def output_format_for(config: ProxyConfig, tok: ChatTokenizer) -> OutputFormat:
    """How outputs are parsed: the tool-call format the chat template writes (unless set), warning on mismatches."""
    detected = default_tool_call_format(tok)
    chosen = config.parsing.tool_call_format
    family = config.trajectory.tito_model
    if family != "auto" and (family in ("qwen3_5", "qwen3_6")) != (detected == "qwen3_coder"):
        log.warning(
            "--tito-model %s does not match the tokenizer's chat template (it writes %s tool calls); "
            "TITO follows the template",
            family,
            "Qwen3.5/Qwen3-Coder XML" if detected == "qwen3_coder" else "Hermes JSON",
        )
    probe = probe_template(tok)
    if not probe.append_only:
        log.warning("the chat template cannot be continued append-only (%s): every turn is rendered whole "
                    "(boundary reason template_not_append_only; see docs/models.md)", probe.reason)
    if not probe.renders_tools:
        log.warning("the chat template ignores tools: the tools a request offers never reach the prompt, so the "
                    "model cannot call them; each such reply says so in its X-Actorproxy-Warning header "
                    "(see docs/models.md)")
    parse_backend = config.parsing.parse_backend
    if chosen == "none" and parse_backend != "local":
        log.warning("--tool-call-format none: no tool calls are parsed, so --tool-call-parse-backend %s has "
                    "nothing to ask SGLang; parsing locally", parse_backend)
        parse_backend = "local"
    return OutputFormat(
        tool_call_format=detected if chosen == "auto" else ("qwen3_coder" if chosen == "qwen3_5" else chosen),
        reasoning_format=config.parsing.reasoning_format,
        parse_backend=parse_backend,
    )
