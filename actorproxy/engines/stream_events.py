"""An engine's streamed body, from bytes to generation events in one pass over what a read brought (sans-IO).

The body is de-chunked straight into :attr:`StreamDecoder.buffer`
(``http/client.py: Response.receive_into``). :meth:`StreamDecoder.read` then takes every
server-sent event complete in it and turns them into :class:`~.base.TokenDelta` and
:class:`~.base.GenerateFinish` events: each engine's reader (a subclass, in its
``protocol.py``) says what one event's JSON means (``feed``) and what the stream's end
means (``end``).

The events of one read are decoded together. When they all have the shape every engine
writes (one ``data:`` line each, ``\\n`` line ends; a JSON text holds no raw line break,
so the shape is checked by counting line breaks), their JSON is decoded in one
``orjson.loads``: a lone event from its span of the buffer (:func:`loads_span`: a short one
copied, a long one where it lies), several as one array made by one ``replace`` of the
separators. Any other shape (comments, ``event:`` names, several ``data:`` lines, ``\\r\\n``
or ``\\r`` line ends) goes through :class:`~actorproxy.http.sse.SSEParser`, an event at a time,
from then on. An engine's commonest event alone in a read (one token, nothing else: SGLang's
incremental event, vLLM's generate chunk) is decoded instead by msgspec into the engine's typed
structs, which check its fields' types as it decodes; any other fails that decode or the checks
after it, before anything changed, and is decoded as JSON (:meth:`StreamDecoder.read_common`).
A reader that decodes each event alone (not
:attr:`StreamDecoder.batched`: SGLang's cumulative events) is given where each one's JSON
lies in the buffer (:meth:`StreamDecoder.take_spans`), to decode it from there (:func:`loads_span`);
an arrival that is one whole event, with nothing buffered, is read where the relay hub received
it (:meth:`StreamDecoder.read_lying`: not copied at all; so is the commonest event of a reader
that has a typed decode), and the end of an event cut short is
searched for only in the bytes that came since the last search (``_clean``).
``[DONE]`` ends the stream (``end(True)``); events after
the finish are kept in :attr:`StreamDecoder.tail` (the generation reads past them to reuse
the connection, or hangs up).

A malformed event is a :class:`~.base.BackendError` naming it, raised by :meth:`read`
after the events before it are handed out (``out``), never a crash. An event whose finish
is the engine's failure (SGLang's abort with an error status, vLLM's ``finish_reason``
``error``) is an error too, raised after the tokens it brings are handed out
(:meth:`StreamDecoder.fail`): the engine sampled and sent them, and the failed step keeps
them, whichever way the events are read (a read each or several, relaying or not).

While :attr:`StreamDecoder.relaying`, the plain tokens of a read (every token stamped with
the event's version, :meth:`StreamDecoder.tokens`) are not made into events: they are kept
as one run (``run_ids``, ``run_logprobs``, ``run_version``) that the generation hands to its
taker directly when nothing else came (``engines/streaming.py: StreamedGeneration.relay``).
Any event handed out after them takes the run, as a :class:`~.base.TokenDelta`, first
(:meth:`StreamDecoder.run_into`), so the order is the stream's either way; the run of a read
is what the events of that read would merge to (``engines/deltas.py: take_merged``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Annotated, Any, NoReturn

import msgspec
import orjson

from ..core.turn_events import TopLogprobs
from ..http.sse import SSEParser
from .base import BackendError, GenerateFinish, GenerationEvent, TokenDelta, WeightVersionSpan
from .deltas import parse_spans

_DONE = b"[DONE]"
_SEPARATOR = b"\n\ndata: "

#: A span of JSON up to this many bytes is decoded from a copy, a longer one from a view of the buffer.
_COPIED_SPAN = 2048

#: An integer of a typed event (:meth:`StreamDecoder.read_common`): one orjson reads as an integer too (it reads
#: one past 64 bits as a float).
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]


def checked_alternatives(pairs: Iterable[tuple[object, object]], what: str, raw: object) -> TopLogprobs:
    """One token's alternatives from the ``(id, logprob)`` pairs an engine's reader found in ``raw`` (the token's
    top logprobs as sent): each id an integer and each logprob a number, else a :class:`~.base.BackendError`
    naming ``raw`` (``what``: the engine)."""
    out = []
    for token, value in pairs:
        if type(token) is not int or not isinstance(value, int | float):
            raise BackendError(f"{what}: malformed top logprobs {raw!r:.200}")
        out.append((token, float(value)))
    return tuple(out)


def loads_span(raw: bytes | bytearray, start: int, stop: int) -> Any:
    """The JSON of ``raw[start:stop]``: a short one from a copy of the span, a long one where it lies.

    ``orjson.loads`` of a view costs ~2,800 instructions more than of a copy (the view's
    making and release, and orjson's own handling of it): for a streamed event of a few
    hundred bytes, more than copying it; the copy costs about one instruction a byte.
    """
    if stop - start <= _COPIED_SPAN:
        return orjson.loads(raw[start:stop])
    with memoryview(raw) as view:
        return orjson.loads(view[start:stop])


class StreamDecoder:
    """Sans-IO reader of one engine stream: body bytes in :attr:`buffer`, generation events out.

    Subclasses implement :meth:`feed` (one event's JSON) and :meth:`end`; ``what`` names
    the engine in errors.
    """

    what = "engine"
    #: The weight version of the latest event.
    version: str
    #: Whether an arrival that is one whole chunk is offered to :meth:`read_lying` before it is copied into
    #: :attr:`buffer` (a reader whose events are read each alone, or that has a :meth:`read_common`).
    reads_lying = False

    def __init__(self) -> None:
        #: Body bytes received and not read yet (de-chunked into it by the HTTP client).
        self.buffer = bytearray()
        #: A finish was handed out: what follows goes to :attr:`tail`.
        self.finished = False
        #: ``[DONE]`` was read.
        self.done = False
        #: Events' JSON read after the finish (for the drain to judge).
        self.tail: list[Any] = []
        #: Events read (their JSON decoded), the finish's included.
        self.payloads = 0
        #: The engine was asked to stop this generation (an abort's finish is then not a failure).
        self.abort_requested = False
        self._sse: SSEParser | None = None  # once an event is not of the common shape: every event through it
        self._clean = 0  # the buffer's first bytes that hold no line break (scanned by an earlier read)
        #: Whether the events of one read may be decoded together (else one :meth:`decode_span` each).
        self.batched = True
        #: Plain tokens are kept in the read's run instead of handed out as events (see the module).
        self.relaying = False
        #: The run's version (``None``: no run), ids and logprobs.
        self.run_version: str | None = None
        self.run_ids: list[int] = []
        self.run_logprobs: list[float] = []
        self._failing: list[GenerationEvent] = []  # the events of an event that failed (see fail)
        #: Each token handed out's alternatives, in order, when the generation asked for them
        #: (``SamplingParams.top_logprobs``: the client sets an empty list); ``None``: not asked, not read.
        self.top: list[TopLogprobs] | None = None

    # -- engine-specific ----------------------------------------------------

    def feed(self, payload: Mapping[str, Any]) -> list[GenerationEvent]:
        """Events for one event's JSON."""
        raise NotImplementedError

    def end(self, done: bool) -> list[GenerationEvent]:
        """Events at the stream's end (``done``: ``[DONE]`` read); a finish, or nothing if none is due."""
        raise NotImplementedError

    def decode(self, data: bytes) -> Any:
        """One event's JSON (an engine's reader may decode less of it: SGLang's cumulative events)."""
        return orjson.loads(data)

    def take_events(self, datas: list[tuple[str, bytes]], out: list[GenerationEvent]) -> None:
        """Read events given one by one (name, data): :meth:`decode` and :meth:`feed` each."""
        for name, data in datas:
            self.take_one(name, data, out)

    def read_versions(self, source: Mapping[str, Any]) -> tuple[WeightVersionSpan, ...]:
        """An event's weight versions (``source``: where the engine writes them): its ``weight_version``, if a
        string, becomes :attr:`version`; its ``weight_versions`` spans (its tokens' versions when they differ),
        parsed, or ``()``."""
        version = source.get("weight_version")
        if isinstance(version, str):
            self.version = version
        raw_spans = source.get("weight_versions")
        return parse_spans(raw_spans) if raw_spans else ()

    def read_common(self, raw: bytearray, start: int, stop: int, out: list[GenerationEvent]) -> bool:
        """Read the lone event whose JSON is ``raw[start:stop]`` if it is of the engine's commonest kind (decoded
        and checked in one typed decode), appending its events to ``out``; ``False``: not read (nothing changed),
        decode it as any other."""
        return False

    def tokens(self, ids: list[int], logprobs: list[float]) -> list[GenerationEvent]:
        """The events of new tokens all sampled by :attr:`version`: one :class:`TokenDelta`, none for no
        tokens; while :attr:`relaying`, none either: they join the read's run (see the module)."""
        if not ids:
            return []
        version = self.version
        if self.relaying:
            if self.run_version is None:
                self.run_ids, self.run_logprobs, self.run_version = ids, logprobs, version
                return []
            if self.run_version == version:
                self.run_ids += ids
                self.run_logprobs += logprobs
                return []
        return [TokenDelta(tuple(ids), tuple(logprobs), version)]  # (_hand_out puts a run of another version first)

    def fail(self, error: BackendError, events: list[GenerationEvent]) -> NoReturn:
        """Raise ``error``: the engine failed the request in an event (its finish an error) that also brought
        ``events``, its new tokens, sampled and sent: :meth:`read` hands them out before the error, after the
        events before it (while relaying, plain tokens joined the run already: in it, they come out the same)."""
        self._failing = events
        raise error

    def run_into(self, out: list[GenerationEvent]) -> None:
        """Append the read's run, if any, to ``out`` as a :class:`TokenDelta` (no run is left)."""
        if self.run_version is not None:
            out.append(TokenDelta(tuple(self.run_ids), tuple(self.run_logprobs), self.run_version))
            self.run_version = None

    # -- reading ------------------------------------------------------------

    def read(self, out: list[GenerationEvent], *, at_end: bool = False) -> None:
        """Append to ``out`` the events of every server-sent event complete in :attr:`buffer` (removed from it).

        ``at_end``: the body ended; a last event without its blank line counts, and a stream
        that ended without a finish is given :meth:`end` (``BackendError`` if none is due).
        """
        try:
            buf = self.buffer
            sse = self._sse
            if sse is None:
                n = len(buf)
                clean = self._clean
                line_end = buf.find(b"\n", clean)
                if line_end < 0 and not at_end and buf.find(b"\r", clean) < 0:
                    self._clean = n  # no event complete yet: the next read scans only what it adds (a long event's
                    return  # bytes arrive in several reads)
                # The common read: one event alone in the buffer (its only line break is the blank line's first).
                lone = n > 8 and line_end == n - 2 and buf[n - 1] == 10
                each = not self.batched and line_end >= 0  # each alone: the shape is checked event by event
                if lone:
                    end, count = n, 1
                elif each:  # (the events' ends are found forward: a long event cut short is not searched backward)
                    end, count = n, 0
                else:
                    end = buf.rfind(b"\n\n") + 2
                    count = 0 if end < 2 else buf.count(_SEPARATOR, 0, end) + 1
                if end >= 2:
                    if each:
                        taken = self._take_each(end, line_end, out)  # (False: the events before another shape were)
                    else:
                        # (A slice compared and a byte's ``in``: no arguments parsed, as startswith and find have;
                        # ~900 instructions each a read. A lone event ends at the buffer's end.)
                        taken = buf[:6] == b"data: " and (13 not in buf if lone else (
                            buf.count(b"\n", 0, end) == 2 * count and buf.find(b"\r", 0, end) < 0))
                        if taken:
                            self._take_batch(end, count, out)
                    if taken:
                        if not each:
                            self._clean = 0
                        if not at_end:
                            return
                        if not buf.strip():
                            self._close(out)
                            return
                    else:
                        sse = self._sse = self._parser()  # another shape: every event through the parser
                elif not at_end and buf.find(b"\r") < 0:
                    return  # no event complete yet
                else:
                    sse = self._sse = self._parser()
            if sse is None:
                sse = self._parser()  # (a fresh one: its state is the buffer's, which starts at an event)
            events = sse.close() if at_end else sse.split()
            if events:
                self.take_events([(event.event, event.data) for event in events], out)
            if at_end:
                self._close(out)
        except BackendError:
            self._hand_out_failing(out)
            raise

    def read_lying(self, raw: bytearray, start: int, stop: int, out: list[GenerationEvent]) -> bool:
        """Read body bytes ``raw[start:stop]`` where they lie (not copied into :attr:`buffer`), appending their
        events to ``out``, when they are one whole event of the common shape, nothing is buffered, and the
        events are read each alone (not :attr:`batched`: SGLang's cumulative events, hundreds of KB each) or
        it is the engine's commonest event (:meth:`read_common`); ``False``: nothing was read (append the
        bytes to :attr:`buffer` and :meth:`read`). Asked only of a reader that :attr:`reads_lying`.

        The checks are :meth:`_take_each`'s for a lone event (one ``data:`` line, its only line
        break the blank line's first: one ``memchr`` over the event), and a batched read's (no
        ``\\r`` in it) for the commonest event.
        """
        if (self.done or self.buffer or self._sse is not None or stop - start < 9 or raw[stop - 1] != 10
                or raw[stop - 3] == 13 or not raw.startswith(b"data: {", start)):
            return False
        if self.batched:  # (an event of a batched read: :meth:`read`'s lone event, its line ends checked as there)
            return (not self.finished and raw.find(b"\n", start, stop) == stop - 2 and raw.find(b"\r", start, stop) < 0
                    and self.read_common(raw, start + 6, stop - 2, out))
        if self.line_break(raw, start, stop) != stop - 2:
            return False
        try:
            self.take_span(start + 6, stop - 2, out, raw)
        except BackendError:
            self._hand_out_failing(out)
            raise
        return True

    def line_break(self, raw: bytearray, start: int, stop: int) -> int:
        """Where the first line break of ``raw[start:stop]`` lies (``-1``: none); an engine's reader may leave out
        what its events repeat (SGLang's cumulative events)."""
        return raw.find(b"\n", start, stop)

    def take_one(self, name: str, data: bytes, out: list[GenerationEvent]) -> None:
        """Read one server-sent event (``name``, its ``data``)."""
        if self.done:
            return
        data = data.strip()
        if data == _DONE:
            self._end(True, out)
            return
        try:
            payload = self.decode(data)
        except ValueError as exc:
            raise BackendError(f"{self.what}: malformed stream event: {data[:200]!r}") from exc
        if name == "error" and not (isinstance(payload, Mapping) and "error" in payload):
            payload = {"error": payload}
        self._take(payload, data, out)

    def _take_batch(self, end: int, count: int, out: list[GenerationEvent]) -> None:
        """The ``count`` common-shape events in ``buffer[:end]``: one JSON decode for them all."""
        buf = self.buffer
        if buf[6] == 0x5B and buf.startswith(b"data: [DONE]\n"):  # ("[": the one test of an event's read)
            stop, done = 0, True
        elif count == 1:
            stop, done = end, False
        else:
            at = buf.find(b"\ndata: [DONE]\n", 0, end)  # (no JSON text holds a raw line break)
            done = at >= 0
            stop = at + 1 if done else end  # the events before [DONE]
            if done:
                count = buf.count(_SEPARATOR, 0, stop) + 1
        if count == 1 and not done and not self.finished and self.read_common(buf, 6, stop - 2, out):
            del buf[:end]
            return
        try:
            if stop == 0:
                payloads: list[Any] = []
            elif count == 1:
                payloads = [loads_span(buf, 6, stop - 2)]
            else:
                buf[5], buf[stop - 2] = 0x5B, 0x5D  # "data:[{...}\n\ndata: {...}]\n": one JSON array
                payloads = orjson.loads(buf[5 : stop - 1].replace(_SEPARATOR, b","))
        except ValueError:
            # One of them is malformed: each alone, so the events before it are read and it is named.
            buf[5], buf[stop - 2] = 0x20, 0x0A
            datas = bytes(buf[:stop]).split(b"\n\n")
            del buf[:end]
            self.take_events([("message", data[6:]) for data in datas if data], out)
        else:
            del buf[:end]
            for payload in payloads:
                if type(payload) is dict and not self.finished:  # (the common event: _take's checks, in line)
                    self.payloads += 1
                    if events := self.feed(payload):  # (none while relaying plain tokens)
                        self._hand_out(events, out)
                else:
                    self._take(payload, b"", out)
        if done:
            self._end(True, out)

    def _take_each(self, end: int, first: int, out: list[GenerationEvent]) -> bool:
        """The events in ``buffer[:end]``, each decoded alone where it lies (a long event is scanned for its
        line end once and copied never; ``[DONE]`` is an event's start); ``first``: the buffer's first line
        break (:meth:`read` searched for it). ``False``: an event is not of the common shape (``data:``
        line, blank line, ``\\n`` line ends): the events before it are read and removed, it and the rest
        are left in the buffer. An event cut short at ``end`` (the buffer's) is left for the next read,
        which searches on for its line end where this one stopped (:attr:`_clean`)."""
        buf = self.buffer
        spans: list[tuple[int, int]] = []
        done = common = True
        at = clean = 0
        while at < end:
            if not buf.startswith(b"data: ", at):
                common = end - at < 6 and b"data: ".startswith(buf[at:end])  # (else: cut short)
                done = False
                break
            if buf.startswith(b"[DONE]\n\n", at + 6):
                at = end  # (what follows it is dropped, as after any [DONE])
                break
            # (The first event's line end is the buffer's first line break: a long event is not searched twice.)
            line_end = buf.find(b"\n", max(at + 6, self._clean), end) if at else first
            if line_end < 0 or line_end + 1 == end:  # cut short: searched up to its end (or its line end)
                clean = (end if line_end < 0 else line_end) - at
                done = False
                break
            if buf[line_end + 1] != 10 or buf[line_end - 1] == 13:
                common = False
                break
            spans.append((at + 6, line_end))
            at = line_end + 2
        else:
            done = False
        self._clean = clean
        try:
            self.take_spans(spans, out)
        finally:
            del buf[:at]
        if done and common:
            self._end(True, out)
        return common

    def take_spans(self, spans: list[tuple[int, int]], out: list[GenerationEvent]) -> None:
        """Read the events whose JSON lies at ``spans`` (start, stop) of :attr:`buffer`, one at a time."""
        for start, stop in spans:
            self.take_span(start, stop, out)

    def take_span(self, start: int, stop: int, out: list[GenerationEvent], raw: bytearray | None = None) -> None:
        """Read the event whose JSON is ``buffer[start:stop]`` (or ``raw[start:stop]``: :meth:`read_lying`;
        :meth:`decode_span`, then :meth:`feed`)."""
        buf = self.buffer if raw is None else raw
        try:
            payload = self.decode_span(buf, start, stop)
        except ValueError as exc:
            shown = bytes(buf[start : min(stop, start + 200)])
            raise BackendError(f"{self.what}: malformed stream event: {shown!r}") from exc
        self._take(payload, b"", out)

    def decode_span(self, raw: bytes | bytearray, start: int, stop: int) -> Any:
        """The JSON of ``raw[start:stop]`` (:func:`loads_span`; an engine's reader may decode less of it)."""
        return loads_span(raw, start, stop)

    def _take(self, payload: Any, data: bytes, out: list[GenerationEvent]) -> None:
        if self.finished:
            self.tail.append(payload)
            return
        if type(payload) is not dict and not isinstance(payload, Mapping):
            shown = data or orjson.dumps(payload)
            raise BackendError(f"{self.what}: unexpected stream event: {shown[:200]!r}")
        self.payloads += 1
        if events := self.feed(payload):
            self._hand_out(events, out)

    def _hand_out_failing(self, out: list[GenerationEvent]) -> None:
        """The tokens of an event that failed (:meth:`fail`), handed out before its error."""
        if self._failing:
            failing, self._failing = self._failing, []
            self._hand_out(failing, out)

    def _hand_out(self, events: list[GenerationEvent], out: list[GenerationEvent]) -> None:
        if events and self.run_version is not None:
            self.run_into(out)  # the run's tokens came before these events
        for event in events:
            out.append(event)
            if type(event) is GenerateFinish:
                self.finished = True
                return

    def _end(self, done: bool, out: list[GenerationEvent]) -> None:
        if done:
            self.done = True
        if not self.finished:
            self._hand_out(self.end(done), out)
            if not self.finished:
                raise BackendError(f"{self.what}: the stream ended without a finish event")

    def _close(self, out: list[GenerationEvent]) -> None:
        if not self.done:
            self._end(False, out)

    def _parser(self) -> SSEParser:
        sse = SSEParser(at_start=self.payloads == 0 and not self.done)  # (a byte order mark is the stream's start's)
        sse.buffer = self.buffer
        return sse
