"""Engine request bodies: token arrays serialized whole (orjson over a numpy view) read back exactly."""

from __future__ import annotations

import json
from array import array

import pytest

from actorproxy.engines.connection import json_body


@pytest.mark.parametrize(
    "ids",
    [array("i"), array("i", [0]), array("i", [151645, -1, 2**31 - 1, -(2**31)]), array("i", range(100_000))],
)
def test_token_arrays_read_back_as_the_same_ints(ids: array[int]) -> None:
    body = {"input_ids": ids, "sampling_params": {"temperature": 1.0, "stop_token_ids": [151645]}, "rid": "r1"}
    decoded = json.loads(json_body(body))
    assert decoded["input_ids"] == ids.tolist()
    assert all(type(i) is int for i in decoded["input_ids"])
    assert decoded["sampling_params"] == {"temperature": 1.0, "stop_token_ids": [151645]}
    assert decoded["rid"] == "r1"


def test_float_arrays_keep_their_values() -> None:
    logprobs = array("f", [-0.5, -1.25, 0.0])
    assert json.loads(json_body({"lp": logprobs}))["lp"] == [-0.5, -1.25, 0.0]


def test_other_objects_are_refused() -> None:
    with pytest.raises(TypeError):
        json_body({"x": object()})
