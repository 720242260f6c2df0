"""Operating it: /metrics in Prometheus' format, one log line per request (text or JSON)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from actorproxy.logs import JsonFormatter
from actorproxy.sim import SimConfig, SimEngine

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 12}


@pytest.fixture
async def engine(tokenizer: Any) -> SimEngine:
    """This module's engine (conftest's ``proxy`` and ``http`` serve it)."""
    return SimEngine(tokenizer, SimConfig(seed=2, token_interval=0.0005))


async def _metrics(http: httpx.AsyncClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = await http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


async def test_counters_move_as_turns_run(http: httpx.AsyncClient) -> None:
    before = await _metrics(http)
    chat = ("actorproxy_turns_total", (("route", "/v1/chat/completions"), ("status", "200")))
    assert chat not in before
    for i in range(3):
        response = await http.post("/v1/chat/completions", json=CHAT, headers={"X-Session-Id": f"m{i}"})
        assert response.status_code == 200
    stream = {**CHAT, "stream": True}
    async with http.stream("POST", "/v1/chat/completions", json=stream, headers={"X-Session-Id": "m9"}) as r:
        async for _ in r.aiter_bytes():
            pass
    bad = await http.post("/v1/chat/completions", json={"messages": "nope"}, headers={"X-Session-Id": "m0"})
    assert bad.status_code == 400
    await http.post("/session/finalize", json={"session_id": "m0"})

    after = await _metrics(http)
    assert after[chat] == 4
    assert after[("actorproxy_turns_total", (("route", "/v1/chat/completions"), ("status", "400")))] == 1
    sampled = after[("actorproxy_sampled_tokens_total", ())]
    assert 4 <= sampled <= 4 * 12
    assert after[("actorproxy_prompt_tokens_total", ())] > 4 * 5
    ttft = ("actorproxy_time_to_first_token_seconds_count", (("route", "/v1/chat/completions"),))
    assert after[ttft] >= 1  # the streamed turn (and the others: their replies also arrive as pieces)
    latency = ("actorproxy_request_duration_seconds_count", (("route", "/v1/chat/completions"),))
    assert after[latency] == 5
    assert after[("actorproxy_active_sessions", ())] == 3  # m1, m2, m9 (m0 was finalized)
    assert after[("actorproxy_store_segments", ())] == 1
    assert after[("actorproxy_segments_by_close_reason_total", (("reason", "finalize"),))] == 1
    assert after[("actorproxy_paused", ())] == 0
    requests = ("actorproxy_requests_total", (("method", "GET"), ("route", "/metrics"), ("status", "200")))
    assert after[requests] == 1  # the first scrape


async def test_pause_state_and_ack_time(http: httpx.AsyncClient) -> None:
    assert (await http.post("/v1/rollout/pause", json={"mode": "abort"})).status_code == 200
    paused = await _metrics(http)
    assert paused[("actorproxy_paused", ())] == 1
    assert paused[("actorproxy_last_pause_ack_seconds", ())] >= 0
    await http.post("/v1/rollout/resume", json={})
    assert (await _metrics(http))[("actorproxy_paused", ())] == 0


async def test_one_access_line_per_request(http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="actorproxy.access")
    ok = await http.post("/v1/chat/completions", json=CHAT, headers={"X-Session-Id": "log-1"})
    assert ok.status_code == 200
    bad = await http.post("/v1/messages", json={"max_tokens": 5}, headers={"X-Session-Id": "log-1"})
    assert bad.status_code == 400
    missing = await http.get("/no/such/route")
    assert missing.status_code == 404
    lines = [r for r in caplog.records if r.name == "actorproxy.access"]
    assert len(lines) == 3
    first, second, third = (r.fields for r in lines)  # type: ignore[attr-defined]
    assert first["method"] == "POST" and first["path"] == "/v1/chat/completions" and first["status"] == 200
    assert first["session"] == "log-1" and first["sampled_tokens"] >= 1 and first["prompt_tokens"] > 0
    assert first["ms"] >= 0
    assert second["status"] == 400 and second["error"] and "sampled_tokens" not in second
    assert third["status"] == 404
    formatted = json.loads(JsonFormatter().format(lines[1]))
    assert formatted["status"] == 400 and formatted["logger"] == "actorproxy.access" and formatted["level"] == "INFO"


async def test_repeated_errors_are_rate_limited(http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="actorproxy.access")
    for _ in range(12):
        assert (await http.post("/v1/chat/completions", json={}, headers={"X-Session-Id": "x"})).status_code == 400
    logged = [r for r in caplog.records if r.name == "actorproxy.access" and getattr(r, "fields", None)]
    assert len(logged) == 5
    metrics = await _metrics(http)
    assert metrics[("actorproxy_turns_total", (("route", "/v1/chat/completions"), ("status", "400")))] == 12


def test_the_request_metrics_expose_what_prometheus_clients_own_counters_and_histograms_would() -> None:
    """Plain numbers, turned into families at scrape time: the same text as prometheus_client's own metrics."""
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from actorproxy.server.request_metrics import RequestMetrics

    buckets = (0.001, 0.01, 0.1, 1, 10)
    values = [0.0, 0.001, 0.0010001, 0.01, 0.5, 1.0, 10, 11, 1e9]  # on the bounds, between them, past the last
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    metrics = RequestMetrics(buckets)
    ours.register(metrics)
    requests = Counter("actorproxy_requests", "HTTP requests by route, method and status",
                       ["route", "method", "status"], registry=theirs)
    latency = Histogram("actorproxy_request_duration_seconds", "Time from request to last byte, by route",
                        ["route"], buckets=buckets, registry=theirs)
    for n, value in enumerate(values):
        route = f"/r{n % 2}"
        metrics.request(route, "POST", "200", value)
        requests.labels(route, "POST", "200").inc()
        latency.labels(route).observe(value)

    def text(registry: CollectorRegistry) -> set[str]:
        return {line for line in generate_latest(registry).decode().splitlines()
                if "_created" not in line and ("actorproxy_requests" in line or "duration" in line)}

    assert text(ours) == text(theirs)


