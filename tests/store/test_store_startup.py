"""The SQLite store at start-up: a damaged file is one line naming --data-dir (exit 2), and
committed data the file no longer holds (its WAL deleted after a crash, an older copy
restored) is detected and said loudly, with how much was lost."""

from __future__ import annotations

import logging
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _util import run_turn

from actorproxy.cli import main
from actorproxy.config import ProxyConfig
from actorproxy.errors import StartupError
from actorproxy.runtime.runtime import open_runtime
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.store.sqlite import DB_FILE, SQLiteStore

HI = [{"role": "user", "content": "hi"}]


def _damaged(data_dir: Path) -> Path:
    data_dir.mkdir()
    (data_dir / DB_FILE).write_bytes(b"SQLite format 3\x00" + bytes(range(256)) * 80)
    return data_dir


def test_a_damaged_store_file_is_one_line_naming_data_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # It was a ~70-line exception-group traceback and exit 1.
    data_dir = _damaged(tmp_path / "data")
    assert main(["run", "--port", "0", "--store", "sqlite", "--data-dir", str(data_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("actorproxy: --data-dir:") and str(data_dir / DB_FILE) in err[0]
    assert "not a database" in err[0] or "malformed" in err[0]


def test_a_damaged_store_file_stops_the_process_with_exit_2(tmp_path: Path) -> None:
    data_dir = _damaged(tmp_path / "data")
    result = subprocess.run([sys.executable, "-m", "actorproxy", "run", "--port", "0", "--store", "sqlite",
                             "--data-dir", str(data_dir)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert [line for line in result.stderr.splitlines() if "Traceback" in line] == []
    assert result.stderr.strip().splitlines()[-1].startswith("actorproxy: --data-dir:")


def test_a_store_that_cannot_be_opened_releases_its_directory(tmp_path: Path) -> None:
    data_dir = _damaged(tmp_path / "data")
    for _ in range(2):  # the second attempt is refused for the damage, not for a lock left behind
        with pytest.raises(StartupError, match="--data-dir") as failure:
            SQLiteStore(str(data_dir))
        assert "in use" not in str(failure.value)


async def test_finalized_sessions_lost_with_the_wal_are_detected_and_counted(
    tmp_path: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # Issue 28: after a crash, a deleted WAL lost 7 of 40 finalized sessions without a word.
    data, copy = tmp_path / "data", tmp_path / "copy"
    config = ProxyConfig.of(port=0, store_kind="sqlite", data_dir=str(data))
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.001))
    async with open_runtime(config, backend=engine, tokenizer=tokenizer) as runtime:
        for i in range(40):
            await run_turn(runtime, f"s{i}", HI)
            await runtime.finalize(f"s{i}")
            if i == 9:  # a checkpoint now: what the main file holds if the WAL goes
                with sqlite3.connect(data / DB_FILE) as db:
                    db.execute("PRAGMA wal_checkpoint(FULL)")
        # The crash: the process dies with the WAL not checkpointed; then the WAL is deleted.
        copy.mkdir()
        for name in (p.name for p in data.iterdir()):
            if not name.endswith(("-wal", "-shm", "LOCK")):
                shutil.copy(data / name, copy / name)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        store = SQLiteStore(str(copy))
    try:
        stats = store.stats()
        kept = stats["closed_by"].get("finalize", 0)
        assert kept == 10
        lost = [r for r in caplog.records if r.levelname == "CRITICAL"]
        assert len(lost) == 1, [r.getMessage() for r in caplog.records]
        assert "30 finalized session(s)" in lost[0].getMessage() and str(copy / DB_FILE) in lost[0].getMessage()
        assert stats["lost_at_start"]["finalized_sessions"] == 30
        assert stats["lost_at_start"]["steps"] == 30
    finally:
        store.close()
    caplog.clear()
    SQLiteStore(str(copy)).close()  # said once: the next start finds nothing more lost
    assert not [r for r in caplog.records if r.levelname == "CRITICAL"]


async def test_a_clean_store_reports_no_loss(tmp_path: Path, tokenizer: Any, caplog: pytest.LogCaptureFixture) -> None:
    config = ProxyConfig.of(port=0, store_kind="sqlite", data_dir=str(tmp_path / "data"))
    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.001))
    for _ in range(2):
        async with open_runtime(config, backend=engine, tokenizer=tokenizer) as runtime:
            await run_turn(runtime, "a", HI)
            await runtime.finalize("a")
            assert "lost_at_start" not in await runtime.store_stats()
    assert not [r for r in caplog.records if r.levelname == "CRITICAL"]
