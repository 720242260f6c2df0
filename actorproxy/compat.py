"""The command lines of the systems actorproxy replaces, accepted unchanged.

Teams migrating from the Dressage proxy, the Claw-R1 gateway or the in-process
(LiveRL/Harbor) proxy paste their launch commands. Every flag those systems
document is an alias here: it sets our own settings (never a second
implementation), and ``actorproxy run --help`` lists them under
"compatibility". A flag whose capability actorproxy lacks is refused with one
line naming what is missing, never ignored. docs/migrating.md maps each one.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import ProxyConfig

#: Model names of Dressage's ``--trajectory-build-model`` / ``--token-build-model`` / ``--tito-model``.
MODEL_FAMILIES = ("qwen3", "qwen3_5", "qwen3_6")
#: What ``--trajectory-build-model`` infers (Dressage: mask, tool-call, reasoning and TITO model).
_INFERRED = {
    "qwen3": {"parsing.tool_call_format": "qwen3", "parsing.reasoning_format": "qwen3"},
    "qwen3_5": {"parsing.tool_call_format": "qwen3_coder", "parsing.reasoning_format": "qwen3"},
    "qwen3_6": {"parsing.tool_call_format": "qwen3_coder", "parsing.reasoning_format": "qwen3"},
}
#: Dressage's ``--token-build-mode``: ``tito`` stitches the exact per-turn ids, ``snapshot`` re-renders the last step.
_TOKEN_BUILD_MODES = {"tito": "concat", "snapshot": "last_step"}
#: Flags only a Dressage launch line uses (its shipped ``dressage/proxy/server.py`` and its documented one).
#: Such a launch serves a real SGLang router: it never runs on the built-in simulator.
_DRESSAGE_FLAGS = (
    "--sglang-router-url", "--trajectory-build-model", "--dressage-partial-rollout", "--token-build-mode",
    "--token-build-model", "--model-mask-type", "--tito-model", "--routed-experts-dtype",
    "--enable-transfer-queue", "--tool-call-hooks",
)
#: The flags of Dressage's shipped launch scripts that select its wire shapes (``--api-dialect dressage``).
_DRESSAGE_SHIPPED = ("--token-build-mode", "--token-build-model")
#: Dressage's ``--api-key`` value that means "no key".
_NO_AUTH = "no-auth"
#: Dressage's router port when only ``SGLANG_ROUTER_HOST`` is set (its ``dressage/config``).
_SGLANG_ROUTER_PORT = 8000
#: The Claw-R1 gateway listens here when its own command line starts it (ours is 8800).
GATEWAY_PORT = 8100
#: Flags only the gateway's command line uses: seeing one means "start like the gateway".
_GATEWAY_FLAGS = ("--data-pool-name", "--prompt-length", "--response-length")


class _BuildModel(argparse.Action):
    """``--trajectory-build-model M``: the tool-call and reasoning formats of model family ``M``.

    Like Dressage, it only fills in what the command line does not set itself:
    an explicit ``--model-tool-call-type`` wins wherever it stands.
    """

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, "compat.build_model", values)


class _Refused(argparse.Action):
    """A seed flag whose capability is not built yet: one line saying what is missing."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        _refuse(namespace, f"{option_string} needs {self.help}; actorproxy does not have it yet")


def _refuse(namespace: Any, line: str) -> None:
    """Keep the first refusal; ``apply_compat`` raises it as the one line ``actorproxy run`` prints."""
    if getattr(namespace, "compat.refused", None) is None:
        setattr(namespace, "compat.refused", line)


class _Accepted(argparse.Action):
    """A seed flag whose meaning needs no setting here: kept for the start-up log (``help`` says why)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        notes = list(getattr(namespace, "compat.accepted", None) or [])
        shown = " ".join(values) if isinstance(values, list) else values
        notes.append(f"{option_string} {shown}: {self.help}")
        setattr(namespace, "compat.accepted", notes)


class _ExpertsDtype(argparse.Action):
    """Dressage's ``--routed-experts-dtype``: actorproxy keeps the engine's int32 expert ids."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        if values != "int32":
            _refuse(namespace, f"{option_string} {values}: actorproxy keeps routed experts as the engine's int32 "
                    "ids (base64, docs/data.md); only int32 is accepted")


