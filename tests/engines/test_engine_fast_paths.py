"""The engine client's fast paths read and write exactly what the general code does.

The SSE splitter's one-``data:``-line events and the body decoder's whole chunks are
read inline (``SSEParser._split_lf``, ``h1.whole_chunks``); random streams,
fed whole and in small pieces, must give the same events, the same bytes left over and
the same errors as the general loops. A ``/generate`` body is the converter's.
"""

from __future__ import annotations

import random
from array import array
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from _util import sse_reference
from hypothesis import example, given, settings
from hypothesis import strategies as st

from actorproxy.engines.base import BackendError, GenerateFinish, GenerateRequest, SamplingParams, TokenDelta
from actorproxy.engines.connection import json_body
from actorproxy.engines.llamacpp import protocol as llamacpp_protocol
from actorproxy.engines.sglang import protocol
from actorproxy.engines.stream_events import StreamDecoder
from actorproxy.engines.vllm import protocol as vllm_protocol
from actorproxy.http import h1
from actorproxy.http.errors import ProtocolError
from actorproxy.http.h1 import BodyDecoder
from actorproxy.http.sse import SSEParser
from actorproxy.schema.converter import CONVERTER, TokenIds

_BOM = "\ufeff".encode()  # (the UTF-8 byte order mark: dropped at the stream's start)
_SSE_PARTS = [b"data: ", b"data:", b"data: {}\n\n", b"\n", b"\n\n", b"x", b"yz", b"event: e", b":ping",
              b"error: q", b"data: a\ndata: b", b" ", b"\r", b"\r\n", b"data: {}\r\r", b"\r\n\r\n", _BOM, _BOM[:2]]


def _events(parser: SSEParser, stream: bytes, sizes: random.Random) -> tuple[list[tuple[str, bytes]], bytes]:
    out: list[tuple[str, bytes]] = []
    at = 0
    while at < len(stream):
        step = sizes.randint(1, 9)
        out += [tuple(e) for e in parser.feed(stream[at : at + step])]  # type: ignore[misc]
        at += step
    left = bytes(parser.buffer)
    out += [tuple(e) for e in parser.close()]  # type: ignore[misc]
    return out, left


def test_sse_events_are_the_specs_whatever_the_line_ends_and_the_reads() -> None:
    # Random streams of event pieces, lines ending in LF, CRLF or a lone CR, fed in reads of 1-9 bytes: the
    # events of the spec's reading of the whole stream (the common one-data-line event read inline or not). A
    # byte order mark that starts the stream is dropped, even cut between reads; one further on is a line's bytes.
    rnd = random.Random(7)
    for trial in range(3000):
        stream = rnd.choice([b"", b"", _BOM]) + b"".join(rnd.choice(_SSE_PARTS) for _ in range(rnd.randint(0, 25)))
        got = _events(SSEParser(), stream, random.Random(trial))
        assert got[0] == sse_reference(stream), stream
        assert got[0] == _events(SSEParser(), stream, random.Random(trial + 1))[0], stream  # any cut


def _chunked(rnd: random.Random) -> bytes:
    parts = []
    for _ in range(rnd.randint(0, 6)):
        data = bytes(rnd.choice(b"ab\r\n") for _ in range(rnd.randint(0, 12)))
        size = len(data) + (0 if rnd.random() < 0.85 else rnd.randint(-1, 2))
        line = (rnd.choice(["%x", "%X", "%02x"]) % max(size, 0)).encode() + rnd.choice([b"", b";x=1", b" ", b"\t;"])
        parts.append(line + rnd.choice([b"\r\n", b"\n"]) + data + rnd.choice([b"\r\n", b"\r\n", b"\n", b"xx"]))
    parts.append(rnd.choice([b"0\r\n\r\n", b"0\r\nT: v\r\n\r\n", b"0\r\n", b"", b"zz\r\n"]))
    return b"".join(parts)


