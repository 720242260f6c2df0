"""The proxy embedded in asyncio and synchronous programs, and per-trial trajectory files."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from _util import READ_TOOL

from actorproxy import start_proxy
from actorproxy.client import load_trajectory_file
from actorproxy.embed import EmbeddedProxyError
from actorproxy.serve import primary_ipv4
from actorproxy.trajectory_file import trajectory_path

openai = pytest.importorskip("openai")

FAST = {"sim_token_interval": 0.0005}
TOOL = READ_TOOL


def _proxy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "actorproxy"]


def _check_file(root: Path, trial: str, read: dict[str, Any]) -> None:
    document = load_trajectory_file(trajectory_path(root, trial).parent)
    assert document["session_id"] == trial
    assert document["segments"] == read["data"]  # ids, masks, logprobs, versions: exactly the store's
    assert [s["step_index"] for s in document["steps"]] == [s["step_index"] for s in read["steps"]]
    assert all("output_ids" not in s and "concat_token_ids" not in s for s in document["steps"])
    assert not [p for p in trajectory_path(root, trial).parent.iterdir() if p.name.endswith(".tmp")]


async def _trial(client: Any, turns: int) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Look at setup.py, then summarise it."}]
    for _ in range(turns):
        reply = await client.chat.completions.create(model="m", messages=messages, tools=[TOOL], max_tokens=48)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "setup(name='x')"})
        if not message.tool_calls:
            messages.append({"role": "user", "content": "And the tests?"})


def test_an_asyncio_trainer_runs_two_trials(tmp_path: Path) -> None:
    async def trainer() -> tuple[dict[str, Any], dict[str, Any]]:
        async with start_proxy(trajectory_dir=str(tmp_path), **FAST) as proxy:
            assert proxy.url.startswith(f"http://{primary_ipv4()}:")
            # The trainer's routes are guarded by the embedding's own admin token.
            async with httpx.AsyncClient() as outsider:
                assert (await outsider.get(proxy.url + "/trajectory/stats")).status_code == 401
            clients = [openai.AsyncOpenAI(base_url=proxy.session_url(t), api_key="-") for t in ("a:1", "b 2")]
            await asyncio.gather(_trial(clients[0], 3), _trial(clients[1], 2))
            for client in clients:
                await client.close()
            finals = await asyncio.gather(proxy.afinalize("a:1", reward=1.0), proxy.afinalize("b 2"))
            assert all(f["trajectory_file"] for f in finals)
            return await proxy.aread("a:1"), await proxy.aread("b 2")

    first, second = asyncio.run(trainer())
    assert _proxy_threads() == []
    assert len(first["steps"]) == 3 and len(second["steps"]) == 2
    assert first["data"][0]["reward"] == 1.0
    for segment in first["data"] + second["data"]:
        assert len(segment["token_ids"]) == len(segment["loss_mask"]) == len(segment["logprobs"])
    _check_file(tmp_path, "a:1", first)
    _check_file(tmp_path, "b 2", second)
    assert trajectory_path(tmp_path, "a:1").parent.name == "a%3A1"


def test_a_synchronous_script(tmp_path: Path) -> None:
    with start_proxy(host="127.0.0.1", trajectory_dir=str(tmp_path), agent_auth="session-key", **FAST) as proxy:
        access = proxy.session("trial-7")
        assert access.api_key and access.base_url + "/v1" == access.openai_base_url
        with openai.OpenAI(base_url=access.openai_base_url, api_key=access.api_key) as client:
            reply = client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=16
            )
        assert reply.choices[0].message.role == "assistant"
        with openai.OpenAI(base_url=proxy.session_url("trial-8"), api_key=access.api_key) as client:
            with pytest.raises(openai.AuthenticationError):  # another trial's URL with this key
                client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(ValueError, match="without '/'"):
            proxy.session_url("a/b")
        summary = proxy.finalize("trial-7", reward=0.5)
        assert summary["steps"] == 1
        read = proxy.read("trial-7")
        _check_file(tmp_path, "trial-7", read)
        with pytest.raises(EmbeddedProxyError, match="HTTP 404"):
            proxy.finalize("never-ran")
    assert _proxy_threads() == []
    with pytest.raises(EmbeddedProxyError, match="not running"):
        proxy.read("trial-7")


def test_a_start_up_failure_reaches_the_caller(tmp_path: Path) -> None:
    with pytest.raises(EmbeddedProxyError, match="failed to start"):
        start_proxy(host="127.0.0.1", tokenizer_path=str(tmp_path / "no-such-tokenizer"))
    assert _proxy_threads() == []
