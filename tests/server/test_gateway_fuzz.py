"""Generated bad requests to every gateway route: never a 5xx, always OpenAI's error format."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from _util import proxy_in_thread
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from actorproxy import ProxyConfig

HELLO = [{"role": "user", "content": "hello"}]
STEP = {"trajectory_uid": "fz-ext", "prompt_uid": "p", "prompt_ids": [1, 2, 3], "response_ids": [4, 5],
        "reward": 1.0, "step_index": 0, "policy_version": 1, "is_last": False, "metadata": {"k": "v"}}
VALID: dict[str, dict[str, Any]] = {
    "/generate": {"trajectory_uid": "fz", "prompt_uid": "p", "messages": HELLO, "max_tokens": 4},
    "/generate?ids": {"prompt_ids": [9707, 11], "sampling_params": {"max_tokens": 4, "seed": 1}},
    "/compute_reward?ids": {"prompt_ids": [9707], "response_ids": [13], "dataset_fields": {"ground_truth": "4"}},
    "/submit_steps": {"steps": [STEP]},
    "/compute_reward": {"trajectory_uid": "fz", "messages": HELLO, "dataset_fields": {"ground_truth": "4"}},
    "/init_trajectory": {"prompt_uid": "p", "channel": "train", "metadata": {}},
    "/complete_trajectory/fz": {"reward": 1.0, "channel": "train"},
    "/fz/p/v1/register_trajectory": {"channel": "validate", "metadata": {}},
    "/fz/p/v1/complete_trajectory": {},
    "/trajectory/fetch_batch": {"groups": 1, "rollouts_per_group": 1, "timeout_s": 0},
}
FIELDS = ["trajectory_uid", "prompt_uid", "messages", "max_tokens", "temperature", "steps", "prompt_ids",
          "response_ids", "step_index", "reward", "is_last", "metadata", "channel", "dataset_fields", "groups",
          "rollouts_per_group", "tools", "stop", "unknown", "policy_version", "rollout_log_probs", "sampling_params",
          "num_turns", "seed"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**20), max_value=10**20),
                    st.floats(allow_nan=False), st.text(max_size=12),
                    st.sampled_from(["\udc80", "", "a/b", "x" * 300, 2**31, 2**63, -1, -1e300, "v99999999999"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=6)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, bytes]:
    path = draw(st.sampled_from(sorted(VALID)))
    kind = draw(st.sampled_from(["mutate", "mutate", "mutate", "step", "json", "bytes", "empty"]))
    if kind == "bytes":
        body = draw(st.binary(max_size=48))
    elif kind == "empty":
        body = b""
    elif kind == "json":
        body = json.dumps(draw(values)).encode()
    else:
        data = copy.deepcopy(VALID[path])
        target = data["steps"][0] if kind == "step" and path == "/submit_steps" else data
        if draw(st.booleans()) and target:
            target.pop(draw(st.sampled_from(sorted(target))))
        else:
            target[draw(st.sampled_from(FIELDS))] = draw(values)
        if path == "/trajectory/fetch_batch":
            data["timeout_s"] = 0  # a long poll would only slow the run down
        body = json.dumps(data).encode()
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "PUT"]))
    return method, path, body


@pytest.fixture(scope="module")
def live_proxy(tokenizer: Any) -> Iterator[str]:
    with proxy_in_thread(tokenizer, ProxyConfig.of(port=0, reward_fn="gsm8k"), seed=3) as url:
        yield url


def test_generated_bad_gateway_requests_never_5xx(live_proxy: str) -> None:
    seen: dict[int, int] = {}
    with httpx.Client(base_url=live_proxy, timeout=60) as http:

        @settings(max_examples=400, derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck))
        @given(requests())
        def one(request: tuple[str, str, bytes]) -> None:
            method, path, body = request
            response = http.request(method, path, content=body if method != "GET" else None)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            assert response.status_code < 500, (method, path, body[:300], response.text[:500])
            # A session that could not handle a request met an exception nothing expected: a bug, however it answers.
            assert "could not handle this request" not in response.text, (method, path, body[:300], response.text)
            if response.status_code >= 400:
                error = response.json()["error"]
                assert isinstance(error["message"], str) and error["type"] and error["code"], error

        one()
        # The cases reached the routes. Hypothesis's derandomized draw still depends on the tests run
        # before it in the process: 22 of the 400 cases succeed alone, 18 after the Dressage and
        # SGLang contract tests (a different draw, not a different answer).
        assert seen.get(200, 0) >= 10 and seen.get(400, 0) > 100, sorted(seen.items())
        assert http.get("/health").status_code == 200
