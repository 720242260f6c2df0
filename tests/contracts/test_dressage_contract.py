"""The Dressage proxy's wire contract (Accio-Lab/Dressage at de8e869), served with ``--api-dialect dressage``.

The cases of Dressage's own ``tests/test_proxy.py`` HTTP tests (finalize idempotent, discard, read and drain,
context overflow 413, the usage chunk before ``[DONE]``, the health config, capabilities, pause/resume with a
reason), and what its rollout clients read: their requests, replies, records and statuses, written from those
facts. The launch lines are those of its example scripts (``PROXY_ARGS``).
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from _asgi import open_app_client
from _proxyproc import ProxyProcess

from actorproxy import ProxyConfig, open_proxy
from actorproxy.cli import build_parser, config_from_args
from actorproxy.serve import RunningProxy
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.sim.server import open_sim_server
from actorproxy.sim.state import SimServerSettings, served_engine
from actorproxy.tokenization.tokenizer import ChatTokenizer

REPO = Path(__file__).resolve().parents[2]

#: ``PROXY_ARGS`` of run_alfworld_whitebox_agent_qwen3.5_4b_partial_rollout_async.sh with its defaults filled in.
WHITE_BOX = (
    "--sglang-router-url {router} --tokenizer-path {tokenizer} --host 0.0.0.0 --port {port} "
    "--model-mask-type qwen3_5 --model-tool-call-type qwen3_5 --tool-call-parse-backend sglang_api "
    "--model-reasoning-type qwen3 --reasoning-parse-backend sglang_api --token-build-mode tito "
    "--rollout-temperature 1.0 --tito-model qwen3_5 --record-token-versions --mask-nonlast-version-tokens "
    "--dressage-partial-rollout --mask-nonlast-version-tokens"
)
#: ``PROXY_ARGS`` of run_blackbox_qwen3.5_4b_partial_rollout_async_local.sh (the router comes from
#: ``SGLANG_ROUTER_URL``, which dressage_env_defaults.sh exports).
BLACK_BOX = (
    "--tokenizer-path {tokenizer} --host 0.0.0.0 --port {port} --token-build-mode tito --token-build-model qwen3_5 "
    "--rollout-temperature 1.0 --dressage-partial-rollout --context-window 32768 --record-token-versions "
    "--mask-nonlast-version-tokens"
)
USER = [{"role": "user", "content": "go"}]


@pytest.fixture
async def engine(tokenizer: ChatTokenizer) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=3, token_interval=0.0005))


def _dressage(**settings: Any) -> ProxyConfig:
    return ProxyConfig.of(port=0, api_dialect="dressage", trajectory_build_mode="concat", tito_model="qwen3",
                          **settings)


@pytest.fixture
async def proxy(engine: SimEngine, tokenizer: ChatTokenizer) -> AsyncIterator[RunningProxy]:
    async with open_proxy(_dressage(context_window=4096), backend=engine, tokenizer=tokenizer) as running:
        yield running


async def _turn(http: httpx.AsyncClient, session: str, instance: str = "inst", **body: Any) -> httpx.Response:
    headers = {"X-Session-Id": session, "X-Instance-Id": instance}
    return await http.post("/v1/chat/completions", headers=headers,
                           json={"model": "fake-model", "messages": USER, "max_tokens": 16, **body})


async def test_finalize_is_idempotent_and_marks_a_complete_segment_set(http: httpx.AsyncClient) -> None:
    assert (await _turn(http, "final-once", "instance-once")).status_code == 200
    payload = {"session_id": "final-once", "instance_id": "instance-once", "label": {"answer": 42}}
    first = await http.post("/session/finalize", json=payload)
    second = await http.post("/session/finalize", json=payload)
    assert first.status_code == second.status_code == 200
    assert second.json() == first.json()
    answer = first.json()
    assert answer["success"] is True and answer["trajectory_id"] == "final-once"
    assert answer["instance_id"] == "instance-once"
    assert (answer["num_steps"], answer["num_turns"], answer["num_segments"]) == (1, 1, 1)
    assert answer["history_rewritten"] is False and answer["token_build_mode"] == "tito"
    read = await http.post("/trajectory/read", json={"trajectory_id": "final-once", "instance_id": "instance-once"})
    (segment,) = read.json()["data"]
    assert segment["segment_index"] == 0 and segment["segment_count"] == 1
    assert segment["label"] == {"answer": 42}
    assert segment["extra_info"]["finalization_complete"] is True
    assert segment["extra_info"]["finalization_id"] == answer["finalization_id"]
    assert segment["extra_info"]["segment_view"] == "lineage"


async def test_discard_removes_a_finalized_session_idempotently(http: httpx.AsyncClient) -> None:
    assert (await _turn(http, "discard-me")).status_code == 200
    assert (await http.post("/session/finalize", json={"session_id": "discard-me"})).status_code == 200
    first = await http.post("/session/discard", json={"session_id": "discard-me"})
    second = await http.post("/session/discard", json={"session_id": "discard-me"})
    assert first.status_code == second.status_code == 200
    assert first.json()["success"] is True
    assert (first.json()["session_removed"], first.json()["segments_removed"]) == (True, 1)
    assert (second.json()["session_removed"], second.json()["segments_removed"]) == (False, 0)
    gone = await http.post("/trajectory/read", json={"trajectory_id": "discard-me"})
    assert gone.status_code == 200 and gone.json()["data"] == [] and gone.json()["success"] is False


async def test_discard_removes_an_unfinalized_session(http: httpx.AsyncClient) -> None:
    assert (await _turn(http, "discard-active")).status_code == 200
    answer = (await http.post("/session/discard", json={"session_id": "discard-active"})).json()
    assert (answer["session_removed"], answer["segments_removed"]) == (True, 0)
    assert (await http.post("/session/finalize", json={"session_id": "discard-active"})).status_code == 404
    refused = await http.post("/session/discard", json={"sesion_id": "x"})
    assert refused.status_code == 400


async def test_read_with_drain_removes_the_exact_trajectory(http: httpx.AsyncClient) -> None:
    assert (await _turn(http, "drain-sess", "drain-inst")).status_code == 200
    await http.post("/session/finalize", json={"session_id": "drain-sess", "instance_id": "drain-inst"})
    other = await http.post("/trajectory/read", json={"trajectory_id": "drain-sess", "instance_id": "elsewhere",
                                                      "drain": True})
    assert other.json()["success"] is False and other.json()["data"] == []
    drained = await http.post("/trajectory/read", json={"trajectory_id": "drain-sess", "instance_id": "drain-inst",
                                                        "drain": True, "segment_view": "lineage"})
    assert drained.status_code == 200
    body = drained.json()
    assert body["success"] is True and body["drained"] is True and body["mode"] == "trajectory"
    assert "meta_info" in body and len(body["data"]) == 1
    second = await http.post("/trajectory/read", json={"trajectory_id": "drain-sess", "instance_id": "drain-inst"})
    assert second.status_code == 200
    assert second.json()["success"] is False and second.json()["data"] == []
    timeline = await http.post("/trajectory/read", json={"trajectory_id": "drain-sess", "segment_view": "timeline"})
    assert timeline.status_code == 400
    steps = await http.post("/trajectory/read", json={"trajectory_id": "drain-sess", "include_steps": True})
    assert steps.status_code == 400 and "messages" in steps.json()["error"]["message"]  # not ignored: refused


async def test_a_record_is_what_dressages_samples_consume(http: httpx.AsyncClient, tokenizer: ChatTokenizer) -> None:
    first = await _turn(http, "rec", "g1")
    reply = first.json()["choices"][0]["message"]
    follow = [*USER, {"role": "assistant", "content": reply["content"]}, {"role": "user", "content": "again"}]
    assert (await _turn(http, "rec", "g1", messages=follow)).status_code == 200
    await http.post("/session/finalize", json={"session_id": "rec", "instance_id": "g1", "label": "42"})
    (record,) = (await http.post("/trajectory/read", json={"trajectory_id": "rec", "instance_id": "g1",
                                                          "drain": True})).json()["data"]
    n = len(record["tokens"])
    assert n == len(record["full_loss_mask"]) == len(record["full_logprobs"]) == len(record["full_versions"])
    assert set(record["full_loss_mask"]) == {0, 1}
    start = record["full_loss_mask"].index(1)
    assert record["aligned_response_length"] == n - start
    assert set(record["full_versions"][:start]) == {"-1"}  # the prompt: not sampled
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "user", "assistant"]
    assert record["messages"][1]["content"] == reply["content"]
    assert record["uid"] == "rec#0" and record["trajectory_id"] == record["session_id"] == "rec"
    assert record["instance_id"] == "g1" and record["label"] == "42" and record["finish_reason"] in ("stop", "length")
    assert record["extra_info"]["mask_nonlast_version_tokens"] is False
    assert tokenizer.decode(record["tokens"][:start]).startswith("<|im_start|>")


async def test_versions_are_the_engines_labels(http: httpx.AsyncClient) -> None:
    resumed = await http.post("/v1/rollout/resume", json={"version": "weights-v7"})
    assert resumed.status_code == 200 and resumed.json()["version"] == "weights-v7"
    assert (await _turn(http, "ver")).status_code == 200
    await http.post("/session/finalize", json={"session_id": "ver"})
    (record,) = (await http.post("/trajectory/read", json={"trajectory_id": "ver"})).json()["data"]
    trained = {v for v, m in zip(record["full_versions"], record["full_loss_mask"], strict=True) if m}
    assert trained == {"weights-v7"}  # the label, not its trailing digits
    assert record["full_versions"][0] == "-1"


async def test_context_overflow_is_a_413_with_a_top_level_code(engine: SimEngine, tokenizer: ChatTokenizer) -> None:
    async with open_proxy(_dressage(context_window=8), backend=engine, tokenizer=tokenizer) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            response = await _turn(http, "sess-input-overflow", max_tokens=4, messages=[{"role": "user",
                                                                                         "content": "hi"}])
            body = response.json()
            assert response.status_code == 413
            assert body["error"] == "context_overflow" and body["code"] == "context_overflow"
            assert body["details"]["phase"] == "input"
            assert body["details"]["last_proxy_step_recorded"] is False
            assert body["details"]["max_tokens"] == 4


async def test_a_stream_ends_with_a_usage_chunk_before_done(http: httpx.AsyncClient) -> None:
    async def stream(session: str, **extra: Any) -> list[str]:
        body = {"model": "fake-model", "stream": True, "messages": USER, "max_tokens": 8, **extra}
        async with http.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": session}) as r:
            assert r.status_code == 200
            return [line for line in [line async for line in r.aiter_lines()] if line.startswith("data: ")]

    lines = await stream("sess-stream-usage")
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][6:])
    assert usage["choices"] == [] and usage["model"] == "fake-model"
    assert usage["usage"]["prompt_tokens"] > 0 and usage["usage"]["completion_tokens"] > 0
    lines = await stream("sess-stream-no-usage", stream_options={"include_usage": False})
    assert not any('"usage"' in line for line in lines)


async def test_health_reports_dressages_config_block(http: httpx.AsyncClient) -> None:
    health = (await http.get("/health")).json()
    config = health["config"]
    assert config["token_build_mode"] == "tito" and config["token_build_model"] == "qwen3"
    assert config["record_token_versions"] is True and config["mask_nonlast_version_tokens"] is False
    assert config["context_window"] == 4096 and config["dynamic_max_tokens"] is True
    assert config["stream_heartbeat_interval_seconds"] == 10.0 and config["max_output_tokens"] is None
    assert config["rollout_temperature"] == 1.0 and config["partial_rollout"] is False
    assert health["rollout_pause"]["paused"] is False
    assert "engines" in config and "trajectory" in config  # ours, by section, beside it


async def test_capabilities_need_the_token_and_report_the_version(engine: SimEngine, tokenizer: ChatTokenizer) -> None:
    async with open_proxy(_dressage(admin_token="proxy-secret"), backend=engine, tokenizer=tokenizer) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            assert (await http.get("/integration/capabilities")).status_code == 401
            headers = {"Authorization": "Bearer proxy-secret"}
            resumed = await http.post("/v1/rollout/resume", headers=headers, json={"version": "weights-v7"})
            assert resumed.status_code == 200
            result = await http.get("/integration/capabilities", headers=headers)
    assert result.status_code == 200
    caps = result.json()
    assert caps["schema_version"] == "dressage.proxy.integration/v1"
    assert caps["token_build_mode"] == "tito" and caps["token_build_model"] == "qwen3"
    assert caps["tokenizer_id"] == "qwen3" and re.fullmatch("[0-9a-f]{64}", caps["chat_template_fingerprint"])
    assert caps["record_token_versions"] is True and caps["partial_rollout"] is False
    assert caps["current_weight_version"] == caps["cached_weight_version"] == "weights-v7"
    assert caps["weight_version_authoritative"] is True and caps["weight_versions_consistent"] is True
    assert caps["weight_version_source"] == "worker_snapshot" and caps["supports_expected_version"] is True


async def test_pause_and_resume_with_a_reason(http: httpx.AsyncClient) -> None:
    paused = await http.post("/v1/rollout/pause", json={"reason": "weight_update", "timeout_seconds": 300})
    assert paused.status_code == 200
    assert paused.json()["status"] == "paused" and paused.json()["reason"] == "weight_update"
    assert paused.json()["quiesced"] is True
    again = await http.post("/v1/rollout/pause", json={"reason": "weight_update"})
    assert again.json()["status"] == "already_paused"
    state = (await http.get("/v1/rollout/pause_state")).json()
    assert state["paused"] is True and state["reason"] == "weight_update" and state["rollout_epoch"] == 0
    resumed = await http.post("/v1/rollout/resume", json={"reason": "weight_update"})
    assert resumed.status_code == 200 and resumed.json()["status"] == "resumed"
    assert resumed.json()["reason"] == "weight_update" and "rollout_epoch" in resumed.json()
    state = (await http.get("/v1/rollout/pause_state")).json()
    assert state["paused"] is False and state["reason"] is None
    again = await http.post("/v1/rollout/resume", json={"reason": "weight_update"})
    assert again.json()["status"] == "already_running"
    assert (await http.post("/v1/rollout/pause", json={"reason": "x", "timeout_seconds": -1})).status_code == 400


async def test_rollout_invalidation_is_a_502_with_detail_error(http: httpx.AsyncClient) -> None:
    assert (await _turn(http, "stale")).status_code == 200
    await http.post("/v1/rollout/pause", json={"reason": "weight_update"})
    await http.post("/v1/rollout/resume", json={"reason": "weight_update", "version": "8"})
    later = await _turn(http, "stale")
    assert later.status_code == 502
    assert later.json()["detail"]["error"] == "trajectory_version_changed"
    mismatch = await http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4},
                               headers={"X-Session-Id": "expect", "X-Dressage-Expected-Version": "7"})
    assert mismatch.status_code == 502 and mismatch.json()["detail"]["error"] == "weight_version_mismatch"
    ok = await http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 4},
                         headers={"X-Session-Id": "expect", "X-Dressage-Expected-Version": "8"})
    assert ok.status_code == 200


async def test_a_resume_after_a_pause_starts_a_new_rollout_epoch(http: httpx.AsyncClient) -> None:
    # Dressage's trainer resumes without a version: every resume after a pause is a new rollout epoch.
    assert (await _turn(http, "epoch")).status_code == 200
    await http.post("/v1/rollout/pause", json={"reason": "weight_update"})
    resumed = (await http.post("/v1/rollout/resume", json={"reason": "weight_update"})).json()
    assert resumed["rollout_epoch"] == 1
    later = await _turn(http, "epoch")
    assert later.status_code == 502 and later.json()["detail"]["error"] == "trajectory_version_changed"
    again = (await http.post("/v1/rollout/resume", json={"reason": "weight_update"})).json()
    assert again["status"] == "already_running" and again["rollout_epoch"] == 1  # no pause: same epoch


async def test_a_batch_read_hands_out_ready_prompt_groups(engine: SimEngine, tokenizer: ChatTokenizer) -> None:
    async with open_proxy(_dressage(min_group_size=2), backend=engine, tokenizer=tokenizer) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            for session, group in (("a1", "A"), ("a2", "A"), ("b1", "B")):
                assert (await _turn(http, session, group)).status_code == 200
                await http.post("/session/finalize", json={"session_id": session})
            batch = (await http.post("/trajectory/read", json={"max_groups": 5})).json()
            assert batch["mode"] == "batch" and batch["success"] is True
            assert [[r["session_id"] for r in group] for group in batch["data"]] == [["a1", "a2"]]
            left = (await http.post("/trajectory/read", json={"trajectory_id": "b1"})).json()
            assert len(left["data"]) == 1  # the group still filling stays


@pytest.mark.parametrize(("cap", "status"), [(0, 502), (1, 200)])
async def test_the_partial_rollout_preempt_cap(engine: SimEngine, tokenizer: ChatTokenizer, cap: int,
                                               status: int) -> None:
    config = _dressage(partial_rollout=True, max_partial_rollout_preempts=cap)
    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            first = (await _turn(http, "capped")).json()["choices"][0]["message"]
            await http.post("/v1/rollout/pause", json={"reason": "weight_update"})
            await http.post("/v1/rollout/resume", json={"reason": "weight_update", "version": "2"})
            follow = [*USER, {"role": "assistant", "content": first["content"]}, {"role": "user", "content": "on"}]
            later = await _turn(http, "capped", messages=follow)  # its tokens would come from a second version
            assert later.status_code == status
            if status == 502:
                assert later.json()["detail"]["error"] == "partial_rollout_staleness_exceeded"


def _config(line: str, **values: str) -> ProxyConfig:
    argv = ["run", *line.format(**values).split()]
    return config_from_args(build_parser().parse_args(argv), argv)


def test_the_shipped_launch_lines_mean_what_they_say(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_ROUTER_URL", raising=False)
    monkeypatch.delenv("SGLANG_ROUTER_HOST", raising=False)
    config = _config(WHITE_BOX, router="http://router:8000", tokenizer="qwen3", port="8800")
    assert config.engines.backend == "sglang" and config.engines.backend_urls == ("http://router:8000",)
    assert config.server.api_dialect == "dressage" and config.trajectory.trajectory_build_mode == "concat"
    assert config.limits.rollout_temperature is None and config.limits.default_temperature == 1.0
    assert config.preemption.partial_rollout and config.trajectory.mask_nonlast_version_tokens
    assert config.security.insecure and config.server.host == "0.0.0.0"
    with pytest.raises(ValueError, match="never falls back to its simulator"):
        _config(BLACK_BOX, tokenizer="qwen3", port="8800")  # no router anywhere: refused, not simulated
    asked = _config(BLACK_BOX + " --backend sim", tokenizer="qwen3", port="8800")
    assert asked.engines.backend == "sim"  # asked for by name: not a fallback
    monkeypatch.setenv("SGLANG_ROUTER_URL", "http://10.0.0.9:8000")
    config = _config(BLACK_BOX, tokenizer="qwen3", port="8800")
    assert config.engines.backend == "sglang" and config.engines.backend_urls == ("http://10.0.0.9:8000",)
    assert config.trajectory.tito_model == "qwen3_5" and config.parsing.tool_call_format == "qwen3_coder"
    monkeypatch.delenv("SGLANG_ROUTER_URL")
    monkeypatch.setenv("SGLANG_ROUTER_HOST", "10.0.0.8")
    assert _config(BLACK_BOX, tokenizer="qwen3", port="1").engines.backend_urls == ("http://10.0.0.8:8000",)
    assert _config(BLACK_BOX + " --token-build-mode snapshot", tokenizer="qwen3",
                   port="1").trajectory.trajectory_build_mode == "last_step"
    claw = _config(BLACK_BOX.replace("qwen3_5", "qwen3_6") + " --default-max-tokens 512 --api-key no-auth",
                   tokenizer="qwen3", port="1")
    assert claw.trajectory.tito_model == "qwen3_6" and claw.limits.default_max_tokens == 512
    assert claw.security.api_key is None
    keyed = _config(BLACK_BOX + " --api-key k1", tokenizer="qwen3", port="1")
    assert keyed.security.api_key == keyed.security.admin_token == "k1"
    sized = _config(BLACK_BOX + " --min-group-size 4 --group-timeout 60 --session-timeout 3200 "
                    "--max-partial-rollout-preempts 2 --max-output-tokens 2048 "
                    "--stream-heartbeat-interval-seconds 15 --routed-experts-dtype int32 "
                    "--transfer-queue-config q.yaml", tokenizer="qwen3", port="1")
    assert (sized.server.min_group_size, sized.server.group_timeout) == (4, 60.0)
    assert sized.limits.session_ttl == 3200.0 and sized.limits.max_output_tokens == 2048
    assert sized.server.heartbeat_interval == 15.0 and sized.preemption.max_partial_rollout_preempts == 2


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        ("--enable-transfer-queue", "TransferQueue"),
        ("--tool-call-hooks my_hook", "tool-call side-effect hooks"),
        ("--routed-experts-dtype uint8", "int32"),
        ("--stream-heartbeat-interval-seconds 0", "heartbeats"),
    ],
)
def test_a_flag_without_its_capability_is_refused_in_one_line(
    extra: str, why: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SGLANG_ROUTER_URL", "http://10.0.0.9:8000")
    from actorproxy.cli import main

    assert main(["run", *BLACK_BOX.format(tokenizer="qwen3", port="1").split(), *extra.split()]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and why in error[0], error


def test_no_launch_line_of_a_system_without_a_simulator_falls_back_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_ROUTER_URL", raising=False)
    monkeypatch.delenv("SGLANG_ROUTER_HOST", raising=False)
    with pytest.raises(ValueError, match="never falls back to its simulator"):
        _config("--data-pool-name data_pool --tokenizer-path qwen3 --prompt-length 4096 --response-length 1024")
    with pytest.raises(ValueError, match="never falls back to its simulator"):
        _config("--tokenizer-path qwen3 --trajectory-build-model qwen3_5 --tito-model qwen3_5")
    assert _config("--tokenizer-path qwen3").engines.backend == "sim"  # ours: the simulator is its default


def test_the_transfer_queue_variable_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_ROUTER_URL", "http://10.0.0.9:8000")
    monkeypatch.setenv("DRESSAGE_ENABLE_TRANSFER_QUEUE", "1")
    with pytest.raises(ValueError, match="TransferQueue"):
        _config(BLACK_BOX, tokenizer="qwen3", port="1")


async def test_an_open_launch_says_so_in_health(engine: SimEngine, tokenizer: ChatTokenizer) -> None:
    # The config of the launch line (--host 0.0.0.0, no token), served in-process: nothing listens on the network.
    async with open_app_client(engine, tokenizer, _dressage(host="0.0.0.0", insecure=True)) as (_, http):
        assert (await http.get("/health")).json()["access"] == "open"


async def test_the_black_box_launch_starts_unchanged(
    tokenizer: ChatTokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Their PROXY_HOST variable set to loopback (the scripts default it to 0.0.0.0): the line is theirs.
    argv = BLACK_BOX.format(tokenizer="qwen3", port="0").replace("0.0.0.0", "127.0.0.1").split()
    settings = SimServerSettings(port=0, engine=served_engine(token_interval=0.0005))
    async with open_sim_server(settings, tokenizer=tokenizer) as sim:
        monkeypatch.setenv("SGLANG_ROUTER_URL", sim.url)  # what dressage_env_defaults.sh exports
        proxy = ProxyProcess(tmp_path / "proxy.log", *argv)
        try:
            url = await proxy.started()
            async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                health = (await http.get("/health")).json()
                assert health["config"]["sglang_router_url"] == sim.url
                assert health["config"]["token_build_mode"] == "tito"
                assert (await _turn(http, "bb")).status_code == 200
        finally:
            proxy.proc.send_signal(signal.SIGTERM)
            await proxy.wait()
        assert len(sim.state.records) >= 1  # the turn went to the engine SGLANG_ROUTER_URL names
    text = (tmp_path / "proxy.log").read_text()
    assert "--backend sglang --backend-url " + sim.url in text and "api-dialect dressage" in text


def test_with_workers_a_discard_goes_to_the_worker_of_the_session_it_names() -> None:
    from actorproxy.workers.routing import NEED_BODY, body_session, head_session

    assert head_session("/session/discard", {}) == NEED_BODY  # not a session named "discard"
    assert body_session(b'{"session_id": "rollout-7"}', "/session/discard") == "rollout-7"
