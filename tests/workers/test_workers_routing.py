"""The workers' routing rules, their merges, and a fan-out that cannot reach a worker (in one process)."""

from __future__ import annotations

import json
import socket
import zlib
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import trio
from _asgi import request_body

from actorproxy.config import ProxyConfig
from actorproxy.errors import StartupError
from actorproxy.http.cycle import request_path
from actorproxy.http.server import ConnectionLimits
from actorproxy.serve import open_proxy
from actorproxy.server.admission import RequestHeaders
from actorproxy.server.http_server import HTTPServer
from actorproxy.workers.fanout import FanOut, control_path
from actorproxy.workers.handoff import Router, serve_handoffs
from actorproxy.workers.merge import ReadSpool, merge_history, merge_json, merge_metrics, read_reply
from actorproxy.workers.routing import NEED_BODY, body_session, head_session, owner, owner_key


async def _local(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"local " + scope["path"].encode()})


def _head(target: bytes, *headers: tuple[bytes, bytes]) -> str | None:
    """What the router finds in a request head, read as the app reads it."""
    return head_session(request_path(target)[0], RequestHeaders(headers))


def test_the_session_is_found_where_resolve_identity_finds_it() -> None:
    turn = b"/v1/chat/completions"
    assert _head(turn, (b"x-session-id", b" s1 ")) == "s1"
    assert _head(turn, (b"x-claude-code-session-id", b"cc")) == "cc"
    # opencode's sub-agent: its parent's session (the worker that keeps its child), unless the URL names one.
    sub = ((b"x-session-id", b"ses_child"), (b"x-parent-session-id", b"ses_main"))
    assert _head(turn, *sub) == "ses_main" and _head(b"/sess/r/v1/chat/completions", *sub) == "r"
    assert _head(b"/sess/s%202/v1/messages") == "s 2"
    assert _head(b"/sess/s%2F2/v1/messages") is None  # the app's URL map matches no route: 404 where it lands
    assert _head(b"/traj/prompt/v1/chat/completions") == "traj"
    assert _head(turn) == NEED_BODY
    assert _head(b"/session/finalize", (b"x-session-id", b"s")) == NEED_BODY
    assert _head(b"/session/abc/sub-1") == "abc/sub-1"
    assert _head(b"/trajectory/stats", (b"x-session-id", b"s")) is None
    assert _head(b"/v1/models", (b"x-session-id", b"s")) is None
    assert _head(turn, (b"x-session-id", b"a" * 300)) is None  # the app refuses it (400) wherever it lands
    assert body_session(b'{"session_id": "b", "messages": []}') == "b"
    assert body_session(b'{"trajectory_id": "t#3"}') == "t#3"
    assert body_session(b'{"session_id": 3}') is None and body_session(b"not json") is None
    codex = RequestHeaders([(b"session-id", b"cx")])
    assert body_session(b"{}", "/v1/responses", codex) == "cx" and body_session(b"{}", "/v1/messages", codex) is None


def test_an_absolute_target_a_doubled_slash_and_an_empty_first_header_name_what_the_app_serves() -> None:
    """The router reads the head with the app's own function (``named_session``) on the path the app sees."""
    assert _head(b"http://h/sess/A/v1/chat/completions", (b"x-session-id", b"B")) == "A"
    assert _head(b"//sess/A/v1/chat/completions", (b"x-session-id", b"B")) == "A"
    assert _head(b"http://h/session/A") == "A"
    assert _head(b"/v1/chat/completions", (b"x-session-id", b""), (b"x-session-id", b"B")) == NEED_BODY
    assert _head(b"/v1/chat/completions", (b"x-session-id", b" "), (b"x-smg-routing-key", b"C")) == "C"


def test_a_body_nested_past_the_recursion_limit_names_no_session() -> None:
    deep = b"[" * 5000 + b"]" * 5000
    assert body_session(deep) is None
    assert body_session(b'{"session_id": "s", "x": ' + deep + b"}") is None
    assert body_session(b'{"x": ' * 5000 + b"1" + b"}" * 5000) is None


