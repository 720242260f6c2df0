"""The tree stays clean for ruff and for ``mypy --strict``: the package, the examples, the benchmarks, the
scripts and the tests for ruff; the package, the examples and the benchmarks for mypy.

Both tools are in the ``test`` extra, pinned to a minor version (pyproject.toml), so this fails on a
finding, not on a machine's choice of release. mypy keeps its cache in ``.mypy_cache``: a second run
reads only what changed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=900)


def test_ruff_finds_nothing() -> None:
    done = run("ruff", "check", "actorproxy", "tests", "examples", "benchmarks", "scripts")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_strict_finds_nothing() -> None:
    done = run("mypy", "--strict", "actorproxy", "examples", "benchmarks")
    assert done.returncode == 0, done.stdout + done.stderr
