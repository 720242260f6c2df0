"""What a Trio test raises reaches pytest as raised: Ctrl-C ends the whole run; a skip keeps its reason.

Trio turns SIGINT into a ``KeyboardInterrupt`` inside the running test, and
pytest-trio's nursery wraps it in a ``BaseExceptionGroup``: pytest then saw an
ordinary failure of that one test and went on with the next. pytest-trio turns a
skip from inside the nursery into a bare ``pytest.skip()``, without its reason.
``tests/_trio_outcomes.py`` (loaded by ``tests/conftest.py``) gives pytest the
original exceptions back.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from _children import die_with_parent, lines_through

TESTS = Path(__file__).resolve().parents[1]

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


def _child_pytest(directory: Path, *flags: str) -> list[str]:
    """A pytest run of ``directory/test_child.py`` with the plugin and Trio mode, as this suite runs."""
    return [sys.executable, "-m", "pytest", "-p", "_trio_outcomes", "-p", "no:cacheprovider", "-p", "no:randomly",
            "-o", "trio_mode=true", "-q", *flags, "--rootdir", str(directory), str(directory / "test_child.py")]


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def _child_preexec() -> None:
    # A run started in the background by a non-interactive shell inherits SIGINT ignored: undo that.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent()


@pytest.mark.parametrize("body", [PLAIN, FIXTURE], ids=["plain", "fixture-nursery"])
def test_ctrl_c_ends_the_run(tmp_path: Path, body: str) -> None:
    (tmp_path / "test_child.py").write_text(body)
    child = subprocess.Popen(_child_pytest(tmp_path, "-s"), cwd=tmp_path, env=_child_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, preexec_fn=_child_preexec)
    try:
        seen = lines_through(child.stdout, "READY")  # the child test started
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


SKIPS = '''
import pytest
import trio

async def test_skips_in_trio() -> None:
    await trio.sleep(0)
    pytest.skip("no chromium here")

@pytest.fixture
async def serving():
    async with trio.open_nursery():
        yield

async def test_skips_with_a_fixture(serving) -> None:
    pytest.skip("no engine here")

async def test_xfails_in_trio() -> None:
    pytest.xfail("known to fail")
'''


def test_a_skip_inside_trio_keeps_its_reason_and_place(tmp_path: Path) -> None:
    """pytest-trio re-raises a skip (or xfail) from its nursery as a bare ``pytest.skip()``: the
    summary said ``SKIPPED [1] .../_pytest/python.py:187: Skipped``, naming neither test nor reason."""
    (tmp_path / "test_child.py").write_text(SKIPS)
    done = subprocess.run(_child_pytest(tmp_path, "-rsx"), cwd=tmp_path, env=_child_env(), capture_output=True,
                          text=True, timeout=120, preexec_fn=die_with_parent)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "python.py" not in out, out
    assert re.search(r"SKIPPED \[1\] test_child\.py:7: test_skips_in_trio: no chromium here", out), out
    assert re.search(r"SKIPPED \[1\] test_child\.py:15: test_skips_with_a_fixture: no engine here", out), out
    assert re.search(r"XFAIL test_child\.py::test_xfails_in_trio - known to fail", out), out