def test_a_session_its_sub_agents_and_its_segments_have_one_owner() -> None:
    assert owner_key("s/sub-2") == owner_key("s#4") == owner_key("s/sub-1/sub-3") == "s"
    assert owner_key("a#b") == "a#b"
    owners = {owner(f"session-{i}", 3) for i in range(60)}
    assert owners == {0, 1, 2}
    assert all(owner(f"s{i}/sub-1", 4) == owner(f"s{i}", 4) == owner(f"s{i}#7", 4) for i in range(50))
    assert owner("fixed", 7) == zlib.crc32(b"fixed") % 7  # the same in every process and run


def test_merged_answers_sum_counts_and_show_disagreements() -> None:
    merged = merge_json([{"status": "ok", "sessions": 2, "epoch": 1, "data": [1], "config": {"port": 5, "n": 3}},
                         {"status": "degraded", "sessions": 3, "epoch": 2, "data": [2], "config": {"port": 5, "n": 3}}])
    assert merged == {"status": "degraded", "sessions": 5, "epoch": [1, 2], "data": [1, 2],
                      "config": {"port": 5, "n": 3}}
    text = merge_metrics(["# HELP a_total A\n# TYPE a_total counter\na_total 1.0\nb{x=\"1\"} 2\n",
                          "# HELP a_total A\n# TYPE a_total counter\na_total 3.0\nb{x=\"1\"} 4\n"])
    assert text == ('# HELP a_total A\n# TYPE a_total counter\na_total{worker="0"} 1.0\na_total{worker="1"} 3.0\n'
                    'b{worker="0",x="1"} 2\nb{worker="1",x="1"} 4\n')


async def test_a_worker_that_does_not_answer_fails_the_control_route_but_a_drain_keeps_what_it_took(
        tmp_path: Path) -> None:
    """Worker 0 answers on its private socket, worker 1 is down (no socket): nothing is merged silently."""
    async def worker0(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        body = b'{"data": [{"trajectory_id": "s#0"}]}' if scope["path"] == "/trajectory/read" else b'{"sessions": 1}'
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    directory = str(tmp_path)
    unix = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    await unix.bind(control_path(directory, 0))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        await nursery.start(partial(HTTPServer(worker0).serve, "", 0, sock=unix, shutdown_trigger=stop.wait))
        public = FanOut(_local, 2, directory)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=public), base_url="http://proxy") as client:
            stats = await client.get("/trajectory/stats")
            assert stats.status_code == 503 and stats.headers["retry-after"] == "1"
            assert stats.json()["error"]["code"] == "worker_unavailable" and "worker 1" in stats.text
            assert (await client.post("/trajectory/read", json={})).status_code == 503
            drained = await client.post("/trajectory/read", json={"drain": True})
            assert drained.status_code == 200
            assert drained.json() == {"data": [{"trajectory_id": "s#0"}], "missing_workers": [1]}
            health = await client.get("/health")
            assert health.status_code == 200
            assert health.json() == {"sessions": 1, "status": "degraded", "workers": 2, "missing_workers": [1]}
            assert (await client.get("/openapi.json")).text.startswith("local")  # not a control route: served here
        stop.set()


def _session_of(worker: int) -> str:
    return next(f"s{i}" for i in range(100) if owner(f"s{i}", 2) == worker)


async def test_a_connection_goes_to_its_owner_over_scm_rights_even_when_the_body_names_the_session(
        tmp_path: Path) -> None:
    """Worker 0's router, worker 1's hand-off socket, in one process: the socket itself moves."""
    async def named(name: bytes) -> Any:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            await request_body(receive)
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length",
                                                                                  str(len(name)).encode())]})
            await send({"type": "http.response.body", "body": name})
        return app

    directory, theirs = str(tmp_path), _session_of(1)
    here = HTTPServer(await named(b"w0"), router=Router(0, 2, directory))
    there = HTTPServer(await named(b"w1"))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(here.serve, "127.0.0.1", 0, shutdown_trigger=stop.wait))
        await nursery.start(partial(there.serve, "127.0.0.1", 0, shutdown_trigger=stop.wait))
        await nursery.start(serve_handoffs, directory, 1, there)
        stream = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
        body = b'{"session_id": "%s", "messages": []}' % theirs.encode()
        await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
                              b"content-length: %d\r\n\r\n" % len(body))
        received = b""
        while b"100 Continue" not in received:  # the router asks for the body it needs
            received += await stream.receive_some(65536)
        await stream.send_all(body)
        while not received.endswith(b"w1"):
            received += await stream.receive_some(65536)
        assert received.count(b"100 Continue") == 1  # the owner does not ask again
        await stream.send_all(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")  # no session: served where it is
        while received.count(b"\r\n\r\nw1") < 2:
            received += await stream.receive_some(65536)
        await stream.aclose()
        stop.set()
        nursery.cancel_scope.cancel()


async def test_a_session_whose_worker_is_down_gets_503_in_the_callers_format(tmp_path: Path) -> None:
    here = HTTPServer(_local, router=Router(0, 2, str(tmp_path)))  # worker 1 has no hand-off socket
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(here.serve, "127.0.0.1", 0, shutdown_trigger=stop.wait))
        async with httpx.AsyncClient(base_url=url) as client:
            theirs = {"X-Session-Id": _session_of(1)}
            refused = await client.post("/v1/chat/completions", headers=theirs, json={"messages": []})
            assert (refused.status_code, refused.headers["retry-after"]) == (503, "1")
            assert refused.json()["error"]["code"] == "worker_unavailable"
            anthropic = await client.post("/v1/messages", headers=theirs, json={"messages": []})
            assert anthropic.json()["type"] == "error" and anthropic.json()["error"]["type"] == "overloaded_error"
            ours = await client.post("/v1/chat/completions", headers={"X-Session-Id": _session_of(0)}, json={})
            assert ours.text == "local /v1/chat/completions"
        stop.set()


