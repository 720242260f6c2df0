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
from typing import Any

#: Model names of Dressage's ``--trajectory-build-model`` / ``--tito-model`` / ``--model-tool-call-type``.
MODEL_FAMILIES = ("qwen3", "qwen3_5")
#: What ``--trajectory-build-model`` infers (Dressage: mask, tool-call, reasoning and TITO model).
_INFERRED = {
    "qwen3": {"parsing.tool_call_format": "qwen3", "parsing.reasoning_format": "qwen3"},
    "qwen3_5": {"parsing.tool_call_format": "qwen3_coder", "parsing.reasoning_format": "qwen3"},
}
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
        parser.error(f"{option_string} needs {self.help}; actorproxy does not have it yet")


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


def apply_compat(
    tree: dict[str, dict[str, Any]], args: argparse.Namespace, argv: list[str]
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Fold the compatibility flags into the settings ``tree``.

    Returns the defaults these command lines change (below the config file and
    the environment) and notes for the start-up log.
    """
    notes: list[str] = []
    defaults: dict[str, dict[str, Any]] = {}
    compat = {k.partition(".")[2]: v for k, v in vars(args).items() if k.startswith("compat.")}
    family = compat.get("build_model")
    if family is not None:
        for dest, value in _INFERRED[family].items():
            section, _, name = dest.partition(".")
            tree.setdefault(section, {}).setdefault(name, value)
        notes.append(f"--trajectory-build-model {family}: tool calls {tree['parsing']['tool_call_format']}")
    if "data_pool_name" in compat:
        store = tree.setdefault("store", {})
        store.setdefault("store_kind", "ray")
        store.setdefault("data_pool", compat["data_pool_name"])
        notes.append(f"--data-pool-name {compat['data_pool_name']}: segments go to that Ray data pool (--store ray)")
    if any(flag in argv for flag in _GATEWAY_FLAGS):
        defaults["server"] = {"port": GATEWAY_PORT}
        defaults["parsing"] = {"tool_call_format": "none"}
        defaults["gateway"] = {"init_base_url": "v1"}
        notes.append(f"the gateway's command line: its default port is {GATEWAY_PORT}, /init_trajectory's base_url "
                     "ends in /v1 and tool calls stay in the content as text (as the gateway does)")
    return defaults, notes
