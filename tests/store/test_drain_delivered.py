"""A drain deletes what it read only once its reply was sent whole; meanwhile no other drain reads it.

A trainer's drain used to delete what it read as soon as the reply was serialised, before a
byte of it was sent: a trainer whose connection broke, or whose read timed out, while a large
reply was on its way lost those trajectories for good. Now what a drain read is held until its
last part is sent (then deleted) or its reply is given up (then let go, for the next drain).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import trio
from _asgi import open_client
from _util import access_logged, run_turn, stop_reading_after_the_head
from trio.testing import wait_all_tasks_blocked

from actorproxy import open_proxy
from actorproxy.config import ProxyConfig
from actorproxy.runtime import store_messages
from actorproxy.runtime.runtime import ClientGone, Runtime, open_runtime
from actorproxy.schema.converter import CONVERTER
from actorproxy.server.app import create_app
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.store.base import ReadQuery
from actorproxy.testing import open_simulated_proxy

HI = [{"role": "user", "content": "hi"}]


async def _finalized(runtime: Runtime, *sessions: str) -> None:
    for name in sessions:
        await run_turn(runtime, name, HI)
        await runtime.finalize(name)


@pytest.fixture(params=["memory", "sqlite"])
async def runtime(request: pytest.FixtureRequest, tmp_path: Path, tokenizer: Any) -> AsyncIterator[Runtime]:
    """A runtime over each store, sessions "a" and "b" finalized."""
    config = ProxyConfig.of(port=0, store_kind=request.param, data_dir=str(tmp_path / "data"))
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.001))
    async with open_runtime(config, backend=engine, tokenizer=tokenizer) as opened:
        await _finalized(opened, "a", "b")
        yield opened


def _sessions_in(parts: list[bytes]) -> list[str]:
    return sorted(s["trajectory_id"].partition("#")[0] for s in orjson.loads(b"".join(parts))["data"])


async def test_a_drain_whose_reply_is_not_sent_whole_deletes_nothing(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_messages, "PART_BYTES", 1000)  # a reply of several parts
    reply = await runtime.read_reply(ReadQuery(drain=True, include_steps=True))
    await reply.__anext__()  # the first part went out, then the client was gone
    await reply.aclose()  # type: ignore[attr-defined]
    again = await runtime.read(drain=True, include_steps=True)
    assert sorted(s.trajectory_id for s in again.data) == ["a#0", "b#0"]
    assert len(again.steps or []) == 2
    assert (await runtime.read()).data == []  # that drain was delivered (in-process): gone


async def test_a_drain_whose_client_is_found_gone_before_the_delete_deletes_nothing(runtime: Runtime) -> None:
    """The server's ``send`` into a connection a write closed returns as if it had sent: the reply asks whether what
    it sent reached its client before it deletes, and ends (``ClientGone``) without deleting if not."""
    asked: list[int] = []

    async def delivered() -> bool:
        asked.append(1)
        await trio.lowlevel.checkpoint()
        return False

    reply = await runtime.read_reply(ReadQuery(drain=True), delivered=delivered)
    with pytest.raises(ClientGone):
        async for _ in reply:
            pass
    assert asked == [1]  # asked once, before the delete (not for every part)
    assert sorted(s.trajectory_id for s in (await runtime.read(drain=True)).data) == ["a#0", "b#0"]


async def test_what_a_drain_holds_no_other_drain_reads_and_what_came_after_stays(runtime: Runtime) -> None:
    first = await runtime.read_reply(ReadQuery(drain=True))  # its reply is on its way
    await _finalized(runtime, "c")  # finalized meanwhile
    assert sorted(s.trajectory_id for s in (await runtime.read()).data) == ["a#0", "b#0", "c#0"]  # a read sees all
    second = await runtime.read_reply(ReadQuery(drain=True))
    second_parts = [part async for part in second]
    assert _sessions_in(second_parts) == ["c"]  # not what the first drain delivers
    first_parts = [part async for part in first]
    assert _sessions_in(first_parts) == ["a", "b"]
    assert (await runtime.read()).data == []
    stats = await runtime.store_stats()
    assert (stats["sessions"], stats["segments"], stats["tokens"]) == (0, 0, 0)


async def test_a_drain_whose_caller_is_cancelled_while_the_store_reads_holds_nothing(runtime: Runtime) -> None:
    """The trainer hung up while the store read its drain (the server cancels the request's task): the answer, and
    what it held, used to be dropped, held for good, so no later drain read it."""
    with trio.CancelScope() as request:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runtime.read_reply, ReadQuery(drain=True))
            await wait_all_tasks_blocked()  # the store reads (SQLite: in its thread)
            request.cancel()
    again = await runtime.read(drain=True)
    assert sorted(s.trajectory_id for s in again.data) == ["a#0", "b#0"]


async def test_a_session_drain_given_up_is_read_again_and_others_are_not_held(runtime: Runtime) -> None:
    given_up = await runtime.read_reply(ReadQuery(session_id="a", drain=True, include_steps=True))
    other = await runtime.read_reply(ReadQuery(drain=True))  # the whole store but "a", held above
    assert _sessions_in([part async for part in other]) == ["b"]
    await given_up.aclose()  # type: ignore[attr-defined]
    assert _sessions_in([part async for part in await runtime.read_reply(
        ReadQuery(session_id="a", drain=True))]) == ["a"]
    stats = await runtime.store_stats()
    assert (stats["sessions"], stats["segments"], stats["steps"], stats["tokens"]) == (0, 0, 0, 0)


def before_each_part(app: Any, before: Callable[[int], Awaitable[None]]) -> Any:
    """``app`` whose reply's body parts each wait for ``before(n)`` (``n``: the part's number, from 1) first."""

    async def served(scope: Any, receive: Any, send: Any) -> None:
        parts = 0

        async def write(message: dict[str, Any]) -> None:
            nonlocal parts
            if message["type"] == "http.response.body" and message.get("body"):
                parts += 1
                await before(parts)
            await send(message)

        await app(scope, receive, write)

    return served


def hanging_up(app: Any, gone: trio.Event, *, after: int) -> Any:
    """``app`` served to a trainer that reads ``after`` parts of a reply's body and hangs up once ``gone`` is
    set: the server's next write fails then, as a socket's does once its peer is gone."""

    async def before(part: int) -> None:
        if part > after:
            await gone.wait()
            raise OSError("the client hung up")

    return before_each_part(app, before)


async def gone_after(http: Any, path: str, body: dict[str, Any], gone: trio.Event, *, parts: int) -> None:
    """The trainer's request: it takes the reply's head and ``parts`` parts of its body, then hangs up."""
    async with http.stream("POST", path, json=body) as reply:
        assert reply.status_code == 200
        if parts:
            async for _ in reply.aiter_raw():
                parts -= 1
                if not parts:
                    break
        gone.set()
    await wait_all_tasks_blocked()


async def test_a_trainer_that_hangs_up_mid_reply_finds_it_all_in_the_next_drain(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """...and the read it left is logged and counted as a 499 ``client_disconnected`` (its head said 200)."""
    caplog.set_level(logging.INFO, logger="actorproxy.access")
    monkeypatch.setattr(store_messages, "PART_BYTES", 1000)
    gone = trio.Event()
    async with open_simulated_proxy(tokenizer=tokenizer) as sim:
        app = create_app(sim.runtime)
        await _finalized(sim.runtime, "a", "b", "c")
        async with open_client(hanging_up(app, gone, after=1)) as http:
            await gone_after(http, "/trajectory/read", {"drain": True, "include_steps": True}, gone, parts=1)
        async with open_client(app) as http:
            again = await http.post("/trajectory/read", json={"drain": True, "include_steps": True})
            assert sorted(s["trajectory_id"] for s in again.json()["data"]) == ["a#0", "b#0", "c#0"]
            assert len(again.json()["steps"]) == 3
            assert (await http.post("/trajectory/read", json={"drain": True})).json() == {"data": []}
            metrics = (await http.get("/metrics")).text
    lines = [(r.fields["status"], r.fields.get("error"))  # type: ignore[attr-defined]
             for r in caplog.records if r.name == "actorproxy.access" and r.fields["path"] == "/trajectory/read"]
    assert lines == [(499, "client_disconnected"), (200, None), (200, None)], lines
    assert 'route="/trajectory/read",status="499"} 1.0' in metrics, metrics


async def test_a_fetch_batch_not_received_puts_its_groups_back_with_their_data(tokenizer: Any) -> None:
    """The Claw-R1 gateway's hand-off: its trajectories are deleted, and its groups leave the queue, only once
    the batch was sent."""
    gone = trio.Event()
    async with open_simulated_proxy(tokenizer=tokenizer) as sim:
        app = create_app(sim.runtime)
        async with open_client(app) as http:
            for uid in ("r0", "r1"):
                assert (await http.post("/generate", json={"trajectory_uid": uid, "prompt_uid": "q", "messages": HI,
                                                           "max_tokens": 4})).status_code == 200
                assert (await http.post(f"/complete_trajectory/{uid}", json={"reward": 1.0})).status_code == 200
        fetch = {"groups": 1, "rollouts_per_group": 2, "timeout_s": 0}
        async with open_client(hanging_up(app, gone, after=0)) as http:  # (a read timed out before the body)
            await gone_after(http, "/trajectory/fetch_batch", fetch, gone, parts=0)
        async with open_client(app) as http:
            batch = (await http.post("/trajectory/fetch_batch", json=fetch)).json()
            assert batch["complete"] and [len(t["segments"]) for t in batch["data"][0]["trajectories"]] == [1, 1]
            assert (await http.post("/trajectory/read", json={})).json() == {"data": []}  # delivered: drained


async def test_a_dressage_batch_read_not_received_is_read_again(tokenizer: Any) -> None:
    gone = trio.Event()
    config = ProxyConfig.of(port=0, api_dialect="dressage", min_group_size=1)
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.001))
    async with open_runtime(config, backend=engine, tokenizer=tokenizer) as runtime:
        app = create_app(runtime)
        await _finalized(runtime, "a", "b")
        async with open_client(hanging_up(app, gone, after=0)) as http:
            await gone_after(http, "/trajectory/read", {}, gone, parts=0)
        async with open_client(app) as http:
            read = (await http.post("/trajectory/read", json={})).json()
            assert read["mode"] == "batch" and sum(len(group) for group in read["data"]) == 2
            assert (await http.post("/trajectory/read", json={})).json()["data"] == []


async def test_a_trainer_that_stops_reading_a_drain_is_cut_after_the_send_timeout_and_loses_nothing(
    tokenizer: Any, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    """A trainer that stops reading in the middle of a drain's reply, its connection left open (a hung process):
    after ``--send-timeout`` seconds without a byte taken it counts as gone, and what the drain read is let go of
    (never deleted by the rest of the reply written into the closed connection), for the next drain."""
    caplog.set_level(logging.INFO, logger="actorproxy.access")
    logged = access_logged(request)
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.001))
    config = ProxyConfig.of(port=0, send_timeout=30.0)
    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running:
        names = [f"s{i}" for i in range(150)]
        for name in names:
            engine.script("word " * 300, routing_key=name)
        await _finalized(running.runtime, *names)
        drain = {"drain": True, "include_steps": True}
        sock = await stop_reading_after_the_head(running.url, "/trajectory/read", drain)
        start = trio.current_time()
        with trio.fail_after(600):
            await logged.wait()  # its request ended
        assert 30 <= trio.current_time() - start <= 31
        # (read in the runtime: under the autojump clock, a reply that waits for the kernel's acknowledgements may
        # see the clock jump past the send timeout)
        again = (await running.runtime.read(drain=True)).data
        sock.close()
    _all_there_and_cut(again, names, caplog)


async def test_a_drain_reply_that_fits_in_the_buffers_is_deleted_only_once_the_trainer_took_it(
    tokenizer: Any, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture,
    request: pytest.FixtureRequest,
) -> None:
    """A reply small enough for the kernel's buffers is written whole at once, whether or not the trainer ever reads
    it (a hung process; over a network, a link that broke): the proxy waits for the trainer's acknowledgement of its
    bytes before it deletes, and a trainer that takes none of them for ``--send-timeout`` seconds counts as gone:
    nothing deleted, all of it there for the next drain."""
    caplog.set_level(logging.INFO, logger="actorproxy.access")
    logged = access_logged(request)
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.001))
    config = ProxyConfig.of(port=0, send_timeout=30.0, store_kind="memory")  # (no thread: the clock jumps)
    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running:
        names = [f"s{i}" for i in range(5)]
        for name in names:
            engine.script("word " * 60, routing_key=name)
        await _finalized(running.runtime, *names)
        drain = {"drain": True}
        size = len(orjson.dumps(CONVERTER.unstructure(await running.runtime.read())))
        # More than the trainer's kernel takes in for it (a 4 KiB receive buffer: about 6 KB), less than the
        # proxy's takes into its send queue (16 KiB at first): the reply is written whole, and not acknowledged.
        assert 10_000 < size < 14_000, size
        sock = await stop_reading_after_the_head(running.url, "/trajectory/read", drain)
        with trio.move_on_after(600):  # (a delete's store thread lets the autojump clock run on to here)
            await logged.wait()  # its request ended
        again = (await running.runtime.read(drain=True)).data
        sock.close()
    _all_there_and_cut(again, names, caplog)


def _all_there_and_cut(again: list[Any], names: list[str], caplog: pytest.LogCaptureFixture) -> None:
    """The next drain read every session, and the drain the trainer left was logged as a 499 hang-up."""
    assert sorted(s.trajectory_id.partition("#")[0] for s in again) == sorted(names)
    lines = [(r.fields["status"], r.fields.get("error")) for r in caplog.records  # type: ignore[attr-defined]
             if r.name == "actorproxy.access" and r.fields["path"] == "/trajectory/read"]
    assert lines[0] == (499, "client_disconnected"), lines


async def test_a_fetch_batch_delivered_with_nothing_to_delete_does_not_come_again(tokenizer: Any) -> None:
    """Its trajectories were drained with /trajectory/read first: the batch holds no data, and once its reply
    went out whole its groups are handed over, not put back in the queue as if it had not been received."""
    async with open_simulated_proxy(tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        for uid in ("r0", "r1"):
            assert (await http.post("/generate", json={"trajectory_uid": uid, "prompt_uid": "q", "messages": HI,
                                                       "max_tokens": 4})).status_code == 200
            assert (await http.post(f"/complete_trajectory/{uid}", json={"reward": 1.0})).status_code == 200
        assert len((await http.post("/trajectory/read", json={"drain": True})).json()["data"]) == 2
        fetch = {"groups": 1, "rollouts_per_group": 2, "timeout_s": 0}
        batch = (await http.post("/trajectory/fetch_batch", json=fetch)).json()
        assert batch["complete"] and [t["trajectory_id"] for t in batch["data"][0]["trajectories"]] == ["r0", "r1"]
        gc.collect()
        assert (await http.post("/trajectory/fetch_batch", json=fetch)).json() == {"data": [], "complete": False}
