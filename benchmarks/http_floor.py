"""The CPU floor of the proxy's two HTTP layers, without any proxy work: what is left to win where.

    python benchmarks/http_floor.py [--requests 2000] [--concurrency 1 64]

1. Ingress: a Quart-trio app on hypercorn (the proxy's stack) whose chat route reads the
   JSON body and answers a canned completion, loaded by ``load_client.py`` from another
   process: its CPU per request is the least any route on this stack costs; then the same
   route served by an ASGI fast lane in front of that Quart app (the turn route answered at
   the ASGI level, everything else falling through to Quart: what the proxy does now), as a
   bare ASGI app on hypercorn (what Quart adds is the difference), by a bare HTTP/1.1
   server on Trio streams with h11 doing the framing (what hypercorn adds is the difference),
   and as the same bare ASGI app on the proxy's own server (``actorproxy.server.http_server``:
   what ASGI costs over that bare server); last, the proxy's real ingress (that server, the
   request tracking, the turn lane with its checks, access log and metrics, Quart behind it)
   with a canned turn handler: what the ingress costs a turn; and the same with a streamed reply of
   16 SSE events arriving one per scheduler round (a real ``SSEReply``): what a streamed token costs it.
2. Engine client: POSTs of a 2,000-token SGLang ``/generate`` body to ``engine_stub.py``,
   each reading the 16-event stream to its end, on one keep-alive connection per task,
   with httpx (the proxy's engine client library) and with a bare HTTP/1.1 exchange over
   a Trio stream: CPU per request of this process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from array import array
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import trio
from load_client import cpu_seconds
from overhead import REPLY, canned, run_client
from processes import engine_stub, free_port, running, wait_ready

from actorproxy.engines.base import GenerateRequest, SamplingParams
from actorproxy.engines.connection import EngineOptions
from actorproxy.engines.sglang.client import SGLangBackend
from actorproxy.http.client import HTTP11Client

APP = '''
import json, sys
from hypercorn.config import Config
from hypercorn.trio import serve
from quart import request, Response
from quart_trio import QuartTrio
import trio
app = QuartTrio(__name__)
ANSWER = json.dumps({"id": "c", "object": "chat.completion", "choices": [{"index": 0,
    "message": {"role": "assistant", "content": "canned"}, "finish_reason": "stop"}]})
@app.post("/v1/chat/completions")
async def chat():
    body = json.loads(await request.get_data())
    return Response(ANSWER, mimetype="application/json")
@app.get("/health")
async def health():
    return "ok"
config = Config()
config.bind = [f"127.0.0.1:{sys.argv[1]}"]
config.accesslog = None
trio.run(serve, app, config)
'''

#: An ASGI app's whole request body: a piece of the app scripts below that read one.
READ_BODY = '''
async def read_body(receive):
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body
'''

# The same route as a bare ASGI app on hypercorn: what Quart adds is the difference.
BARE_APP = '''
import json, sys
from hypercorn.config import Config
from hypercorn.trio import serve
import trio
ANSWER = json.dumps({"id": "c", "object": "chat.completion", "choices": [{"index": 0,
    "message": {"role": "assistant", "content": "canned"}, "finish_reason": "stop"}]}).encode()
''' + READ_BODY + '''
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return
    body = await read_body(receive)
    if scope["path"] == "/v1/chat/completions":
        json.loads(body)
        out = ANSWER
    else:
        out = b"ok"
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(out)).encode())]})
    await send({"type": "http.response.body", "body": out})
config = Config()
config.bind = [f"127.0.0.1:{sys.argv[1]}"]
config.accesslog = None
trio.run(serve, app, config)
'''


# An ASGI fast lane in front of the Quart app: the turn route at the ASGI level, the rest through Quart.
LANE_APP = APP.replace("trio.run(serve, app, config)", READ_BODY + '''
ANSWER_BYTES = ANSWER.encode()
HEAD = {"type": "http.response.start", "status": 200,
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER_BYTES)).encode())]}
async def lane(scope, receive, send):
    if scope["type"] != "http" or scope["path"] != "/v1/chat/completions" or scope["method"] != "POST":
        return await app(scope, receive, send)
    json.loads(await read_body(receive))
    await send(HEAD)
    await send({"type": "http.response.body", "body": ANSWER_BYTES})
trio.run(serve, lane, config)
''')

# The same route on a bare HTTP/1.1 server: Trio streams, h11 framing, one send per response.
H11_APP = '''
import json, sys
import h11, trio
ANSWER = json.dumps({"id": "c", "object": "chat.completion", "choices": [{"index": 0,
    "message": {"role": "assistant", "content": "canned"}, "finish_reason": "stop"}]}).encode()
async def handle(stream):
    connection = h11.Connection(h11.SERVER)
    while True:
        event = connection.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(65536)
            connection.receive_data(data)
            if not data:
                return
            continue
        if isinstance(event, h11.Request):
            target, body = event.target, b""
            continue
        if isinstance(event, h11.Data):
            body += event.data
            continue
        if isinstance(event, h11.EndOfMessage):
            out = ANSWER if target == b"/v1/chat/completions" else b"ok"
            if out is ANSWER:
                json.loads(body)
            head = h11.Response(status_code=200, headers=[("content-type", "application/json"),
                                                          ("content-length", str(len(out)))])
            await stream.send_all(connection.send(head) + connection.send(h11.Data(data=out))
                                  + connection.send(h11.EndOfMessage()))
            if connection.our_state is h11.MUST_CLOSE:
                return
            connection.start_next_cycle()
            continue
        return
trio.run(trio.serve_tcp, handle, int(sys.argv[1]))
'''


# The bare ASGI app on the proxy's own HTTP/1.1 server.
OURS_APP = BARE_APP.replace("trio.run(serve, app, config)", '''
from functools import partial
from actorproxy.server.http_server import HTTPServer
trio.run(partial(HTTPServer(app).serve, "127.0.0.1", int(sys.argv[1]), shutdown_trigger=trio.sleep_forever))
''')

#: The lane in front of Quart on the proxy's own server: the proxy's ingress as it is.
LANE_OURS_APP = LANE_APP.replace("trio.run(serve, lane, config)", '''
from functools import partial
from actorproxy.server.http_server import HTTPServer
trio.run(partial(HTTPServer(lane).serve, "127.0.0.1", int(sys.argv[1]), shutdown_trigger=trio.sleep_forever))
''')


#: The proxy's real ingress (its server, request tracking, turn lane, observer, Quart behind) with a canned turn:
#: a JSON answer, or (``"stream": true``) a real SSEReply of 16 deltas arriving one per scheduler round, as an
#: engine's tokens do (the per-event cost of a streamed reply).
INGRESS_APP = '''
import math, sys
from functools import partial
import trio
from actorproxy.core.turn_events import TurnAccepted, TurnDelta, TurnDone
from actorproxy.runtime.turn_stream import TurnStream
from actorproxy.server.turns import sse_frames
from quart_trio import QuartTrio
from actorproxy.server.admission import Admission
from actorproxy.server.auth import AccessPolicy
from actorproxy.server.drain import DrainRequestBody
from actorproxy.runtime.in_flight import InFlight
from actorproxy.server.http_server import HTTPServer
from actorproxy.server.lane import TurnLane
from actorproxy.server.observe import Observer
from actorproxy.telemetry import note_first_token, note_turn
from actorproxy.schema.jsonio import dumps, loads
app = QuartTrio(__name__)
@app.get("/health")
async def health():
    return "ok"
observer = Observer()
observer.install(app)
lane = TurnLane(DrainRequestBody(app.asgi_app), observer=observer,
                admission=Admission(AccessPolicy(), max_body=1 << 26, body_timeout=600))
ANSWER = dumps({"id": "c", "object": "chat.completion", "choices": [{"index": 0,
    "message": {"role": "assistant", "content": "canned"}, "finish_reason": "stop"}]})
class Writer:
    def start(self, accepted):
        return b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\\n\\n'
    def delta(self, delta):
        return b'data: {"choices":[{"index":0,"delta":{"content":"' + delta + b'"}}]}\\n\\n'
    def heartbeat(self):
        return b": ping\\n\\n"
    def finish(self, done):
        return b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\\n\\ndata: [DONE]\\n\\n'
    def error(self, error):
        return b'data: {"error":{}}\\n\\n'
DONE = TurnDone(0, None, "stop", 100, 16, False)
async def feed(send):
    for _ in range(16):
        await trio.lowlevel.cancel_shielded_checkpoint()
        send.send_nowait(TurnDelta(b"tok"))
    await trio.lowlevel.cancel_shielded_checkpoint()
    send.send_nowait(DONE)
async def chat(raw, headers, url_session, url_instance, confined):
    if not loads(raw).get("stream"):
        note_first_token()
        note_turn(session=headers.get("x-session-id"), prompt_tokens=100, sampled_tokens=16)
        return ANSWER
    send, receive = trio.open_memory_channel(math.inf)
    events = TurnStream(TurnAccepted(0, 100), receive)
    accepted = await events.receive()
    feeders.start_soon(feed, send)
    return sse_frames(events, accepted, Writer(), heartbeat=15.0)
lane.mount("/v1/chat/completions", chat)
app.asgi_app = lane
async def main():
    global feeders
    async with trio.open_nursery() as feeders:
        await HTTPServer(lane, tracker=InFlight()).serve("127.0.0.1", int(sys.argv[1]),
                                                               shutdown_trigger=trio.sleep_forever)
trio.run(main)
'''


def ingress_floor(concurrency: list[int], duration: float) -> None:
    apps = (("hypercorn + quart-trio", APP), ("ASGI lane before quart", LANE_APP),
            ("hypercorn, bare ASGI   ", BARE_APP), ("h11 on trio, bare     ", H11_APP),
            ("our server, bare ASGI ", OURS_APP), ("our server, lane+quart", LANE_OURS_APP),
            ("the proxy's ingress   ", INGRESS_APP))
    for name, app in apps:
        port = free_port()
        with running([sys.executable, "-c", app, str(port)]) as process:
            url = f"http://127.0.0.1:{port}"
            wait_ready(url + "/health", process)
            for c in concurrency:
                out = run_client(url, "--concurrency", str(c), "--duration", str(duration), "--watch",
                                 f"target={process.pid}", "--tag", f"floor{c}")
                print(f"{name}, trivial chat route, c={c:<3}: "
                      f"{out['cpu_ms_per_turn']['target']:.2f} ms CPU per request ({out['turns_per_s']:.0f}/s)")
            for c in concurrency if app is INGRESS_APP else ():
                out = run_client(url, "--concurrency", str(c), "--duration", str(duration), "--watch",
                                 f"target={process.pid}", "--tag", f"sse{c}", "--stream")
                print(f"{name}, 16 SSE events,       c={c:<3}: "
                      f"{out['cpu_ms_per_turn']['target']:.2f} ms CPU per request ({out['turns_per_s']:.0f}/s)")


async def _bare_post(stream: trio.SocketStream, path: bytes, body: bytes) -> bytes:
    head = b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    await stream.send_all(head % (path, len(body)) + body)
    buffer = b""
    while b"\r\n0\r\n\r\n" not in buffer:  # the stub's streams are chunked; the last chunk ends them
        data = await stream.receive_some(65536)
        if not data:
            raise ConnectionError("closed")
        buffer += data
    return buffer


async def engine_client_floor(stub_url: str, requests: int, concurrency: int) -> dict[str, float]:
    body: dict[str, Any] = {"rid": "r", "input_ids": list(range(1000, 3000)), "stream": True,
                            "sampling_params": {"max_new_tokens": 16}, "return_logprob": True}
    raw = json.dumps(body).encode()
    host, port = stub_url.removeprefix("http://").split(":")
    results: dict[str, float] = {}

    async def with_httpx() -> None:
        limits = httpx.Limits(max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(limits=limits) as client:
            async def task(n: int) -> None:
                for _ in range(n):
                    request = client.build_request("POST", stub_url + "/generate", content=raw,
                                                   headers={"Content-Type": "application/json"})
                    response = await client.send(request, stream=True)
                    async for _chunk in response.aiter_bytes():
                        pass
                    await response.aclose()
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(task, requests // concurrency)

    async def bare() -> None:
        async def task(n: int) -> None:
            stream = await trio.open_tcp_stream(host, int(port))
            async with stream:
                for _ in range(n):
                    await _bare_post(stream, b"/generate", raw)
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(task, requests // concurrency)

    async def h11_client() -> None:
        pool = HTTP11Client(stub_url, max_idle=concurrency)

        async def task(n: int) -> None:
            for _ in range(n):
                response = await pool.stream("POST", stub_url + "/generate", raw,
                                             {"Content-Type": "application/json"})
                while await response.receive() is not None:
                    pass
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(task, requests // concurrency)
        await pool.aclose()

    def generations() -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            backend = SGLangBackend(stub_url, EngineOptions(concurrency=concurrency))
            request = GenerateRequest(array("i", range(1000, 3000)), SamplingParams(max_new_tokens=16))

            async def task(n: int) -> None:
                for _ in range(n):
                    async with backend.open_generation(request) as generation:
                        async for _event in generation:
                            pass
            async with trio.open_nursery() as nursery:
                for _ in range(concurrency):
                    nursery.start_soon(task, requests // concurrency)
            await backend.aclose()
        return run

    runs: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        ("httpx", with_httpx), ("HTTP11Client (ours)", h11_client), ("bare trio stream", bare),
        ("SGLang client on HTTP11Client", generations()),
    ]
    for name, run in runs:
        samples = []
        for _ in range(3):
            start = cpu_seconds(os.getpid())
            await run()
            samples.append((cpu_seconds(os.getpid()) - start) * 1000 / requests)
        results[name] = statistics.median(samples)
    return results


def main(args: argparse.Namespace) -> None:
    print(f"load average: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    if not args.skip_ingress:
        ingress_floor(args.concurrency, args.duration)
    if args.skip_engine:
        return
    with engine_stub(canned(REPLY, 16)) as stub:
        for c in args.concurrency:
            floors = trio.run(engine_client_floor, stub.url, args.requests, c)
            for name, ms in floors.items():
                print(f"engine client, {name:<24}, c={c:<3}: {ms:.3f} ms CPU per streamed /generate")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--skip-ingress", action="store_true", help="the engine client rows only")
    parser.add_argument("--skip-engine", action="store_true", help="the ingress rows only")
    main(parser.parse_args())
