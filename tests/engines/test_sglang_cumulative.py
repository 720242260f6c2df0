"""SGLang's cumulative ``/generate`` stream is read in O(new tokens): each event's repeated
prefix is cut as bytes before JSON decoding, and the tokens delivered are exactly the
engine's, whatever the events hold (module ``actorproxy.engines.sglang.cumulative``).

Events are written as SGLang writes them (orjson, keys ``text``, ``output_ids``,
``meta_info``), and also with ``json.dumps``' spaced separators, which the cutter does
not recognise: those are decoded whole and must read the same.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from actorproxy.engines import stream_events
from actorproxy.engines.base import BackendError, GenerateFinish, GenerationEvent, TokenDelta
from actorproxy.engines.sglang import cumulative, protocol
from actorproxy.engines.sglang.cumulative import PrefixCutter
from actorproxy.engines.sglang.protocol import SGLangStreamParser


def event(ids: list[int], lps: list[float] | None, *, text: str = "", finish: Any = None, count: int | None = None,
          spaced: bool = False, version: str = "default", entry_texts: list[str | None] | None = None,
          top: list[list[tuple[float, int]] | None] | None = None) -> bytes:
    """An event as SGLang writes it (``meta_info``'s keys in its order); ``lps=None``: logprobs not asked;
    ``entry_texts``: each logprob entry's text (``return_text_in_logprobs``), else ``null``; ``top``: each
    token's alternatives (``top_logprobs_num``; ``None``: SGLang's ``null`` for a token without them)."""
    meta: dict[str, Any] = {"id": "r", "finish_reason": finish, "prompt_tokens": 3, "weight_version": version}
    if lps is not None:
        meta["input_token_logprobs"] = []
        texts = entry_texts or [None] * len(ids)
        meta["output_token_logprobs"] = [[lp, t, s] for t, lp, s in zip(ids, lps, texts, strict=True)]
        meta["output_token_logprobs_length"] = len(ids)
    if top is not None:
        meta["input_top_logprobs"] = []
        meta["output_top_logprobs"] = [None if alts is None else [[lp, t, None] for lp, t in alts] for alts in top]
    meta |= {"completion_tokens": len(ids) if count is None else count, "cached_tokens": 0}
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
        payload = parser.decode(event(ids[:n], lps[:n], text="héllo \"]]\" " * n, entry_texts=[
            None, "a[b[0]]", '"]]"\\', "]]"][:n]))  # (entry texts too: cut all the same)
        decoded.append(payload["output_ids"])
        parser.feed(payload)
    # The first event, and the second (the shape is learned from it), are decoded whole.
    assert decoded == [[7], [7, 8], [9], [10]]
    assert parser.ids == ids


def test_an_event_that_does_not_repeat_the_prefix_is_decoded_whole() -> None:
    cutter = PrefixCutter()
    first = event([1, 2], [-0.5, -0.5])
    assert cutter.cut(first) == (None, 0)
    cutter.tokens = 2
    other = event([1, 3], [-0.5, -0.5])
    assert cutter.cut(other) == (None, 0)
    cutter.tokens = 2
    longer = event([1, 3, 4], [-0.5, -0.5, -0.25], text="abc")
    raw, cut = cutter.cut(longer)
    assert raw is not None
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
#: A logprob entry's text (``return_text_in_logprobs``): what breaks a search for the entries' end, escapes and
#: unicode, pieces that look like an entry's end or the next key; ``None``: SGLang's ``null``.
_entry_texts = st.none() | st.lists(st.sampled_from(
    [']', ']]', '[', '"', '\\', '\\"', '"]]', ',', 'a[b[0]]', ']],"x":[', '日', 'é', '\n', '\u2028', '\x00', 'null']),
    max_size=5).map("".join)


class WholeEvents(SGLangStreamParser):
    """The reader with every event decoded whole by ``orjson.loads`` (nothing cut, nothing skipped): what the
    cut reading must read."""

    def decode_span(self, raw: bytes | bytearray, start: int, stop: int) -> Any:
        return orjson.loads(bytes(raw[start:stop]))

    def take_spans(self, spans: list[tuple[int, int]], out: list[GenerationEvent]) -> None:
        for start, stop in spans:
            self.take_span(start, stop, out)


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), _texts, st.lists(_entry_texts, min_size=4, max_size=4),
                          st.sampled_from(["v1", "v1", "v2"])), min_size=1, max_size=10),
       st.booleans(), st.booleans(), st.sampled_from(["stop", "length", "queued-abort"]), st.booleans())
@example([(1, "", [']]', None, None, None], "v1"), (1, "", [']]', None, None, None], "v1"),
          (1, "", [None] * 4, "v1")], False, True, "stop", False)
@example([(1, "", [None] * 4, "v1"), (2, "", [None] * 4, "v1"), (0, "", [None] * 4, "v1"),
          (4, "", [None] * 4, "v1")], False, True, "queued-abort", True)
def test_any_cumulative_stream_reads_exactly_the_engines_tokens(
    steps: list[tuple[int, str, list[str | None], str]], spaced: bool, counted: bool, ending: str, asked: bool
) -> None:
    # Whatever the texts (the event's, and each logprob entry's when SGLang returns text in logprobs: ``]]``,
    # quotes, backslashes, unicode), the cut reading reads the engine's tokens, as a whole-event decode of each
    # event does: the same ids, logprobs and versions, an event a read or all in one read (where the event before
    # the queued abort's, which repeats only the last token, is skipped at first); and with the alternatives
    # ``asked``, the same alternatives.
    ids: list[int] = []
    lps: list[float] = []
    entry_texts: list[str | None] = []
    text = ""
    raws = []

    def tops(n: int) -> list[list[tuple[float, int]] | None] | None:
        return [alternatives(i) for i in range(n)] if asked else None

    version = "default"
    for n, piece, pieces, version in steps:
        ids += [100 + len(ids) + i for i in range(n)]
        lps += [-(len(lps) + i) / 7 for i in range(n)]
        entry_texts += pieces[:n]
        text += piece
        raws.append(event(list(ids), list(lps), text=text, spaced=spaced, count=None if counted else -1,
                          version=version, entry_texts=list(entry_texts), top=tops(len(ids))))
    if ending == "queued-abort" and ids:
        finish = {"type": "abort", "message": "Abort in waiting queue"}
        raws.append(event(ids[-1:], lps[-1:], finish=finish, count=len(ids), spaced=spaced, version=version,
                          entry_texts=entry_texts[-1:], top=None if tops(1) is None else tops(len(ids))[-1:]))
    else:
        finish = {"type": "length", "length": len(ids)} if ending == "length" else {"type": "stop", "matched": 1}
        raws.append(event(list(ids), list(lps), text=text, finish=finish, spaced=spaced, version=version,
                          entry_texts=list(entry_texts), top=tops(len(ids))))

    def reader(parser: SGLangStreamParser) -> SGLangStreamParser:
        parser.top = [] if asked else None
        return parser

    got_ids, got_lps, finishes = read(reader(SGLangStreamParser()), raws)
    assert got_ids == ids and got_lps == lps
    assert len(finishes) == 1 and isinstance(finishes[0], GenerateFinish)
    whole_reader = reader(WholeEvents())
    whole = read_stream(whole_reader, [sse(raws)])
    assert whole[:2] == (ids, lps)
    assert whole_reader.top == ([tuple((t, lp) for lp, t in a or ()) for a in tops(len(ids)) or ()] if asked else None)
    for reads in ([sse([raw]) for raw in raws], [sse(raws)]):  # an event a read, or all in one read
        parser = reader(SGLangStreamParser())
        assert read_stream(parser, reads)[:3] == whole[:3]
        assert parser.top == whole_reader.top


def sse(raws: list[bytes]) -> bytes:
    return b"".join(b"data: " + raw + b"\n\n" for raw in raws)


def decoded_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The size of every JSON text the SGLang reader decodes from now on; the SSE parser refused."""
    sizes: list[int] = []

    def loads(data: Any) -> Any:
        sizes.append(len(data))
        return orjson.loads(data)

    def no_parser(self: Any) -> Any:
        if self.buffer:  # (an empty buffer at the body's end is closed by one)
            raise AssertionError("the common shape went through the SSE parser")
        return parser(self)

    parser = stream_events.StreamDecoder._parser

    spy = type("orjson", (), {"loads": staticmethod(loads)})
    monkeypatch.setattr(protocol, "orjson", spy)
    monkeypatch.setattr(stream_events, "orjson", spy)  # (``loads_span``: an event decoded from its span)
    monkeypatch.setattr(stream_events.StreamDecoder, "_parser", no_parser)
    return sizes


