"""The HTTP floor: bytes, HTTP/1.1 and ASGI, and nothing of the proxy above it (as httpcore sits under httpx).

:mod:`.h1` is the one HTTP/1.1 codec, sans-IO, for both roles (the server reads requests
and writes responses, the engine client writes requests and reads responses); :mod:`.state`
the one record of where a connection's request and response stand, which the server's
connections and the client pool's both hold; :mod:`.errors` names what a transport can fail
with. Nothing here imports the rest of ``actorproxy``.
"""
