"""The settings tree: :class:`ProxyConfig`, its sections by name, and the converter that builds it from TOML/flags."""

from __future__ import annotations

from typing import Any

import attrs
import cattrs

from .sections import (
    EngineSettings,
    GatewaySettings,
    LimitSettings,
    ParsingSettings,
    PreemptionSettings,
    SecuritySettings,
    ServerSettings,
    StoreSettings,
    TrajectorySettings,
)


@attrs.frozen
class ProxyConfig:
    """Every setting of ``actorproxy run``, by section."""

    server: ServerSettings = attrs.field(factory=ServerSettings)
    engines: EngineSettings = attrs.field(factory=EngineSettings)
    trajectory: TrajectorySettings = attrs.field(factory=TrajectorySettings)
    preemption: PreemptionSettings = attrs.field(factory=PreemptionSettings)
    limits: LimitSettings = attrs.field(factory=LimitSettings)
    store: StoreSettings = attrs.field(factory=StoreSettings)
    parsing: ParsingSettings = attrs.field(factory=ParsingSettings)
    gateway: GatewaySettings = attrs.field(factory=GatewaySettings)
    security: SecuritySettings = attrs.field(factory=SecuritySettings)

    def __attrs_post_init__(self) -> None:
        engines, parsing = self.engines, self.parsing
        if engines.backend != "sim" and not engines.backend_urls:
            raise ValueError(f"--backend {engines.backend} needs at least one engine URL (--backend-url)")
        if engines.backend == "sim" and engines.backend_urls:
            raise ValueError("--backend-url needs --backend sglang, vllm or llamacpp (sim is built in)")
        if self.security.agent_auth == "api-key" and not self.security.api_key:
            raise ValueError("--agent-auth api-key needs --api-key (or ACTORPROXY_API_KEY)")
        if parsing.parse_backend != "local" and self.parse_url is None:
            raise ValueError(f"--parse-backend {parsing.parse_backend} needs an SGLang server (--sglang-parse-url)")

    @classmethod
    def of(cls, **settings: Any) -> ProxyConfig:
        """A config from settings named by field (``ProxyConfig.of(port=0, partial_rollout=True)``).

        A section's name takes a whole section object (``engines=EngineSettings(...)``).
        """
        tree: dict[str, dict[str, Any]] = {}
        whole: dict[str, Any] = {}
        for name, value in settings.items():
            if name in SECTIONS:
                whole[name] = value
                continue
            section = FIELD_SECTIONS.get(name)
            if section is None:
                raise TypeError(f"ProxyConfig has no setting {name!r}")
            tree.setdefault(section, {})[name] = value
        sections = {
            name: attrs.evolve(whole.get(name, kind()), **tree.get(name, {})) for name, kind in SECTIONS.items()
        }
        return cls(**sections)

    def evolve(self, **settings: Any) -> ProxyConfig:
        """A copy with some settings changed, named as in :meth:`of`."""
        current = {name: getattr(self, name) for name in SECTIONS}
        for name, value in settings.items():
            if name in SECTIONS:
                current[name] = value
            elif name in FIELD_SECTIONS:
                section = FIELD_SECTIONS[name]
                current[section] = attrs.evolve(current[section], **{name: value})
            else:
                raise TypeError(f"ProxyConfig has no setting {name!r}")
        return ProxyConfig(**current)

    @property
    def parse_url(self) -> str | None:
        """The SGLang server that parses outputs, when parsing is not local."""
        if self.parsing.sglang_parse_url:
            return self.parsing.sglang_parse_url
        if self.engines.backend == "sglang" and self.engines.backend_urls:
            return self.engines.backend_urls[0]
        return None

    def public(self) -> dict[str, Any]:
        """The settings as shown by ``GET /health``, by section (secrets left out)."""
        return {
            name: attrs.asdict(getattr(self, name), filter=lambda a, _v: not a.metadata.get("secret"))
            for name in SECTIONS
        }


#: Section name -> its class, in the order ``--help`` shows them.
SECTIONS: dict[str, type[Any]] = {
    "server": ServerSettings,
    "engines": EngineSettings,
    "trajectory": TrajectorySettings,
    "preemption": PreemptionSettings,
    "limits": LimitSettings,
    "store": StoreSettings,
    "parsing": ParsingSettings,
    "gateway": GatewaySettings,
    "security": SecuritySettings,
}
#: Field name -> the section holding it.
FIELD_SECTIONS: dict[str, str] = {
    field.name: section for section, kind in SECTIONS.items() for field in attrs.fields(kind)
}


def config_converter() -> cattrs.Converter:
    """The converter that builds a :class:`ProxyConfig` from a TOML/flag tree (unknown keys refused)."""
    converter = cattrs.Converter(forbid_extra_keys=True)

    def _strings(value: Any, _t: Any) -> tuple[str, ...]:
        if isinstance(value, str):  # "http://a,http://b", as on the command line
            return tuple(part.strip() for part in value.split(",") if part.strip())
        if isinstance(value, list | tuple) and all(isinstance(v, str) for v in value):
            return tuple(value)
        raise ValueError(f"expected a list of strings, got {value!r}")

    converter.register_structure_hook_func(lambda t: t == tuple[str, ...], _strings)
    return converter
