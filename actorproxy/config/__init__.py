"""The proxy's settings: one frozen tree shared read-only by every actor.

Each section is an attrs class; each field carries its help text (and, where
the command line names it differently, its flags) in its metadata, so the
``actorproxy run`` parser is generated from the tree (:mod:`actorproxy.settings_cli`)
and a TOML file (``--config``) has the same shape::

    [engines]
    backend = "vllm"
    backend_urls = ["http://gpu-1:8000", "http://gpu-2:8000"]

    [trajectory]
    on_history_rewrite = "recompute"

A field's flag is its name with dashes (``--on-history-rewrite``), unique
across the tree, so :meth:`ProxyConfig.of` also takes settings by bare name.

The package: :mod:`.fields` (:func:`setting` and the validators),
:mod:`.sections` (one class per section), :mod:`.tree` (:class:`ProxyConfig`
and the converter that builds it), :mod:`.sim_engine` (the simulated engine's
``SimConfig``, whose defaults ``actorproxy sim`` and the ``--sim-*`` settings take).
"""

from __future__ import annotations

from .fields import RECOMPUTE_ENV as RECOMPUTE_ENV
from .fields import RECOMPUTE_ENVS as RECOMPUTE_ENVS
from .fields import AgentAuth as AgentAuth
from .fields import BackendKind as BackendKind
from .fields import BuildMode as BuildMode
from .fields import RewriteMode as RewriteMode
from .fields import SubAgentMode as SubAgentMode
from .fields import recompute_logprobs_from_env as recompute_logprobs_from_env
from .fields import setting as setting
from .sections import EngineSettings as EngineSettings
from .sections import GatewaySettings as GatewaySettings
from .sections import LimitSettings as LimitSettings
from .sections import ParsingSettings as ParsingSettings
from .sections import PreemptionSettings as PreemptionSettings
from .sections import SecuritySettings as SecuritySettings
from .sections import ServerSettings as ServerSettings
from .sections import StoreKind as StoreKind
from .sections import StoreSettings as StoreSettings
from .sections import TrajectorySettings as TrajectorySettings
from .tree import FIELD_SECTIONS as FIELD_SECTIONS
from .tree import SECTIONS as SECTIONS
from .tree import ProxyConfig as ProxyConfig
from .tree import config_converter as config_converter