def _dechunked(stream: bytes, step: int) -> tuple[str, bytes, bytes, bool]:
    decoder, buf, out = BodyDecoder(keep_alive=True, chunked=True), bytearray(), bytearray()
    try:
        for at in range(0, len(stream), step):
            buf += stream[at : at + step]
            decoder.decode(buf, out)
    except ProtocolError as error:
        return str(error), bytes(out), bytes(buf), decoder.done
    return "", bytes(out), bytes(buf), decoder.done


@pytest.mark.parametrize("together", [False, True], ids=["a-read-each", "one-read"])
def test_an_engine_stream_that_starts_with_a_byte_order_mark_reads_as_without(together: bool) -> None:
    raws = [orjson.dumps({"text": "", "output_ids": [7 + i], "meta_info": {
        "id": "r", "finish_reason": {"type": "length", "length": 3} if i == 2 else None, "prompt_tokens": 3,
        "output_token_logprobs": [[-0.5, 7 + i, None]], "completion_tokens": i + 1}}) for i in range(3)]
    events = [b"data: " + raw + b"\n\n" for raw in raws]
    plain = _read_events(protocol.SGLangStreamParser(), events, together, False)
    assert [t for t, _, _ in plain[0]] == [7, 8, 9] and plain[2] is None
    with_bom = _read_events(protocol.SGLangStreamParser(), [_BOM[:1], _BOM[1:] + events[0], *events[1:]], together,
                            False)
    assert (with_bom[0], [f.reason for f in with_bom[1]], with_bom[2]) == (plain[0], ["length"], None)


def test_whole_chunks_read_inline_are_read_as_the_general_states_read_them(monkeypatch: pytest.MonkeyPatch) -> None:
    rnd = random.Random(11)
    streams = [_chunked(rnd) for _ in range(4000)]
    steps = [1, 3, 7, 1 << 20]
    inline = [[_dechunked(stream, step) for step in steps] for stream in streams]
    monkeypatch.setattr(h1, "whole_chunks", lambda buf, pos, out: pos)
    general = [[_dechunked(stream, step) for step in steps] for stream in streams]
    for stream, a, b in zip(streams, inline, general, strict=True):
        assert a == b, stream


def test_a_generate_body_is_the_converters_body_of_its_request() -> None:
    rnd = random.Random(5)
    for _ in range(2000):
        sampling = SamplingParams(
            max_new_tokens=rnd.randint(1, 50), temperature=rnd.choice([0.0, 0.7, 1.0]), top_p=rnd.choice([1.0, 0.9]),
            top_k=rnd.choice([-1, 20]), min_p=rnd.choice([0.0, 0.1]),
            stop_token_ids=tuple(rnd.sample(range(100), rnd.randint(0, 3))), seed=rnd.choice([None, 1, 2]))
        request = GenerateRequest(array("i", [rnd.randint(0, 1000) for _ in range(rnd.randint(0, 5))]), sampling)
        routed = rnd.random() < 0.3
        expected = CONVERTER.unstructure(protocol.GenerateReqInput(
            rid=request.rid, input_ids=TokenIds(request.input_ids), stream=True,
            sampling_params=protocol.SGLangSamplingParams.of(sampling), return_logprob=True, logprob_start_len=-1,
            top_logprobs_num=0, return_routed_experts=routed))
        assert protocol.generate_bytes(request, routed) == json_body(expected)


def test_sampling_settings_that_cannot_be_a_key_still_give_the_converters_body() -> None:
    sampling = SamplingParams(max_new_tokens=4, stop_token_ids=[7, 8])  # type: ignore[arg-type]
    request = GenerateRequest(array("i", [1, 2]), sampling)
    expected = CONVERTER.unstructure(protocol.GenerateReqInput(
        rid=request.rid, input_ids=TokenIds(request.input_ids), stream=True,
        sampling_params=protocol.SGLangSamplingParams.of(sampling), return_logprob=True, logprob_start_len=-1,
        top_logprobs_num=0))
    assert protocol.generate_bytes(request, False) == json_body(expected)


