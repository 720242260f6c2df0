"""Weight versions whose number passes 32 bits (a step count, a timestamp in milliseconds) are recorded whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from actorproxy import ProxyConfig, open_proxy
from actorproxy.core.records import CONTEXT_VERSION, Step, float_array, int_array, version_array, version_number
from actorproxy.sim import SimConfig, SimEngine
from actorproxy.store.codec import decode_step, step_blob, step_meta, unpack_arrays

LABEL = "run-20261202183000"  # 20,261,202,183,000: past 2**31, well inside 64 bits
USER = [{"role": "user", "content": "hi"}]


async def _turns(tmp_path: Path, tokenizer: Any) -> list[dict[str, Any]]:
    engine = SimEngine(tokenizer, SimConfig(seed=3, token_interval=0.0))
    config = ProxyConfig.of(port=0, store_kind="sqlite", data_dir=str(tmp_path))
    async with open_proxy(config, backend=engine, tokenizer=tokenizer) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            await http.post("/v1/rollout/pause", json={})
            assert (await http.post("/v1/rollout/resume", json={"weight_version": LABEL})).status_code == 200
            first = await http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 3},
                                    headers={"X-Session-Id": "wide"})
            assert first.status_code == 200, first.text
            await http.post("/session/finalize", json={"session_id": "wide"})
            read = await http.post("/trajectory/read", json={"session_id": "wide"})
            data: list[dict[str, Any]] = read.json()["data"]
            return data


async def test_a_version_past_32_bits_is_recorded_and_read_back_whole(tmp_path: Path, tokenizer: Any) -> None:
    """A trainer naming its weights by a timestamp: every turn failed ("the session could not handle this request",
    an OverflowError of the 32-bit version array). Now the tokens carry the number, from the store and after a
    restart (the segment's versions are kept in 64 bits only when they need them)."""
    [segment] = await _turns(tmp_path, tokenizer)
    sampled = {v for v, m in zip(segment["versions"], segment["loss_mask"], strict=True) if m}
    assert sampled == {20261202183000}
    assert set(segment["versions"]) == {CONTEXT_VERSION, 20261202183000}
    engine = SimEngine(tokenizer, SimConfig(seed=3))
    async with open_proxy(ProxyConfig.of(port=0, store_kind="sqlite", data_dir=str(tmp_path)), backend=engine,
                          tokenizer=tokenizer) as running:
        async with httpx.AsyncClient(base_url=running.url, timeout=30) as http:
            again = (await http.post("/trajectory/read", json={"session_id": "wide"})).json()["data"]
    assert again[0]["versions"] == segment["versions"]


def test_a_number_past_64_bits_is_no_number() -> None:
    assert version_number("step-" + "9" * 30) == 0 and version_number(2**63) == 0
    assert version_number(2**63 - 1) == 2**63 - 1 and version_number("v-12") == 12


def test_a_journaled_step_keeps_its_wide_versions_and_narrow_ones_stay_32_bit() -> None:
    """What crash recovery reads back: the step's versions as recorded; 32-bit on disk when they fit."""
    for versions, stored in (([20261202183000, 20261202183000], "q"), ([4, 5], "i")):
        step = Step(index=0, session_id="s", segment_index=0, turn_id=None, instance_id=None, new_messages=[],
                    message_count=1, prompt_len=2, fragment_ids=int_array([9707, 11]), max_new_tokens=2,
                    output_ids=int_array([13, 14]), output_logprobs=float_array([-0.5, -0.25]),
                    output_versions=version_array(versions), status="completed")
        blob = step_blob(step)
        assert unpack_arrays(blob)[3].typecode == stored
        back = decode_step(step_meta(step), blob)
        assert back.output_versions.tolist() == versions and back.output_versions.typecode == "q"