def read_stream(parser: SGLangStreamParser, reads: list[bytes], *, end: bool = True,
                out: list[GenerationEvent] | None = None) -> tuple[
        list[int], list[float], list[str], list[GenerationEvent]]:
    """``reads`` through ``parser.read`` (each as one read brought it; ``end``: then the body's end): ids,
    logprobs, each id's version, finishes. ``out``: where the events go (what was handed out before an error);
    while the parser relays, each read's run is taken as the generation takes it."""
    out = [] if out is None else out
    try:
        for piece in reads:
            parser.buffer += piece
            parser.read(out)
            parser.run_into(out)
        if end:
            parser.read(out, at_end=True)
    finally:
        parser.run_into(out)
    return handed_out(out)


def handed_out(out: list[GenerationEvent]) -> tuple[list[int], list[float], list[str], list[GenerationEvent]]:
    """The ids, logprobs and each id's version of the events ``out``, and the other events."""
    deltas = [e for e in out if isinstance(e, TokenDelta)]
    return ([t for d in deltas for t in d.token_ids], [lp for d in deltas for lp in d.logprobs],
            [d.weight_version for d in deltas for _ in d.token_ids], [e for e in out if not isinstance(e, TokenDelta)])


@pytest.mark.parametrize("asked", [False, True], ids=["plain", "alternatives"])
@pytest.mark.parametrize("together", [False, True], ids=["a-read-each", "one-read"])
def test_a_long_cumulative_stream_is_decoded_for_its_new_part_only_where_it_lies(
    monkeypatch: pytest.MonkeyPatch, together: bool, asked: bool
) -> None:
    # 300 tokens, one an event, with unicode and JSON-looking text: after the first two
    # events (the shape is learned from the second), what is decoded stays small however
    # long the events grow, and nothing goes through the SSE parser (no copy of the event).
    # With the alternatives ``asked`` (``top_logprobs``), every event repeats each earlier
    # token's too: their array is cut as the others are (decoded whole, relaying n tokens
    # would decode O(n²) alternatives), and they are read as a whole-event decode reads them.
    sizes = decoded_sizes(monkeypatch)
    ids = [1000 + i for i in range(300)]
    lps = [-i / 64 for i in range(300)]
    tops = [alternatives(n) for n in range(300)] if asked else None
    texts = ["é\"]],\"output_ids\":[ 日本 " * (n + 1) for n in range(300)]
    raws = [event(ids[: n + 1], lps[: n + 1], text=texts[n], top=tops and tops[: n + 1]) for n in range(299)]
    raws.append(event(ids, lps, text=texts[-1], top=tops, finish={"type": "length", "length": 300}))
    events = [sse(raws) + b"data: [DONE]\n\n"] if together else [sse([raw]) for raw in raws] + [b"data: [DONE]\n\n"]
    parser, whole = SGLangStreamParser(), WholeEvents()
    parser.top, whole.top = ([], []) if asked else (None, None)
    got_ids, got_lps, _, finishes = read_stream(parser, events)
    assert (got_ids, got_lps) == (ids, lps)
    assert [type(f) for f in finishes] == [GenerateFinish]
    read_stream(whole, events)
    assert parser.top == whole.top and (parser.top is None or len(parser.top) == 300 and parser.top[3] == ()
                                        and parser.top[4] == ((504, -4 / 9), (604, -4 / 5 - 1), (704, -4 / 3 - 2)))
    # Read together, the events the last repeats are not decoded at all: each token once.
    assert len(raws[-1]) > 15_000
    assert sum(sizes[2:]) < len(raws[-1]) - len(texts[-1]) if together else max(sizes[2:]) < 400 + 200 * asked