@pytest.mark.parametrize("engine", ["vllm-generate", "vllm-completions", "llamacpp"])
def test_every_engines_request_bytes_are_the_converters_body_of_its_request(engine: str) -> None:
    rnd = random.Random(7)
    for n in range(300):
        sampling = SamplingParams(
            max_new_tokens=rnd.randint(1, 50), temperature=rnd.choice([0.0, 0.7]), top_k=rnd.choice([-1, 20]),
            stop_token_ids=tuple(rnd.sample(range(100), rnd.randint(0, 2))), seed=rnd.choice([None, 3]))
        size = 5000 if n % 50 == 0 else rnd.randint(0, 5)  # now and then a long prompt, written through IdsJSON
        request = GenerateRequest(array("i", [rnd.randint(0, 150_000) for _ in range(size)]), sampling)
        if engine == "vllm-generate":
            got = vllm_protocol.generate_tokens_bytes(request)
            expected: object = vllm_protocol.GenerateTokensRequest(
                token_ids=TokenIds(request.input_ids), request_id=request.rid, stream=True,
                stream_options=vllm_protocol.StreamOptions(include_usage=True),
                sampling_params=vllm_protocol.SamplingFields.of(sampling))
        elif engine == "vllm-completions":
            model = rnd.choice([None, "m"])
            got = vllm_protocol.completion_bytes(request, model)
            expected = vllm_protocol.CompletionRequest.of_tokens(request.input_ids, sampling, rid=request.rid,
                                                                 model=model)
        else:
            got = llamacpp_protocol.completion_bytes(request)
            expected = llamacpp_protocol.CompletionRequest.of(request.input_ids, sampling)
        assert got == json_body(CONVERTER.unstructure(expected))


# -- SGLang's events: a lone new token read directly, anything else by the general checks ------------------------

_SG_EVENT = st.fixed_dictionaries({
    "tokens": st.integers(0, 3),  # new tokens in the event
    "value": st.sampled_from(["float", "int"]),  # a logprob written as a float, or as an integer (-1)
    "entry": st.sampled_from([3, 2]),  # [logprob, id, text] or [logprob, id]
    "count": st.sampled_from(["exact", "exact", "absent"]),  # completion_tokens (SGLang's running count), or none
    "version": st.sampled_from(["v1", "v1", "v2", None]),  # weight_version (None: not sent)
    "spans": st.booleans(),  # weight_versions: the first new token sampled by another version
    "repeat": st.integers(0, 9),  # 0: the abort of a queued request instead (the last token again, nothing new)
})
_SG_BAD = st.sampled_from([None, "other-id", "null-logprob", "no-entries", "ids-not-list", "malformed", "failed",
                           "failed-spans"])


