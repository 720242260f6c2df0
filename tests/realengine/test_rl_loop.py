"""The whole RL loop on the real vLLM: ``examples/train_on_cpu.py``, short, as a user runs it.

The example starts its own dev-mode vLLM (the tiny Qwen3 with its own output layer, float32),
plays agents through the embedded proxy, trains with torch in the vLLM venv, and reloads the
weights into vLLM in place four times, the syncs taking turns in how they stop the turns in
flight (abort with partial rollout, keep frozen in vLLM); the batch played across the last sync
is fetched and checked too. Then it stops vLLM. What it holds the loop to:

* the mismatch: every sampled token's logprob recomputed by the trainer at the weights that
  sampled it is within 1e-3 of the recorded one on average and 1e-2 at most (both float32), the
  agents sampling at temperature 0.8: the trainer divides its logits by the temperature the batch
  says its steps were sampled at, and vLLM reports the logprobs of that tempered distribution
  (``--logprobs-mode processed_logprobs``; its default would be off by the temperature);
* no token lost or sampled twice across any weight sync: every turn, those cut by a sync of
  either mode included, holds exactly the tokens its agent received (their count, their text),
  and the batches hold every token vLLM generated in the run (its own counter), no more;
* the versions in the batches are the versions vLLM reported on ``/weight_info`` after each sync.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from realengine_util import REPO
from vllm_util import VLLMInstall

pytestmark = [pytest.mark.heavy, pytest.mark.vllm]

EXAMPLE = REPO / "examples" / "train_on_cpu.py"
ITERATIONS = 4
PROMPTS, GROUP, TURNS = 2, 4, 2
#: Longer turns than the example's default: more of them are in flight when a sync comes.
MAX_TOKENS = 32
#: Not 1: the recorded sampling, the trainer's temperature and vLLM's logprobs must agree.
TEMPERATURE = 0.8


@pytest.mark.timeout(1800)  # vLLM's start-up (1.5-3 minutes on 2 busy cores) and four iterations
def test_rl_loop_on_the_real_vllm(vllm_install: VLLMInstall, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    args = [sys.executable, str(EXAMPLE), "--vllm-python", str(vllm_install.python),
            "--iterations", str(ITERATIONS), "--prompts", str(PROMPTS), "--group", str(GROUP),
            "--max-tokens", str(MAX_TOKENS), "--sync-mode", "both", "--temperature", str(TEMPERATURE),
            "--work-dir", str(tmp_path / "work"), "--plot", str(tmp_path / "loop.png"), "--report", str(report)]
    done = subprocess.run(args, capture_output=True, text=True, timeout=1700, cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    result = json.loads(report.read_text())
    rows = result["iterations"]
    # N trained iterations and the batch played across the last sync (checked, not trained on).
    assert [row["iteration"] for row in rows] == list(range(ITERATIONS + 1))
    assert [row["sync"] for row in rows] == ["abort", "keep"] * (ITERATIONS // 2) + [None], rows
    # Every batch says it was sampled at the agents' temperature: each step recorded it.
    assert {row["temperature"] for row in rows} == {TEMPERATURE}, rows
    for row in rows:
        # The mismatch, at the weights that sampled each token (the trainer holds the last two versions).
        assert row["checked_tokens"] > 0 and row["checked_tokens"] + row["unchecked"] == row["tokens"], row
        assert row["mean_abs"] <= 1e-3 and row["max_abs"] <= 1e-2, row
        # Nothing lost or twice: every turn is the agent's, to the token.
        assert row["turns"] == row["exact"] == PROMPTS * GROUP * TURNS, row
        assert row["lost"] == row["dup"] == 0, row
    # Both kinds of sync stopped turns in flight (aborted, or frozen in vLLM), and those came out whole too.
    assert sum(row["aborted"] for row in rows if row["sync"] == "abort") > 0, rows
    assert sum(row["in_flight"] for row in rows if row["sync"] == "keep") > 0, rows
    cut = {mode: sum(row["cut"].get(mode, 0) for row in rows) for mode in ("abort", "keep")}
    assert cut["abort"] > 0 and cut["keep"] > 0, cut
    # Every token vLLM generated in the run is in a batch, once: none lost at a sync, none sampled twice.
    tokens = result["tokens"]
    assert tokens["generated_by_vllm"] == tokens["in_batches"] > 0, tokens
    # The versions are the engine's: vLLM reported each after its sync, and the batches carry only those.
    reported = result["engine_versions"]
    assert reported == {str(v): str(v) for v in range(ITERATIONS + 1)}, reported
    for row in rows:
        assert set(row["versions_in_batch"]) <= {int(v) for v in reported.values()}, row
        assert max(row["versions_in_batch"]) <= row["version"], row  # no token of weights not yet synced
    # Every version a trained iteration synced sampled tokens that reached a batch. (The last sync's may
    # not: the turns it cut can all have been at their last token, so the closing batch holds none of it;
    # a run asserting it failed once so.)
    assert set(range(ITERATIONS)) <= {v for row in rows for v in row["versions_in_batch"]}, rows
    # The plot: a real PNG (matplotlib, the `rl` extra; without it the example says so and writes none).
    plot = tmp_path / "loop.png"
    assert plot.is_file(), done.stdout[-2000:]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "reward" in done.stdout and "mean|d|" in done.stdout
