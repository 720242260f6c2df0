"""At ``--max-sessions``, the least recently used idle session makes room (issue 11 #8).

It retires into the store (nothing is lost: its segment closes with
``capacity_evicted`` and its steps are kept); a new session is refused only
when every live session is busy.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from _util import run_turn

from actorproxy.config import ProxyConfig
from actorproxy.errors import Overloaded
from actorproxy.runtime.messages import ChatRequest, Identity, TurnAccepted, TurnDone
from actorproxy.runtime.runtime import open_runtime
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.wire.converter import CONVERTER

HI = [{"role": "user", "content": "hi"}]


def _engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.01))


async def test_a_new_session_evicts_the_least_recently_used_idle_one(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    config = ProxyConfig.of(port=0, max_sessions=2)
    async with open_runtime(config, backend=_engine(tokenizer), tokenizer=tokenizer) as runtime:
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
    config = ProxyConfig.of(port=0, max_sessions=1)
    engine = _engine(tokenizer)
    engine.script("one two three four five six seven eight nine ten eleven twelve", routing_key="busy")
    async with open_runtime(config, backend=engine, tokenizer=tokenizer) as runtime:
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
