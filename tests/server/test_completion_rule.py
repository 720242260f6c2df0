"""Who may complete a trajectory, grade it and hand it to training, per auth mode (docs/security.md's table).

One test per row of the table. The rule: with an admin token configured, nothing
without it sets a reward or hands a trajectory to training; an agent completes
only its own trajectory and never grades it. Without an admin token every
trainer route is open (the proxy then listens on loopback only).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx
import pytest

from actorproxy import ProxyConfig, open_proxy
from actorproxy.sim import SimConfig, SimEngine

ADMIN = "s3cret-admin"
API_KEY = "k-123"
HI = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@attrs.frozen
class Proxy:
    """A running proxy, the trainer's headers and the agents' credentials."""

    http: httpx.AsyncClient
    trainer: dict[str, str]
    agent_auth: str


@pytest.fixture
async def engine(tokenizer: Any) -> SimEngine:
    return SimEngine(tokenizer, SimConfig(seed=3, token_interval=0.0002))


@asynccontextmanager
async def _proxy(engine: SimEngine, tokenizer: Any, **settings: Any) -> AsyncIterator[Proxy]:
    config = ProxyConfig.of(port=0, **settings)
    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            trainer = {"Authorization": f"Bearer {ADMIN}"} if settings.get("admin_token") else {}
            yield Proxy(http, trainer, "api-key" if settings.get("api_key") else config.security.agent_auth)


def _agent_headers(proxy: Proxy, key: str | None) -> dict[str, str]:
    """What an agent sends: its session key, the static API key, or nothing."""
    if proxy.agent_auth == "session-key":
        return {"Authorization": f"Bearer {key}"} if key else {}
    if proxy.agent_auth == "api-key":
        return {"Authorization": f"Bearer {API_KEY}"}
    return {}


async def _rollout(proxy: Proxy, prompt: str = "p") -> dict[str, Any]:
    """The trainer opens a trajectory; its agent runs one turn on the base URL."""
    init = await proxy.http.post("/init_trajectory", json={"prompt_uid": prompt}, headers=proxy.trainer)
    assert init.status_code == 200, init.text
    trajectory: dict[str, Any] = init.json()
    turn = await proxy.http.post(trajectory["base_url"] + "/v1/chat/completions", json=HI,
                                 headers=_agent_headers(proxy, trajectory["api_key"]))
    assert turn.status_code == 200, turn.text
    return trajectory


async def _queued(proxy: Proxy) -> list[tuple[str, float | None]]:
    """The trajectories handed to training (drained), with their rewards."""
    batch = await proxy.http.post("/trajectory/fetch_batch", json={"groups": 10, "rollouts_per_group": 1,
                                                                    "timeout_s": 0}, headers=proxy.trainer)
    assert batch.status_code == 200, batch.text
    return [(t["trajectory_id"], t["reward"]) for g in batch.json()["data"] for t in g["trajectories"]]


async def _live(proxy: Proxy, session_id: str) -> bool:
    return (await proxy.http.get(f"/session/{session_id}", headers=proxy.trainer)).status_code == 200


def _refused(response: httpx.Response, code: str) -> None:
    assert response.status_code == 401, response.text
    assert response.json()["error"]["code"] == code


# -- no settings: open -----------------------------------------------------------------------


async def test_open_anyone_completes_grades_and_hands_over(engine: SimEngine, tokenizer: Any) -> None:
    async with _proxy(engine, tokenizer) as proxy:
        mine = await _rollout(proxy)
        done = await proxy.http.post(mine["base_url"] + "/v1/complete_trajectory", json={"reward": 1.0})
        assert done.status_code == 200 and done.json()["queued_for_training"], done.text
        assert await _queued(proxy) == [(mine["trajectory_uid"], 1.0)]
        health = (await proxy.http.get("/health")).json()
        assert health["access"] == "open"  # says so to anyone who asks


# -- --admin-token ---------------------------------------------------------------------------


async def test_admin_token_an_agent_without_it_completes_nothing(engine: SimEngine, tokenizer: Any) -> None:
    async with _proxy(engine, tokenizer, admin_token=ADMIN) as proxy:
        victim = await _rollout(proxy)
        for body in ({"reward": 1.0}, {}, {"channel": "train"}):
            for url in (victim["base_url"], proxy.http.base_url.join(f"/sess/{victim['trajectory_uid']}")):
                response = await proxy.http.post(f"{url}/v1/complete_trajectory", json=body)
                _refused(response, "admin_token_required")
        assert await _live(proxy, victim["trajectory_uid"])  # not finalized
        assert await _queued(proxy) == []
        done = await proxy.http.post(victim["base_url"] + "/v1/complete_trajectory", json={"reward": 0.25},
                                     headers=proxy.trainer)
        assert done.status_code == 200 and done.json()["queued_for_training"], done.text
        assert await _queued(proxy) == [(victim["trajectory_uid"], 0.25)]
        assert (await proxy.http.get("/health", headers=proxy.trainer)).json()["access"] == "admin-token"


async def test_admin_token_registering_a_channel_is_the_trainers(engine: SimEngine, tokenizer: Any) -> None:
    async with _proxy(engine, tokenizer, admin_token=ADMIN) as proxy:
        held = await _rollout(proxy)
        response = await proxy.http.post(held["base_url"] + "/v1/register_trajectory", json={"channel": "train"})
        _refused(response, "admin_token_required")
        ok = await proxy.http.post(held["base_url"] + "/v1/register_trajectory", json={"channel": "validate"},
                                   headers=proxy.trainer)
        assert ok.status_code == 200, ok.text


# -- --api-key -------------------------------------------------------------------------------


async def test_api_key_alone_trainer_routes_stay_open(engine: SimEngine, tokenizer: Any) -> None:
    async with _proxy(engine, tokenizer, api_key=API_KEY) as proxy:
        mine = await _rollout(proxy)
        done = await proxy.http.post(mine["base_url"] + "/v1/complete_trajectory", json={"reward": 1.0},
                                     headers=_agent_headers(proxy, None))
        assert done.status_code == 200 and done.json()["queued_for_training"], done.text
        assert (await proxy.http.get("/health")).json()["access"] == "open"


async def test_api_key_with_admin_token_the_key_grades_nothing(engine: SimEngine, tokenizer: Any) -> None:
    async with _proxy(engine, tokenizer, api_key=API_KEY, admin_token=ADMIN) as proxy:
        victim = await _rollout(proxy)
        for body in ({"reward": 1.0}, {}):
            response = await proxy.http.post(victim["base_url"] + "/v1/complete_trajectory", json=body,
                                             headers=_agent_headers(proxy, None))
            _refused(response, "admin_token_required")
        assert await _live(proxy, victim["trajectory_uid"])
        assert await _queued(proxy) == []


# -- --agent-auth session-key ----------------------------------------------------------------


async def test_session_key_an_agent_completes_only_its_own_without_a_reward(
    engine: SimEngine, tokenizer: Any
) -> None:
    async with _proxy(engine, tokenizer, admin_token=ADMIN, agent_auth="session-key") as proxy:
        mine, other = await _rollout(proxy, "p"), await _rollout(proxy, "p")
        own = _agent_headers(proxy, mine["api_key"])
        # Another trajectory, by its base URL or its /sess/ URL: refused.
        for url in (other["base_url"], proxy.http.base_url.join(f"/sess/{other['trajectory_uid']}")):
            _refused(await proxy.http.post(f"{url}/v1/complete_trajectory", json={}, headers=own), "wrong_session")
        # A reward, or a channel, on its own: refused (an agent never grades itself).
        for body in ({"reward": 1.0}, {"reward": 0.0}, {"channel": "train"}):
            response = await proxy.http.post(mine["base_url"] + "/v1/complete_trajectory", json=body, headers=own)
            _refused(response, "admin_token_required")
        # Its own, plainly: accepted as its word that it is done; nothing is finalized or handed over.
        done = await proxy.http.post(mine["base_url"] + "/v1/complete_trajectory", json={}, headers=own)
        assert done.status_code == 200, done.text
        assert done.json()["status"] == "awaiting_trainer" and not done.json()["queued_for_training"]
        assert await _live(proxy, mine["trajectory_uid"]) and await _queued(proxy) == []
        # The trainer completes it with the reward: finalized and handed over.
        graded = await proxy.http.post(f"/complete_trajectory/{mine['trajectory_uid']}", json={"reward": 0.5},
                                       headers=proxy.trainer)
        assert graded.json()["queued_for_training"] and graded.json()["steps"] == 1
        stored = await proxy.http.post("/trajectory/read", json={"session_id": mine["trajectory_uid"]},
                                       headers=proxy.trainer)
        assert [s["reward"] for s in stored.json()["data"]] == [0.5]  # on its segment too
        assert await _queued(proxy) == [(mine["trajectory_uid"], 0.5)]
        assert await _live(proxy, other["trajectory_uid"])


async def test_session_key_without_admin_token_an_agent_still_never_grades(
    engine: SimEngine, tokenizer: Any
) -> None:
    async with _proxy(engine, tokenizer, agent_auth="session-key") as proxy:
        mine = await _rollout(proxy)
        own = _agent_headers(proxy, mine["api_key"])
        response = await proxy.http.post(mine["base_url"] + "/v1/complete_trajectory", json={"reward": 1.0},
                                         headers=own)
        _refused(response, "admin_token_required")
        response = await proxy.http.post(mine["base_url"] + "/v1/complete_trajectory", json={"reward": 1.0})
        _refused(response, "missing_api_key")
        done = await proxy.http.post(mine["base_url"] + "/v1/complete_trajectory", json={}, headers=own)
        assert done.json()["status"] == "awaiting_trainer"
        # No admin token: the trainer's own routes are open (to anyone on loopback), as /health says.
        assert (await proxy.http.get("/health")).json()["access"] == "open"
        graded = await proxy.http.post(f"/complete_trajectory/{mine['trajectory_uid']}", json={"reward": 1.0})
        assert graded.json()["queued_for_training"], graded.text
        assert await _queued(proxy) == [(mine["trajectory_uid"], 1.0)]
