"""Ctrl-C ends the whole test run, also while a Trio test is running.

Trio turns SIGINT into a ``KeyboardInterrupt`` inside the running test, and
pytest-trio's nursery wraps it in a ``BaseExceptionGroup``: pytest then saw an
ordinary failure of that one test and went on with the next. ``tests/_interrupt.py``
(loaded by ``tests/conftest.py``) gives pytest the bare ``KeyboardInterrupt`` back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

PLAIN = '''
import trio

async def test_waits() -> None:
    print("READY", flush=True)
    await trio.sleep_forever()

async def test_after() -> None:
    print("RAN-AFTER", flush=True)
'''

# An async fixture that owns a nursery, as the HTTP tests' proxy fixture does.
FIXTURE = '''
import pytest
import trio

@pytest.fixture
async def serving():
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.sleep_forever)
        yield
        nursery.cancel_scope.cancel()

async def test_waits(serving) -> None:
    print("READY", flush=True)
    await trio.sleep_forever()

async def test_after() -> None:
    print("RAN-AFTER", flush=True)
'''


def _child_preexec() -> None:
    # A run started in the background by a non-interactive shell inherits SIGINT ignored: undo that.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    from _children import die_with_parent

    die_with_parent()


@pytest.mark.parametrize("body", [PLAIN, FIXTURE], ids=["plain", "fixture-nursery"])
def test_ctrl_c_ends_the_run(tmp_path: Path, body: str) -> None:
    (tmp_path / "test_child.py").write_text(body)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "_interrupt", "-p", "no:cacheprovider", "-p", "no:randomly",
         "-o", "trio_mode=true", "-s", "-q", "--rootdir", str(tmp_path), str(tmp_path / "test_child.py")],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_child_preexec)
    try:
        assert child.stdout is not None
        seen = []
        for line in child.stdout:
            seen.append(line)
            if "READY" in line:
                break
        else:
            pytest.fail("the child test never started:\n" + "".join(seen))
        child.send_signal(signal.SIGINT)
        try:
            rest, _ = child.communicate(timeout=60)
        except subprocess.TimeoutExpired as exc:
            pytest.fail("the run went on 60 s after SIGINT:\n" + "".join(seen) + str(exc.output or ""))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    output = "".join(seen) + rest
    assert child.returncode == pytest.ExitCode.INTERRUPTED, output
    assert "RAN-AFTER" not in output, output
    assert "KeyboardInterrupt" in output, output
