"""The examples stay true to the code: each runs to success."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=EXAMPLES.parent, capture_output=True, text=True, timeout=300)


def test_user_preemption_test_example_passes() -> None:
    result = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLES / "preemption_test.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


@pytest.mark.parametrize("script", ["whitebox_rollout.py", "agent_rewrites.py"])
def test_rollout_examples_run(script: str) -> None:
    result = _run(str(EXAMPLES / script))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "segment" in result.stdout
