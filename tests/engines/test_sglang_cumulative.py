"""SGLang's cumulative ``/generate`` stream is read in O(new tokens): each event's repeated
prefix is cut as bytes before JSON decoding, and the tokens delivered are exactly the
engine's, whatever the events hold (module ``actorproxy.engines.sglang.cumulative``).

Events are written as SGLang writes them (orjson, keys ``text``, ``output_ids``,
``meta_info``), and also with ``json.dumps``' spaced separators, which the cutter does
not recognise: those are decoded whole and must read the same.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actorproxy.engines.base import BackendError, GenerateFinish, TokenDelta
from actorproxy.engines.sglang.cumulative import PrefixCutter
from actorproxy.engines.sglang.protocol import SGLangStreamParser


def event(ids: list[int], lps: list[float], *, text: str = "", finish: Any = None, count: int | None = None,
          spaced: bool = False) -> bytes:
    meta: dict[str, Any] = {
        "id": "r", "finish_reason": finish, "prompt_tokens": 3, "weight_version": "default",
        "input_token_logprobs": [], "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, lps, strict=True)],
        "completion_tokens": len(ids) if count is None else count, "cached_tokens": 0,
    }
    if count == -1:  # older builds: no count
        del meta["completion_tokens"]
    payload = {"text": text, "output_ids": ids, "meta_info": meta}
    return json.dumps(payload).encode() if spaced else orjson.dumps(payload)


def read(parser: SGLangStreamParser, raws: list[bytes]) -> tuple[list[int], list[float], list[Any]]:
    ids: list[int] = []
    lps: list[float] = []
    finishes: list[Any] = []
    for raw in raws:
        for e in parser.feed(parser.decode(raw)):
            if isinstance(e, TokenDelta):
                ids += e.token_ids
                lps += e.logprobs
            else:
                finishes.append(e)
    return ids, lps, finishes


def test_the_cutter_leaves_only_the_new_tokens_to_decode() -> None:
    ids, lps = [7, 8, 9, 10], [-0.5, -0.25, -1.0, -0.125]
    parser = SGLangStreamParser()
    decoded = []
    for n in range(1, 5):
        payload = parser.decode(event(ids[:n], lps[:n], text="héllo \"]]\" " * n))
        decoded.append(payload["output_ids"])
        parser.feed(payload)
    # The first event, and the second (the shape is learned from it), are decoded whole.
    assert decoded == [[7], [7, 8], [9], [10]]
    assert parser.ids == ids


def test_an_event_that_does_not_repeat_the_prefix_is_decoded_whole() -> None:
    cutter = PrefixCutter()
    first = event([1, 2], [-0.5, -0.5])
    assert cutter.cut(first) == (first, 0)
    cutter.tokens = 2
    other = event([1, 3], [-0.5, -0.5])
    assert cutter.cut(other) == (other, 0)
    cutter.tokens = 2
    longer = event([1, 3, 4], [-0.5, -0.5, -0.25], text="abc")
    raw, cut = cutter.cut(longer)
    assert cut == 2 and orjson.loads(raw)["output_ids"] == [4] and orjson.loads(raw)["text"] == ""
    assert orjson.loads(raw)["meta_info"]["output_token_logprobs"] == [[-0.25, 4, None]]


@pytest.mark.parametrize("incremental", [False, True], ids=["cumulative", "incremental"])
def test_the_abort_of_a_queued_request_repeats_only_the_last_token(incremental: bool) -> None:
    # SGLang answers an abort of a request waiting in its queue (after a retraction, say)
    # with the last token alone and completion_tokens counting all of them.
    parser = SGLangStreamParser()
    if incremental:
        raws = [event([5], [-0.5]), event([6], [-0.25], count=2), event([7], [-1.0], count=3)]
    else:
        raws = [event([5], [-0.5]), event([5, 6], [-0.5, -0.25]), event([5, 6, 7], [-0.5, -0.25, -1.0])]
    abort = {"type": "abort", "message": "Abort in waiting queue"}
    raws.append(event([7], [-1.0], finish=abort, count=3))
    ids, _, finishes = read(parser, raws)
    assert ids == [5, 6, 7]
    assert [f.reason for f in finishes] == ["abort"]


def test_a_cumulative_event_that_rewrites_the_past_is_an_error() -> None:
    parser = SGLangStreamParser()
    read(parser, [event([5], [-0.5]), event([5, 6], [-0.5, -0.25])])
    with pytest.raises(BackendError, match="does not extend"):
        read(parser, [event([5, 9, 7], [-0.5, -0.25, -1.0])])  # only the boundary is checked: O(1)


_texts = st.lists(st.sampled_from(['a', 'é', '"', '\\', ']]', '[', ',', ':', '","output_ids":[', '\n', '{']),
                  max_size=6).map("".join)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), _texts), min_size=1, max_size=10),
       st.booleans(), st.booleans(), st.sampled_from(["stop", "length", "queued-abort"]))
def test_any_cumulative_stream_reads_exactly_the_engines_tokens(
    steps: list[tuple[int, str]], spaced: bool, counted: bool, ending: str
) -> None:
    ids: list[int] = []
    lps: list[float] = []
    text = ""
    raws = []
    for n, piece in steps:
        ids += [100 + len(ids) + i for i in range(n)]
        lps += [-(len(lps) + i) / 7 for i in range(n)]
        text += piece
        raws.append(event(list(ids), list(lps), text=text, spaced=spaced, count=None if counted else -1))
    if ending == "queued-abort" and ids:
        finish = {"type": "abort", "message": "Abort in waiting queue"}
        raws.append(event(ids[-1:], lps[-1:], finish=finish, count=len(ids), spaced=spaced))
    else:
        finish = {"type": "length", "length": len(ids)} if ending == "length" else {"type": "stop", "matched": 1}
        raws.append(event(list(ids), list(lps), text=text, finish=finish, spaced=spaced))
    got_ids, got_lps, finishes = read(SGLangStreamParser(), raws)
    assert got_ids == ids and got_lps == lps
    assert len(finishes) == 1 and isinstance(finishes[0], GenerateFinish)
