"""A zero-delay engine for benchmarks: canned replies, SGLang ``/generate`` and OpenAI chat.

    python benchmarks/engine_stub.py --reply reply.json [--port 0] [--token-interval 0.1]

It prints ``PORT <n>`` once listening. Every ``/generate`` (SGLang's native API, streamed
in its default cumulative shape, one event per token) and every ``/v1/chat/completions``
(the "direct engine" baseline, streamed or not) answers at once with the canned reply
(``{"ids": [...], "pieces": [...]}``: token ids and the text of each). ``POST /stub/reply``
replaces the reply; ``GET /stub/stats`` counts the TCP connections accepted and the
requests served, so a benchmark sees whether its client reuses connections.

With ``--token-interval`` a streamed ``/generate`` is *paced* instead: every interval the
stub takes one decoding step for every running generation, as a batched engine does (one
token each, cycling through the canned ids, up to ``max_new_tokens``), and streams it in
SGLang's incremental shape (``--cumulative`` for the default shape). A generation whose
connection is backed up gets its tokens coalesced into the next event, as SGLang's
tokenizer manager does, so the engine keeps generating whatever the reader's pace.
With ``--start-together N`` the steps begin once N generations are running (a rollout
batch), so that starting a thousand streams is not measured as streaming. ``POST
/abort_request`` (``{"rid"}`` or ``{"abort_all": true}``) makes the next step the
last: one more token, then ``finish_reason: abort``. ``GET /stub/generations`` tells,
per generation, its routing key, the tokens written to the connection, how it ended
(``stop``/``length``, ``abort`` after an abort call, or ``cut``: the connection closed
before the finish), when its first abort call arrived and when its finish was written
(``time.monotonic``), and when the last decoding step began (``step_at``); after
``POST /stub/pace {"max_new_tokens": n}`` the generations started from then on end after
``n`` tokens with the end-of-turn token, ``stop`` (``null`` lifts it).

Plain asyncio with a hand-written HTTP/1.1 reader (keep-alive, ``Content-Length``
bodies, chunked responses) rather than the project's Trio/Quart stack: the stub's own
CPU per request (tens of microseconds) must stay far below what is measured, on a
machine where it shares the cores with the proxy and the load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from typing import Any

try:  # the stub's JSON is not what is measured: the fastest library at hand
    import orjson

    def dumps(value: Any) -> bytes:
        return orjson.dumps(value)

    loads = orjson.loads
except ImportError:  # pragma: no cover
    def dumps(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":")).encode()

    loads = json.loads  # type: ignore[assignment]  # the same call, a wider signature


class Paced:
    """One paced generation (``--token-interval``): its connection, budget and counts."""

    def __init__(self, rid: str, key: str, budget: int, transport: asyncio.Transport) -> None:
        self.rid, self.key, self.budget, self.transport = rid, key, budget, transport
        self.ids: list[int] = []  # every token generated
        self.written = 0  # tokens written to the connection
        self.prompt = 0
        self.abort_calls = 0  # abort calls that named it (or all)
        self.state = "running"  # then stop, length, abort or cut
        self.stop_after: int | None = None  # end with the end-of-turn token at this many tokens
        self.abort_at: float | None = None  # when the first abort call naming it arrived (``time.monotonic``)
        self.ended_at: float | None = None  # when its finish was written


class Stub:
    def __init__(self, reply: dict[str, Any], interval: float = 0.0, cumulative: bool = False,
                 start_together: int = 0) -> None:
        self.connections = 0
        self.requests = 0
        self.ids: list[int] = []
        self.pieces: list[str] = []
        self._rids = itertools.count()
        self.interval = interval
        self.cumulative = cumulative
        self.cap: int | None = None
        self.start_together = start_together  # paced decoding begins once this many generations run
        self.abort_calls = 0
        self.step_at: float | None = None  # when the last decoding step began (``time.monotonic``)
        self.running: dict[str, Paced] = {}
        self.generations: list[Paced] = []
        self.set_reply(reply)

    def set_reply(self, reply: dict[str, Any]) -> None:
        self.ids = [int(i) for i in reply["ids"]]
        self.pieces = [str(p) for p in reply["pieces"]]
        self.text = "".join(self.pieces)

    # -- routes -------------------------------------------------------------

    def handle(self, method: str, path: str, body: bytes) -> tuple[int, bytes, list[bytes] | None]:
        """(status, JSON body, or SSE events for a chunked stream)."""
        self.requests += 1
        if path == "/generate":
            return self._generate(loads(body))
        if path == "/v1/chat/completions":
            return self._chat(loads(body))
        if path == "/abort_request":
            self._abort(loads(body) if body else {})
            return 200, b"", None
        if path == "/stub/generations":
            return 200, dumps({"abort_calls": self.abort_calls, "step_at": self.step_at, "generations": [
                {"rid": g.rid, "key": g.key, "tokens": g.written, "state": g.state, "abort_calls": g.abort_calls,
                 "abort_at": g.abort_at, "ended_at": g.ended_at}
                for g in self.generations]}), None
        if path == "/stub/pace" and method == "POST":
            self.cap = loads(body).get("max_new_tokens")
            return 200, b"{}", None
        if path in ("/health", "/update_weight_version"):
            return 200, b"", None
        if path in ("/get_model_info", "/get_weight_version"):
            return 200, dumps({"model_path": "stub", "weight_version": "default", "max_model_len": 1_000_000}), None
        if path == "/v1/models":
            return 200, dumps({"data": [{"id": "stub", "max_model_len": 1_000_000}]}), None
        if path == "/stub/stats":
            return 200, dumps({"connections": self.connections, "requests": self.requests}), None
        if path == "/stub/reply" and method == "POST":
            self.set_reply(loads(body))
            return 200, b"{}", None
        return 404, dumps({"error": {"message": f"no route {method} {path}"}}), None

    def _generate(self, body: dict[str, Any]) -> tuple[int, bytes, list[bytes] | None]:
        rid = body.get("rid") or f"stub-{next(self._rids)}"
        prompt = len(body.get("input_ids") or ())
        stop = self.ids[-1]
        if not body.get("stream"):
            meta = self._meta(rid, prompt, len(self.ids), stop)
            return 200, dumps({"text": self.text, "output_ids": self.ids, "meta_info": meta}), None
        events = []
        for n in range(1, len(self.ids) + 1):  # SGLang's default: cumulative ids and logprobs
            meta = self._meta(rid, prompt, n, stop if n == len(self.ids) else None)
            events.append(dumps({"text": "".join(self.pieces[:n]), "output_ids": self.ids[:n], "meta_info": meta}))
        events.append(b"[DONE]")
        return 200, b"", events

    # -- paced generations -----------------------------------------------

    def paced(self, body: bytes, key: str, transport: asyncio.Transport) -> bool:
        """Start a paced ``/generate`` stream on ``transport`` if this request is one."""
        if not self.interval:
            return False
        request = loads(body)
        if not request.get("stream"):
            return False
        self.requests += 1
        params = request.get("sampling_params") or {}
        budget = int(params.get("max_new_tokens") or 1_000_000)
        gen = Paced(request.get("rid") or f"stub-{next(self._rids)}", key, budget, transport)
        gen.stop_after = self.cap
        gen.prompt = len(request.get("input_ids") or ())
        self.running[gen.rid] = gen
        self.generations.append(gen)
        transport.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        return True

    def _abort(self, body: dict[str, Any]) -> None:
        self.abort_calls += 1
        if body.get("abort_all"):
            targets = list(self.running.values())
        else:
            target = self.running.get(str(body.get("rid") or ""))
            targets = [] if target is None else [target]
        now = time.monotonic()
        for gen in targets:
            gen.abort_calls += 1
            gen.abort_at = gen.abort_at or now

    async def tick(self) -> None:
        """One decoding step per interval for every running paced generation."""
        loop = asyncio.get_running_loop()
        due = loop.time()
        cycle = self.ids[:-1] or self.ids  # the canned text without its end-of-turn token
        while True:
            due += self.interval
            await asyncio.sleep(max(0.0, due - loop.time()))
            if len(self.running) < self.start_together:
                continue  # a batch starts decoding together
            self.start_together = 0
            self.step_at = time.monotonic()
            for gen in list(self.running.values()):
                if gen.transport.is_closing():
                    gen.state = "cut"
                    del self.running[gen.rid]
                    continue
                n = len(gen.ids)
                finish: dict[str, Any] | None = None
                if gen.stop_after is not None and n + 1 >= gen.stop_after and not gen.abort_calls:
                    gen.ids.append(self.ids[-1])
                    finish = {"type": "stop", "matched": self.ids[-1]}
                else:
                    gen.ids.append(cycle[n % len(cycle)])
                    if gen.abort_calls:
                        finish = {"type": "abort", "message": "Abort request"}
                    elif len(gen.ids) >= gen.budget:
                        finish = {"type": "length", "length": len(gen.ids)}
                if finish is None and gen.transport.get_write_buffer_size() > 0:
                    continue  # backed up: these tokens go out with the next event
                self._send(gen, finish)

    def _send(self, gen: Paced, finish: dict[str, Any] | None) -> None:
        start = 0 if self.cumulative else gen.written
        ids = gen.ids[start:]
        meta = {"id": gen.rid, "finish_reason": finish, "prompt_tokens": gen.prompt,
                "completion_tokens": len(gen.ids), "cached_tokens": 0, "weight_version": "default",
                "output_token_logprobs": [[-0.5, i, None] for i in ids]}
        events = [dumps({"text": "", "output_ids": ids, "meta_info": meta})]
        gen.written = len(gen.ids)
        if finish is not None:
            gen.state = finish["type"]
            gen.ended_at = time.monotonic()
            del self.running[gen.rid]
            events.append(b"[DONE]")
        parts = []
        for event in events:
            data = b"data: " + event + b"\n\n"
            parts.append(b"%x\r\n%s\r\n" % (len(data), data))
        if finish is not None:
            parts.append(b"0\r\n\r\n")
        gen.transport.write(b"".join(parts))

    def _meta(self, rid: str, prompt: int, n: int, stop: int | None) -> dict[str, Any]:
        return {
            "id": rid,
            "finish_reason": None if stop is None else {"type": "stop", "matched": stop},
            "prompt_tokens": prompt,
            "completion_tokens": n,
            "cached_tokens": 0,
            "weight_version": "default",
            "output_token_logprobs": [[-0.5, i, None] for i in self.ids[:n]],
        }

    def _chat(self, body: dict[str, Any]) -> tuple[int, bytes, list[bytes] | None]:
        created = int(time.time())
        base = {"id": "chatcmpl-stub", "created": created, "model": "stub"}
        usage = {"prompt_tokens": 0, "completion_tokens": len(self.ids), "total_tokens": len(self.ids)}
        if not body.get("stream"):
            message = {"role": "assistant", "content": self.text}
            choice = {"index": 0, "message": message, "finish_reason": "stop"}
            return 200, dumps({**base, "object": "chat.completion", "choices": [choice], "usage": usage}), None
        chunk = {**base, "object": "chat.completion.chunk"}
        events = [dumps({**chunk, "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})]
        for piece in self.pieces[:-1]:  # the last token is the end-of-turn marker
            delta = {"index": 0, "delta": {"content": piece}, "finish_reason": None}
            events.append(dumps({**chunk, "choices": [delta]}))
        events.append(dumps({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
        events.append(b"[DONE]")
        return 200, b"", events


class Connection(asyncio.Protocol):
    def __init__(self, stub: Stub) -> None:
        self.stub = stub
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.stub.connections += 1

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            end = self.buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buffer[:end].decode("latin-1").split("\r\n")
            method, path, _ = head[0].split(" ", 2)
            length = 0
            close = False
            key = ""
            for line in head[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value)
                elif name == "connection" and value.strip().lower() == "close":
                    close = True
                elif name == "x-smg-routing-key":
                    key = value.strip()
            if len(self.buffer) < end + 4 + length:
                return
            body = self.buffer[end + 4:end + 4 + length]
            self.buffer = self.buffer[end + 4 + length:]
            assert self.transport is not None
            if path == "/generate" and self.stub.paced(body, key, self.transport):
                continue
            self._respond(*self.stub.handle(method, path.split("?", 1)[0], body))
            if close and self.transport is not None:
                self.transport.close()
                return

    def _respond(self, status: int, body: bytes, events: list[bytes] | None) -> None:
        assert self.transport is not None
        reason = b"OK" if status == 200 else b"Error"
        if events is None:
            kind = b"application/json" if body else b"text/plain"
            head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n" % (
                status, reason, kind, len(body))
            self.transport.write(head + body)
            return
        parts = [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"]
        for event in events:
            data = b"data: " + event + b"\n\n"
            parts.append(b"%x\r\n%s\r\n" % (len(data), data))
        parts.append(b"0\r\n\r\n")
        self.transport.write(b"".join(parts))


async def serve(host: str, port: int, reply: dict[str, Any], interval: float = 0.0, cumulative: bool = False,
                start_together: int = 0) -> None:
    stub = Stub(reply, interval, cumulative, start_together)
    server = await asyncio.get_running_loop().create_server(lambda: Connection(stub), host, port, backlog=4096)
    print(f"PORT {server.sockets[0].getsockname()[1]}", flush=True)
    ticker = asyncio.create_task(stub.tick()) if interval else None
    async with server:
        await server.serve_forever()
    if ticker is not None:
        ticker.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--reply", required=True, help='a JSON file {"ids": [...], "pieces": [...]}')
    parser.add_argument("--token-interval", type=float, default=0.0,
                        help="seconds per decoding step of streamed /generate (0: answer at once)")
    parser.add_argument("--cumulative", action="store_true", help="paced streams in SGLang's cumulative shape")
    parser.add_argument("--start-together", type=int, default=0, metavar="N",
                        help="paced decoding starts once N streamed generations are running (a batch)")
    args = parser.parse_args()
    with open(args.reply, encoding="utf-8") as f:
        reply = json.load(f)
    try:
        asyncio.run(serve(args.host, args.port, reply, args.token_interval, args.cumulative, args.start_together))
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