def test_without_logprobs_the_ids_alone_are_cut() -> None:
    cutter = PrefixCutter()
    assert cutter.cut(event([1, 2], None)) == (None, 0)
    cutter.tokens = 2
    raw, cut = cutter.cut(event([1, 2, 3, 4], None, text="abc"))
    assert cut == 2 and raw is not None
    assert orjson.loads(raw) == {"text": "", "output_ids": [3, 4], "meta_info": orjson.loads(event([3, 4], None))[
        "meta_info"] | {"completion_tokens": 4}}
    cutter.tokens = 4  # logprobs appear: the event is decoded whole (the remembered lengths do not match)
    assert cutter.cut(event([1, 2, 3, 4, 5], [-1.0] * 5)) == (None, 0)


def test_without_logprobs_a_stream_is_an_error_after_its_first_tokens() -> None:
    # The proxy always asks for logprobs: a stream without them is refused, saying so.
    with pytest.raises(BackendError, match="logprob entries None"):
        read_stream(SGLangStreamParser(), [sse([event([1], None), event([1, 2], None)])])


def test_a_prefix_that_does_not_match_where_it_lies_is_decoded_whole_and_checked(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    sizes = decoded_sizes(monkeypatch)
    first = [event([5], [-0.5]), event([5, 6], [-0.5, -0.25]), event([5, 6, 7], [-0.5, -0.25, -1.0])]
    rewritten = event([5, 16, 7, 8], [-0.5, -0.25, -1.0, -2.0])  # the last id read (7) is where it was
    other_last = event([5, 6, 17, 8], [-0.5, -0.25, -1.0, -2.0])  # the last id read differs: decoded whole
    parser = SGLangStreamParser()
    assert read_stream(parser, [sse(first)], end=False)[0] == [5, 6, 7]
    with pytest.raises(BackendError, match="does not extend"):
        read_stream(parser, [sse([other_last])], end=False)
    assert sizes[-1] == len(other_last)
    # A rewrite before the boundary is not seen by the O(1) check: the new token alone is read.
    assert read_stream(SGLangStreamParser(), [sse(first), sse([rewritten])], end=False)[0] == [5, 6, 7, 8]


@pytest.mark.parametrize("together", [False, True], ids=["a-read-each", "one-read"])
def test_a_weight_version_change_mid_stream_stamps_each_token_with_its_version(together: bool) -> None:
    ids, lps = [10, 11, 12, 13, 14, 15], [-0.5, -0.25, -1.0, -2.0, -0.75, -0.125]
    versions = ["v1", "v1", "v1", "v2", "v2", "v3"]
    raws = [event(ids[: n + 1], lps[: n + 1], version=versions[n], text="ü" * n) for n in range(5)]
    raws.append(event(ids, lps, version="v3", finish={"type": "stop", "matched": 15}))
    events = [sse(raws)] if together else [sse([raw]) for raw in raws]
    got_ids, got_lps, got_versions, finishes = read_stream(SGLangStreamParser(), [*events, b"data: [DONE]\n\n"])
    assert (got_ids, got_lps, got_versions) == (ids, lps, versions)
    assert [f.weight_version for f in finishes if isinstance(f, GenerateFinish)] == ["v3"]


def test_an_incremental_stream_in_another_sse_shape_is_not_looked_at_for_repeats(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # ``look`` tells a cumulative event the next one repeats; an incremental stream has none to skip. Once the
    # shape is known (its second event), a read of several events (\r\n line ends: through the SSE parser) is
    # read without looking at any of them.
    looked: list[int] = []
    look = protocol.look
    monkeypatch.setattr(protocol, "look", lambda raw, *span: looked.append(len(raw)) or look(raw, *span))
    ids, lps = [7, 8, 9, 10, 11, 12], [-0.5, -0.25, -1.0, -0.125, -2.0, -0.75]
    raws = [event([t], [lp], count=n + 1) for n, (t, lp) in enumerate(zip(ids, lps, strict=True))]
    raws[-1] = event([ids[-1]], [lps[-1]], count=6, finish={"type": "length", "length": 6})
    parser = SGLangStreamParser()
    crlf = [sse(raws[:2]).replace(b"\n", b"\r\n"), sse(raws[2:]).replace(b"\n", b"\r\n")]
    got_ids, got_lps, _, finishes = read_stream(parser, crlf)
    assert (got_ids, got_lps) == (ids, lps) and [type(f) for f in finishes] == [GenerateFinish]
    assert looked == []


@pytest.mark.parametrize("asked", [False, True], ids=["plain", "alternatives"])
def test_events_read_together_are_searched_without_what_they_repeat(
        monkeypatch: pytest.MonkeyPatch, asked: bool) -> None:
    # Whether an event the next repeats may be skipped is read from its keys; a long event's text and arrays
    # as the previous event had them (no quote in them) are left out of the search: it stays small. With the
    # alternatives ``asked``, theirs too.
    searched: list[int] = []
    look = cumulative.look
    monkeypatch.setattr(cumulative, "look", lambda raw, start=0, stop=None: searched.append(
        (len(raw) if stop is None else stop) - start) or look(raw, start, stop))
    ids = [1000 + i for i in range(400)]
    lps = [-i / 64 for i in range(400)]
    tops = [alternatives(n) for n in range(400)] if asked else None
    raws = [event(ids[: n + 1], lps[: n + 1], text="ab é" * (n + 1), top=tops and tops[: n + 1]) for n in range(399)]
    raws.append(event(ids, lps, text="ab é" * 400, top=tops, finish={"type": "length", "length": 400}))
    reads = [sse(raws[:300]), sse(raws[300:]) + b"data: [DONE]\n\n"]
    parser = SGLangStreamParser()
    parser.top = [] if asked else None
    got_ids, got_lps, _, finishes = read_stream(parser, reads)
    assert (got_ids, got_lps) == (ids, lps) and [type(f) for f in finishes] == [GenerateFinish]
    assert parser.top is None or parser.top == [tuple((t, lp) for lp, t in a or ()) for a in tops or ()]
    assert len(raws[300]) > 9_000
    # (The first read: nothing known to leave out. The second: what was not in the last event decoded, the 300th.)
    assert len(searched) == 300 + 100
    assert all(size < len(raw) - len(raws[299]) + 300 for size, raw in zip(searched[300:], raws[300:], strict=True))


def odd_event(ids: list[int], lps: list[float], text: str, kind: str, order: list[int], pad: int,
              version: str) -> bytes:
    """An event that is not an ordinary extension of the stream: the last token again (the queued abort's
    shape) with an error, weight-version spans or a finish, its keys in ``order`` (a permutation; the text
    first), after ``pad`` bytes of an id string (the keys land where a long event's arrays lay)."""
    meta: dict[str, Any] = {"id": "r" * pad, "finish_reason": None, "weight_version": version,
                            "output_token_logprobs": [[lps[-1], ids[-1], None]], "completion_tokens": len(ids)}
    top: dict[str, Any] = {"output_ids": ids[-1:], "meta_info": meta}
    if kind == "error":
        top["error"] = {"message": "engine failed", "code": 500}
    elif kind == "spans":
        meta["weight_versions"] = [[0, len(ids) - 1, "other"]]
    else:
        meta["finish_reason"] = {"type": "abort", "message": "Abort in waiting queue"}
    meta |= {key: meta.pop(key) for key in [list(meta)[i] for i in order if i < len(meta)]}
    return orjson.dumps({"text": text, **{key: top[key] for key in sorted(top, key=lambda k: order.index(len(k) % 6))}})


@settings(max_examples=200, derandomize=True, database=None, deadline=None)
@given(st.integers(50, 90), st.lists(st.tuples(st.integers(0, 3), _texts), min_size=3, max_size=14),
       st.lists(st.integers(1, 6), min_size=1, max_size=6), st.booleans(),
       st.tuples(st.integers(0, 13), st.sampled_from(["error", "spans", "abort", "failed", "none"]),
                 st.permutations(range(6)), st.integers(0, 1500)),
       st.lists(st.sampled_from(["v1", "v1", "v1", "v2"]), min_size=20, max_size=20))
# (An odd event whose spans lie where the previous event's logprob entries lay, its version before them.)
@example(60, [(1, "a")] * 4, [4], False, (0, "spans", [1, 2, 4, 3, 5, 0], 1200), ["v1"] * 20)
# (The engine fails the request in an event with a new token, read with the event before it, which it repeats.)
@example(60, [(1, "a")] * 4, [4], False, (0, "failed", [0, 1, 2, 3, 4, 5], 0), ["v1"] * 20)
def test_events_read_together_read_as_each_alone(
    first: int, steps: list[tuple[int, str]], sizes: list[int], entry_text: bool,
    odd: tuple[int, str, list[int], int], versions: list[str],
) -> None:
    # A long cumulative stream (its old content above what is left out of the search), its texts with or
    # without quotes, logprob entries with or without a text, weight versions changing, and an odd
    # event or none (an error, spans or a finish where a long event's arrays lay, keys in any order; or the engine's
    # failure of the request in an event bringing a new token) among ordinary ones: read in reads of several events,
    # relaying or not, it reads as it does an event a read: the same tokens, and the same finish or the same tokens
    # handed out before the same error.
    ids: list[int] = []
    lps: list[float] = []
    text = ""
    raws = []
    for k, (n, piece) in enumerate([(first, "x" * 500), *steps]):
        ids += [100 + len(ids) + i for i in range(n)]
        lps += [-(len(lps) + i) / 8 for i in range(n)]
        text += piece
        raw = event(list(ids), list(lps), text=text, version=versions[k])
        raws.append(raw.replace(b",null]", b',"t\\"]"]') if entry_text else raw)
    finish = {"type": "length", "length": len(ids)}
    raws.append(event(list(ids), list(lps), text=text, finish=finish, version=versions[-1]))
    at, kind, order, pad = odd
    if kind != "none":
        at = 2 + at % (len(raws) - 2)  # (its version the next event's: it would be skipped if it were ordinary)
        version = orjson.loads(raws[at])["meta_info"]["weight_version"]
        if kind == "failed":  # the engine fails the request in an event that brings a new token
            before = orjson.loads(raws[at - 1])
            known = before["output_ids"]
            raws.insert(at, event(known + [9_999], [e[0] for e in before["meta_info"]["output_token_logprobs"]]
                                  + [-0.25], text=before["text"], version=version,
                                  finish={"type": "abort", "message": "engine failed", "status_code": 500}))
        else:
            raws.insert(at, odd_event(ids[:first], lps[:first], "x" * 500, kind, order, pad, version))
    reads, at = [sse(raws[:1]), sse(raws[1:2])], 2
    for size in sizes * len(raws):
        reads.append(sse(raws[at : at + size]))
        at += size
    reads.append(b"data: [DONE]\n\n")

    def outcome(pieces: list[bytes], relaying: bool) -> Any:
        parser = SGLangStreamParser()
        parser.relaying = relaying
        out: list[GenerationEvent] = []
        try:
            return read_stream(parser, pieces, out=out)
        except BackendError as exc:
            return handed_out(out)[:3], str(exc)  # (the tokens handed out before the error, and the error)

    alone = outcome([sse([raw]) for raw in raws] + [b"data: [DONE]\n\n"], False)
    for relaying in (False, True):
        assert outcome(reads, relaying) == alone
    assert outcome([sse([raw]) for raw in raws] + [b"data: [DONE]\n\n"], True) == alone
    if kind == "failed":  # (the failing event's new token among them)
        assert alone[0][0][-1] == 9_999


def test_a_lone_new_token_cut_after_fewer_tokens_than_delivered_is_an_error() -> None:
    # After the queued abort's repeat (the last token alone), the cutter remembers one token; an event cut after
    # it that then holds one new id does not extend the three delivered (it rewinds): an error, not a token.
    parser = SGLangStreamParser()
    raws = [event([5], [-0.5]), event([5, 5], [-0.5, -0.5]), event([5, 5, 5], [-0.5, -0.5, -0.5]),
            event([5], [-0.5], count=3)]
    assert read_stream(parser, [sse([raw]) for raw in raws], end=False)[0] == [5, 5, 5]
    with pytest.raises(BackendError, match="does not extend"):
        read_stream(parser, [sse([event([5, 9], [-0.5, -1.0])])], end=False)


@settings(max_examples=100, derandomize=True, database=None, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), _texts, st.lists(_entry_texts, min_size=6, max_size=6)),
                min_size=1, max_size=8), st.booleans(), st.booleans())
