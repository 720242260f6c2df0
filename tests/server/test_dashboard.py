"""GET /sessions and the /ui dashboard, loaded in a real headless browser."""

from __future__ import annotations

import re
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from actorproxy import ProxyConfig, open_proxy
from actorproxy.serve import RunningProxy
from actorproxy.sim import SimConfig, SimEngine

ADMIN = {"Authorization": "Bearer dash-token"}
CHAT = {"messages": [{"role": "user", "content": "Tell me about the tests."}], "max_tokens": 16}


@pytest.fixture
async def proxy(tokenizer: Any) -> AsyncIterator[RunningProxy]:
    engine = SimEngine(tokenizer, SimConfig(seed=4, token_interval=0.0005))
    config = ProxyConfig.of(port=0, admin_token="dash-token")
    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running:
        yield running


@pytest.fixture
async def http(proxy: RunningProxy) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=proxy.url, timeout=30, headers=ADMIN) as client:
        yield client


async def _turns(http: httpx.AsyncClient, sessions: dict[str, str | None]) -> None:
    for session, instance in sessions.items():
        headers = {"X-Session-Id": session, **({"X-Instance-Id": instance} if instance else {})}
        response = await http.post("/v1/chat/completions", json=CHAT, headers=headers)
        assert response.status_code == 200, response.text


async def test_sessions_are_listed_paged_and_filtered(http: httpx.AsyncClient) -> None:
    await _turns(http, {"s1": "g1", "s2": "g1", "s3": "g2", "s4": None})
    page = (await http.get("/sessions", params={"limit": 2})).json()
    assert page["total"] == 4 and [r["session_id"] for r in page["data"]] == ["s4", "s3"]
    assert page["data"][0]["state"] == "idle" and page["data"][0]["steps"] == 1
    second = (await http.get("/sessions", params={"limit": 2, "offset": 2})).json()
    assert [r["session_id"] for r in second["data"]] == ["s2", "s1"]
    group = (await http.get("/sessions", params={"instance": "g1"})).json()
    assert group["total"] == 2 and {r["session_id"] for r in group["data"]} == {"s1", "s2"}
    assert (await http.get("/sessions", params={"state": "generating"})).json()["total"] == 0
    for bad in ({"limit": "0"}, {"limit": "x"}, {"state": "asleep"}, {"offset": "-1"}):
        response = await http.get("/sessions", params=bad)
        assert response.status_code == 400 and response.json()["error"]["param"] in bad
    assert (await http.get("/sessions", headers={"Authorization": "Bearer no"})).status_code == 401


async def test_a_session_as_runs_of_tokens_by_loss_mask(http: httpx.AsyncClient, tokenizer: Any) -> None:
    await _turns(http, {"d1": None})
    await http.post("/session/finalize", json={"session_id": "d1"})
    detail = (await http.get("/ui/api/session/d1")).json()
    assert detail["live"] is None
    [segment] = detail["segments"]
    runs = segment["runs"]
    assert [r["mask"] for r in runs] == [0, 1]  # the prompt, then the reply
    assert runs[1]["tokens"] == segment["num_trained_tokens"]
    stored = (await http.post("/trajectory/read", json={"session_id": "d1"})).json()["data"][0]
    assert "".join(r["text"] for r in runs) == tokenizer.decode(stored["token_ids"])
    assert (await http.get("/ui/api/session/nobody")).status_code == 404


def _chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.skip("Debian's chromium is not installed (.ci/run installs it: apt-get install chromium)")
    return found


async def _browser(*args: str, user_data: Path) -> str:
    command = [
        _chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={user_data}", "--virtual-time-budget=8000", *args,
    ]
    result = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    return result.stdout.decode()


@pytest.mark.heavy
@pytest.mark.browser
async def test_the_dashboard_renders_in_a_real_browser(
    proxy: RunningProxy, http: httpx.AsyncClient, tmp_path: Path
) -> None:
    for round_ in range(3):
        await _turns(http, {f"b{i}": "grp" for i in range(round_, round_ + 4)})
    await http.post("/session/finalize", json={"session_id": "b0"})
    assert (await httpx.AsyncClient().get(proxy.url + "/ui")).status_code == 401  # no token, no page
    url = f"{proxy.url}/ui?token=dash-token&session=b0"
    dom = await _browser("--dump-dom", url, user_data=tmp_path / "profile")
    assert 'data-ready="1"' in dom, re.search(r'<header>.*?</header>', dom, re.S)
    points = [int(p) for p in re.findall(r'id="chart-[a-z]+"[^>]*data-points="(\d+)"', dom)]
    assert len(points) == 2 and all(p > 0 for p in points)
    assert int(re.search(r'id="sessions"[^>]*data-rows="(\d+)"', dom).group(1)) == 5  # b1..b5 are live (b0 finalized)
    assert "b5" in dom and "grp" in dom
    assert int(re.search(r'id="recent"[^>]*data-rows="(\d+)"', dom).group(1)) == 1  # b0#0, closed by finalize
    assert "b0#0" in dom
    assert int(re.search(r'id="detail"[^>]*data-segments="(\d+)"', dom).group(1)) == 1
    assert 'class="mask-1"' in dom and 'class="mask-0"' in dom
    shot = tmp_path / "dashboard.png"
    await _browser(f"--screenshot={shot}", "--window-size=1280,1000", url, user_data=tmp_path / "profile2")
    assert shot.stat().st_size > 10_000
    target = trio.Path(__file__).parents[2] / "docs" / "dashboard.png"
    if not await target.exists():  # the README's picture; regenerate by deleting it
        shutil.copyfile(shot, str(target))
