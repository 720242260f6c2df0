"""The simulated engine: in-process (:class:`SimEngine`) or served over HTTP (:mod:`.server`).

:class:`SimEngine` is a deterministic :class:`~actorproxy.engines.base.Backend` on
Trio's clock; :mod:`.policy` decides what it says. ``actorproxy sim --port 30000``
serves one over HTTP, protocol-faithful to SGLang, vLLM and llama.cpp (each
engine kind's routes in ``<kind>_routes``, speaking the format of ``actorproxy.engines.<kind>.protocol``).
Tests use :func:`actorproxy.sim.server.open_sim_server` on port 0 and arm faults
through :attr:`~actorproxy.sim.server.RunningSim.faults`.
"""

from ..config.sim_engine import SimConfig as SimConfig
from .engine import SimEngine as SimEngine
from .generation import SimGeneration as SimGeneration
from .outputs import ScriptedOutput as ScriptedOutput
from .outputs import SimRequestStats as SimRequestStats
