"""A session actor that fails fails alone (issue 11 #1): the runtime and every other session keep running.

The reproduction from the issue (a second turn under another system prompt
whose user message has a non-string ``name`` or ``tool_call_id``) is sent
below the HTTP edge, straight to the runtime, so it reaches the session actor
whatever the edge validates; a failure injected into ``SessionState.prepare``
and one inside the generation check the mechanism itself.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing
from _util import run_turn

from actorproxy.config import ProxyConfig
from actorproxy.core.session_state import SessionState
from actorproxy.runtime.runtime import Runtime, open_runtime
from actorproxy.schema.converter import CONVERTER
from actorproxy.sim import SimConfig, SimEngine

HI = [{"role": "user", "content": "hi"}]


def _engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.01))


async def _check_failed_alone(runtime: Runtime, bad: str, bystander: str) -> None:
    """The failed session's step is in the store, the bystander and a successor still work, it was counted."""
    await trio.testing.wait_all_tasks_blocked()
    census = await runtime.census()
    assert census["sessions_failed"] == 1
    stored = CONVERTER.unstructure(await runtime.read(session_id=bad, include_steps=True))
    assert [s["step_index"] for s in stored["steps"]] == [0]
    assert [s["boundary_reason"] for s in stored["data"]] == ["session_failed"]
    assert (await run_turn(runtime, bystander, [*HI, {"role": "user", "content": "still there?"}])).done is not None
    again = await run_turn(runtime, bad, HI)
    assert again.done is not None and again.done.step_index == 1  # a successor continues the numbering


@pytest.mark.parametrize(
    "bad_field",
    [{"name": {}}, {"tool_call_id": [1]}],
    ids=["name-object", "tool_call_id-list"],
)
async def test_the_issue_reproduction_no_longer_fails_its_session(
    tokenizer: Any, autojump_clock: trio.testing.MockClock, bad_field: dict[str, Any]
) -> None:
    """Fields of types the lane routing could not hash once failed the session; they are served now.

    (The failure path itself is covered by the injected failures below.)
    """
    async with open_runtime(ProxyConfig.of(port=0), backend=_engine(tokenizer), tokenizer=tokenizer) as runtime:
        assert (await run_turn(runtime, "bystander", HI)).done is not None
        assert (await run_turn(runtime, "s1", HI)).done is not None
        second = [{"role": "system", "content": "another system prompt"},
                  {"role": "user", "content": "hi", **bad_field}]
        served = await run_turn(runtime, "s1", second)
        assert served.error is None and served.done is not None
        assert (await runtime.census())["sessions_failed"] == 0


async def test_a_failure_injected_into_prepare_fails_only_its_session(
    tokenizer: Any, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepare = SessionState.prepare

    def failing(self: SessionState, request: Any, identity: Any) -> Any:
        if request.messages[-1]["content"] == "boom":
            raise RuntimeError("injected")
        return prepare(self, request, identity)

    monkeypatch.setattr(SessionState, "prepare", failing)
    async with open_runtime(ProxyConfig.of(port=0), backend=_engine(tokenizer), tokenizer=tokenizer) as runtime:
        first = await run_turn(runtime, "bad", HI)
        assert (await run_turn(runtime, "bystander", HI)).done is not None
        failed = await run_turn(runtime, "bad", [*HI, first.message, {"role": "user", "content": "boom"}])
        assert failed.error is not None and failed.error.code == "session_failed"
        assert "RuntimeError: injected" in failed.error.message
        await _check_failed_alone(runtime, "bad", "bystander")


class _BrokenEngine:
    """The simulator, except that session ``bad``'s second generation raises a bug (not a BackendError)."""

    def __init__(self, inner: SimEngine) -> None:
        self.inner = inner
        self.calls = 0

    def open_generation(self, request: Any) -> Any:
        if request.routing_key == "bad":
            self.calls += 1
            if self.calls == 2:
                raise KeyError("injected inside the generation")
        return self.inner.open_generation(request)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_failure_inside_the_generation_fails_only_its_session(
    tokenizer: Any, autojump_clock: trio.testing.MockClock
) -> None:
    engine = _BrokenEngine(_engine(tokenizer))
    async with open_runtime(ProxyConfig.of(port=0), backend=engine, tokenizer=tokenizer) as runtime:  # type: ignore[arg-type]
        first = await run_turn(runtime, "bad", HI)
        assert (await run_turn(runtime, "bystander", HI)).done is not None
        failed = await run_turn(runtime, "bad", [*HI, first.message, {"role": "user", "content": "more"}])
        assert failed.error is not None and failed.error.code == "session_failed"
        await trio.testing.wait_all_tasks_blocked()
        stored = CONVERTER.unstructure(await runtime.read(session_id="bad", include_steps=True))
        # Both steps are kept: the first in the closed segment, the failed one (running when it failed) beside it.
        assert [s["step_index"] for s in stored["steps"]] == [0, 1]
        assert stored["data"][0]["step_indices"] == [0]
        assert (await runtime.census())["sessions_failed"] == 1
        assert (await run_turn(runtime, "bystander", [*HI, {"role": "user", "content": "still there?"}])).done
