"""Every kind of credential on every route, in every guarded auth mode (issue 28): nothing without
the admin token grades, finalizes or hands over a session, and nothing answers 5xx.

For each mode a real proxy serves a victim agent's live session. Every route that can settle it
(the gateway's included) and the turn and read routes get every credential but the admin token (no
credentials, a wrong token, a forged key, another agent's or the victim's own session key, the
static API key, the admin token as an API key or in a malformed header), each with a valid body and
with its reward, channel or bytes changed: 1,287 requests per mode. The oracle, per request: below 500,
an error in its route's format, and a success on a trainer's route only with the admin token (an
agent's own completion answers ``awaiting_trainer``). At the end the victim's session is live and
unchanged, and nothing reached the hand-off.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _util import proxy_in_thread
from test_fuzz_routes import _check_error_format

from actorproxy import ProxyConfig
from actorproxy.server.auth import AccessPolicy, route_kind

ADMIN = "fuzz-admin-token"
API_KEY = "fuzz-api-key"
HELLO = [{"role": "user", "content": "hello"}]
VICTIM, PROMPT = "victim", "p"

MODES = {
    "admin-token": {"admin_token": ADMIN},
    "admin-token+session-key": {"admin_token": ADMIN, "agent_auth": "session-key"},
    "admin-token+api-key": {"admin_token": ADMIN, "api_key": API_KEY},
}

VALID: dict[str, dict[str, Any]] = {
    f"/{VICTIM}/{PROMPT}/v1/complete_trajectory": {"reward": 1.0},
    f"/sess/{VICTIM}/v1/complete_trajectory": {"reward": 1.0},
    f"/{VICTIM}/{PROMPT}/v1/register_trajectory": {"channel": "train"},
    f"/complete_trajectory/{VICTIM}": {"reward": 1.0, "channel": "train"},
    "/session/finalize": {"session_id": VICTIM, "reward": 1.0},
    "/submit_steps": {"steps": [{"trajectory_uid": VICTIM, "prompt_uid": PROMPT, "prompt_ids": [1],
                                 "response_ids": [2], "step_index": 0, "reward": 1.0, "is_last": True}]},
    "/trajectory/read": {"session_id": VICTIM, "drain": True},
    "/trajectory/fetch_batch": {"groups": 1, "rollouts_per_group": 1, "timeout_s": 0},
    "/init_trajectory": {"prompt_uid": PROMPT},
    "/generate": {"trajectory_uid": VICTIM, "prompt_uid": PROMPT, "messages": HELLO, "max_tokens": 4},
    "/compute_reward": {"trajectory_uid": VICTIM, "messages": HELLO},
    "/v1/rollout/pause": {"mode": "abort"},
    "/v1/rollout/resume": {"weight_version": "9"},
    "/session/open": {"session_id": "opened"},
    # Turns, on another session (a turn on the victim's own is the victim's business).
    "/sess/intruder/v1/chat/completions": {"messages": HELLO, "max_tokens": 4},
    f"/intruder/{PROMPT}/v1/messages": {"model": "m", "messages": HELLO, "max_tokens": 4},
}
#: Routes whose success would grade, finalize, hand over or change the victim's session.
SETTLING = {path for path in VALID if route_kind(path) == "admin"} | {
    f"/{VICTIM}/{PROMPT}/v1/complete_trajectory", f"/sess/{VICTIM}/v1/complete_trajectory"}
GETS = ["/health", f"/session/{VICTIM}", "/trajectory/stats", "/v1/rollout/pause_state", "/sessions"]

keys = AccessPolicy.build(admin_token=ADMIN, agent_auth="session-key")


def _credentials() -> list[tuple[str, dict[str, str]]]:
    """Everything but the admin token itself (whose calls settle the victim by design)."""
    own, other = keys.session_key(VICTIM), keys.session_key("intruder")
    forged = own[:-1] + ("0" if own[-1] != "0" else "1")
    return [
        ("none", {}), ("wrong", {"Authorization": "Bearer nope"}),
        ("own-key", {"Authorization": f"Bearer {own}"}), ("own-key-x", {"x-api-key": own}),
        ("other-key", {"Authorization": f"Bearer {other}"}), ("forged", {"Authorization": f"Bearer {forged}"}),
        ("api-key", {"Authorization": f"Bearer {API_KEY}"}), ("admin-as-x-api-key", {"x-api-key": ADMIN}),
        ("basic", {"Authorization": f"Basic {ADMIN}"}), ("long", {"Authorization": "Bearer " + "a" * 5000}),
        ("two", {"Authorization": f"Bearer {ADMIN} x"}),
    ]


BODY_CHANGES = [("keep", None), ("reward", 0.0), ("reward", "1"), ("no-reward", None), ("channel", "train"),
                ("raw", b"{"), ("raw", b"")]


def _body(path: str, change: str, value: Any) -> bytes:
    """The route's valid body, or one with its reward or channel changed, or raw bytes."""
    if change == "raw":
        return bytes(value)
    body = dict(VALID[path])
    if change == "reward":
        body["reward"] = value
    elif change == "no-reward":
        body.pop("reward", None)
    elif change == "channel":
        body["channel"] = value
    return json.dumps(body).encode()


