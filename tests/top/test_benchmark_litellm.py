"""The benchmarks that set LiteLLM beside the proxy run without it: its rows are skipped with a line, not a crash.

LiteLLM is not a dependency (docs/performance.md says how to install it beside the project), so
the suite never has it: ``long_streams.py --targets actorproxy litellm`` is run here for one
short stream with ``litellm`` off ``PATH``, and must say that LiteLLM is skipped and still give
the proxy's row.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIPPED = "litellm: not installed (pip install 'litellm[proxy]'), skipped"


def _without_litellm() -> dict[str, str]:
    """This environment with every ``PATH`` directory holding a ``litellm`` command left out."""
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "litellm").exists()]
    return {**os.environ, "PATH": os.pathsep.join(path), "PYTHONPATH": str(ROOT)}


def test_long_streams_skips_litellm_when_it_is_not_installed(tmp_path: Path) -> None:
    rows = tmp_path / "rows.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "long_streams.py"), "--targets", "actorproxy", "litellm",
               "--no-direct", "--streams", "1", "--tokens", "5", "--interval", "0.001", "--timeout", "60",
               "--litellm-timeout", "5", "--json", str(rows)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT, env=_without_litellm())
    assert done.returncode == 0, done.stdout + done.stderr
    assert SKIPPED in done.stdout.splitlines()
    got = json.loads(rows.read_text())
    assert [(r["via"], r["completed"], r["tokens"]) for r in got] == [("actorproxy", 1, 5)]
    assert got[0]["proxy_sys_us_per_token"] >= 0  # the kernel's part of the proxy's CPU, a column of its own


def test_long_streams_help_names_the_litellm_flags() -> None:
    shown = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "long_streams.py"), "--help"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert shown.returncode == 0, shown.stderr
    assert "--targets" in shown.stdout and "--litellm-timeout" in shown.stdout
