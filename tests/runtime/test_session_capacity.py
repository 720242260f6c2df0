"""At ``--max-sessions``, the least recently used idle session makes room (issue 11 #8).

It retires into the store (nothing is lost: its segment closes with
``capacity_evicted`` and its steps are kept); a new session is refused only
when every live session is busy.
"""

from __future__ import annotations

import contextlib
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from _util import run_turn, runtime_over

from actorproxy import open_proxy
from actorproxy.config import ProxyConfig
from actorproxy.core.requests import ChatRequest, Identity
from actorproxy.core.turn_events import TurnAccepted, TurnDone
from actorproxy.errors import NotFound, Overloaded, TooManySessions
from actorproxy.schema.converter import CONVERTER
from actorproxy.server.replies import error_reply
from actorproxy.sim import SimConfig, SimEngine

HI = [{"role": "user", "content": "hi"}]


def _engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.01))


async def test_a_new_session_evicts_the_least_recently_used_idle_one(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    async with runtime_over(_engine(tokenizer), tokenizer, max_sessions=2) as runtime:
        a = await run_turn(runtime, "a", HI, max_tokens=4)
        await run_turn(runtime, "b", HI, max_tokens=4)
        await run_turn(runtime, "c", HI, max_tokens=4)  # "a" is the least recently used: it makes room
        await trio.testing.wait_all_tasks_blocked()
        census = await runtime.census()
        assert (census["active_sessions"], census["sessions_evicted_for_room"]) == (2, 1)
        stored = CONVERTER.unstructure(await runtime.read(session_id="a", include_steps=True))
        assert [s["boundary_reason"] for s in stored["data"]] == ["capacity_evicted"]
        assert [(s["step_index"], s["status"]) for s in stored["steps"]] == [(0, "completed")]
        assert a.done is not None and stored["steps"][0]["completion_tokens"] == a.done.completion_tokens
        # Recency is by use, not by age: "b" is used again, so "c" goes next.
        await run_turn(runtime, "b", [*HI, {"role": "user", "content": "again"}], max_tokens=4)
        await run_turn(runtime, "d", HI, max_tokens=4)
        await trio.testing.wait_all_tasks_blocked()
        assert [s.boundary_reason for s in (await runtime.read(session_id="c")).data] == ["capacity_evicted"]
        assert (await runtime.describe_session("b")).next_step == 2
        # An evicted session comes back as a successor that keeps counting.
        back = await run_turn(runtime, "a", HI, max_tokens=4)
        assert back.done is not None and back.done.step_index == 1


async def test_busy_sessions_are_never_evicted(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    engine = _engine(tokenizer)
    engine.script("one two three four five six seven eight nine ten eleven twelve", routing_key="busy")
    async with runtime_over(engine, tokenizer, max_sessions=1) as runtime:
        request = ChatRequest(messages=HI, max_tokens=50, stream=True)  # told when it is accepted
        async with await runtime.start_turn(request, Identity("busy")) as events:
            assert isinstance(events.first, TurnAccepted)  # "busy" is generating
            with pytest.raises(Overloaded):
                await run_turn(runtime, "newcomer", HI, max_tokens=4)
            async for event in events:
                if isinstance(event, TurnDone):
                    break
        # Idle now: the newcomer gets its slot, and the busy session's turn is in the store.
        assert (await run_turn(runtime, "newcomer", HI, max_tokens=4)).done is not None
        await trio.testing.wait_all_tasks_blocked()
        assert len(CONVERTER.unstructure(await runtime.read(session_id="busy", include_steps=True))["steps"]) == 1


async def test_a_client_at_the_cap_evicts_its_own_idle_sessions_never_anothers(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    """Issue 28 #13: one client opening --max-sessions new sessions must not split another agent's conversation."""
    async with runtime_over(_engine(tokenizer), tokenizer, max_sessions=3) as runtime:
        await run_turn(runtime, "victim", HI, max_tokens=4, client="addr:10.0.0.2")  # then idle: the oldest
        for n in range(6):
            done = await run_turn(runtime, f"flood-{n}", HI, max_tokens=4, client="addr:10.0.0.9")
            assert done.done is not None, done.error
        await trio.testing.wait_all_tasks_blocked()
        assert (await runtime.describe_session("victim")).next_step == 1  # still live, never split
        evicted = [s.parent_traj_id for s in (await runtime.read()).data if s.boundary_reason == "capacity_evicted"]
        assert sorted(evicted) == ["flood-0", "flood-1", "flood-2", "flood-3"]
        # A newcomer with fewer sessions than the flooder takes the flooder's idle session, not the victim's.
        assert (await run_turn(runtime, "newcomer", HI, max_tokens=4, client="addr:10.0.0.3")).done is not None
        await trio.testing.wait_all_tasks_blocked()
        assert (await runtime.describe_session("victim")).next_step == 1
        census = await runtime.census()
        assert (census["active_sessions"], census["sessions_evicted_for_room"]) == (3, 5)


async def test_a_client_over_its_share_with_nothing_idle_of_its_own_gets_429(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    engine = _engine(tokenizer)
    engine.script("one two three four five six seven eight nine ten eleven twelve", routing_key="busy")
    async with runtime_over(engine, tokenizer, max_sessions=2) as runtime:
        await run_turn(runtime, "idle-agent", HI, max_tokens=4, client="addr:10.0.0.2")
        request = ChatRequest(messages=HI, max_tokens=50, stream=True)
        async with await runtime.start_turn(request, Identity("busy", client="addr:10.0.0.9")) as events:
            assert isinstance(events.first, TurnAccepted)
            # The busy client holds as many sessions as the idle agent: the idle agent's is not its to take.
            with pytest.raises(TooManySessions) as refused:
                await run_turn(runtime, "more", HI, max_tokens=4, client="addr:10.0.0.9")
            assert refused.value.status == 429 and "--max-sessions" in refused.value.message
            async for event in events:
                if isinstance(event, TurnDone):
                    break
        assert (await runtime.describe_session("idle-agent")).next_step == 1


async def test_max_sessions_per_client(tokenizer: Any, autojump_clock: trio.testing.MockClock) -> None:
    engine = _engine(tokenizer)
    engine.script("one two three four five six seven eight nine ten eleven twelve", routing_key="b1")
    engine.script("one two three four five six seven eight nine ten eleven twelve", routing_key="b2")
    async with runtime_over(engine, tokenizer, max_sessions=10, max_sessions_per_client=2) as runtime:
        # At its bound, a client's own least recently used idle session makes room...
        for n in range(3):
            assert (await run_turn(runtime, f"s{n}", HI, max_tokens=4, client="key:k")).done is not None
        await trio.testing.wait_all_tasks_blocked()
        assert [s.boundary_reason for s in (await runtime.read(session_id="s0")).data] == ["capacity_evicted"]
        # ...and with none idle it is refused (429), while another client still opens sessions.
        request = ChatRequest(messages=HI, max_tokens=50, stream=True)
        async with await runtime.start_turn(request, Identity("b1", client="addr:1")) as one, \
                await runtime.start_turn(request, Identity("b2", client="addr:1")) as two:
            assert isinstance(one.first, TurnAccepted) and isinstance(two.first, TurnAccepted)
            with pytest.raises(TooManySessions) as refused:
                await run_turn(runtime, "b3", HI, max_tokens=4, client="addr:1")
            assert "--max-sessions-per-client" in refused.value.message
            assert (await run_turn(runtime, "other", HI, max_tokens=4, client="addr:2")).done is not None
            for events in (one, two):
                async for event in events:
                    if isinstance(event, TurnDone):
                        break
        # The trainer (no client label) is bound only by --max-sessions.
        for n in range(3):
            assert (await run_turn(runtime, f"t{n}", HI, max_tokens=4)).done is not None


async def test_over_http_clients_are_told_apart_by_address_and_refused_in_their_format(tokenizer: Any) -> None:
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.0002))
    config = ProxyConfig.of(port=0, max_sessions=4, max_sessions_per_client=2)
    chat = {"max_tokens": 4, "messages": HI}

    def client(address: str) -> httpx.AsyncClient:
        return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(local_address=address), timeout=30)

    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running, \
            client("127.0.0.2") as agent, client("127.0.0.1") as flooder:
        assert (await agent.post(f"{running.url}/sess/agent/v1/chat/completions", json=chat)).status_code == 200
        for n in range(5):  # at its bound of two, the flooder's own idle sessions make room
            reply = await flooder.post(f"{running.url}/sess/flood-{n}/v1/chat/completions", json=chat)
            assert reply.status_code == 200, reply.text
        assert (await running.runtime.describe_session("agent")).next_step == 1
        census = await running.runtime.census()
        assert census["sessions_evicted_for_room"] == 3  # counted when asked, with the reply that asked
        # An evicted session leaves the live ones once it has flushed into the store, in its own task:
        # a census asked at once could still count it (expected (3, 3), seen otherwise on a loaded
        # machine). Asking each one something orders the census after its retirement: a retiring
        # session answers what is queued behind its eviction only after it told the registry it
        # retired (or it is gone already: NotFound).
        for n in range(3):
            with contextlib.suppress(NotFound):
                await running.runtime.describe_session(f"flood-{n}")
        census = await running.runtime.census()
        assert (census["active_sessions"], census["sessions_evicted_for_room"]) == (3, 3)
    # Refused: 429 in the caller's own format (OpenAI's, Anthropic's on /v1/messages).
    refused = TooManySessions("this client holds 2 live sessions")
    openai_shape = error_reply(refused, anthropic_shape=False, method="POST", path="/v1/chat/completions")
    assert openai_shape.status == 429 and openai_shape.data["error"]["code"] == "too_many_sessions"
    anthropic_shape = error_reply(refused, anthropic_shape=True, method="POST", path="/v1/messages")
    assert anthropic_shape.data["error"]["type"] == "rate_limit_error"