def test_a_long_cumulative_events_line_break_is_found_without_searching_what_it_repeats(
    steps: list[tuple[int, str, list[str | None]]], logprobs: bool, spaced: bool,
) -> None:
    # Each event read where it lies (``read_lying``, amid other bytes): its line break, searched in its text and
    # new part only once the arrays' old content is long, is where a search of the whole event finds it, whatever
    # the texts (line breaks, quotes, ``]]``, keys' look-alikes: escaped in the JSON), and the tokens are the
    # engine's. The first event brings 4,000 tokens (20,000 ids alone): the old content is past ``_SEARCHED``.
    parser, cutter = SGLangStreamParser(), PrefixCutter()
    out: list[GenerationEvent] = []
    ids: list[int] = []
    lps: list[float] = []
    entry_texts: list[str | None] = []
    text = ""
    for k, (n, piece, pieces) in enumerate(steps):
        n = (4000 if logprobs else 20_000) if k == 0 else n
        ids += [100 + len(ids) + i for i in range(n)]
        lps += [-(len(lps) + i) / 7 for i in range(n)]
        entry_texts += (pieces * 4000)[:n]
        text += piece
        framed = sse([event(list(ids), list(lps) if logprobs else None, text=text, spaced=spaced,
                            entry_texts=list(entry_texts) if logprobs else None)])
        raw = bytearray(b"\n\n" + framed + b"data")
        start, stop = 2, 2 + len(framed)
        if logprobs:
            assert parser.line_break(raw, start, stop) == raw.find(b"\n", start, stop) == stop - 2
            assert parser.read_lying(raw, start, stop, out)
            parser.run_into(out)
        else:  # (the proxy always asks for logprobs: the cutter alone, as the reader would use it)
            assert cutter.line_break(raw, start, stop) == raw.find(b"\n", start, stop) == stop - 2
            cutter.cut(raw, start + 6, stop - 2)
            cutter.tokens = len(ids)
    if logprobs:
        assert handed_out(out)[:2] == (ids, lps)


