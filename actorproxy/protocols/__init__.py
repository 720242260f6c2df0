"""The agent protocols: every body an agent or a trainer sends, and every reply we render for it.

Each chat protocol (``openai_chat``, ``anthropic``, ``responses_format``) is a
:class:`~actorproxy.protocols.format.TurnFormat`: parse, render and a stream writer; ``gateway_models`` and
``trainer`` are the gateway's and the trainer's bodies. All of them are structured by the one converter
(:mod:`actorproxy.schema.converter`). Nothing here does I/O; the package sits above the runtime, whose turn
events (:mod:`actorproxy.core.turn_events`) it renders.
"""