def add_compat_arguments(group: Any) -> None:
    """Fill the "compatibility" argument group of ``actorproxy run``."""
    add = group.add_argument
    add("--sglang-router-url", metavar="URL", action=_EngineShorthand,
        help="Dressage: --backend sglang --backend-url URL (an SGLang worker or sgl-router)")
    add("--vllm-addresses", metavar="URL,URL", action=_EngineShorthand,
        help="Claw-R1 gateway: --backend vllm --backend-url URL,URL (host:port means http://host:port)")
    add("--trajectory-build-model", choices=MODEL_FAMILIES, action=_BuildModel, dest="compat.build_model",
        default=argparse.SUPPRESS,
        help="Dressage: infer the tool-call format (qwen3_5: Qwen3.5/Qwen3-Coder XML; qwen3: Hermes JSON) and "
        "the reasoning format (qwen3) unless given; the loss mask and TITO follow the chat template")
    add("--dressage-partial-rollout", action="store_true", dest="preemption.partial_rollout",
        default=argparse.SUPPRESS, help="Dressage: --partial-rollout")
    add("--response-length", type=int, metavar="N", dest="limits.default_max_tokens", default=argparse.SUPPRESS,
        help="Claw-R1 gateway: --default-max-tokens N (max_tokens when a request sends none)")
    add("--data-pool-name", metavar="NAME", dest="compat.data_pool_name", default=argparse.SUPPRESS,
        help="Claw-R1 gateway: --store ray --data-pool NAME (the shared Ray data pool segments go to)")
    add_dressage_arguments(group)


def add_dressage_arguments(group: Any) -> None:
    """The flags of Dressage's shipped ``parse_args`` (Accio-Lab/Dressage de8e869) that are not ours already."""
    add = group.add_argument
    add("--token-build-mode", choices=tuple(_TOKEN_BUILD_MODES), dest="compat.token_build_mode",
        default=argparse.SUPPRESS,
        help="Dressage: tito = --trajectory-build-mode concat, snapshot = --trajectory-build-mode last_step; "
        "also selects --api-dialect dressage")
    add("--token-build-model", choices=MODEL_FAMILIES, action=_BuildModel, dest="compat.build_model",
        default=argparse.SUPPRESS,
        help="Dressage: as --trajectory-build-model (qwen3_6 as qwen3_5); also selects --api-dialect dressage")
    add("--model-mask-type", metavar="TYPE", action=_Accepted, dest="compat.accepted", default=argparse.SUPPRESS,
        help="Dressage: accepted; the loss mask follows the tokenizer's chat template (no setting)")
    add("--routed-experts-dtype", choices=("uint8", "uint16", "int32"), action=_ExpertsDtype,
        dest="compat.experts_dtype", default=argparse.SUPPRESS,
        help="Dressage: int32 (what is recorded); uint8 and uint16 are refused")
    add("--enable-transfer-queue", nargs=0, action=_Refused, default=argparse.SUPPRESS,
        help="TransferQueue offload of logprobs and routed experts (segments stay in the --store)")
    for flag, meta in (("--transfer-queue-config", "PATH"), ("--transfer-queue-retention-seconds", "S")):
        add(flag, metavar=meta, action=_Accepted, dest="compat.accepted", default=argparse.SUPPRESS,
            help="Dressage: ignored, as there, without --enable-transfer-queue (actorproxy has no TransferQueue)")
    add("--transfer-params", nargs="+", metavar="FIELD", action=_Accepted, dest="compat.accepted",
        default=argparse.SUPPRESS,
        help="Dressage: ignored, as there, without --enable-transfer-queue (actorproxy has no TransferQueue)")
    add("--tool-call-hooks", nargs="+", metavar="HOOK", action=_Refused, default=argparse.SUPPRESS,
        help="pluggable tool-call side-effect hooks run by the proxy")
    add("--tool-call-hook-before-timeout", metavar="S", action=_Refused, default=argparse.SUPPRESS,
        help="pluggable tool-call side-effect hooks run by the proxy")


