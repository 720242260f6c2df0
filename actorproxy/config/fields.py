"""The field machinery of the settings tree: :func:`setting` (help and flags in the metadata), validators, types."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import attrs

BuildMode = Literal["concat", "last_step"]
RewriteMode = Literal["segment", "recompute"]
SubAgentMode = Literal["train", "log", "off"]
SideCallMode = Literal["train", "log", "off"]
BackendKind = Literal["sim", "sglang", "vllm", "llamacpp"]
AgentAuth = Literal["none", "session-key", "api-key"]

#: Set to ``0`` to keep ``--on-history-rewrite recompute`` from asking the engine for prompt logprobs.
RECOMPUTE_ENV = "ACTORPROXY_RECOMPUTE_MISMATCH_LOGPROBS"
#: Ours first, then the in-process (Harbor) proxy's name for the same switch.
RECOMPUTE_ENVS = (RECOMPUTE_ENV, "HARBOR_RECOMPUTE_MISMATCH_LOGPROBS")


def recompute_logprobs_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``$ACTORPROXY_RECOMPUTE_MISMATCH_LOGPROBS`` is ``0``/``false``/``no``/``off``."""
    source = environ if environ is not None else os.environ
    value = next((source[name] for name in RECOMPUTE_ENVS if name in source), "1")
    return str(value).strip().lower() not in ("0", "false", "no", "off")


def _positive(_inst: Any, attribute: Any, value: Any) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"--{attribute.name.replace('_', '-')} must be positive, got {value}")


def non_negative(_inst: Any, attribute: Any, value: Any) -> None:
    if value is not None and value < 0:
        raise ValueError(f"--{attribute.name.replace('_', '-')} must be 0 or more, got {value}")


def temperature_range(_inst: Any, attribute: Any, value: Any) -> None:
    if value is not None and not 0.0 <= value <= 2.0:
        raise ValueError(f"--{attribute.name.replace('_', '-')} must be between 0 and 2, got {value}")


def tool_call_json(_inst: Any, attribute: Any, value: Any) -> None:
    from .sim_engine import parse_tool_calls  # (a leaf module of this package: no cycle)

    if value is not None:
        try:
            parse_tool_calls(value)
        except ValueError as exc:
            raise ValueError(f"--{attribute.name.replace('_', '-')}: {exc}") from None


def probability(_inst: Any, attribute: Any, value: Any) -> None:
    if value is not None and not 0.0 <= value <= 1.0:
        raise ValueError(f"--{attribute.name.replace('_', '-')} must be between 0 and 1, got {value}")


def setting(
    default: Any = attrs.NOTHING,
    *,
    help: str,
    factory: Any = None,
    flags: tuple[str, ...] = (),
    env: str | tuple[str, ...] | None = None,
    metavar: str | None = None,
    positive: bool = False,
    validator: Any = None,
    converter: Any = None,
    secret: bool = False,
    compat: bool = False,
) -> Any:
    """An attrs field with what the command line needs to know about it.

    ``flags`` replace the default ``--field-name`` (the first is the primary
    one); ``env`` is read when neither a flag nor the config file sets the
    field; ``secret`` keeps it out of ``GET /health`` and reprs.
    """
    validators = [v for v in (_positive if positive else None, validator) if v is not None]
    envs = (env,) if isinstance(env, str) else tuple(env or ())
    metadata = {"help": help, "flags": flags, "env": envs, "metavar": metavar, "secret": secret, "compat": compat}
    common: dict[str, Any] = {"validator": validators or None, "metadata": metadata, "repr": not secret}
    if converter is not None:
        common["converter"] = converter
    if factory is not None:
        return attrs.field(factory=factory, **common)
    return attrs.field(default=default, **common)