def _sg_stream(events: list[dict[str, Any]], bad: str | None, finish_tokens: int, cumulative: bool = False) -> tuple[
        list[bytes], list[tuple[int, float, str]], bool]:
    """A ``/generate`` stream of ``events`` (then a finish, or the ``bad`` event), incremental or ``cumulative``
    (each event with every id and entry so far, but the queued abort's): its events' bytes and the tokens it
    delivers (id, logprob, version), and whether it is an error."""
    raws: list[bytes] = []
    sent: list[tuple[int, float, str]] = []
    version = "default"
    written_ids: list[int] = []  # what a cumulative event repeats
    written: list[Any] = []

    def write(ids: Any, entries: Any, meta: dict[str, Any], count: str = "exact", repeat: bool = True) -> None:
        meta = {"id": "r", "finish_reason": None, "prompt_tokens": 3, **meta}
        if cumulative and repeat:
            if isinstance(ids, list):
                written_ids.extend(ids)
                ids = list(written_ids)
            if entries is not None:
                written.extend(entries)
                entries = list(written)
        if entries is not None:
            meta["output_token_logprobs"] = entries
        if count == "exact":
            meta["completion_tokens"] = len(sent)
        raws.append(orjson.dumps({"text": "", "output_ids": ids, "meta_info": meta}))
        if bad == "malformed" and meta.get("bad"):  # (cut short: not JSON)
            raws[-1] = raws[-1][: raws[-1].index(b',"bad"')]

    def tokens(e: dict[str, Any], n: int) -> tuple[list[int], list[Any], dict[str, Any]]:
        nonlocal version
        meta: dict[str, Any] = {}
        if e["version"] is not None:
            version = meta["weight_version"] = e["version"]
        ids = [1000 + 7 * len(sent) + i for i in range(n)]  # (never a prefix of what came before: no count needed)
        values = [-1 - len(sent) - i if e["value"] == "int" else -(len(sent) + i + 1) / 8 for i in range(n)]
        entries = [[lp, t, "x"][: e["entry"]] for t, lp in zip(ids, values, strict=True)]
        versions = [version] * n
        if e["spans"] and n:
            versions[0] = "v9"
            meta["weight_versions"] = [{"version": "v9", "start": len(sent), "end": len(sent) + 1},
                                       {"version": version, "start": len(sent) + 1, "end": len(sent) + n}]
        sent.extend((t, float(lp), v) for t, lp, v in zip(ids, values, versions, strict=True))
        return ids, entries, meta

    for e in events:
        if e["repeat"] == 0 and sent:  # the last token and every entry so far again, completion_tokens unchanged
            last, lp, _ = sent[-1]
            write([last], [[lp, last, None]], {}, repeat=False)
            continue
        ids, entries, meta = tokens(e, e["tokens"])
        write(ids, entries, meta, e["count"])
    if bad in ("failed", "failed-spans"):  # the engine fails the request: an abort with an error status, its new
        # tokens in it (sampled and sent: delivered before the error, whichever way the event is read)
        ids, entries, meta = tokens({"version": None, "spans": bad == "failed-spans", "value": "float", "entry": 3}, 2)
        meta["finish_reason"] = {"type": "abort", "message": "engine failed", "status_code": 500, "err_type": None}
        write(ids, entries, meta)
        return raws, sent, True
    if bad is not None:
        ids, entries, meta = tokens({"version": None, "spans": False, "value": "float", "entry": 3}, 1)
        wrong = {"other-id": [[-0.5, ids[0] + 1, None]], "null-logprob": [[None, ids[0], None]], "no-entries": None,
                 "ids-not-list": entries, "malformed": entries}[bad]
        if bad == "malformed":
            wrong, meta["bad"] = entries, True
        write(ids if bad != "ids-not-list" else {"0": ids[0]}, wrong, meta)  # type: ignore[arg-type]
        return raws, sent[:-1], True  # (its token is not delivered)
    ids, entries, meta = tokens({"version": None, "spans": False, "value": "float", "entry": 3}, finish_tokens)
    meta["finish_reason"] = {"type": "length", "length": len(sent)}
    write(ids, entries, meta)
    return raws, sent, False


def _sg_read(raws: list[bytes], together: bool, relaying: bool) -> tuple[list[tuple[int, float, str]], Any]:
    """The tokens (id, logprob, version) the reader delivers from ``raws`` (a read each, or one read), and its
    finish or error."""
    tokens, finishes, end = _read_events(protocol.SGLangStreamParser(), [b"data: " + raw + b"\n\n" for raw in raws],
                                         together, relaying)
    return tokens, end if end is not None else finishes


def _read_events(parser: StreamDecoder, events: list[bytes], together: bool, relaying: bool) -> tuple[
        list[tuple[int, float, str]], list[GenerateFinish], BackendError | None]:
    """What ``parser`` hands out for ``events`` (a read each, or one read; ``relaying``: each read's run taken as
    the generation takes it): the tokens (id, logprob, version), finishes, and its error or ``None``."""
    parser.relaying = relaying
    out: list[Any] = []
    end = None
    try:
        for data in [b"".join(events)] if together else events:
            parser.buffer += data
            parser.read(out)
            parser.run_into(out)
    except BackendError as exc:
        end = exc
    parser.run_into(out)
    tokens = [(t, lp, e.weight_version) for e in out if type(e) is TokenDelta
              for t, lp in zip(e.token_ids, e.logprobs, strict=True)]
    return tokens, [e for e in out if type(e) is GenerateFinish], end


_SG_PLAIN = {"tokens": 1, "value": "float", "entry": 3, "count": "exact", "version": None, "spans": False, "repeat": 5}