async def test_every_metric_label_is_bounded_whatever_the_client_sends(http: httpx.AsyncClient) -> None:
    """Made-up methods and paths add no series (issue 28 §9: 20,000 methods grew /metrics to 5.5 MB)."""
    for i in range(40):
        await http.request(f"M{i}X", "/health")
        await http.request(f"Q{i}", f"/made/up/{i}", content=b"{}")
        await http.post(f"/v1/nowhere/{i}", json={})
        await http.get(f"/s{i}/p/v1/chat/completions")
    samples = await _metrics(http)
    methods = {dict(labels).get("method") for name, labels in samples if name == "actorproxy_requests_total"}
    assert methods <= {"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE", "other"}
    assert "other" in methods
    routes = {dict(labels)["route"] for name, labels in samples if "route" in dict(labels)}
    assert not any("made" in route or "nowhere" in route or route.startswith("/s1") for route in routes), routes
    statuses = {dict(labels)["status"] for name, labels in samples if "status" in dict(labels)}
    assert all(len(status) == 3 and status.isdigit() for status in statuses), statuses
    assert len(samples) < 400, len(samples)  # 160 odd requests: a few series, not one per method or path


@pytest.mark.parametrize("shape", ["openai", "anthropic"])
def test_a_server_side_failure_says_what_failed_in_its_access_line(
    shape: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A 5xx's line carries its message (``detail=``, quoted in text); a refusal's (4xx) does not: its caller has it."""
    import time

    from actorproxy.errors import BadRequest, EngineError
    from actorproxy.logs import TextFormatter
    from actorproxy.server.observe import Observer
    from actorproxy.server.replies import error_reply
    from actorproxy.telemetry import RequestInfo

    caplog.set_level(logging.INFO, logger="actorproxy.access")
    observer = Observer()
    path = "/v1/messages" if shape == "anthropic" else "/v1/chat/completions"
    for error in (EngineError("inference engine failed: the stream ended"), BadRequest("no messages")):
        failed = error_reply(error, anthropic_shape=shape == "anthropic", method="POST", path=path)
        info = RequestInfo("POST", path, path, time.perf_counter(), status=failed.status, error_code=failed.code,
                           error_detail=failed.detail)
        observer.finish(info)
    failure, refusal = (r for r in caplog.records if r.name == "actorproxy.access")
    assert failure.fields["detail"] == "inference engine failed: the stream ended"  # type: ignore[attr-defined]
    assert re.search(r' status=502 ms=[0-9.]+ error=engine_error detail="inference engine failed: the stream ended"$',
                     TextFormatter().format(failure)), failure.getMessage()
    assert json.loads(JsonFormatter().format(failure))["detail"] == "inference engine failed: the stream ended"
    assert "detail" not in refusal.fields  # type: ignore[attr-defined]
