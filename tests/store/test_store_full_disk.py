"""A full disk must not block the trainer's way out: on a real, small filesystem.

Issue 28: once the WAL had filled the volume again, the draining read answered 507
"database or disk is full" while the store was not marked failed (turns kept being
taken), and shutdown logged a traceback yet exited 0. Here the store lives on a 4 MiB
tmpfs, filled to the last byte: a drain still runs (the store's reserve file is given
up for it), a drain that cannot run marks the store failed everywhere (/health,
refused turns, /metrics), and a shutdown that cannot close the file says so and fails.

Skipped only where a tmpfs cannot be mounted (not root).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _asgi import open_client
from _util import run_turn

from actorproxy import cli
from actorproxy.config import ProxyConfig
from actorproxy.errors import ShutdownError
from actorproxy.runtime.runtime import open_runtime
from actorproxy.server.app import create_app
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.store.sqlite import RESERVE_FILE

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True,
                             text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def fill(disk: Path) -> Path:
    """Take every free byte of ``disk``; returns the filler (delete it to free them)."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for size in (1 << 16, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
    return filler


def _config(disk: Path) -> ProxyConfig:
    return ProxyConfig.of(port=0, store_kind="sqlite", data_dir=str(disk / "data"))


def _engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.0))


async def _sessions(runtime: Any, names: range) -> None:
    for i in names:
        await run_turn(runtime, f"s{i}", HI, max_tokens=300)
        await runtime.finalize(f"s{i}")


async def test_a_drain_runs_on_a_full_disk(small_disk: Path, tokenizer: Any) -> None:
    async with open_runtime(_config(small_disk), backend=_engine(tokenizer), tokenizer=tokenizer) as runtime, \
            open_client(create_app(runtime)) as client:
        await _sessions(runtime, range(20))
        assert (small_disk / "data" / RESERVE_FILE).exists()
        filler = fill(small_disk)
        drained = await client.post("/trajectory/read", json={"drain": True})
        assert drained.status_code == 200, drained.text  # it was 507 "database or disk is full"
        assert len(drained.json()["data"]) == 20
        health = (await client.get("/health")).json()
        assert health["status"] == "ok" and health["store"]["failed"] is False
        filler.unlink()
        await _sessions(runtime, range(20, 22))  # and the store takes turns
        assert len((await client.post("/trajectory/read", json={"drain": True})).json()["data"]) == 2


async def test_a_drain_that_cannot_run_marks_the_store_failed_everywhere(small_disk: Path, tokenizer: Any) -> None:
    async with open_runtime(_config(small_disk), backend=_engine(tokenizer), tokenizer=tokenizer) as runtime, \
            open_client(create_app(runtime)) as client:
        await _sessions(runtime, range(20))
        (small_disk / "data" / RESERVE_FILE).unlink()  # no reserve left to give
        filler = fill(small_disk)
        # What it read cannot be deleted: its reply is cut short before its end (a trainer takes no reply whose
        # data the next drain reads again), and the store is failed.
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post("/trajectory/read", json={"drain": True})
        health = (await client.get("/health")).json()
        assert health["status"] == "degraded" and health["store"]["failed"] is True
        assert "full" in health["store"]["failure"]
        turn = await client.post("/v1/chat/completions", json={"messages": HI}, headers={"X-Session-Id": "new"})
        assert turn.status_code == 507 and turn.json()["error"]["code"] == "store_failed"
        assert "actorproxy_store_failed 1" in (await client.get("/metrics")).text
        filler.unlink()  # space again: the next drain works and the store takes turns again
        drained = await client.post("/trajectory/read", json={"drain": True})
        assert drained.status_code == 200 and len(drained.json()["data"]) == 20
        assert (await client.get("/health")).json()["store"]["failed"] is False
        turn = await client.post("/v1/chat/completions", json={"messages": HI}, headers={"X-Session-Id": "new"})
        assert turn.status_code == 200


async def test_a_shutdown_that_cannot_close_the_store_fails_with_one_line(small_disk: Path, tokenizer: Any) -> None:
    with pytest.raises(ShutdownError) as failure:
        async with open_runtime(_config(small_disk), backend=_engine(tokenizer), tokenizer=tokenizer) as runtime:
            await _sessions(runtime, range(20))
            await run_turn(runtime, "open", HI, max_tokens=300)  # flushed at shutdown
            (small_disk / "data" / RESERVE_FILE).unlink()
            fill(small_disk)
    message = str(failure.value)
    assert "\n" not in message and message.startswith("--data-dir:") and "full" in message


def test_run_exits_1_with_one_line_when_the_store_did_not_stop_cleanly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def served_then_failed(*args: Any) -> None:
        raise BaseExceptionGroup("nursery", [ShutdownError("--data-dir", "the trajectory store did not stop cleanly")])

    monkeypatch.setattr(cli, "_run", served_then_failed)
    assert cli.main(["run", "--port", "0"]) == 1  # it exited 0 after a traceback
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["actorproxy: --data-dir: the trajectory store did not stop cleanly"]