@settings(max_examples=300, derandomize=True, database=None, deadline=None)
@given(st.lists(_SG_EVENT, max_size=8), _SG_BAD, st.integers(0, 2), st.booleans(), st.booleans(), st.booleans())
# (A cumulative stream read in one read, its last event bad: the one before it, which it repeats, is skipped.)
@example([_SG_PLAIN] * 4, "malformed", 0, True, False, True)
@example([_SG_PLAIN] * 4, "no-entries", 0, True, True, True)
# (The queued abort's repeat of the last token twice: the second is cut after the first, and brings nothing.)
@example([_SG_PLAIN | {"tokens": 0}, _SG_PLAIN, _SG_PLAIN, _SG_PLAIN | {"repeat": 0}, _SG_PLAIN | {"repeat": 0}],
         None, 0, False, False, True)
# (The engine fails the request in an event that brings tokens: an event a read, not relaying, then all in one.)
@example([_SG_PLAIN] * 2, "failed", 0, False, False, False)
@example([_SG_PLAIN] * 3, "failed", 0, True, False, True)
@example([_SG_PLAIN] * 2, "failed-spans", 0, False, True, False)
def test_sglang_events_deliver_exactly_the_engines_tokens_whichever_way_each_is_read(
        events: list[dict[str, Any]], bad: str | None, finish_tokens: int, together: bool, relaying: bool,
        cumulative: bool) -> None:
    # A lone plain new token (float logprob, its entry naming it; incremental: the count one more; cumulative:
    # cut after exactly the tokens delivered) is read directly; every other event (several tokens, an integer
    # logprob, no count, spans, a repeat, the finish, a bad entry, a cumulative stream's first events) by the
    # general checks. Either way: the engine's tokens, each with its logprob and version.
    # A bad last event (a wrong entry, no entries, ids not a list, not JSON) fails the stream after every token
    # before it is handed out, whether the events came a read each or all in one (where a cumulative event the
    # bad one would repeat is not decoded until the bad one fails). An event whose finish is the engine's failure
    # (an abort with an error status) hands out the tokens it brings before its error, as the stream's record has
    # every token the engine sampled and sent: relaying or not, a read each or all in one.
    raws, expected, failed = _sg_stream(events, bad, finish_tokens, cumulative)
    tokens, end = _sg_read(raws, together, relaying)
    assert tokens == expected
    assert all(type(lp) is float for _, lp, _ in tokens)
    if failed:
        assert isinstance(end, BackendError) and str(end).startswith("SGLang: ")
        for other in (_sg_read(raws, not together, relaying), _sg_read(raws, together, not relaying)):
            assert (other[0], str(other[1])) == (tokens, str(end))  # the same tokens and error either way
    else:
        assert [f.reason for f in end] == ["length"]


def _typed_as_json(make: Callable[[], StreamDecoder], events: list[bytes], relaying: bool) -> int:
    """Check that a reader (``make``) that reads ``events`` (JSON, a read each) hands out what one reading each
    event's JSON does (the same tokens, versions, finishes, error); how many of them it decoded typed (their JSON
    not read: ``StreamDecoder.read_common``)."""
    read: list[tuple[Any, ...]] = []
    fed: list[int] = []
    for typed in (True, False):
        parser = make()
        payloads: list[Any] = []

        def feed(payload: Any, feed: Callable[[Any], Any] = parser.feed, payloads: list[Any] = payloads) -> Any:
            payloads.append(payload)
            return feed(payload)

        parser.feed = feed  # type: ignore[method-assign]
        if not typed:
            parser.read_common = lambda *_: False  # type: ignore[method-assign]
        tokens, finishes, error = _read_events(parser, [b"data: " + raw + b"\n\n" for raw in events], False, relaying)
        read.append((tokens, finishes, str(error)))
        fed.append(len(payloads))
    assert read[0] == read[1]
    return fed[1] - fed[0]