def _spliced(bodies: list[bytes], piece: int) -> bytes:
    """The workers' read answers, each given to its spool ``piece`` bytes at a time, spliced."""
    spools = []
    for body in bodies:
        spool = ReadSpool()
        for at in range(0, len(body), piece):
            spool.feed(body[at:at + piece])
        spool.end()
        spools.append(spool)
    return b"".join(read_reply(spools))


@pytest.mark.parametrize("piece", [1, 3, 1 << 20])
@pytest.mark.parametrize("steps", [False, True])
def test_read_answers_are_spliced_as_the_json_merge_orders_them(steps: bool, piece: int) -> None:
    """Worker 0's segments first, then worker 1's (and the steps alike), empty answers and text that looks like
    the arrays' ends included: the same value the JSON merge makes, without decoding an answer into objects,
    whatever pieces the answers arrive in."""
    answers = [{"data": [{"trajectory_id": "a#0", "text": '],"steps":[ \\" {'}, {"trajectory_id": "b#0"}]},
               {"data": []}, {"data": [{"trajectory_id": "c#0", "ids": [1, 2]}]}]
    if steps:
        for i, answer in enumerate(answers):
            answer["steps"] = [{"step": i, "ids": [[i]]}] if i != 1 else []
    bodies = [orjson.dumps(a) for a in answers]
    spliced = orjson.loads(_spliced(bodies, piece) + b"}")
    assert spliced == merge_json(answers)
    assert _spliced([b'{"data":[ ]}', b'{"data":[]}'], piece) == b'{"data":[]'
    spaced = b' { "steps" : [ {"x" : 1} ] , "data" : [ {"a":[1]} ,{"b":"]"}] } '
    assert _spliced([spaced, b'{"data":[{}]}'], piece) == b'{"data":[ {"a":[1]} ,{"b":"]"},{}],"steps":[ {"x" : 1} ]'


@pytest.mark.parametrize("piece", [1, 1 << 20])
@pytest.mark.parametrize("body", [b'{"data":{}}', b'{"data":[],"success":true}', b"[]", b"{", b'{"steps":[]}',
                                  b'{"data":[1]}', b'{"data":[{},]}', b'{"data":[{}{}]}', b'{"data":[,{}]}',
                                  b'{"data":[{"a":1,}]}', b'{"data":[]} x', b'{"data":[],"data":[]}',
                                  b'{"data":[{"a":"]}', b'{"data":[}', b'{"data":[{"a":01}]}'])
def test_an_answer_that_is_not_a_reads_is_not_spliced(body: bytes, piece: int) -> None:
    with pytest.raises(ValueError, match="not a read's answer"):
        _spliced([b'{"data":[]}', body], piece)


def test_the_dashboards_history_is_one_sample_per_second() -> None:
    merged = merge_history([{"t": 2, "turns": 1, "p50_ms": 5.0}, {"t": 1, "turns": 2, "p50_ms": None},
                            {"t": 2, "turns": 3, "p50_ms": 9.0}])
    assert merged == [{"t": 1, "turns": 2, "p50_ms": None}, {"t": 2, "turns": 4, "p50_ms": 9.0}]