def alternatives(n: int) -> list[tuple[float, int]] | None:
    """Token ``n``'s alternatives in the tests below: three, or none (SGLang's ``null``) for every seventh."""
    return None if n % 7 == 3 else [(-n / 9, 500 + n), (-n / 5 - 1, 600 + n), (-n / 3 - 2, 700 + n)]


def test_alternatives_the_cut_cannot_vouch_for_are_decoded_whole() -> None:
    # The alternatives' array is cut only where the previous event's ended at an entry's end; an entry with a
    # text (``return_text_in_logprobs``, which the proxy does not ask for) or an array where the old one was not
    # leaves the event to be decoded whole, and read the same.
    cutter = PrefixCutter()
    tops = [alternatives(n) for n in range(4)]
    cutter.cut(event([1, 2], [-1.0, -2.0], top=tops[:2]), top=True)
    cutter.tokens = 2
    raw, cut = cutter.cut(event([1, 2, 3, 4], [-1.0, -2.0, -3.0, -4.0], top=tops), top=True)
    assert cut == 2 and raw is not None
    meta = orjson.loads(raw)["meta_info"]
    assert meta["output_top_logprobs"] == [[[-2 / 9, 502, None], [-2 / 5 - 1, 602, None], [-2 / 3 - 2, 702, None]],
                                           None]
    assert meta["output_token_logprobs"] == [[-3.0, 3, None], [-4.0, 4, None]]
    cutter.tokens = 4
    shorter = [None] * 5  # the old alternatives are not where the previous event's ended: whole
    assert cutter.cut(event([1, 2, 3, 4, 5], [-1.0] * 5, top=shorter), top=True) == (None, 0)
    texted = orjson.loads(event([1, 2, 3, 4, 5, 6], [-1.0] * 6, top=[None] * 6))
    texted["meta_info"]["output_top_logprobs"][-1] = [[-1.0, 9, ']],"'], [-2.0, 8, "]"]]
    cutter.tokens = 5
    plain = copy.copy(cutter)
    assert plain.cut(event([1, 2, 3, 4, 5, 6], [-1.0] * 6, top=[None] * 6), top=True)[1] == 5
    assert cutter.cut(orjson.dumps(texted), top=True) == (None, 0)
    assert cutter.cut(event([1, 2], [-1.0, -2.0], top=None), top=True) == (None, 0)  # none sent: whole


