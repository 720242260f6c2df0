"""The README's fast path: ``python -m pytest -m "not heavy"`` leaves out every tier that installs,
builds or starts something big (npm's Node.js and agent CLIs, the llama.cpp build, Ray, chromium,
SGLang's release source), and nothing else."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Every test of these files is heavy; elsewhere only the tests named here are.
HEAVY_FILES = (
    "tests/agents/", "tests/realengine/", "tests/store/test_ray_pool.py", "tests/contracts/test_sglang_contract.py",
)
HEAVY_TESTS = {
    "tests/top/test_examples.py::test_ray_data_pool_example_feeds_one_trainer_from_two_replicas",
    "tests/contracts/test_compat.py::test_the_gateway_command_line",
    "tests/server/test_dashboard.py::test_the_dashboard_renders_in_a_real_browser",
}


#: A plugin for the child run: it prints each test the -m expression left out.
DESELECTED = """
def pytest_deselected(items):
    for item in items:
        print("DESELECTED", item.nodeid)
"""


def test_not_heavy_leaves_out_the_heavy_tiers_and_nothing_else(tmp_path: Path) -> None:
    (tmp_path / "print_deselected.py").write_text(DESELECTED)
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-s", "-p", "no:randomly",
                           "-p", "no:cacheprovider", "-p", "print_deselected", "-m", "not heavy"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp_path)])})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    heavy = {line.split()[1].split("[")[0] for line in lines if line.startswith("DESELECTED ")}
    light = {line.split("[")[0] for line in lines if "::" in line and not line.startswith("DESELECTED ")}
    assert light and not light & heavy
    assert not [t for t in light if t.startswith(HEAVY_FILES)], "a heavy tier is in the fast path"
    assert {t for t in heavy if not t.startswith(HEAVY_FILES)} == HEAVY_TESTS
    assert all(any(t.startswith(f) for t in heavy) for f in HEAVY_FILES), heavy
    assert "tests/protocols/test_fast_path.py::test_not_heavy_leaves_out_the_heavy_tiers_and_nothing_else" in light