async def test_an_embedded_proxy_refuses_several_workers() -> None:
    """Only ``actorproxy run`` starts worker processes: an embedded proxy is one, and says so instead of ignoring it."""
    with pytest.raises(BaseExceptionGroup) as raised:  # from open_proxy's nursery
        async with open_proxy(ProxyConfig.of(port=0, workers=2)):
            pass
    assert raised.group_contains(StartupError, match="--workers: an embedded proxy is one process", depth=None)


async def test_a_refused_gateway_call_keeps_its_connection(tmp_path: Path) -> None:
    """The refusal of a gateway route left its body unread: the connection closed without saying so, and the next
    request on it got no answer."""
    server = HTTPServer(FanOut(_local, 2, str(tmp_path)))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(server.serve, "127.0.0.1", 0, shutdown_trigger=stop.wait))
        stream = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
        await stream.send_all(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
                              b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
        received = b""
        with trio.fail_after(10):
            while b"local /v1/models" not in received and (data := await stream.receive_some(65536)):
                received += data
        assert received.startswith(b"HTTP/1.1 404 ") and b"not_served_with_workers" in received
        assert b"local /v1/models" in received
        await stream.aclose()
        stop.set()


async def test_a_request_without_a_body_that_the_router_would_route_by_its_body_is_answered(tmp_path: Path) -> None:
    """A turn route's GET, or a POST /session/finalize with no body: the router waited for bytes that never come."""
    here = HTTPServer(_local, router=Router(0, 2, str(tmp_path)))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(here.serve, "127.0.0.1", 0, shutdown_trigger=stop.wait))
        async with httpx.AsyncClient(base_url=url) as client:
            with trio.fail_after(10):
                assert (await client.get("/v1/chat/completions")).text == "local /v1/chat/completions"
                assert (await client.post("/session/finalize")).text == "local /session/finalize"
        stop.set()


async def test_a_body_the_router_waits_for_is_bounded_by_the_servers_rate(tmp_path: Path) -> None:
    """The body a turn names its session in stops coming: 408 in the caller's format once the rate bound says so, as
    one process answers it (the router waited 600 s)."""
    here = HTTPServer(_local, router=Router(0, 2, str(tmp_path)), limits=ConnectionLimits(body_grace=0.5))
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        url = await nursery.start(partial(here.serve, "127.0.0.1", 0, shutdown_trigger=stop.wait))
        for path, anthropic in ((b"/v1/chat/completions", False), (b"/v1/messages", True)):
            stream = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
            await stream.send_all(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{\"session" % path)
            received = b""
            with trio.fail_after(10):
                while data := await stream.receive_some(65536):
                    received += data
            head, _, body = received.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408 ") and b"connection: close" in head, received
            error = json.loads(body)
            assert error["type"] == "error" if anthropic else error["error"]["code"] == "request_timeout", error
            await stream.aclose()
        stop.set()


async def test_a_fault_while_routing_or_serving_a_connection_ends_that_connection_alone(tmp_path: Path) -> None:
    """A router's own error is a 400 in the caller's format on its connection; a failure in any router the server is
    given ends that connection, and the server goes on serving the others."""
    class Faulty(Router):
        async def route(self, connection: Any, request: Any) -> Any:
            raise RuntimeError("a fault of the router's own")

    async def broken(connection: Any, request: Any) -> Any:
        raise RuntimeError("a fault outside the router's guard")

    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        faulty = await nursery.start(partial(HTTPServer(_local, router=Faulty(0, 2, str(tmp_path))).serve,
                                             "127.0.0.1", 0, shutdown_trigger=stop.wait))
        bare = await nursery.start(partial(HTTPServer(_local, router=broken).serve, "127.0.0.1", 0,
                                           shutdown_trigger=stop.wait))
        async with httpx.AsyncClient(base_url=faulty) as client:
            refused = await client.post("/v1/messages", json={})
            assert refused.status_code == 400 and refused.headers["connection"] == "close"
            assert refused.json()["type"] == "error" and "could not be routed" in refused.json()["error"]["message"]
        for _ in range(2):  # each connection ends; the server still accepts the next one
            with pytest.raises(httpx.RemoteProtocolError):
                async with httpx.AsyncClient(base_url=bare) as client:
                    await client.get("/v1/models")
        stop.set()
