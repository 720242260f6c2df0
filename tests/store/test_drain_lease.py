"""A leased drain: what it read is deleted only once the trainer acknowledges it, after it has it safe.

A plain drain deletes what it read once the trainer's side acknowledged every byte of the reply
(``test_drain_delivered.py``). That is as far as the proxy can see: a reply the trainer's kernel
took whole, then lost with the trainer's process (it crashed, or never got to read it), was
deleted. With ``"lease": seconds`` the drain deletes nothing: what it read stays held (no other
drain reads it) until the trainer's ``POST /trajectory/ack`` deletes it or gives it back, and is
given back, for the next drain, once the lease ends without one.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import orjson
import pytest
import trio
from _asgi import InProcessTransport, open_client
from _util import run_turn
from test_drain_delivered import before_each_part, gone_after, hanging_up
from trio.testing import wait_all_tasks_blocked

from actorproxy.client import ProxyClient
from actorproxy.config import ProxyConfig
from actorproxy.errors import StorageFull
from actorproxy.runtime import store_messages
from actorproxy.runtime.runtime import Runtime, open_runtime
from actorproxy.server.app import create_app
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.testing import open_simulated_proxy

HI = [{"role": "user", "content": "hi"}]


async def _finalized(runtime: Runtime, *sessions: str) -> None:
    for name in sessions:
        await run_turn(runtime, name, HI)
        await runtime.finalize(name)


def _sessions(read: dict[str, Any]) -> list[str]:
    return sorted(s["trajectory_id"] for s in read["data"])


def _leases(metrics: str) -> tuple[str, str]:
    lines = metrics.splitlines()
    return (next(x for x in lines if x.startswith("actorproxy_drain_leases_open ")).split()[1],
            next(x for x in lines if x.startswith("actorproxy_drain_leases_expired_total ")).split()[1])


async def test_a_leased_drain_deletes_only_what_the_trainer_acknowledges(tokenizer: Any) -> None:
    async with open_simulated_proxy(tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        await _finalized(sim.runtime, "a", "b")
        leased = (await http.post("/trajectory/read", json={"drain": True, "include_steps": True, "lease": 60})).json()
        assert _sessions(leased) == ["a#0", "b#0"] and len(leased["steps"]) == 2
        assert leased["lease"]["seconds"] == 60 and isinstance(leased["lease"]["id"], str)
        # held for its trainer: no other drain reads it, and it is still in the store
        assert (await http.post("/trajectory/read", json={"drain": True})).json() == {"data": []}
        assert (await http.get("/trajectory/stats")).json()["segments"] == 2
        assert _leases((await http.get("/metrics")).text) == ("1.0", "0.0")
        acked = await http.post("/trajectory/ack", json={"lease": leased["lease"]["id"]})
        assert acked.status_code == 200, acked.text
        assert acked.json() == {"lease": leased["lease"]["id"], "status": "deleted"}
        assert (await http.get("/trajectory/stats")).json()["segments"] == 0
        assert _leases((await http.get("/metrics")).text) == ("0.0", "0.0")


async def test_an_acknowledgement_sent_again_is_answered_as_the_first_was(tokenizer: Any) -> None:
    """Its first answer was lost (or timed out): the trainer sends it again and learns the data was deleted, not
    that the lease is unknown; a release sent after it is told the same, and changes nothing."""
    async with open_simulated_proxy(tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        await _finalized(sim.runtime, "a", "b")
        lease = (await http.post("/trajectory/read", json={"drain": True, "lease": 60})).json()["lease"]["id"]
        assert (await http.post("/trajectory/ack", json={"lease": lease})).json() == {"lease": lease,
                                                                                   "status": "deleted"}
        for body in ({"lease": lease}, {"lease": lease, "release": True}):
            again = await http.post("/trajectory/ack", json=body)
            assert again.status_code == 200, again.text
            assert again.json() == {"lease": lease, "status": "deleted", "repeated": True}
        assert (await http.get("/trajectory/stats")).json()["segments"] == 0
        unknown = await http.post("/trajectory/ack", json={"lease": "never-made"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_lease", unknown.text


async def test_acknowledgements_racing_a_delete_wait_for_it(tokenizer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second comes while the first's delete is under way: both are answered once it is done, alike."""
    gate, deleting = trio.Event(), trio.Event()
    drained = Runtime.drained

    async def slow(self: Runtime, held: Any) -> None:
        deleting.set()
        await gate.wait()
        await drained(self, held)

    async with open_simulated_proxy(tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        await _finalized(sim.runtime, "a")
        lease = (await http.post("/trajectory/read", json={"drain": True, "lease": 60})).json()["lease"]["id"]
        monkeypatch.setattr(Runtime, "drained", slow)
        answers: list[Any] = []

        async def acknowledge() -> None:
            answers.append(await http.post("/trajectory/ack", json={"lease": lease}))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(acknowledge)
            await deleting.wait()
            nursery.start_soon(acknowledge)
            await wait_all_tasks_blocked()
            waited = list(answers)
            gate.set()
        assert waited == []  # (the second did not answer before the delete was done)
        assert [(a.status_code, a.json()) for a in answers] == [(200, {"lease": lease, "status": "deleted"}),
                                                                (200, {"lease": lease, "status": "deleted",
                                                                       "repeated": True})]
        assert (await http.get("/trajectory/stats")).json()["segments"] == 0


class _LosingFirstAck(httpx.AsyncBaseTransport):
    """``inner``, but the answer to the first acknowledgement is lost once the proxy gave it (a connection reset)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner, self.lost = inner, 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path == "/trajectory/ack" and not self.lost:
            self.lost += 1
            await response.aread()
            raise httpx.ReadError("connection reset by peer", request=request)
        return response


async def test_the_client_sends_again_an_acknowledgement_whose_answer_was_lost(tokenizer: Any) -> None:
    """``ProxyClient.leased_drain`` acknowledges once the block ends: the answer is lost after the delete, the client
    sends it once more and is told it was deleted, rather than failing the trainer's step."""
    async with open_simulated_proxy(tokenizer=tokenizer) as sim, trio.open_nursery() as nursery:
        await _finalized(sim.runtime, "a")
        losing = _LosingFirstAck(InProcessTransport(create_app(sim.runtime), nursery))
        async with ProxyClient("http://proxy", transport=losing) as client:
            async with client.leased_drain(lease=60) as read:
                assert _sessions(read) == ["a#0"]
            assert losing.lost == 1 and (await client.stats())["segments"] == 0
        nursery.cancel_scope.cancel()


async def test_a_released_lease_gives_its_data_to_the_next_drain(tokenizer: Any) -> None:
    async with open_simulated_proxy(tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        await _finalized(sim.runtime, "a")
        leased = (await http.post("/trajectory/read", json={"drain": True, "lease": 60})).json()
        released = await http.post("/trajectory/ack", json={"lease": leased["lease"]["id"], "release": True})
        assert released.json() == {"lease": leased["lease"]["id"], "status": "released"}
        acked = await http.post("/trajectory/ack", json={"lease": leased["lease"]["id"]})  # (it deletes nothing)
        assert acked.json() == {"lease": leased["lease"]["id"], "status": "released", "repeated": True}
        assert _sessions((await http.post("/trajectory/read", json={"drain": True})).json()) == ["a#0"]


async def test_a_lease_not_acknowledged_in_time_is_given_back(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    """The trainer read it, then died: nothing of it is lost, the next drain has it once the lease ended."""
    async with open_simulated_proxy(tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        await _finalized(sim.runtime, "a", "b")
        leased = (await http.post("/trajectory/read", json={"drain": True, "lease": 30})).json()
        assert _sessions(leased) == ["a#0", "b#0"]
        await trio.sleep(29)
        assert (await http.post("/trajectory/read", json={"drain": True})).json() == {"data": []}
        await trio.sleep(2)
        assert _sessions((await http.post("/trajectory/read", json={"drain": True, "lease": 30})).json()) == [
            "a#0", "b#0"]
        late = await http.post("/trajectory/ack", json={"lease": leased["lease"]["id"]})
        assert late.status_code == 410, late.text  # the late acknowledgement deletes nothing: the new lease holds it
        assert late.json()["error"]["code"] == "lease_expired" and "given back at" in late.json()["error"]["message"]
        assert (await http.get("/trajectory/stats")).json()["segments"] == 2
        assert _leases((await http.get("/metrics")).text) == ("1.0", "1.0")


async def test_a_leased_drain_not_received_holds_no_lease(tokenizer: Any) -> None:
    """A trainer that hung up mid-reply never got the lease: nothing waits for its acknowledgement."""
    gone = trio.Event()
    async with open_simulated_proxy(tokenizer=tokenizer) as sim:
        app = create_app(sim.runtime)
        await _finalized(sim.runtime, "a")
        async with open_client(hanging_up(app, gone, after=0)) as http:
            await gone_after(http, "/trajectory/read", {"drain": True, "lease": 60}, gone, parts=0)
        assert len(sim.runtime.leases) == 0
        async with open_client(app) as http:
            assert _sessions((await http.post("/trajectory/read", json={"drain": True})).json()) == ["a#0"]


async def test_leases_are_bounded_and_bad_ones_refused(tokenizer: Any) -> None:
    async with open_simulated_proxy(tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        sim.runtime.leases.limit = 2
        for body in ({"lease": 60}, {"drain": True, "lease": 0}, {"drain": True, "lease": 3601},
                     {"drain": True, "lease": "60"}):
            refused = await http.post("/trajectory/read", json=body)
            assert refused.status_code == 400, (body, refused.text)
            assert refused.json()["error"]["param"] == "lease", refused.text
        for body in ({}, {"lease": ""}, {"lease": "x", "release": "yes"}, {"lease": "x", "other": 1}):
            assert (await http.post("/trajectory/ack", json=body)).status_code == 400, body
        first = (await http.post("/trajectory/read", json={"drain": True, "lease": 60})).json()["lease"]["id"]
        await http.post("/trajectory/read", json={"drain": True, "lease": 60})
        third = await http.post("/trajectory/read", json={"drain": True, "lease": 60})
        assert third.status_code == 429 and third.json()["error"]["code"] == "too_many_leases", third.text
        assert (await http.post("/trajectory/ack", json={"lease": first})).status_code == 200
        assert (await http.post("/trajectory/read", json={"drain": True, "lease": 60})).status_code == 200


async def test_the_dressage_dialect_refuses_a_lease_and_drains_nothing(tokenizer: Any) -> None:
    config = ProxyConfig.of(port=0, api_dialect="dressage", min_group_size=1)
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.001))
    async with open_runtime(config, backend=engine, tokenizer=tokenizer) as runtime:
        await _finalized(runtime, "a")
        async with open_client(create_app(runtime)) as http:
            refused = await http.post("/trajectory/read", json={"lease": 60})
            assert refused.status_code == 400 and "lease" in refused.text, refused.text
            read = (await http.post("/trajectory/read", json={})).json()
            assert sum(len(group) for group in read["data"]) == 1


def slowed(app: Any, go_on: trio.Event) -> Any:
    """``app`` whose reply's body waits for ``go_on`` after its first part (a trainer still reading it)."""

    async def before(part: int) -> None:
        if part == 2:
            await go_on.wait()

    return before_each_part(app, before)


async def test_a_lease_acknowledged_before_its_reply_was_read_whole_is_a_409(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The id comes in the reply's first bytes; the data is only safe with the trainer once it has it all."""
    monkeypatch.setattr(store_messages, "PART_BYTES", 1000)  # a reply of several parts
    go_on = trio.Event()
    async with open_simulated_proxy(tokenizer=tokenizer) as sim:
        app = create_app(sim.runtime)
        await _finalized(sim.runtime, "a", "b", "c")
        async with open_client(slowed(app, go_on)) as trainer, open_client(app) as http:
            async with trainer.stream("POST", "/trajectory/read", json={"drain": True, "include_steps": True,
                                                                         "lease": 60}) as reply:
                chunks = reply.aiter_raw()
                first = await chunks.__anext__()
                lease = re.search(rb'"lease":\{"id":"([^"]+)"', first)
                assert lease is not None, first[:200]
                early = await http.post("/trajectory/ack", json={"lease": lease[1].decode()})
                assert early.status_code == 409 and early.json()["error"]["code"] == "lease_reply_unfinished"
                go_on.set()
                rest = b"".join([first, *[chunk async for chunk in chunks]])
            assert len(orjson.loads(rest)["data"]) == 3
            acked = await http.post("/trajectory/ack", json={"lease": lease[1].decode()})
            assert acked.json()["status"] == "deleted"
            assert (await http.get("/trajectory/stats")).json()["segments"] == 0


async def _two_completed(http: Any) -> None:
    for uid in ("r0", "r1"):
        assert (await http.post("/generate", json={"trajectory_uid": uid, "prompt_uid": "q", "messages": HI,
                                                   "max_tokens": 4})).status_code == 200
        assert (await http.post(f"/complete_trajectory/{uid}", json={"reward": 1.0})).status_code == 200


async def test_a_leased_fetch_batch_is_deleted_only_once_acknowledged(tokenizer: Any) -> None:
    """The gateway's hand-off by prompt group: the batch's data stays in the store and its groups out of the
    queue until the trainer's acknowledgement."""
    fetch = {"groups": 1, "rollouts_per_group": 2, "timeout_s": 0}
    async with open_simulated_proxy(tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        await _two_completed(http)
        batch = (await http.post("/trajectory/fetch_batch", json={**fetch, "lease": 60})).json()
        assert batch["complete"] and batch["lease"]["seconds"] == 60
        assert [t["trajectory_id"] for t in batch["data"][0]["trajectories"]] == ["r0", "r1"]
        assert (await http.post("/trajectory/fetch_batch", json=fetch)).json() == {"data": [], "complete": False}
        assert (await http.get("/trajectory/stats")).json()["segments"] == 2
        plain = (await http.post("/trajectory/fetch_batch", json=fetch)).json()
        assert "lease" not in plain  # (a fetch without one answers as Claw-R1's does)
        acked = await http.post("/trajectory/ack", json={"lease": batch["lease"]["id"]})
        assert acked.json()["status"] == "deleted"
        assert (await http.get("/trajectory/stats")).json()["segments"] == 0
        again = await http.post("/trajectory/ack", json={"lease": batch["lease"]["id"]})
        assert again.json() == {"lease": batch["lease"]["id"], "status": "deleted", "repeated": True}


async def test_a_leased_fetch_batch_not_acknowledged_puts_its_groups_back_first(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    fetch = {"groups": 1, "rollouts_per_group": 2, "timeout_s": 0}
    async with open_simulated_proxy(tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        await _two_completed(http)
        released = (await http.post("/trajectory/fetch_batch", json={**fetch, "lease": 30})).json()["lease"]["id"]
        assert (await http.post("/trajectory/ack", json={"lease": released, "release": True})).status_code == 200
        expiring = (await http.post("/trajectory/fetch_batch", json={**fetch, "lease": 30})).json()
        assert [t["trajectory_id"] for t in expiring["data"][0]["trajectories"]] == ["r0", "r1"]
        await trio.sleep(31)  # the trainer died: the lease ends, the group is first in the queue again
        late = await http.post("/trajectory/ack", json={"lease": expiring["lease"]["id"]})
        assert late.status_code == 410 and late.json()["error"]["code"] == "lease_expired", late.text
        again = (await http.post("/trajectory/fetch_batch", json=fetch)).json()
        assert again["complete"] and [len(t["segments"]) for t in again["data"][0]["trajectories"]] == [1, 1]
        assert (await http.get("/trajectory/stats")).json()["segments"] == 0  # delivered, not leased: deleted


async def test_a_leased_fetch_batch_whose_data_was_drained_already_still_settles(tokenizer: Any) -> None:
    """Its trajectories were read with /trajectory/read first: nothing to hold, and the lease still answers."""
    fetch = {"groups": 1, "rollouts_per_group": 2, "timeout_s": 0, "lease": 60}
    async with open_simulated_proxy(tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        await _two_completed(http)
        assert len((await http.post("/trajectory/read", json={"drain": True})).json()["data"]) == 2
        batch = (await http.post("/trajectory/fetch_batch", json=fetch)).json()
        assert [len(t["segments"]) for t in batch["data"][0]["trajectories"]] == [0, 0]
        assert (await http.post("/trajectory/ack", json={"lease": batch["lease"]["id"]})).status_code == 200
        assert len(sim.runtime.leases) == 0


async def test_an_acknowledged_fetch_whose_delete_fails_puts_its_groups_back(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store could not delete (its disk): the trainer is told, and the batch is handed out again, data and
    groups alike, not left in the store with its groups gone from the queue."""
    fetch = {"groups": 1, "rollouts_per_group": 2, "timeout_s": 0}

    async def failing(self: Runtime, held: Any) -> None:
        await self.let_go(held)  # (what the store does when its delete fails)
        raise StorageFull("disk I/O error")

    async with open_simulated_proxy(tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        await _two_completed(http)
        lease = (await http.post("/trajectory/fetch_batch", json={**fetch, "lease": 60})).json()["lease"]["id"]
        monkeypatch.setattr(Runtime, "drained", failing)
        refused = await http.post("/trajectory/ack", json={"lease": lease})
        assert refused.status_code == 507, refused.text
        monkeypatch.undo()
        again = await http.post("/trajectory/ack", json={"lease": lease})  # told the same: nothing was deleted
        assert (again.status_code, again.json()) == (507, refused.json())
        again = (await http.post("/trajectory/fetch_batch", json=fetch)).json()
        assert again["complete"] and [len(t["segments"]) for t in again["data"][0]["trajectories"]] == [1, 1]