_SG_META = b'"id":"r","finish_reason":null,"prompt_tokens":3,"completion_tokens":3,"weight_version":"v2",'
_SG_ENTRIES = b'"output_token_logprobs":[[-0.5,1009,null]]'
#: Every field SGLang 0.5.23's incremental event has with default flags (tokenizer_manager.py), and ``dp_rank``
#: (several data-parallel ranks): ``cached_tokens_details`` on every event, ``response_sent_to_client_ts`` on the
#: first.
_SG_REAL = (b'"num_retractions":0,"input_token_logprobs":[],"output_token_logprobs_length":1,"reasoning_tokens":0,'
            b'"cached_tokens":0,"cached_tokens_details":null,"dp_rank":1,')
#: With a cache hit, on the first event, under ``--enable-metrics``.
_SG_METRICS = (b'"cached_tokens":12,"cached_tokens_details":{"device":12,"host":0},"queue_time":0.002,'
               b'"forward_entry_time":1796098592.5,"prefill_finished_time":1796098592.51,'
               b'"response_sent_to_client_ts":1796098592.52,')
_SG_TYPED = [b'{"text":" so","output_ids":[1009],"meta_info":{' + _SG_META + _SG_ENTRIES + b'}}',
             b'{"output_ids":[1009],"meta_info":{' + _SG_META + b'"output_token_logprobs":[[-1,1009,"x"]]}}',
             b'{"text":" so","output_ids":[1009],"meta_info":{' + _SG_META + _SG_REAL + _SG_ENTRIES + b'}}',
             b'{"text":" so","output_ids":[1009],"meta_info":{' + _SG_META + _SG_METRICS + _SG_ENTRIES + b'}}']


@pytest.mark.parametrize("event", [
    *_SG_TYPED,  # (the second: an integer logprob; the third and fourth: a real SGLang's)
    b'{"output_ids":[1009],"meta_info":{' + _SG_META + b'"output_token_logprobs":[[-0.5,1009]]}}',  # a short entry
    b'{"output_ids":[true],"meta_info":{' + _SG_META + b'"output_token_logprobs":[[-0.5,true,null]]}}',
    b'{"output_ids":[18446744073709551616],"meta_info":{' + _SG_META  # (orjson: a float)
    + b'"output_token_logprobs":[[-0.5,18446744073709551616,null]]}}',
    b'{"output_ids":[1009],"meta_info":{' + _SG_META + _SG_ENTRIES + b',"e2e_latency":1e400}}',  # (orjson: refused)
    b'{"output_ids":[1009],"meta_info":{' + _SG_META.replace(b":3,", b":1e400,", 1) + _SG_ENTRIES + b'}}',
    b'{"output_ids":[1009],"meta_info":{' + _SG_META + b'"output_token_logprobs":[[-1e400,1009,null]]}}',
    b'{"output_ids":[1009],"meta_info":{' + _SG_META + _SG_ENTRIES + b',"queue":"\xff"}}',  # (not UTF-8)
    b'{"text":"\xff","output_ids":[1009],"meta_info":{' + _SG_META + _SG_ENTRIES + b'}}',
    b'{"text":7,"output_ids":[1009],"meta_info":{' + _SG_META + _SG_ENTRIES + b'}}',
    b'{"error":null,"output_ids":[1009],"meta_info":{' + _SG_META + _SG_ENTRIES + b'}}',
    b'{"output_ids":[1009],"meta_info":{' + _SG_META.replace(b'"v2"', b"2") + _SG_ENTRIES + b'}}',
    b'{"output_ids":[1009],"meta_info":{' + _SG_META.replace(b":3,", b":2,") + _SG_ENTRIES + b'}}',  # a repeat
    b'{"output_ids":[1009],"meta_info":{' + _SG_META.replace(b"null", b'{"type":"length"}') + _SG_ENTRIES + b'}}',
    b'{"output_ids":[1009],"meta_info":{' + _SG_META + _SG_ENTRIES
    + b',"weight_versions":[{"version":"v9","start":2,"end":3}]}}',
    b'{"output_ids":[1008],"meta_info":{' + _SG_META + _SG_ENTRIES + b'}}',  # the entry names another token
    b'{"output_ids":[1009],"output_ids":[1009,1010],"meta_info":{' + _SG_META + _SG_ENTRIES + b'}}',
    b'{"output_ids":[1009],"meta_info":{' + _SG_META + _SG_ENTRIES + b'}',  # cut short
], ids=["plain", "int-logprob", "sglang-0.5", "sglang-0.5-metrics", "short-entry", "bool-id", "huge-id",
        "huge-number", "huge-count", "huge-logprob", "bad-utf8-field", "bad-utf8-text",
        "text-not-str", "error-null", "version-not-str", "repeat", "finish", "spans", "other-id", "key-twice",
        "cut-short"])
