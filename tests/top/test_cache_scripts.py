"""The install scripts' cache (``scripts/cache.sh``) does not grow with every version: superseded entries go."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def _dir(path: Path, mtime: int) -> Path:
    path.mkdir(parents=True)
    (path / "payload").write_text("x")
    os.utime(path, (mtime, mtime))
    return path


def _run(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script), *args], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60, check=True)


def test_prune_keeps_the_entry_in_use_and_the_one_used_last_before_it(tmp_path: Path) -> None:
    old, older, newest = (_dir(tmp_path / f"kind-{n}", t) for n, t in (("1", 1_000), ("2", 500), ("3", 2_000)))
    _dir(tmp_path / "other-9", 100)
    subprocess.run(["bash", "-c", f'source {SCRIPTS / "cache.sh"} test; prune_superseded "$1" "$2"/kind-*',
                    "bash", str(old), str(tmp_path)], check=True, capture_output=True, timeout=60)
    # kind-1 is in use (and now the newest), kind-3 was used last before it, kind-2 is gone; others untouched.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kind-1", "kind-3", "other-9"]
    assert old.stat().st_mtime > newest.stat().st_mtime
    assert not older.exists()


def test_sglang_source_cache_drops_superseded_releases(tmp_path: Path) -> None:
    text = (SCRIPTS / "sglang" / "install.sh").read_text()
    version = text.split('SGLANG_VERSION="', 1)[1].split('"', 1)[0]
    current = _dir(tmp_path / f"sglang-src-{version}", 3_000)
    (current / ".complete").write_text(version)
    _dir(tmp_path / "sglang-src-0.4.0", 1_000)
    _dir(tmp_path / "sglang-src-0.5.0", 2_000)
    out = _run(SCRIPTS / "sglang" / "install.sh", {"ACTORPROXY_CACHE": str(tmp_path)})
    assert out.stdout.strip() == f"source={current}"
    assert sorted(p.name for p in tmp_path.glob("sglang-src-*")) == ["sglang-src-0.5.0", current.name]
    assert "removing" in out.stderr and "sglang-src-0.4.0" in out.stderr


def test_python_agent_clients_cache_drops_superseded_venvs(tmp_path: Path) -> None:
    python = sys.executable
    version = subprocess.run([python, "--version"], capture_output=True, text=True, check=True).stdout
    digest = hashlib.sha256((SCRIPTS / "agents" / "python-clients.txt").read_bytes() + version.encode()).hexdigest()
    current = _dir(tmp_path / f"py-{digest[:16]}", 3_000)
    (current / ".installed").touch()
    for name, mtime in (("py-0000000000000001", 1_000), ("py-0000000000000002", 2_000), ("py-0000000000000003", 500)):
        _dir(tmp_path / name, mtime)
    out = _run(SCRIPTS / "agents" / "install_python.sh", {"ACTORPROXY_AGENTS_CACHE": str(tmp_path), "PYTHON": python})
    assert out.stdout.strip() == f"{current}/bin/python"
    assert sorted(p.name for p in tmp_path.glob("py-*")) == sorted(["py-0000000000000002", current.name])
