"""The specifying systems' command lines and environment variables, unchanged, start actorproxy."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from actorproxy.cli import build_parser, config_from_args, main
from actorproxy.config import ProxyConfig, recompute_logprobs_from_env
from actorproxy.sim.server import RunningSim, open_sim_server
from actorproxy.sim.state import SimServerSettings, served_engine
from actorproxy.tokenization.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parents[2]

#: The Dressage proxy's example command line (seed 003, "Starting the Proxy"), after its program name.
DRESSAGE = (
    "--tokenizer-path {tokenizer} --sglang-router-url {engine} --trajectory-build-model qwen3_5 "
    "--context-window 32768 --no-dynamic-max-tokens --rollout-temperature 1.0 --record-token-versions "
    "--mask-nonlast-version-tokens --dressage-partial-rollout --tool-call-parse-backend sglang_api "
    "--reasoning-parse-backend sglang_api --model-tool-call-type qwen3_5 --model-reasoning-type qwen3"
)
#: Dressage's build-mode example (seed 003, "Configuration").
DRESSAGE_BUILD = (
    "--tokenizer-path {tokenizer} --trajectory-build-mode concat --trajectory-build-model qwen3_5 --tito-model qwen3_5"
)
#: The Claw-R1 gateway's (seed 000, "Starting the Gateway"), after ``python -m claw_r1.gateway.gateway``.
GATEWAY = (
    "--data-pool-name data_pool --vllm-addresses {engine},{engine} --tokenizer-path {tokenizer} "
    "--prompt-length 4096 --response-length 1024"
)


def _args(line: str, **values: str) -> list[str]:
    return line.format(**values).split()


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Hugging Face tokenizer directory (the built-in qwen3 one, saved), standing in for the seed's path."""
    directory = tmp_path_factory.mktemp("Qwen3.5-4B")
    load_tokenizer().hf.save_pretrained(str(directory))
    return str(directory)


@pytest.fixture
async def engine(tokenizer: Any) -> AsyncIterator[RunningSim]:
    settings = SimServerSettings(port=0, engine=served_engine(token_interval=0.0005))
    async with open_sim_server(settings, tokenizer=tokenizer) as sim:
        yield sim


