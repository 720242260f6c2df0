"""The journal's JSON text (``store.codec.journal_meta``): the values ``dumps`` writes, through orjson when it can.

Recovery reads a journaled step back as values (``json.loads``), so the text may differ
(orjson spells some floats otherwise); the values may not. orjson writes non-finite
floats as ``null`` and refuses what it cannot write: those steps keep the standard
library's text.
"""

from __future__ import annotations

import json
import math
from array import array
from typing import Any

import attrs

from actorproxy.core.messages import AssistantOutput, ToolCall
from actorproxy.core.records import Step
from actorproxy.store.codec import dumps, fast_dumps, journal_meta, step_meta


def _step(**fields: Any) -> Step:
    step = Step(index=3, session_id="s", segment_index=0, turn_id="t-3", instance_id=None,
                new_messages=[{"role": "user", "content": "dé\u2028jà \"vu\"\n\x01 🫠"}], message_count=8,
                prompt_len=120, fragment_ids=array("i", range(20)), max_new_tokens=64)
    step.output_ids.extend(range(4))
    step.output_logprobs.extend([-0.5] * 4)
    step.output_versions.extend([0] * 4)
    step.output = AssistantOutput("It is 42.", "think", (ToolCall("call_1", "f", '{"x": 1e-07}'),))
    step.status, step.finished_at = "completed", 1764253000.1234567
    return attrs.evolve(step, **fields) if fields else step


def _same_values(text: str, step: Step) -> None:
    got, want = json.loads(text), json.loads(dumps(step_meta(step)))
    assert got == want
    assert json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)  # -inf, nan and key order included


def test_a_plain_step_is_journaled_with_the_same_values() -> None:
    step = _step()
    _same_values(journal_meta(step), step)


def test_non_finite_logprobs_of_a_discarded_attempt_stay_non_finite() -> None:
    step = _step()
    step.discarded.append({"output_ids": [1, 2], "output_logprobs": [-math.inf, math.nan], "output_versions": [0, 0],
                           "weight_version": "0"})
    text = journal_meta(step)
    assert "-Infinity" in text and "NaN" in text  # orjson would have written null
    _same_values(text, step)


def test_what_orjson_refuses_goes_through_the_standard_library() -> None:
    big = _step(new_messages=[{"role": "user", "content": "x", "n": 2**70}])
    _same_values(journal_meta(big), big)
    assert fast_dumps({1: "a"}) == dumps({1: "a"}) == '{"1":"a"}'  # a non-string key