class _EngineShorthand(argparse.Action):
    """``--sglang-router-url URL`` / ``--vllm-addresses A,B``: the backend kind and its URLs at once."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        kind = "sglang" if option_string == "--sglang-router-url" else "vllm"
        if getattr(namespace, "engines.backend", kind) != kind:
            parser.error(f"{option_string} names a {kind} engine, but --backend says otherwise")
        setattr(namespace, "engines.backend", kind)
        urls = list(getattr(namespace, "engines.backend_urls", None) or [])
        urls.extend(_with_scheme(part.strip()) for part in str(values).split(",") if part.strip())
        setattr(namespace, "engines.backend_urls", urls)


def _with_scheme(address: str) -> str:
    """``host:port`` (as verl reports a replica) means ``http://host:port``, as the gateway reads it."""
    return address if address.startswith(("http://", "https://")) else f"http://{address}"


def _given(argv: list[str], flags: tuple[str, ...]) -> bool:
    """Whether ``argv`` uses one of ``flags`` (as ``--flag value`` or ``--flag=value``)."""
    return any(arg.split("=", 1)[0] in flags for arg in argv)


def sglang_router_from_env(environ: Mapping[str, str]) -> str | None:
    """The SGLang router Dressage's environment names: ``$SGLANG_ROUTER_URL``, else ``$SGLANG_ROUTER_HOST``:port."""
    url = (environ.get("SGLANG_ROUTER_URL") or "").strip()
    if url:
        return url
    host = (environ.get("SGLANG_ROUTER_HOST") or "").strip()
    if host:
        return f"http://{host}:{(environ.get('SGLANG_ROUTER_PORT') or '').strip() or _SGLANG_ROUTER_PORT}"
    return None


def is_dressage_launch(argv: list[str]) -> bool:
    """A Dressage launch line: it serves a real SGLang router, never the built-in simulator."""
    return _given(argv, _DRESSAGE_FLAGS)


def _dressage(
    tree: dict[str, dict[str, Any]], compat: dict[str, Any], argv: list[str], environ: Mapping[str, str],
    defaults: dict[str, dict[str, Any]], notes: list[str],
) -> None:
    """What Dressage's shipped launch lines mean here (docs/migrating.md)."""
    mode = compat.get("token_build_mode")
    if mode is not None:
        tree.setdefault("trajectory", {}).setdefault("trajectory_build_mode", _TOKEN_BUILD_MODES[mode])
        notes.append(f"--token-build-mode {mode}: --trajectory-build-mode {_TOKEN_BUILD_MODES[mode]}")
    notes.extend(compat.get("accepted") or ())
    if _given(argv, _DRESSAGE_SHIPPED):
        defaults.setdefault("server", {})["api_dialect"] = "dressage"
        notes.append("a Dressage launch line: --api-dialect dressage (its finalize, read, discard and "
                     "capabilities shapes; docs/migrating.md)")
        limits = tree.get("limits", {})
        if "rollout_temperature" in limits:  # Dressage's is the fallback for a request without one
            limits["default_temperature"] = limits.pop("rollout_temperature")
            notes.append(f"--rollout-temperature {limits['default_temperature']}: the temperature of a request "
                         "that sends none (Dressage's meaning; --default-temperature)")
    if tree.get("server", {}).get("heartbeat_interval") == 0 and _given(argv, ("--stream-heartbeat-interval-seconds",)):
        raise ValueError("--stream-heartbeat-interval-seconds 0 (no heartbeats) is refused: actorproxy streams "
                         "tokens as they are sampled, and a paused stream is kept open only by its heartbeats")
    security = tree.get("security", {})
    if security.get("api_key") == _NO_AUTH:  # Dressage's way of saying "no key"
        del security["api_key"]
        notes.append(f"--api-key {_NO_AUTH}: no key (Dressage's default)")
    elif security.get("api_key") and _given(argv, _DRESSAGE_SHIPPED):
        # Dressage's key guards every route but /health: here it is the agents' key and the admin token.
        security.setdefault("admin_token", security["api_key"])
        notes.append("--api-key: every route but /health needs it (Dressage's meaning: agents' key and admin token)")
    if is_dressage_launch(argv):
        # Dressage's proxy listens on 0.0.0.0 without a token and its rollout clients send none: the same
        # launch starts here, loudly (a start-up warning, "access" in /health); docs/migrating.md#access.
        defaults.setdefault("security", {})["insecure"] = True
    flag_value = (environ.get("DRESSAGE_ENABLE_TRANSFER_QUEUE") or "").strip().lower()
    if flag_value in ("1", "true", "yes", "on"):
        raise ValueError("$DRESSAGE_ENABLE_TRANSFER_QUEUE asks for TransferQueue offload, which actorproxy does "
                         "not have (segments stay in the --store); unset it")


