"""Crash recovery with ``--on-history-rewrite recompute``: a prefix rebuilt in place survives a SIGKILL.

In recompute mode a rewritten history does not close the segment: the next
step's fragment is the whole conversation rebuilt (its earlier replies trained
again), and the steps before it leave the segment. Each pair of sessions runs
the same conversation (the simulated engine's output depends on the prompt
alone): one is finalized before the kill, its twin is left open; after the
restart the twin's recovered segment must be the finalized one's sample.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import trio
from _proxyproc import ProxyProcess

PAIRS = 4
FLAGS = ("--on-history-rewrite", "recompute", "--verify-tito", "--sim-token-interval", "0.001")
_SAMPLE = ("token_ids", "loss_mask", "logprobs", "versions", "step_indices", "start_reason", "num_trained_tokens")


async def _turn(http: httpx.AsyncClient, session: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    reply = await http.post("/v1/chat/completions", headers={"X-Session-Id": session},
                            json={"messages": messages, "max_tokens": 12})
    assert reply.status_code == 200, reply.text
    return dict(reply.json()["choices"][0]["message"])


async def _conversation(http: httpx.AsyncClient, session: str, i: int) -> None:
    """Two turns, a turn over a rewritten history (rebuilt in place), one more turn."""
    first = {"role": "user", "content": f"task {i}: hi"}
    a1 = await _turn(http, session, [first])
    a2 = await _turn(http, session, [first, a1, {"role": "user", "content": "more"}])
    edited = [{"role": "user", "content": f"task {i}: hi (edited)"}, a1, {"role": "user", "content": "more"}, a2,
              {"role": "user", "content": "and more"}]
    a3 = await _turn(http, session, edited)
    await _turn(http, session, [*edited, a3, {"role": "user", "content": "last"}])


async def test_sigkill_in_recompute_mode_recovers_the_rebuilt_segment(tmp_path: Path) -> None:
    data = tmp_path / "data"
    proxy = ProxyProcess(tmp_path / "proxy.log", "--data-dir", str(data), *FLAGS)
    try:
        url = await proxy.started()
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            async with trio.open_nursery() as nursery:
                for i in range(PAIRS):
                    nursery.start_soon(_conversation, http, f"fin{i}", i)
                    nursery.start_soon(_conversation, http, f"open{i}", i)
            for i in range(PAIRS):
                assert (await http.post("/session/finalize", json={"session_id": f"fin{i}"})).status_code == 200
            # Polled (bounded): the journal commits in the proxy's writer thread within ~50 ms of a step's
            # end, and /trajectory/stats is the only sign of it another process can see.
            with trio.fail_after(10):
                while (await http.get("/trajectory/stats")).json()["journal_steps"] < 4 * PAIRS:  # noqa: ASYNC110
                    await trio.sleep(0.02)
            proxy.proc.kill()
            proxy.proc.wait()
    finally:
        proxy.kill()
    restarted = ProxyProcess(tmp_path / "proxy2.log", "--data-dir", str(data), *FLAGS)
    try:
        url = await restarted.started()
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            stored = (await http.post("/trajectory/read", json={"include_steps": True})).json()
            stats = (await http.get("/trajectory/stats")).json()
            # The recovered session goes on in a fresh segment; no step or trajectory id is reused.
            again = await http.post("/v1/chat/completions", headers={"X-Session-Id": "open0"},
                                    json={"messages": [{"role": "user", "content": "new task"}], "max_tokens": 4})
            assert again.status_code == 200
            assert (await http.post("/session/finalize", json={"session_id": "open0"})).status_code == 200
            open0 = (await http.post("/trajectory/read", json={"session_id": "open0", "include_steps": True})).json()
    finally:
        restarted.kill()
    segments = {s["trajectory_id"]: s for s in stored["data"]}
    assert len(segments) == len(stored["data"]) == 2 * PAIRS  # one segment per session: rebuilt in place
    assert stats["recovered_segments"] == PAIRS and stats["recovered_steps"] == 4 * PAIRS
    for i in range(PAIRS):
        finalized, recovered = segments[f"fin{i}#0"], segments[f"open{i}#0"]
        assert finalized["boundary_reason"] == "finalize" and recovered["boundary_reason"] == "recovered"
        assert finalized["metadata"]["rebuilds"] and finalized["metadata"]["verify"]
        for key in _SAMPLE:
            assert recovered[key] == finalized[key], (i, key)
        for key in ("rebuilds", "rebuilt_steps", "recomputed_logprob_spans", "invalid_logprob_spans",
                    "logprobs_invalid"):
            assert recovered["metadata"][key] == finalized["metadata"][key], (i, key)
    steps = [(s["session_id"], s["step_index"]) for s in stored["steps"]]
    assert len(steps) == len(set(steps)) == 8 * PAIRS  # every completed step once
    in_segment = {(s["session_id"], s["step_index"]): s["in_segment"] for s in stored["steps"]}
    for i in range(PAIRS):  # the steps the rebuild replaced left the segment, in both twins
        assert [in_segment[(f"open{i}", n)] for n in range(4)] == [in_segment[(f"fin{i}", n)] for n in range(4)]
    assert [s["trajectory_id"] for s in open0["data"]] == ["open0#0", "open0#1"]
    assert [s["step_index"] for s in open0["steps"]] == [0, 1, 2, 3, 4]
    assert json.dumps(open0["data"][0]) == json.dumps(segments["open0#0"])
