"""The examples stay true to the code: each runs to success."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


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


def test_embedded_trainer_example_runs(tmp_path: Path) -> None:
    result = _run(str(EXAMPLES / "embedded_trainer.py"), "--trials", "3", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("segment 0 of") == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trial-0", "trial-1", "trial-2"]


def test_dressage_command_line_example_runs() -> None:
    result = _run(str(EXAMPLES / "dressage_command_line.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "segment sess-001#0" in result.stdout and "instance inst-001" in result.stdout


@pytest.mark.parametrize(("script", "expected"), [("gateway_whitebox.py", "acknowledged: 0 segments left"),
                                                  ("gateway_blackbox.py", "queued for training: True")])
def test_gateway_examples_run(script: str, expected: str) -> None:
    result = _run(str(EXAMPLES / script))
    assert result.returncode == 0, result.stdout + result.stderr
    assert expected in result.stdout


def test_leased_drain_example_loses_nothing_to_a_killed_trainer() -> None:
    result = _run(str(EXAMPLES / "leased_drain.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "after the lease ended: ['rollout-1#0', 'rollout-2#0', 'rollout-3#0']" in result.stdout
    assert "acknowledged: 0 segments left" in result.stdout


def test_durable_store_example_recovers_after_sigkill() -> None:
    result = _run(str(EXAMPLES / "durable_store.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "boundary_reason=recovered" in result.stdout and "exited with 0" in result.stdout


def test_token_ids_rollout_example_builds_the_recorded_segment() -> None:
    result = _run(str(EXAMPLES / "token_ids_rollout.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "turn 1: prompt " in result.stdout  # a tool loop of several turns
    assert "the agent's ids, loss mask and logprobs equal the segment's" in result.stdout


def test_sampling_extensions_example_shapes_each_reply() -> None:
    result = _run(str(EXAMPLES / "sampling_extensions.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "held off: " in result.stdout
    assert "each field shaped the reply as asked, and each step records it" in result.stdout


def test_side_calls_example_runs() -> None:
    result = _run(str(EXAMPLES / "side_calls.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("side call: 1 step(s), steps [0]") == 1 and result.stdout.count("  main: ") == 1
    assert "/sub-1#0  sub-agent: 2 step(s)" in result.stdout
    assert "sub-agent turn 1: session side-calls-" in result.stdout
    assert '"side_call_segments": 1' in result.stdout and "turn 0 logprobs:" in result.stdout
    assert "turn 0 top_logprobs of the first token: 2, " in result.stdout


@pytest.mark.heavy
@pytest.mark.ray
def test_ray_data_pool_example_feeds_one_trainer_from_two_replicas() -> None:
    pytest.importorskip("ray")
    result = _run(str(EXAMPLES / "ray_data_pool.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "from 2 replicas, 3 groups fetched" in result.stdout and "0 leases open" in result.stdout
    assert "replicas exited with [0, 0]" in result.stdout  # SIGTERM drains a --store ray proxy: exit 0


def test_several_workers_example_runs() -> None:
    result = _run(str(EXAMPLES / "several_workers.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "8 segments of 8 sessions, one each" in result.stdout and "exited with 0" in result.stdout
    assert "pause: paused on 2 workers" in result.stdout


def test_training_adapters_example_runs() -> None:
    result = _run(str(EXAMPLES / "training_adapters.py"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "batch: 6 rows" in result.stdout and "sampled at temperature 0.8" in result.stdout
    for trainer in ("verl", "slime", "openrlhf", "skyrl", "trl"):
        assert f"\n{trainer}: " in result.stdout


def _example_env(**changes: str) -> dict[str, str]:
    """This environment without the suite's ACTORPROXY_STORE=memory (the example runs as a user runs it)."""
    env = {k: v for k, v in os.environ.items() if k != "ACTORPROXY_STORE"}
    return {**env, **changes}


def test_dressage_example_runs_beside_a_readme_proxy(tmp_path: Path) -> None:
    """A proxy started as the README says holds ./actorproxy-data; the example keeps its data elsewhere."""
    held = tmp_path / "actorproxy-data"
    held.mkdir()
    with (held / "LOCK").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # what a running 'actorproxy run' holds
        result = subprocess.run([sys.executable, str(EXAMPLES / "dressage_command_line.py")], cwd=tmp_path,
                                capture_output=True, text=True, timeout=300, env=_example_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "segment sess-001#0" in result.stdout


def test_dressage_example_shows_why_a_server_exited(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, str(EXAMPLES / "dressage_command_line.py")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300, env=_example_env(ACTORPROXY_STORE="bogus"))
    assert result.returncode != 0
    assert "exited with 2 before serving" in result.stderr, result.stderr
    assert "bogus" in result.stderr, result.stderr  # the child's own error line


def _train_on_cpu() -> Any:
    """``examples/train_on_cpu.py`` as a module (its plot needs no engine)."""
    spec = importlib.util.spec_from_file_location("train_on_cpu", EXAMPLES / "train_on_cpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Two iterations as the loop reports them, a mismatch of 0 (no place on a log axis) included.
_RL_ROWS = [{"iteration": i, "reward": r, "reward_min": r - 0.2, "reward_max": r + 0.1, "reward_std": 0.05,
             "mean_abs": m, "max_abs": 4 * m, "older_tokens": o, "tokens": 512}
            for i, (r, m, o) in enumerate([(0.6, 2.5e-7, 0), (0.8, 0.0, 300)])]


def test_train_on_cpu_plots_reward_and_mismatch_as_a_png(tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image", reason='the plot needs matplotlib: pip install -e ".[rl]"')
    example = _train_on_cpu()
    path = tmp_path / "loop.png"
    said = example.write_plot(path, _RL_ROWS, "tiny-qwen3-untied, syncs: abort/keep")
    assert said == f"plot {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width = image.imread(path).shape[:2]  # a PNG matplotlib reads back, of the figure's size
    assert (width, height) == (800, 750)


def test_train_on_cpu_says_how_to_install_matplotlib_when_it_is_missing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    example = _train_on_cpu()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # ``import matplotlib`` raises ImportError
    path = tmp_path / "loop.png"
    said = example.write_plot(path, _RL_ROWS, "title")
    assert said == 'plot: not written, matplotlib is not installed (pip install -e ".[rl]")'
    assert not path.exists()