@pytest.mark.parametrize("relaying", [False, True])
def test_an_sglang_event_decoded_typed_reads_as_its_json_does(event: bytes, relaying: bool) -> None:
    # An incremental stream's third event (the shape known) is decoded into msgspec's typed structs when it is
    # one plain token; whatever it is, what the reader hands out (tokens, versions, finish) or the error it
    # raises is what reading its JSON gives, the finish after it read alike.
    first = [b'{"output_ids":[%d],"meta_info":{"completion_tokens":%d,"output_token_logprobs":[[-0.25,%d,null]]}}'
             % (1000 + i, i + 1, 1000 + i) for i in range(2)]
    finish = b'{"output_ids":[],"meta_info":{"finish_reason":{"type":"stop","matched":2},"completion_tokens":3}}'
    assert _typed_as_json(protocol.SGLangStreamParser, [*first, event, finish], relaying) == (event in _SG_TYPED)


def _vllm_chunk(ids: list[int], at: int, finish: str | None = None, spans: bool = False) -> bytes:
    """A ``/inference/v1/generate`` chunk of ``ids`` (the stream's tokens from index ``at``), as vLLM writes it."""
    content = [{"token_id": t, "logprob": -(at + i + 1) / 4} for i, t in enumerate(ids)]
    choice: dict[str, Any] = {"index": 0, "token_ids": ids, "logprobs": {"content": content}, "finish_reason": finish}
    if spans:  # (its first token sampled by another version)
        choice["weight_versions"] = [{"version": "v9", "start": at, "end": at + 1},
                                     {"version": "v1", "start": at + 1, "end": at + len(ids)}]
    return b"data: " + orjson.dumps({"request_id": "generate-tokens-x", "choices": [choice]}) + b"\n\n"


def _vllm_read(chunks: list[bytes], together: bool, relaying: bool) -> tuple[list[tuple[int, float, str]], str]:
    """The tokens (id, logprob, version) the vLLM reader hands out from ``chunks`` (a read each, or one), its
    error's text."""
    tokens, _, error = _read_events(vllm_protocol.VLLMStreamParser(version="v1"), chunks, together, relaying)
    return tokens, str(error)



_VL_ENTRY = b'{"token":"token_id:1009","token_id":1009,"logprob":-0.5,"bytes":null,"top_logprobs":[]}'
_VL_TYPED = [b'{"request_id":"r","choices":[{"index":0,"logprobs":{"content":[' + _VL_ENTRY
             + b']},"finish_reason":null,"token_ids":[1009]}]}',
             b'{"choices":[{"logprobs":{"content":[{"token_id":1009,"logprob":-0.5}]},"token_ids":[1009]}]}',
             b'{"choices":[{"index":0,"weight_version":"v2","logprobs":{"content":[' + _VL_ENTRY
             + b']},"token_ids":[1009]}]}',
             # vLLM 0.32's, as it wrote one (its nulls, the entry's rank, the sampled token among its top logprobs).
             b'{"request_id":"generate-tokens-g2","usage":null,"output_mode":"tokens","choices":[{"index":0,'
             b'"finish_reason":null,"stop_reason":null,"token_ids":[1009],"routed_experts":null,"sampling_mask":null,'
             b'"weight_versions":null,"logprobs":{"content":[{"token_id":1009,"logprob":-11.5804443359375,"rank":7327,'
             b'"top_logprobs":[{"token_id":1009,"logprob":-11.5804443359375,"rank":7327}]}]}}]}',
             _VL_ENTRY.join([b'{"request_id":"r","choices":[{"index":0,"logprobs":{"content":[',
                             b']},"token_ids":[1009]}]}']).replace(b"[]", b'[{"token_id":7,"logprob":-2.0}]')]