async def _serve_and_run_one_turn(argv: list[str], env: dict[str, str], cwd: Path) -> dict[str, Any]:
    """``actorproxy run ARGV`` as a process in ``cwd``: one turn, finalize, read; then SIGTERM. Returns the segment.

    ``cwd`` is the test's own directory: the default ``--data-dir`` is ``./actorproxy-data``, and a store
    shared with other runs would hand back their recovered segments too.
    """
    command = [sys.executable, "-m", "actorproxy", "run", *argv]
    process = await trio.lowlevel.open_process(
        command, stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO), **env}, cwd=cwd
    )
    assert process.stderr is not None
    log = b""
    try:
        with trio.fail_after(120):
            while (found := re.search(rb"serving on (http://\S+)", log)) is None:
                chunk = await process.stderr.receive_some(4096)
                assert chunk, f"actorproxy exited before serving:\n{log.decode()}"
                log += chunk
        url = found.group(1).decode()
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            turn = await http.post(
                "/v1/chat/completions",
                headers={"X-Session-Id": "seed-1"},
                json={"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 24},
            )
            assert turn.status_code == 200, turn.text
            assert (await http.post("/session/finalize", json={"session_id": "seed-1"})).status_code == 200
            read = await http.post("/trajectory/read", json={"session_id": "seed-1", "include_steps": True})
            assert read.status_code == 200, read.text
            data: dict[str, Any] = read.json()
    finally:
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(30):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()
    assert len(data["data"]) == 1 and len(data["steps"]) == 1
    return {**data["data"][0], "log": log.decode()}


async def test_the_dressage_command_line(engine: RunningSim, tokenizer_dir: str, tmp_path: Path) -> None:
    segment = await _serve_and_run_one_turn(
        _args(DRESSAGE, tokenizer=tokenizer_dir, engine=engine.url), {"ACTORPROXY_PORT": "0"}, tmp_path
    )
    assert sum(segment["loss_mask"]) > 0 and len(segment["token_ids"]) == len(segment["versions"])
    assert "--trajectory-build-model qwen3_5" in segment["log"]


@pytest.mark.heavy
@pytest.mark.ray
async def test_the_gateway_command_line(engine: RunningSim, tokenizer_dir: str, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    argv = _args(GATEWAY, tokenizer=tokenizer_dir, engine=engine.url)
    # Ray's socket paths must stay under 108 bytes: its temporary directory is a short one of its own.
    ray_tmp = tempfile.mkdtemp(prefix="ap-ray-", dir="/tmp")
    try:
        env = {"ACTORPROXY_PORT": "0", "ACTORPROXY_STORE": "", "RAY_NAMESPACE": "", "TMPDIR": ray_tmp}
        segment = await _serve_and_run_one_turn(argv, env, tmp_path)  # segments go to the Ray pool 'data_pool'
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert sum(segment["loss_mask"]) > 0
    assert "--data-pool-name data_pool" in segment["log"]


def test_what_the_seed_command_lines_set(tokenizer_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = build_parser()
    argv = ["run", *_args(DRESSAGE, tokenizer=tokenizer_dir, engine="http://router:30000")]
    config = config_from_args(parser.parse_args(argv), argv)
    assert config.engines.backend == "sglang" and config.engines.backend_urls == ("http://router:30000",)
    assert config.parsing.tool_call_format == "qwen3_coder" and config.parsing.reasoning_format == "qwen3"
    assert config.parsing.parse_backend == "sglang_api"
    assert config.preemption.partial_rollout and config.trajectory.mask_nonlast_version_tokens
    assert config.limits.context_window == 32768 and not config.limits.dynamic_max_tokens
    assert config.limits.rollout_temperature == 1.0 and config.server.port == 8800

    argv = ["run", *_args(DRESSAGE_BUILD, tokenizer=tokenizer_dir)]
    monkeypatch.setenv("SGLANG_ROUTER_URL", "http://router:8000")  # Dressage's variable names its engine
    config = config_from_args(parser.parse_args(argv), argv)
    assert config.trajectory.tito_model == "qwen3_5" and config.trajectory.trajectory_build_mode == "concat"
    assert config.engines.backend == "sglang" and config.engines.backend_urls == ("http://router:8000",)

    argv = ["run", *_args(GATEWAY, tokenizer=tokenizer_dir, engine="http://h:8001")]
    config = config_from_args(parser.parse_args(argv), argv)
    assert config.store.store_kind == "ray" and config.store.data_pool == "data_pool"
    assert config.engines.backend == "vllm" and config.engines.backend_urls == ("http://h:8001", "http://h:8001")
    assert config.limits.max_prompt_tokens == 4096 and config.limits.default_max_tokens == 1024
    assert config.server.port == 8100  # the gateway's default port, when started with its command line
    argv += ["--port", "9"]
    assert config_from_args(parser.parse_args(argv), argv).server.port == 9


def test_an_explicit_tool_call_type_beats_the_inferred_one() -> None:
    parser = build_parser()
    argv = ["run", "--sglang-router-url", "http://r:1", "--model-tool-call-type", "qwen3", "--trajectory-build-model",
            "qwen3_5"]
    assert config_from_args(parser.parse_args(argv), argv).parsing.tool_call_format == "qwen3"


def test_the_seeds_environment_variables(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert recompute_logprobs_from_env({"HARBOR_RECOMPUTE_MISMATCH_LOGPROBS": "0"}) is False
    assert recompute_logprobs_from_env({"HARBOR_RECOMPUTE_MISMATCH_LOGPROBS": "1"}) is True
    monkeypatch.setenv("HARBOR_RECOMPUTE_MISMATCH_LOGPROBS", "0")
    assert ProxyConfig.of().trajectory.recompute_logprobs is False
    monkeypatch.setenv("DRESSAGE_PROXY_MAX_STEPS_PER_SESSION", "3")
    parser = build_parser()
    assert config_from_args(parser.parse_args(["run"])).limits.max_steps_per_session == 3
    monkeypatch.setenv("DRESSAGE_PROXY_MAX_STEPS_PER_SESSION", "many")
    assert main(["run"]) == 2
    assert "$DRESSAGE_PROXY_MAX_STEPS_PER_SESSION: expected a number" in capsys.readouterr().err


def test_help_groups_the_compatibility_flags() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["run"].format_help()  # type: ignore[union-attr]
    compat = help_text[help_text.index("compatibility") :]
    for flag in ("--sglang-router-url", "--vllm-addresses", "--trajectory-build-model", "--tito-model",
                 "--dressage-partial-rollout", "--response-length", "--prompt-length", "--data-pool-name"):
        assert flag in compat, flag


async def test_the_prompt_length_guard(tokenizer: Any) -> None:
    from actorproxy import open_proxy
    from actorproxy.sim import SimConfig, SimEngine

    engine = SimEngine(tokenizer, SimConfig(seed=1, token_interval=0.0005))
    async with open_proxy(ProxyConfig.of(port=0, max_prompt_tokens=40), backend=engine, tokenizer=tokenizer) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url, timeout=30) as http:
            headers = {"X-Session-Id": "p"}
            short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
            assert (await http.post("/v1/chat/completions", json=short, headers=headers)).status_code == 200
            long = {"messages": [{"role": "user", "content": "word " * 60}], "max_tokens": 8}
            refused = await http.post("/v1/chat/completions", json=long, headers={"X-Session-Id": "q"})
            assert refused.status_code == 400
            assert refused.json()["error"]["code"] == "context_overflow"
            assert "--max-prompt-tokens" in refused.json()["error"]["message"]
