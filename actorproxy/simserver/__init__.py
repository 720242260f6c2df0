"""A simulated inference engine served over HTTP, protocol-faithful to SGLang, vLLM and llama.cpp.

``actorproxy sim --port 30000`` serves a :class:`~actorproxy.backends.sim.SimEngine`
so real engine clients can be tested against it (and the real-engine path of the
proxy can be tried on a laptop). Tests use :func:`open_sim_server` on port 0 and
arm faults through :attr:`RunningSim.faults`.
"""

from .app import RunningSim as RunningSim
from .app import create_sim_app as create_sim_app
from .app import open_sim_server as open_sim_server
from .app import serve_sim as serve_sim
from .app import sim_state as sim_state
from .core import RequestRecord as RequestRecord
from .core import SimServerSettings as SimServerSettings
from .core import SimState as SimState
from .faults import SimFaults as SimFaults
