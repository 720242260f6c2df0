"""The engine stream decoders (``engines/stream_events.py`` and each engine's reader): bytes in, events out.

Streams are written as each engine writes them (orjson, one ``data:`` line an event,
a blank line after it), in SGLang's incremental and cumulative shapes, vLLM's
``/v1/completions`` chunks and llama.cpp's ``/completion`` events. Whatever points the
bytes are split at (one read or many, an event cut anywhere), the decoder gives the same
events: the engine's tokens, logprobs and finish, exactly. A malformed event or an
engine's error mid-stream is a ``BackendError`` saying so, raised after the events before
it are handed out.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actorproxy.engines.base import BackendError, GenerateFinish, GenerationEvent, TokenDelta
from actorproxy.engines.llamacpp.protocol import LlamaCppStreamParser
from actorproxy.engines.sglang.protocol import SGLangStreamParser
from actorproxy.engines.stream_events import StreamDecoder
from actorproxy.engines.vllm.protocol import VLLMStreamParser

SHAPES = ["sglang-incremental", "sglang-cumulative", "vllm", "llamacpp"]
EOT = 151645


def sse(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def likeliest(token: int, logprob: float, k: int) -> list[tuple[int, float]]:
    """The alternatives a written stream lists for a token (:func:`written`'s ``top``), the likeliest first."""
    return [(token + i, logprob - i) for i in range(k)]


def written(shape: str, groups: list[list[int]], top: int = 0) -> tuple[bytes, list[int], list[float]]:
    """A stream of ``shape`` sending the tokens ``groups`` (an event each), then EOT; its ids and logprobs.
    ``top``: each token's ``top`` alternatives (:func:`likeliest`) in the engine's shape."""
    ids: list[int] = []
    lps: list[float] = []
    out = []
    for n, group in enumerate([*groups, [EOT]]):
        last = n == len(groups)
        new_lps = [-(len(lps) + i + 1) / 8 for i in range(len(group))]
        ids += group
        lps += new_lps
        if shape.startswith("sglang"):
            cumulative = shape == "sglang-cumulative"
            shown, shown_lps = (ids, lps) if cumulative else (group, new_lps)
            meta = {"id": "r", "finish_reason": {"type": "stop", "matched": EOT} if last else None,
                    "prompt_tokens": 3, "weight_version": "v1", "completion_tokens": len(ids), "cached_tokens": 0,
                    "output_token_logprobs": [[lp, t, None] for t, lp in zip(shown, shown_lps, strict=True)]}
            if top:
                meta["output_top_logprobs"] = [[[v, a, None] for a, v in likeliest(t, lp, top)]
                                               for t, lp in zip(shown, shown_lps, strict=True)]
            out.append(sse({"text": " so" * len(shown), "output_ids": list(shown), "meta_info": meta}))
        elif shape == "vllm":
            choice = {"index": 0, "text": " so" * len(group), "token_ids": group,
                      "logprobs": {"tokens": [f"token_id:{t}" for t in group], "token_logprobs": new_lps},
                      "finish_reason": "stop" if last else None, "stop_reason": None}
            if top:  # (the sampled token first, as vLLM lists it)
                choice["logprobs"]["top_logprobs"] = [
                    {f"token_id:{a}": v for a, v in [(t, lp), *likeliest(t, lp, top)[::-1]]}
                    for t, lp in zip(group, new_lps, strict=True)]
            out.append(sse({"id": "cmpl-r", "object": "text_completion", "choices": [choice]}))
        else:
            probs = [{"id": t, "token": " so", "logprob": lp} for t, lp in zip(group, new_lps, strict=True)]
            if top:
                for entry in probs:
                    entry["top_logprobs"] = [{"id": a, "token": " so", "logprob": v}
                                             for a, v in likeliest(entry["id"], entry["logprob"], top)]
            out.append(sse({"index": 0, "content": " so" * len(group), "tokens": group, "stop": False,
                            "completion_probabilities": probs}))
    if shape == "vllm":
        out.append(sse({"id": "cmpl-r", "object": "text_completion", "choices": [],
                        "usage": {"prompt_tokens": 3, "completion_tokens": len(ids)}}))
        out.append(b"data: [DONE]\n\n")
    elif shape == "llamacpp":
        out.append(sse({"index": 0, "content": "", "tokens": [], "stop": True, "stop_type": "eos",
                        "timings": {"cache_n": 0}}))
    elif shape.startswith("sglang"):
        out.append(b"data: [DONE]\n\n")
    return b"".join(out), ids, lps


def decoder(shape: str) -> StreamDecoder:
    if shape.startswith("sglang"):
        return SGLangStreamParser(stop_token_ids=[EOT])
    if shape == "vllm":
        return VLLMStreamParser()
    return LlamaCppStreamParser(stop_token_ids=(), max_new_tokens=10_000, prompt_len=3, version="v1")


def read(shape: str, pieces: list[bytes], top: list[Any] | None = None) -> list[GenerationEvent]:
    """Every event of the stream given in ``pieces`` (each as one read brought it); the alternatives of its
    tokens onto ``top``, when given."""
    dec = decoder(shape)
    dec.top = top
    out: list[GenerationEvent] = []
    for piece in pieces:
        dec.buffer += piece
        dec.read(out)
    dec.read(out, at_end=True)
    return out


def flat(events: list[GenerationEvent]) -> tuple[list[int], list[float], list[GenerateFinish]]:
    deltas = [e for e in events if isinstance(e, TokenDelta)]
    return ([t for d in deltas for t in d.token_ids], [lp for d in deltas for lp in d.logprobs],
            [e for e in events if isinstance(e, GenerateFinish)])


def cut(raw: bytes, points: list[int]) -> list[bytes]:
    at = sorted({p % (len(raw) + 1) for p in points})
    return [raw[a:b] for a, b in zip([0, *at], [*at, len(raw)], strict=True)]


_groups = st.lists(st.lists(st.integers(0, 150_000), min_size=0, max_size=4), min_size=0, max_size=8)


@settings(max_examples=150, derandomize=True, database=None, deadline=None)
@given(st.sampled_from(SHAPES), _groups, st.lists(st.integers(0, 1 << 20), max_size=12))
def test_the_same_bytes_split_anywhere_give_the_same_events(shape: str, groups: list[list[int]],
                                                             points: list[int]) -> None:
    groups = [g for g in groups if g or shape.startswith("sglang")]  # (an empty event is SGLang's alone)
    raw, ids, lps = written(shape, groups)
    whole = read(shape, [raw])
    for pieces in (cut(raw, points), [raw[i : i + 1] for i in range(len(raw))]):  # (and a read per byte)
        split = read(shape, pieces)
        if shape == "sglang-cumulative":  # cumulative events read together are read as the last: fewer deltas
            assert flat(split) == flat(whole)
        else:
            assert split == whole
    got_ids, got_lps, finishes = flat(whole)
    assert (got_ids, got_lps) == (ids, lps)
    assert len(finishes) == 1 and finishes[0].reason == "stop"
    assert finishes[0].matched_stop == EOT


@settings(max_examples=100, derandomize=True, database=None, deadline=None)
@given(st.sampled_from(SHAPES), _groups, st.lists(st.integers(0, 1 << 20), max_size=12))
def test_alternatives_are_read_for_every_token_however_the_bytes_split(
    shape: str, groups: list[list[int]], points: list[int]
) -> None:
    """Asked for (``top``), each token's alternatives are read in the token's order: one list a token, every
    token once (a cumulative event's repeated ones too, decoded whole or skipped), wherever the bytes split."""
    groups = [g for g in groups if g or shape.startswith("sglang")]
    raw, ids, lps = written(shape, groups, top=3)
    for pieces in ([raw], cut(raw, points), [raw[i : i + 1] for i in range(len(raw))]):
        top: list[Any] = []
        assert flat(read(shape, pieces, top))[:2] == (ids, lps)
        expected = [likeliest(t, lp, 3) for t, lp in zip(ids, lps, strict=True)]
        if shape == "vllm":  # (listed as vLLM lists them: the sampled token first, then the others)
            expected = [[(t, lp), *[a for a in alternatives[::-1] if a[0] != t]]
                        for t, lp, alternatives in zip(ids, lps, expected, strict=True)]
        assert top == [tuple(a) for a in expected]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_stream_without_the_alternatives_asked_for_is_an_error(shape: str) -> None:
    raw, _, _ = written(shape, [[5], [6, 7]])
    with pytest.raises(BackendError, match="top"):
        read(shape, [raw], [])


@pytest.mark.parametrize("shape", SHAPES)
def test_events_read_together_are_the_events_read_one_by_one(shape: str) -> None:
    raw, ids, _ = written(shape, [[5], [6, 7], [8]])
    events = raw.split(b"\n\n")
    one_by_one = read(shape, [e + b"\n\n" for e in events if e])
    assert flat(read(shape, [raw])) == flat(one_by_one) and flat(one_by_one)[0] == ids


@pytest.mark.parametrize("eol", [b"\r\n", b"\r"], ids=["crlf", "cr"])
@pytest.mark.parametrize("shape", SHAPES)
def test_other_sse_shapes_read_the_same(shape: str, eol: bytes) -> None:
    # Comments, \r\n or lone \r line ends (the spec allows both), a data field without its space: read through
    # the general parser, the same events; at a few cuts, and a byte a read (a read that ends in the \r of a
    # \r\n: the \n the next begins with ends the same line).
    raw, _, _ = written(shape, [[5], [6, 7]])
    other = b": keep-alive" + eol + eol + raw.replace(b"\n", eol).replace(b"data: ", b"data:")
    for pieces in (cut(other, [7, 50, 51, 120]), [other[i : i + 1] for i in range(len(other))]):
        assert flat(read(shape, pieces)) == flat(read(shape, [raw]))


@pytest.mark.parametrize("shape", SHAPES)
def test_a_malformed_event_mid_stream_is_an_engine_error_after_the_events_before_it(shape: str) -> None:
    raw, _, _ = written(shape, [[5], [6]])
    first, second, *_ = raw.split(b"\n\n")
    dec = decoder(shape)
    dec.buffer += first + b"\n\n" + second + b"\n\ndata: {\"output_ids\": [7,\n\n"
    out: list[GenerationEvent] = []
    with pytest.raises(BackendError, match="malformed stream event"):
        dec.read(out)
    assert flat(out)[0] == [5, 6]


@pytest.mark.parametrize("payload", [[1, 2], "text", 3])
def test_an_event_that_is_not_an_object_is_an_engine_error(payload: Any) -> None:
    dec = decoder("vllm")
    dec.buffer += sse(payload) + sse(payload)
    with pytest.raises(BackendError, match="unexpected stream event"):
        dec.read([])


@pytest.mark.parametrize("shape", SHAPES)
def test_the_engines_error_mid_stream_is_an_engine_error_with_its_message(shape: str) -> None:
    raw, _, _ = written(shape, [[5]])
    dec = decoder(shape)
    dec.buffer += raw.split(b"\n\n")[0] + b"\n\n" + sse({"error": {"message": "out of memory", "code": 500}})
    out: list[GenerationEvent] = []
    with pytest.raises(BackendError, match="out of memory"):
        dec.read(out)
    assert flat(out)[0] == [5]


@pytest.mark.parametrize("shape", SHAPES)
def test_a_stream_cut_before_its_finish_is_an_engine_error(shape: str) -> None:
    raw, _, _ = written(shape, [[5], [6]])
    dec = decoder(shape)
    dec.buffer += raw.split(b"\n\n")[0] + b"\n\n"
    out: list[GenerationEvent] = []
    dec.read(out)
    with pytest.raises(BackendError, match="without a finish"):
        dec.read(out, at_end=True)
    assert flat(out)[0] == [5]


@pytest.mark.parametrize("shape", ["sglang-incremental", "vllm"])
def test_done_without_a_finish_is_an_engine_error(shape: str) -> None:
    dec = SGLangStreamParser() if shape.startswith("sglang") else VLLMStreamParser()
    dec.buffer += b"data: [DONE]\n\n"
    if shape == "vllm":  # vLLM's [DONE] without a finish reason: an abort saying so
        out: list[GenerationEvent] = []
        dec.read(out)
        assert isinstance(out[0], GenerateFinish) and out[0].reason == "abort"
        return
    with pytest.raises(BackendError, match="without a finish"):
        dec.read([])


def test_events_after_the_finish_are_kept_for_the_drain() -> None:
    raw, _, _ = written("llamacpp", [[5]])
    dec = LlamaCppStreamParser(stop_token_ids=(5,), max_new_tokens=100, prompt_len=3, version="v1")
    dec.buffer += raw
    out: list[GenerationEvent] = []
    dec.read(out)
    assert flat(out)[2][0].reason == "stop"  # the client's own stop, at token 5
    assert [p["stop"] for p in dec.tail] == [False, True]  # the EOT event and llama.cpp's final one


def read_or_error(shape: str, pieces: list[bytes], *, lying: bool = False) -> list[Any]:
    """:func:`read`, the error raised, if any, as the last item; ``lying``: each piece that finds the buffer
    empty offered to ``read_lying`` first, amid other bytes (as the relay hub's receive buffer holds it)."""
    dec = decoder(shape)
    out: list[Any] = []
    try:
        for piece in pieces:
            raw = bytearray(b"\n\n" + piece + b"data")
            if not (lying and not dec.buffer and dec.read_lying(raw, 2, 2 + len(piece), out)):
                dec.buffer += piece
                dec.read(out)
        dec.read(out, at_end=True)
    except BackendError as exc:
        out.append(str(exc))
    return out


@settings(max_examples=100, derandomize=True, database=None, deadline=None)
@given(st.sampled_from(SHAPES), _groups, st.lists(st.integers(0, 1 << 20), max_size=6),
       st.sampled_from([b"", b"data: {\"output_ids\": 7}\n\n", b"data: {\"text\"\n\n", b"data: {}\r\n\r\n",
                        b"data: {\"a\":\n1}\n\n"]))
def test_an_event_read_where_it_lies_gives_what_the_buffer_gives(
    shape: str, groups: list[list[int]], points: list[int], odd: bytes,
) -> None:
    # ``odd``: an event that fails, or of another shape, before the last (the engine's finish).
    groups = [g for g in groups if g or shape.startswith("sglang")]
    raw, _, _ = written(shape, groups)
    events = [e + b"\n\n" for e in raw.split(b"\n\n") if e]
    events[-2:-2] = [odd] if odd else []
    stream = b"".join(events)
    for pieces in (events, cut(stream, points)):
        assert read_or_error(shape, pieces, lying=True) == read_or_error(shape, pieces)


def test_a_cumulative_event_alone_in_its_read_is_read_where_it_lies() -> None:
    raw, ids, _ = written("sglang-cumulative", [[5], [6, 7], [8]])
    dec = decoder("sglang-cumulative")
    out: list[GenerationEvent] = []
    for event in raw.split(b"\n\n")[:-2]:  # (every event but [DONE], the finish's included)
        arrival = bytearray(event + b"\n\n")
        assert dec.read_lying(arrival, 0, len(arrival), out)
        assert not dec.buffer
    assert flat(out)[0] == ids and flat(out)[2][0].reason == "stop"


class _Searched(bytearray):
    """A buffer that counts the bytes its searches pass over (found or not)."""

    searched = 0

    def find(self, sub: Any, start: Any = 0, stop: Any = None) -> int:  # type: ignore[override]
        stop = len(self) if stop is None else stop
        at = super().find(sub, start, stop)
        _Searched.searched += (stop if at < 0 else at + len(sub)) - start
        return at

    def rfind(self, sub: Any, start: Any = 0, stop: Any = None) -> int:  # type: ignore[override]
        stop = len(self) if stop is None else stop
        at = super().rfind(sub, start, stop)
        _Searched.searched += stop - (start if at < 0 else at)
        return at

    def count(self, sub: Any, start: Any = 0, stop: Any = None) -> int:  # type: ignore[override]
        stop = len(self) if stop is None else stop
        _Searched.searched += stop - start
        return super().count(sub, start, stop)


def test_long_cumulative_events_arriving_in_pieces_are_searched_once() -> None:
    # A reader behind its engine: each read brings one event's end and the next one's start (hundreds of KB
    # at 16,000 tokens). Each byte is searched once for a line break and once for a bare CR (another SSE
    # shape), both at memchr's pace, and not again backward from the read's end for the last event's end
    # (a byte at a time: 3.1 times the stream's bytes were searched so).
    raw, ids, _ = written("sglang-cumulative", [[i % 1000] for i in range(300)])
    dec = decoder("sglang-cumulative")
    dec.buffer = _Searched()
    _Searched.searched = 0
    out: list[GenerationEvent] = []
    pieces = cut(raw, list(range(0, len(raw), 1000)))
    for piece in pieces:
        dec.buffer += piece
        dec.read(out)
    dec.read(out, at_end=True)
    assert flat(out)[0] == ids
    assert _Searched.searched < 2.1 * len(raw)
