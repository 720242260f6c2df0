"""Sampled tokens onto a step (``core/attempts.py: record_tokens``): a token alone and runs record alike."""

from __future__ import annotations

from array import array

import pytest

from actorproxy.core.attempts import record_tokens
from actorproxy.core.records import Step


def _step() -> Step:
    return Step(index=0, session_id="s", segment_index=0, turn_id="t", instance_id=None, new_messages=[],
                message_count=1, prompt_len=3, fragment_ids=array("i", [1, 2, 3]), max_new_tokens=64)


def test_tokens_alone_in_runs_and_as_tuples_record_the_same_ids_logprobs_and_versions() -> None:
    step = _step()
    record_tokens(step, [7], [-0.5], "v1")  # alone (a streamed token's list)
    record_tokens(step, (8,), (-0.25,), "v1")  # alone (a TokenDelta's tuples)
    record_tokens(step, [9, 10, 11], [-1.0, -2.0, -3.0], "v2")  # a run, of another version
    record_tokens(step, [], [], "v2")  # nothing
    record_tokens(step, [12], [0.0], "")  # alone, no label
    assert list(step.output_ids) == [7, 8, 9, 10, 11, 12]
    assert list(step.output_logprobs) == [-0.5, -0.25, -1.0, -2.0, -3.0, 0.0]
    assert list(step.output_versions) == [1, 1, 2, 2, 2, 0]
    assert step.version_labels == {1: "v1", 2: "v2"}
    assert step.weight_version == "" and step.first_token_at is not None


def test_a_token_that_is_no_int_is_refused_alone_as_in_a_run() -> None:
    for ids in (["x"], ["x", "y"]):
        with pytest.raises(TypeError):
            record_tokens(_step(), ids, [-0.5] * len(ids), "v1")  # type: ignore[arg-type]
