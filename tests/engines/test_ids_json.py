"""A long prompt's JSON from the kept text of a prompt it extends: always the bytes orjson writes for it whole."""

from __future__ import annotations

import random
from array import array

import numpy as np
import orjson

from actorproxy.engines.connection import json_body
from actorproxy.engines.ids_json import MIN_IDS, IdsJSON


def whole(ids: array[int]) -> bytes:
    return orjson.dumps(np.frombuffer(ids, dtype=ids.typecode), option=orjson.OPT_SERIALIZE_NUMPY)


def ids_of(n: int, rng: random.Random) -> array[int]:
    return array("i", (rng.randrange(-(2**31), 2**31) if rng.random() < 0.01 else rng.randrange(200_000)
                       for _ in range(n)))


def test_a_session_growing_turn_by_turn_is_written_from_its_kept_prefix() -> None:
    rng = random.Random(1)
    kept = IdsJSON()
    prompt = ids_of(MIN_IDS - 10, rng)
    for turn in range(40):
        prompt = prompt + ids_of(rng.choice([0, 1, 7, 300, 5000]), rng)
        assert kept.text(prompt) == whole(prompt), turn
    assert len(kept) == 1  # each turn's prompt replaced the one it extended


def test_sessions_that_share_their_start_each_extend_their_own() -> None:
    rng = random.Random(2)
    kept = IdsJSON()
    start = ids_of(3 * MIN_IDS, rng)
    sessions = [start + ids_of(50 + i, rng) for i in range(5)]
    for _ in range(3):
        for i, prompt in enumerate(sessions):
            assert kept.text(prompt) == whole(prompt)
            sessions[i] = prompt + ids_of(20, rng)
    assert len(kept) == 5


def test_a_prompt_that_differs_anywhere_is_written_whole() -> None:
    rng = random.Random(3)
    kept = IdsJSON()
    prompt = ids_of(2 * MIN_IDS, rng)
    assert kept.text(prompt) == whole(prompt)
    for at in (0, 1, MIN_IDS - 1, MIN_IDS, len(prompt) - 1):
        changed = prompt + ids_of(10, rng)
        changed[at] += 1
        assert kept.text(changed) == whole(changed)
    shorter = prompt[:-1]  # a prefix of a kept prompt, not an extension of it
    assert kept.text(shorter) == whole(shorter)
    assert kept.text(prompt) == whole(prompt)  # the same prompt again (a retry)


def test_short_prompts_and_other_arrays_are_not_kept() -> None:
    kept = IdsJSON()
    assert kept.text(array("i", range(MIN_IDS - 1))) == whole(array("i", range(MIN_IDS - 1)))
    assert kept.text(array("i")) == b"[]"
    assert kept.text(array("q", range(MIN_IDS))) == whole(array("q", range(MIN_IDS)))
    assert len(kept) == 0


def test_what_is_kept_stays_within_its_bytes() -> None:
    rng = random.Random(4)
    one = ids_of(MIN_IDS, rng)
    size = len(one.tobytes()) + len(whole(one))
    kept = IdsJSON(max_bytes=3 * size)
    prompts = [ids_of(MIN_IDS, rng) for _ in range(6)]
    for prompt in prompts:
        assert kept.text(prompt) == whole(prompt)
    assert len(kept) <= 3
    for prompt in prompts:  # the oldest were dropped: written whole again, the same bytes
        longer = prompt + array("i", [1, 2, 3])
        assert kept.text(longer) == whole(longer)


def test_engine_bodies_are_the_bytes_orjson_writes_whatever_they_hold() -> None:
    rng = random.Random(5)
    prompt = ids_of(MIN_IDS + 3, rng)
    other = ids_of(2 * MIN_IDS, rng)
    for turn in range(4):
        body = {"input_ids": prompt, "rid": f"r{turn}", "stop": ["\0", "a\0b"], "lp": array("f", [0.5, -1.0]),
                "nested": {"ids": other, "few": array("i", [1, 2])}, "text": "\0" * turn}
        expected = orjson.dumps(body, default=lambda v: np.frombuffer(v, dtype=v.typecode),
                                option=orjson.OPT_SERIALIZE_NUMPY)
        assert json_body(body) == expected
        prompt = prompt + ids_of(turn * 3, rng)
        other = other + ids_of(1, rng)
