"""A CLI that explains itself: --version, `actorproxy check`, one-line start-up failures, the banner."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from _children import lines_through

from actorproxy import __version__
from actorproxy.cli import main


def _actorproxy(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "actorproxy", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_version() -> None:
    result = _actorproxy("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"actorproxy {__version__}"


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_bad_tokenizer_path_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--port", "0", "--tokenizer-path", str(tmp_path / "nope")]) == 2
    line = _one_line(capsys)
    assert line.startswith("actorproxy: --tokenizer-path:") and "does not exist" in line
    (tmp_path / "empty").mkdir()
    assert main(["run", "--port", "0", "--tokenizer-path", str(tmp_path / "empty")]) == 2
    line = _one_line(capsys)
    assert line.startswith("actorproxy: --tokenizer-path: cannot load a tokenizer")


def test_a_port_in_use_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["run", "--port", str(port)]) == 2
    line = _one_line(capsys)
    assert line.startswith("actorproxy: --port:") and "already in use" in line


def test_an_unreachable_engine_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # bound, never listening: connections are refused
        code = main(["run", "--port", "0", "--backend", "vllm", "--backend-url", f"http://127.0.0.1:{port}",
                     "--engine-startup-timeout", "0.5"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("actorproxy: --backend-url:") and f"127.0.0.1:{port}" in err[-1]


def test_check_passes_and_fails(tmp_path: Path) -> None:
    good = _actorproxy("check", "--port", "0")
    assert good.returncode == 0, good.stdout + good.stderr
    assert [line.split()[0] for line in good.stdout.splitlines()] == ["ok"] * 4
    bad = _actorproxy("check", "--port", "0", "--tokenizer-path", str(tmp_path / "nope"))
    assert bad.returncode == 2
    assert "FAIL tokenizer: --tokenizer-path:" in bad.stdout


def test_the_start_up_banner(tmp_path: Path) -> None:
    process = subprocess.Popen([sys.executable, "-m", "actorproxy", "run", "--port", "0", "--data-dir", str(tmp_path)],
                               stderr=subprocess.PIPE, text=True)
    try:
        lines = lines_through(process.stderr, "  try:")
        url = re.search(r"serving on (http://\S+)", "".join(lines)).group(1)  # type: ignore[union-attr]
        turn = httpx.post(url + "/v1/chat/completions", headers={"X-Session-Id": "open-1"}, timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert turn.status_code == 200
    finally:
        process.terminate()
        rest = process.communicate(timeout=60)[1]
    assert "1 open session(s) finalized into the store" in rest  # shutdown says what it did
    text = "".join(lines)
    assert "serving on http://127.0.0.1:" in text
    assert "engine:    the built-in simulated engine" in text
    assert "  store:     memory" in text  # the suite runs with ACTORPROXY_STORE=memory (conftest)
    assert text.count("  store:") == 1, text
    assert "tokenizer: qwen3" in text and "/metrics" in text and "curl -s http://127.0.0.1:" in text
    assert "loading tokenizer" not in text
    # No admin token: the banner and a WARNING say that every route, rewards and drains included, is open.
    assert "access:    OPEN: anyone reaching 127.0.0.1 may set rewards" in text
    assert "WARNING" in text and "no --admin-token: every route is open to anyone who reaches http://127.0.0.1:" in text


def _quickstart_block() -> list[str]:
    """The start-up output docs/quickstart.md shows under its first ``actorproxy run``."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "quickstart.md").read_text()
    block = re.search(r"```bash\n[^`]*\nactorproxy run\n```\n\n```\n(.*?)```", text, re.S)
    assert block, "docs/quickstart.md: no output block after 'actorproxy run'"
    return block.group(1).splitlines()


def test_the_quickstart_shows_what_run_prints(tmp_path: Path) -> None:
    """docs/quickstart.md's start-up output is what a plain ``actorproxy run`` prints, line for line
    (its defaults: ./actorproxy-data; the time stamp left out, the port 8800). The first run, which
    builds the tokenizer cache, prints the same lines."""
    env = {k: v for k, v in os.environ.items() if k != "ACTORPROXY_STORE"}
    process = subprocess.Popen([sys.executable, "-m", "actorproxy", "run", "--port", "0"], cwd=tmp_path,
                               stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = lines_through(process.stderr, "  try:")
    finally:
        process.terminate()
        process.communicate(timeout=60)
    port = re.search(r"serving on http://127\.0\.0\.1:(\d+)", "".join(lines)).group(1)  # type: ignore[union-attr]
    printed = [re.sub(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", "", line.rstrip("\n")).replace(f":{port}", ":8800")
               for line in lines]
    assert _quickstart_block() == printed