def test_alternatives_that_end_the_event_are_cut_too() -> None:
    # The array may close ``meta_info`` (the simulator writes it there): its close is then the event's ``]}}``.
    def last(raw: bytes) -> bytes:
        payload = orjson.loads(raw)
        payload["meta_info"]["output_top_logprobs"] = payload["meta_info"].pop("output_top_logprobs")
        return orjson.dumps(payload)

    tops = [alternatives(n) for n in range(5)]
    cutter = PrefixCutter()
    cutter.cut(last(event([1, 2, 3], [-1.0, -2.0, -3.0], top=tops[:3])), top=True)
    cutter.tokens = 3
    raw, cut = cutter.cut(last(event([1, 2, 3, 4, 5], [-1.0, -2.0, -3.0, -4.0, -5.0], top=tops)), top=True)
    assert cut == 3 and raw is not None and raw.endswith(b"]}}")
    assert orjson.loads(raw)["meta_info"]["output_top_logprobs"] == [
        None, [[-4 / 9, 504, None], [-4 / 5 - 1, 604, None], [-4 / 3 - 2, 704, None]]]


def test_a_long_events_line_break_is_not_searched_for_in_the_alternatives_it_repeats() -> None:
    # Once the old content is long, the alternatives' old part is skipped like the other arrays': a line break
    # forged there (an event cannot hold one: the previous event, which had that content, was one line) is not
    # found, the event's own is.
    ids = [100 + i for i in range(3001)]
    lps = [-i / 7 for i in range(3001)]
    tops = [alternatives(n) for n in range(3001)]
    parser = SGLangStreamParser()
    parser.top = []
    out: list[GenerationEvent] = []
    for n in (1, 3000):
        framed = sse([event(ids[:n], lps[:n], top=tops[:n])])
        assert parser.read_lying(bytearray(framed), 0, len(framed), out)
    framed = sse([event(ids, lps, top=tops)])
    forged = framed.find(b'"output_top_logprobs":[') + 5_000
    raw = bytearray(framed)
    raw[forged] = 0x0A
    assert raw.find(b"\n") == forged
    assert parser.line_break(raw, 0, len(raw)) == len(raw) - 2
    assert parser.read_lying(bytearray(framed), 0, len(framed), out)
    parser.run_into(out)
    assert handed_out(out)[:2] == (ids, lps) and len(parser.top) == 3001