def _every_call() -> Iterator[tuple[str, str, str, dict[str, str], bytes]]:
    """Every credential on every route with every body change (GETs with none)."""
    for name, headers in _credentials():
        for path in GETS:
            yield name, "GET", path, headers, b""
        for path in sorted(VALID):
            for change, value in BODY_CHANGES:
                yield name, "POST", path, headers, _body(path, change, value)


def _victim(http: httpx.Client, admin: dict[str, str]) -> dict[str, Any]:
    response = http.get(f"/session/{VICTIM}", headers=admin)
    assert response.status_code == 200, response.text
    described: dict[str, Any] = response.json()
    return described


@pytest.fixture(scope="module", params=sorted(MODES))
def guarded(request: pytest.FixtureRequest, tokenizer: Any) -> Iterator[tuple[str, str]]:
    with proxy_in_thread(tokenizer, ProxyConfig.of(port=0, **MODES[request.param]), seed=4) as url:
        yield request.param, url


def test_no_credential_but_the_admin_token_settles_a_session(guarded: tuple[str, str]) -> None:
    mode, url = guarded
    admin = {"Authorization": f"Bearer {ADMIN}"}
    agent = {"Authorization": f"Bearer {keys.session_key(VICTIM)}"} if "session-key" in mode else (
        {"Authorization": f"Bearer {API_KEY}"} if "api-key" in mode else {})
    with httpx.Client(base_url=url, timeout=60) as http:
        turn = http.post(f"/{VICTIM}/{PROMPT}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 8},
                         headers=agent)
        assert turn.status_code == 200, turn.text
        before = _victim(http, admin)
        seen: dict[tuple[str, int], int] = {}
        for name, method, path, headers, body in _every_call():
            response = http.request(method, path, content=body or None,
                                    headers={"content-type": "application/json", **headers})
            seen[name, response.status_code] = seen.get((name, response.status_code), 0) + 1
            assert response.status_code < 500, (mode, name, path, body[:200], response.text[:300])
            if response.status_code >= 400:
                _check_error_format(path, response)
            elif path in SETTLING:
                # Only an agent's own plain completion gets through, and it settles nothing.
                assert name in ("own-key", "own-key-x") and response.json()["status"] == "awaiting_trainer", (
                    mode, name, path, body[:200], response.text[:300])
            if path == "/v1/rollout/pause" and response.status_code == 200:
                assert http.post("/v1/rollout/resume", json={}, headers=admin).status_code == 200
        refused = sum(n for (_, status), n in seen.items() if status == 401)
        assert refused > 200, seen  # the cases reached the checks
        # The victim's session: live, and exactly as it was; nothing handed over.
        assert _victim(http, admin) == before
        batch = http.post("/trajectory/fetch_batch", json={"groups": 5, "rollouts_per_group": 1, "timeout_s": 0},
                          headers=admin).json()
        assert batch["data"] == []
        assert http.get("/health").status_code == 200
