"""Records and replies are attrs classes; their JSON comes from the one wire converter (issue 10 #2, #3)."""

from __future__ import annotations

import tempfile
from array import array

import attrs

from actorproxy.client import ProxyClient, Segment
from actorproxy.core.records import Step, build_segment
from actorproxy.runtime.replies import EngineAck, FinalizeResult, PauseAck
from actorproxy.runtime.store_messages import encode_body
from actorproxy.schema.converter import CONVERTER
from actorproxy.schema.records import StepSummary
from actorproxy.serve import RunningProxy
from actorproxy.sim import SimEngine
from actorproxy.store.base import ReadQuery
from actorproxy.store.memory import MemoryStore
from actorproxy.store.sqlite import SQLiteStore


def _step(index: int, **changes: object) -> Step:
    step = Step(index=index, session_id="s", segment_index=0, turn_id=None, instance_id="g",
                new_messages=[{"role": "user", "content": f"q{index} \u00e9"}], message_count=2 * index + 1,
                prompt_len=3 * index + 3, fragment_ids=array("i", [7, 8, 9]), max_new_tokens=16,
                created_at=1.5, first_token_at=2.5, finished_at=3.5)
    step.output_ids, step.output_logprobs = array("i", [11, 12]), array("f", [-0.25, -1.5])
    step.output_versions = array("q", [4, 4])
    step.status, step.in_segment, step.finish_reason = "completed", True, "stop"
    return attrs.evolve(step, **changes)


def _segment(steps: list[Step]) -> Segment:
    seg = build_segment(steps, session_id="s", instance_id="g", rollout_id="s", segment_index=0,
                        start_reason="session_start", boundary_reason="finalize", reward=0.5)
    return attrs.evolve(seg, created_at=4.5)


def test_a_durable_store_reads_back_the_bytes_the_memory_store_sends() -> None:
    """A SQLite row (JSON text + packed arrays) and a live record unstructure to the same body."""
    steps = [_step(0, routed_experts="AAAA", discarded=[{"output_ids": [1]}]), _step(1, retry_of=0)]
    seg = _segment(steps)
    query = ReadQuery("s", None, False, True)
    memory = MemoryStore()
    memory.put("s", (seg,), tuple(steps))
    live = memory.read(query, encode_body)
    with tempfile.TemporaryDirectory() as directory:
        durable = SQLiteStore(directory, synchronous="OFF")
        durable.put("s", (seg,), tuple(steps))
        durable.commit()
        stored = durable.read(query, encode_body)
        durable.close()
    assert stored == live
    assert live.startswith(b'{"data":[{"trajectory_id":"s#0","parent_traj_id":"s","instance_id":"g","rollout_id":"s",'
                           b'"segment_index":0,"token_ids":[7,8,9,11,12,7,8,9,11,12],"loss_mask":[0,0,0,1,1,0,0,0,1,1]')


def test_a_segment_round_trips_through_its_json() -> None:
    seg = _segment([_step(0), _step(1)])
    data = CONVERTER.unstructure(seg)
    assert (data["num_tokens"], data["num_trained_tokens"], data["num_steps"]) == (10, 4, 2)
    back = CONVERTER.structure(data, Segment)
    assert back.loss_mask.typecode == "b" and back.token_ids == seg.token_ids and back.logprobs == seg.logprobs
    assert CONVERTER.unstructure(back) == data


def test_a_step_summary_counts_its_long_payloads_and_leaves_out_its_arrays() -> None:
    step = _step(0, routed_experts="AAAA", routed_experts_chunks=["A", "B"], discarded=[{"x": 1}, {"x": 2}])
    summary = CONVERTER.unstructure(StepSummary(step))
    full = CONVERTER.unstructure(step)
    assert (summary["routed_experts"], summary["routed_experts_chunks"], summary["discarded"]) == ("...", 2, 2)
    assert "output_ids" not in summary and full["output_ids"] == [11, 12]
    assert full["concat_response_mask"] == [0, 0, 0, 1, 1] and full["concat_versions"] == [-1, -1, -1, 4, 4]
    assert list(summary) == [key for key in full if key in summary]  # the same keys, in the same order


def test_replies_leave_out_what_did_not_happen() -> None:
    assert CONVERTER.unstructure(FinalizeResult("a", segments=1, steps=2)) == {"session_id": "a", "segments": 1,
                                                                              "steps": 2}
    parent = FinalizeResult("a", 1, 2, sub_agents=[FinalizeResult("a/sub-1", 1, 1)], trajectory_file="/t.json")
    assert CONVERTER.unstructure(parent)["sub_agents"] == [{"session_id": "a/sub-1", "segments": 1, "steps": 1}]
    ack = PauseAck(mode="abort", aborted=1, partial_tokens=5, weight_version="3", epoch=0)
    assert list(CONVERTER.unstructure(ack)) == ["status", "mode", "aborted", "partial_tokens", "weight_version",
                                               "epoch"]
    forwarded = attrs.evolve(ack, engines=[EngineAck("sglang", True), EngineAck("vllm", False, "down")])
    assert CONVERTER.unstructure(forwarded)["engines"] == [{"engine": "sglang", "ok": True},
                                                           {"engine": "vllm", "ok": False, "error": "down"}]


async def test_the_client_reads_typed_segments(proxy: RunningProxy, engine: SimEngine) -> None:
    engine.script("Four.", routing_key="typed")
    async with ProxyClient(proxy.url, timeout=30) as client:
        await client.chat_completions({"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 8},
                                      session_id="typed")
        await client.finalize_session("typed", reward=1.0)
        raw = (await client.read_trajectory(session_id="typed"))["data"]
        [segment] = await client.read_segments(session_id="typed")
    assert isinstance(segment, Segment) and isinstance(segment.token_ids, array)
    assert segment.reward == 1.0 and segment.num_trained_tokens == raw[0]["num_trained_tokens"] > 0
    assert CONVERTER.unstructure(segment) == raw[0]
