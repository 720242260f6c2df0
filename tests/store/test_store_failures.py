"""A failing disk under the SQLite store: bounded retries, then loud refusal, nothing lost, recovery.

The disk is simulated by the connection: while ``failing`` is set, every
statement that writes raises the error SQLite raises for a full disk, an I/O
error or a read-only file. The store runs on the event loop (not in its writer
thread) so that the mock clock drives every retry.
"""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import trio
from _asgi import open_client
from _util import run_turn

from actorproxy.config import ProxyConfig
from actorproxy.errors import StorageFull
from actorproxy.runtime import runtime as runtime_module
from actorproxy.runtime import store as st
from actorproxy.runtime.replies import FinalizeResult
from actorproxy.runtime.runtime import open_runtime
from actorproxy.schema.converter import CONVERTER
from actorproxy.server.app import create_app
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.store.sqlite import SQLiteStore
from actorproxy.testing import open_simulated_proxy

HI = [{"role": "user", "content": "hi"}]
_READS = ("SELECT", "PRAGMA")


class FlakyDisk:
    """A sqlite3 connection whose writes fail (with SQLite's own error) while ``failing`` is set."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self.failing: str | None = None
        #: Writes refused so far; ``heal_after``: the disk works again after that many.
        self.refused = 0
        self.heal_after: int | None = None

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        if self.failing is not None and not sql.lstrip().upper().startswith(_READS):
            self.refused += 1
            if self.heal_after is not None and self.refused >= self.heal_after:
                self.failing = None
            if self.db.in_transaction:  # what SQLite does on SQLITE_FULL / SQLITE_IOERR: the transaction is gone
                self.db.execute("ROLLBACK")
            raise sqlite3.OperationalError(self.failing)
        return self.db.execute(sql, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.db, name)


class InlineSQLite(SQLiteStore):
    """The SQLite store run on the event loop (deterministic under the mock clock) over a flaky disk."""

    blocking = False

    def __init__(self, data_dir: str) -> None:
        super().__init__(data_dir)
        self.disk = FlakyDisk(self._db)
        self._db = self.disk  # type: ignore[assignment]


@pytest.fixture
def flaky(monkeypatch: pytest.MonkeyPatch) -> list[InlineSQLite]:
    opened: list[InlineSQLite] = []

    def open_backend(config: ProxyConfig) -> InlineSQLite:
        opened.append(InlineSQLite(config.store.data_dir))
        return opened[-1]

    monkeypatch.setattr(runtime_module, "open_store_backend", open_backend)
    return opened


def _engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.001))


@pytest.mark.parametrize(
    "error", ["database or disk is full", "disk I/O error", "attempt to write a readonly database"]
)
async def test_a_failing_disk_refuses_turns_loses_nothing_and_recovers(
    error: str, tmp_path: Path, tokenizer: Any, flaky: list[InlineSQLite], autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = ProxyConfig.of(port=0, store_kind="sqlite", data_dir=str(tmp_path / "data"))
    async with open_runtime(config, backend=_engine(tokenizer), tokenizer=tokenizer) as runtime:
        disk = flaky[0].disk
        done = await run_turn(runtime, "done", HI)
        await runtime.finalize("done")
        first = await run_turn(runtime, "open", HI)
        await runtime.describe_session("open")  # the session journaled its step before it took this question
        assert (await runtime.store_stats())["journal_steps"] == 1

        disk.failing = error
        # A turn taken before the failure completes; its step cannot be journaled.
        second = await run_turn(runtime, "open", [*HI, first.message, {"role": "user", "content": "more"}])
        await runtime.describe_session("open")
        with trio.fail_after(5):  # mock time: 4 attempts (0.1 + 0.2 + 0.4 s of backoff), then failed
            stats = await runtime.store_stats()
        assert stats["failed"] and error in stats["failure"] and stats["pending_writes"] == 1
        assert stats["commit_failures"] == st.COMMIT_ATTEMPTS and stats["store_failures"] == 1
        assert any(r.levelno == logging.CRITICAL and "THE TRAJECTORY STORE FAILED" in r.getMessage()
                   for r in caplog.records)

        # New turns are refused, loudly and with a delay to wait.
        with pytest.raises(StorageFull) as refused:
            await run_turn(runtime, "new", HI)
        assert refused.value.status == 507 and refused.value.code == "store_failed"
        assert refused.value.retry_after and error in refused.value.message
        # A finalize is not durable now: the caller is told to retry; the store keeps the segment meanwhile.
        for _ in range(2):
            with pytest.raises(StorageFull) as unfinished:
                await runtime.finalize("open")
            assert unfinished.value.code == "store_failed" and unfinished.value.retry_after
        stats = await runtime.store_stats()
        assert stats["pending_segments"] == 1 and stats["pending_steps"] == 3  # journal entry, then the flush
        # What the file holds is still read (a trainer's drain is the way out of a full disk),
        # not a session whose writes are kept in memory.
        assert len((await runtime.read(session_id="done")).data) == 1
        with pytest.raises(StorageFull):
            await runtime.read(session_id="open")

        # Bounded: a minute of a dead disk is a handful of attempts, not a spin.
        attempts = disk.refused
        await trio.sleep(60)
        assert disk.refused - attempts <= 60 / st.FAILED_RETRY_MAX + 3

        disk.failing = None  # the disk works again: the next attempt writes everything kept in memory
        await trio.sleep(st.FAILED_RETRY_MAX)
        stats = await runtime.store_stats()
        assert not stats["failed"] and stats["pending_writes"] == 0 and stats["failure"] is None
        assert await runtime.finalize("open") == FinalizeResult("open", segments=0, steps=0)
        got = CONVERTER.unstructure(await runtime.read(session_id="open", include_steps=True))
        (seg,) = got["data"]
        assert seg["trajectory_id"] == "open#0" and seg["step_indices"] == [0, 1]
        assert [s["step_index"] for s in got["steps"]] == [0, 1]
        assert [len(s["output_ids"]) for s in got["steps"]] == [first.done.completion_tokens,
                                                                 second.done.completion_tokens]
        done_tokens = done.done.prompt_tokens + done.done.completion_tokens
        assert (await runtime.read(session_id="done")).data[0].num_tokens == done_tokens
        stats = await runtime.store_stats()  # counted once each, though some writes were tried many times
        assert stats["segments"] == stats["segments_stored"] == 2 and stats["steps"] == stats["steps_stored"] == 3
        assert stats["journal_steps"] == 0
        assert (await run_turn(runtime, "new", HI)).done is not None


async def test_a_batch_that_fails_once_is_committed_once(
    tmp_path: Path, tokenizer: Any, flaky: list[InlineSQLite], autojump_clock: trio.testing.MockClock
) -> None:
    """A failure the retries absorb: no refusal, and nothing written twice (the counters are rolled back too)."""
    config = ProxyConfig.of(port=0, store_kind="sqlite", data_dir=str(tmp_path / "data"))
    async with open_runtime(config, backend=_engine(tokenizer), tokenizer=tokenizer) as runtime:
        disk = flaky[0].disk
        await run_turn(runtime, "a", HI)
        disk.failing, disk.heal_after = "database or disk is full", 2  # two attempts fail, the third commits
        assert (await runtime.finalize("a")).segments == 1  # answered once committed
        stats = await runtime.store_stats()
        assert not stats["failed"] and stats["commit_failures"] == 2 and stats["store_failures"] == 0
        assert stats["segments"] == stats["segments_stored"] == 1 and stats["steps"] == stats["steps_stored"] == 1
        assert stats["tokens"] == 2 * CONVERTER.unstructure(await runtime.read(session_id="a"))["data"][0]["num_tokens"]


async def test_a_failed_store_over_http(
    tmp_path: Path, tokenizer: Any, flaky: list[InlineSQLite], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal in each caller's format with Retry-After; /health and /metrics show it; the close saves all."""
    monkeypatch.setattr(st, "FIRST_RETRY", 0.0)
    config = ProxyConfig.of(port=0, store_kind="sqlite", data_dir=str(tmp_path / "data"))
    # In-process HTTP: what is tested is the app's answers, not the socket.
    async with open_simulated_proxy(config, tokenizer=tokenizer) as sim, open_client(create_app(sim.runtime)) as http:
        disk = flaky[0].disk
        disk.failing = "database or disk is full"
        await run_turn(sim.runtime, "a", HI)  # its journal entry fails: the store is failed
        await sim.runtime.describe_session("a")
        assert (await sim.runtime.store_stats())["failed"]
        chat = await http.post("/v1/chat/completions", json={"model": "m", "messages": HI},
                               headers={"X-Session-Id": "b"})
        assert chat.status_code == 507, chat.text
        assert float(chat.headers["retry-after"]) > 0
        assert chat.json()["error"]["code"] == "store_failed"
        anthropic = await http.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": HI},
                                    headers={"X-Session-Id": "c"})
        assert anthropic.status_code == 507 and anthropic.json()["type"] == "error"
        assert "retry-after" in anthropic.headers
        health = (await http.get("/health")).json()
        assert health["status"] == "degraded" and health["store"]["failed"] and health["store"]["pending_writes"]
        metrics = (await http.get("/metrics")).text
        assert "actorproxy_store_failed 1.0" in metrics and "actorproxy_store_pending_writes 1.0" in metrics
        disk.failing = None  # the disk works again by the shutdown: its flush and what was kept are written
    store = SQLiteStore(str(tmp_path / "data"))
    try:
        stats = store.stats()
        assert stats["segments"] == 1 and stats["steps"] == 1 and stats["journal_steps"] == 0
        assert stats["closed_by"] == {"shutdown": 1}
    finally:
        store.close()