def _engine(
    tree: dict[str, dict[str, Any]], argv: list[str], environ: Mapping[str, str],
    defaults: dict[str, dict[str, Any]], notes: list[str],
) -> None:
    """``$SGLANG_ROUTER_URL`` names the engine when the command line names none."""
    engines = tree.get("engines", {})
    if "backend" in engines or "backend_urls" in engines:
        return
    router = sglang_router_from_env(environ)
    if router is not None:
        defaults.setdefault("engines", {}).update(backend="sglang", backend_urls=(router,))
        notes.append(f"$SGLANG_ROUTER_URL: --backend sglang --backend-url {router}")


def check_engine(config: ProxyConfig, argv: list[str]) -> None:
    """A launch line of a system with no simulator must name a real engine: never fall back to ours.

    ``--backend sim`` on the line itself is a choice, not a fallback.
    """
    if config.engines.backend != "sim" or _given(argv, ("--backend",)):
        return
    if is_dressage_launch(argv):
        raise ValueError("a Dressage launch line serves a real SGLang router: give --sglang-router-url URL or set "
                         "SGLANG_ROUTER_URL (actorproxy never falls back to its simulator; --backend sim is for "
                         "trying it without a GPU)")
    if _given(argv, _GATEWAY_FLAGS):
        raise ValueError("a Claw-R1 gateway launch line serves real vLLM engines: give --vllm-addresses "
                         "(actorproxy never falls back to its simulator; --backend sim is for trying it without a GPU)")


def apply_compat(
    tree: dict[str, dict[str, Any]], args: argparse.Namespace, argv: list[str],
    environ: Mapping[str, str] | None = None,
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Fold the compatibility flags (and Dressage's environment) into the settings ``tree``.

    Returns the defaults these command lines change (below the config file and
    the environment) and notes for the start-up log. A refused combination
    raises ``ValueError`` with one line.
    """
    environ = os.environ if environ is None else environ
    notes: list[str] = []
    defaults: dict[str, dict[str, Any]] = {}
    compat = {k.partition(".")[2]: v for k, v in vars(args).items() if k.startswith("compat.")}
    if compat.get("refused"):
        raise ValueError(compat["refused"])
    _dressage(tree, compat, argv, environ, defaults, notes)
    _engine(tree, argv, environ, defaults, notes)
    family = compat.get("build_model")
    if family is not None:
        for dest, value in {**_INFERRED[family], "trajectory.tito_model": family}.items():
            section, _, name = dest.partition(".")
            tree.setdefault(section, {}).setdefault(name, value)
        notes.append(f"--trajectory-build-model {family}: tool calls {tree['parsing']['tool_call_format']}")
    if "data_pool_name" in compat:
        store = tree.setdefault("store", {})
        store.setdefault("store_kind", "ray")
        store.setdefault("data_pool", compat["data_pool_name"])
        notes.append(f"--data-pool-name {compat['data_pool_name']}: segments go to that Ray data pool (--store ray)")
    if any(flag in argv for flag in _GATEWAY_FLAGS):
        defaults.setdefault("server", {})["port"] = GATEWAY_PORT
        defaults["parsing"] = {"tool_call_format": "none"}
        defaults["gateway"] = {"init_base_url": "v1"}
        notes.append(f"the gateway's command line: its default port is {GATEWAY_PORT}, /init_trajectory's base_url "
                     "ends in /v1 and tool calls stay in the content as text (as the gateway does)")
    return defaults, notes