def _vl_chunk(choice: bytes = b'"index":0', entry: bytes = _VL_ENTRY, ids: bytes = b"[1009]", top: bytes = b""
              ) -> bytes:
    return (b'{"request_id":"r",' + top + b'"choices":[{' + choice + b',"logprobs":{"content":[' + entry
            + b']},"token_ids":' + ids + b"}]}")


@pytest.mark.parametrize("chunk", [
    *_VL_TYPED,
    _vl_chunk(entry=_VL_ENTRY.replace(b"-0.5", b"-1")),  # an integer logprob
    _vl_chunk(entry=_VL_ENTRY.replace(b"-0.5", b"-1e400")),
    _vl_chunk(entry=_VL_ENTRY.replace(b"1009,", b"1008,")),  # the entry names another token
    _vl_chunk(entry=_VL_ENTRY.replace(b'"token_id:1009"', b'"\xff"')),  # (not UTF-8)
    _vl_chunk(ids=b"[1009,1010]"),
    _vl_chunk(ids=b"[18446744073709551616]", entry=_VL_ENTRY.replace(b"1009,", b"18446744073709551616,")),
    _vl_chunk(choice=b'"index":1'),
    _vl_chunk(choice=b'"index":0,"finish_reason":"length"'),
    _vl_chunk(choice=b'"index":0,"weight_version":2'),
    _vl_chunk(choice=b'"index":0,"weight_versions":[{"version":"v9","start":2,"end":3}]'),
    _vl_chunk(choice=b'"index":0,"e2e":1e400'),
    _vl_chunk(top=b'"usage":{"prompt_tokens":5},'),
    _vl_chunk(top=b'"object":"error",'),
    _vl_chunk(top=b'"error":null,'),
    _vl_chunk()[:-2],  # cut short
], ids=["plain", "bare", "version", "vllm-0.32", "top-logprobs", "int-logprob", "huge-logprob", "other-id", "bad-utf8",
        "two-tokens", "huge-id", "index-1", "finish", "version-not-str", "spans", "unknown-field", "usage",
        "object-error", "error-null", "cut-short"])
@pytest.mark.parametrize("relaying", [False, True])
def test_a_vllm_chunk_decoded_typed_reads_as_its_json_does(chunk: bytes, relaying: bool) -> None:
    # A generate chunk of one plain token is decoded into msgspec's typed structs; whatever it is, what the
    # reader hands out (tokens, versions, finish) or the error it raises is what reading its JSON gives.
    first = _vl_chunk(entry=_VL_ENTRY.replace(b"1009", b"1000"), ids=b"[1000]")
    finish = _vl_chunk(choice=b'"index":0,"finish_reason":"stop"', entry=_VL_ENTRY.replace(b"1009", b"1011"),
                       ids=b"[1011]")
    # (The first chunk, one plain token, is typed too.)
    typed = _typed_as_json(lambda: vllm_protocol.VLLMStreamParser(version="v1"), [first, chunk, finish], relaying)
    assert typed == 1 + (chunk in _VL_TYPED)

@pytest.mark.parametrize("spans", [False, True], ids=["one-version", "spans"])
@pytest.mark.parametrize("before", [0, 1, 3])
def test_vllm_tokens_of_a_chunk_failing_the_request_are_handed_out_before_its_error(before: int, spans: bool) -> None:
    # vLLM's finish_reason "error" comes in a chunk that may bring tokens (sampled and sent): they are the
    # stream's, handed out before the error, whether the chunks are read one a read or all in one, relayed or not.
    chunks = [_vllm_chunk([100 + i], i) for i in range(before)]
    chunks.append(_vllm_chunk([200, 201], before, finish="error", spans=spans))
    expected = [(100 + i, -(i + 1) / 4, "v1") for i in range(before)]
    expected += [(200, -(before + 1) / 4, "v9" if spans else "v1"), (201, -(before + 2) / 4, "v1")]
    for together in (False, True):
        for relaying in (False, True):
            assert _vllm_read(chunks, together, relaying) == (
                expected, "vLLM: the engine failed the request (finish_reason error)"), (together, relaying)
