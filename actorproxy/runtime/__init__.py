"""The actors: session registry, session actors, trajectory store, and the runtime facade."""

from .messages import ChatRequest as ChatRequest
from .messages import Identity as Identity
from .runtime import Runtime as Runtime
from .runtime import open_runtime as open_runtime
