"""The streamed-generation driver every HTTP engine client shares.

:class:`StreamedGeneration` is one streamed generation as a
:class:`~actorproxy.engines.base.Generation`. A subclass builds the request and knows how
to ask its engine to abort; its engine's sans-IO stream decoder
(:class:`~.stream_events.StreamDecoder`) turns the body's bytes into generation events.
This class does the I/O: each read's bytes de-chunked into the decoder's buffer and decoded
in one pass (while only plain tokens come, handed to the caller's taker straight from the
read: :meth:`StreamedGeneration.relay`), the acknowledged abort, reading the stream to its end so the connection is
reused, and the shielded, bounded cleanup when the caller leaves the block early.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Generic, TypeVar

import trio

from ..http.client import Response
from ..http.errors import TransportError
from ..http.sockets import WakeLater
from .base import AbortBatch, BackendError, FinishSink, GenerateFinish, GenerationEvent, TokenDelta, TokenSink
from .connection import EngineHTTP, EngineResponse
from .deltas import take_merged
from .errors import backend_error, mapped_errors
from .stream_events import StreamDecoder

_DRAIN_LIMIT = 64 * 1024

P = TypeVar("P", bound=StreamDecoder)


class StreamedGeneration(Generic[P]):
    """A :class:`Generation` over one streamed HTTP response (see module docstring).

    ``parser`` reads the engine's events. Subclasses implement :meth:`_open` and, when
    their engine can acknowledge an abort, :meth:`_send_abort`.
    """

    what = "engine"

    def __init__(self, client: EngineHTTP, rid: str, parser: P, *, abort_grace: float) -> None:
        self.rid = rid
        self._parser = parser
        parser.what = self.what
        self._client = client
        self._grace = abort_grace
        self._response: EngineResponse | None = None
        self._body_ended = False  # the response was read to its end
        self._pending: deque[GenerationEvent] = deque()
        self._entered = False
        self._finish_queued = False
        self._abort_requested = False
        self._resend_abort = False
        self._cut: str | None = None  # why the stream is cut locally (no engine acknowledgement)
        self._error: BackendError | None = None  # raised once the events before it are delivered
        self._take: TokenSink | None = None  # the relay's taker, while it relays
        self._ended: FinishSink | None = None  # told an aborted stream's finish, while it relays
        self._go: bool | Awaitable[bool] = True  # what the taker answered a relayed read, when not True

    # -- engine-specific --------------------------------------------------

    async def _open(self) -> EngineResponse:
        """Send the request; return the (checked) streaming response."""
        raise NotImplementedError

    async def _send_abort(self) -> bool:
        """Ask the engine to stop this request; ``False`` when it cannot acknowledge."""
        return False

    def _local_finish(self, message: str) -> GenerateFinish:
        """The finish to report when the stream is cut without the engine's own."""
        return GenerateFinish("abort", weight_version=self._parser.version, message=message)

    def _tail_ok(self, payload: Mapping[str, Any]) -> bool:
        """Whether a payload after the finish may be read past to reuse the connection.

        ``False`` closes the connection instead (an engine still decoding after a
        client-side stop must be cancelled by the hang-up).
        """
        return True

    # -- the Generation protocol -----------------------------------------

    async def __aenter__(self) -> StreamedGeneration[P]:
        if self._entered:
            raise RuntimeError("a generation can be entered only once")
        self._entered = True
        try:
            with mapped_errors(self.what):
                self._response = await self._open()
        except BaseException as exc:
            # The engine may have started decoding if it never answered (cancelled or
            # timed out while waiting for headers): tell it to stop, for nobody reads.
            if not isinstance(exc, BackendError) or exc.status == 504:
                with trio.CancelScope(shield=True), trio.move_on_after(self._grace):
                    await self._send_abort()
            raise
        if self._abort_requested:
            await self._request_abort()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        response = self._response
        if (type(response) is Response and response.ended and self._finish_queued and self._error is None
                and self._cut is None):
            # The usual end of a short generation: its finish and the body's end came in the reads
            # already done, the connection is back in its pool, and nothing is left to wait for
            # (what _drain and _close_response would do here takes no await).
            self._response, self._body_ended = None, True
            return
        # Runs on cancellation too: shielded, and bounded so a dead engine cannot hang us.
        try:
            with trio.CancelScope(shield=True), trio.move_on_after(self._grace):
                if self._finish_queued and self._error is None and self._cut is None:
                    await self._drain()
                await self._close_response()
                if not self._finish_queued and self._cut is None:
                    await self._send_abort()
        finally:
            # The error raised is let go: its traceback holds this generation's frames (and so this
            # generation), a reference cycle that would keep the turn's objects until a collection.
            self._error = None

    def __aiter__(self) -> StreamedGeneration[P]:
        return self

    async def __anext__(self) -> GenerationEvent:
        if not self._entered:
            raise RuntimeError("enter the generation with `async with` before iterating")
        while True:
            pending = self._pending
            if pending:
                return pending.popleft() if len(pending) == 1 else take_merged(pending)
            if self._error is not None:
                raise self._error
            if self._finish_queued:
                raise StopAsyncIteration
            if self._cut is not None:
                await self._close_response()
                self._queue([self._local_finish(self._cut)])
                continue
            response, parser = self._response, self._parser
            assert response is not None
            try:  # the read, in this coroutine (one a streamed token)
                more = await response.receive_into(parser.buffer)
            except TransportError as exc:
                self._failed(exc)
                continue
            try:
                self._decode(more)
            except BackendError as exc:
                # Tokens that arrived before the failure are still delivered first.
                self._error = exc
                continue
            if self._resend_abort and parser.payloads and not self._finish_queued:
                self._resend_abort = False
                try:
                    with trio.move_on_after(self._grace):
                        await self._send_abort()
                except BackendError as exc:
                    self._error = exc

    def relay(self, take: TokenSink, ended: FinishSink | None = None) -> Awaitable[None] | None:
        """Give each read's plain tokens to ``take`` straight from the read (see ``Generation.relay``), and an
        aborted stream's finish to ``ended`` as it is read (:meth:`_end_early`).

        ``None`` when something must be iterated first (an event pending, an error, the
        finish, a cut stream, an abort to send again): an aborted stream's last token comes
        with its finish, a thousand at once in a pause.
        """
        return self._relay(take, ended) if self._response is not None and not self._stopped() else None

    async def _relay(self, take: TokenSink, ended: FinishSink | None) -> None:
        """The loop of :meth:`relay`: read, decode, and hand each read's run of tokens to ``take``.

        On a plain socket the task parks on the run's relay hub (``http/sockets.py: RelayHub``)
        for the whole run: the hub reads each arrival and calls :meth:`_arrived`, in its own task,
        which decodes it and hands its tokens on; the task wakes only when anything else comes.
        Else each read is this task's. A read that brought anything but plain tokens of one version
        leaves its events queued (the run of tokens before them first) and returns:
        :meth:`__anext__` goes on. What ``take`` answered other than ``True`` (``False``, or the
        awaitable of back-pressure) is handled here, in this task.
        """
        response, parser = self._response, self._parser
        assert response is not None
        wire = response if type(response) is Response else None  # (else a test's stand-in: no socket of its own)
        self._take, self._ended = take, ended
        parser.relaying = True  # (for the whole relay: its reads are the only decoding meanwhile)
        try:
            while not self._stopped():
                hub = wire.relay_hub() if wire is not None else None
                try:
                    if hub is not None:
                        assert wire is not None
                        if await wire.park(hub, self._arrived):  # the server closed the connection
                            self._relayed(await wire.receive_into(parser.buffer))
                    else:
                        self._relayed(await response.receive_into(parser.buffer))
                except TransportError as exc:
                    self._failed(exc)
                    return
                go, self._go = self._go, True
                if go is not True and (isinstance(go, bool) or not await go):
                    return
        finally:
            parser.relaying = False
            self._take = self._ended = None  # (references to the turn: no cycle left behind)

    def _stopped(self) -> bool:
        """Something must be iterated (an event pending, an error, the finish, a cut stream, an abort to send again)."""
        return bool(self._pending or self._error is not None or self._finish_queued or self._cut is not None
                    or self._resend_abort)

    def _arrived(self) -> bool | WakeLater:
        """The relay hub's call as bytes arrived for the parked :meth:`_relay`: ``True`` to wait on."""
        response = self._response
        assert type(response) is Response
        parser = self._parser
        try:
            # A whole chunk, nothing buffered: read where the hub received it (SGLang's cumulative events, an
            # engine's commonest event: not copied; see StreamDecoder.read_lying).
            lying = response.lying_chunk() if parser.reads_lying and not parser.buffer else None
            if lying is not None:
                return self._relayed(True, lying)
            more = response.received_now(parser.buffer)
        except TransportError as exc:
            self._failed(exc)
            return False
        return True if more is None else self._relayed(more)

    def _relayed(self, more: bool, lying: tuple[bytearray, int, int] | None = None) -> bool | WakeLater:
        """A read's bytes decoded (``more``: the body goes on; ``lying``: they lie there, not in the decoder's
        buffer) and its run of plain tokens taken; ``True`` to read on (or where the reader's wake-up waits:
        :meth:`_end_early`). What the taker answered other than ``True`` is left in ``_go``."""
        parser = self._parser
        try:
            self._decode(more, lying)
        except BackendError as exc:
            self._error = exc  # raised by __anext__ once the tokens before it are delivered
            return False
        if parser.run_version is not None:  # (nothing else came: else _decode queued the run too)
            ids, logprobs, version = parser.run_ids, parser.run_logprobs, parser.run_version
            parser.run_version = None
            assert self._take is not None
            go = self._take(ids, logprobs, version)
            if go is not True:
                self._go = go
                return False
        elif self._finish_queued and self._abort_requested and self._ended is not None:
            return self._end_early(self._ended)
        return not self._stopped()

    def _end_early(self, ended: FinishSink) -> bool | WakeLater:
        """An aborted stream's finish came in this read: its tokens taken here, then the finish told to ``ended``
        (the relaying task still iterates it). ``False`` to wake the task now, or where its wake-up waits.

        So a pause's thousand generations end as the hub reads their finishes, each recording what its
        read brought first; their tasks' own steps can wait until the pause is answered. Anything but
        tokens before the finish (an error, a cut), or a taker that does not answer ``True``, leaves the rest
        to the task, as before.
        """
        pending = self._pending
        finish = pending[-1]
        if self._error is not None or self._cut is not None or type(finish) is not GenerateFinish:
            return False
        take = self._take
        assert take is not None
        while len(pending) > 1:
            delta = pending[0]
            if type(delta) is not TokenDelta:
                return False
            pending.popleft()
            go = take(delta.token_ids, delta.logprobs, delta.weight_version)
            if go is not True:
                self._go = go
                return False
        return ended(finish)

    def abort_soon(self, batch: AbortBatch | None = None) -> Callable[[], Awaitable[None]] | None:
        """:meth:`abort`, begun now (see ``Generation.abort_soon``); the engine's own part is :meth:`_start_abort`."""
        if self._finish_queued or self._abort_requested:
            return None
        if not (self._entered and self._response is not None):
            return self.abort  # sent as the generation opens
        self._abort_requested = self._parser.abort_requested = True
        return self._start_abort(batch)

    def _start_abort(self, batch: AbortBatch | None) -> Callable[[], Awaitable[None]] | None:
        """Send the abort now if the engine allows; what is left (see :meth:`abort_soon`).

        By default nothing is sent here: the whole call is left to the task.
        """
        return self._request_abort

    async def abort(self) -> None:
        """Acknowledged abort: the engine stops and the stream goes on to its finish.

        An engine that cannot acknowledge (or whose abort call fails) gets its stream
        cut instead; the finish then reports what had arrived. A slow answer is waited
        for: bound the call (``trio.move_on_after``) to give up on it.
        """
        if self._finish_queued or self._abort_requested:
            await trio.lowlevel.checkpoint()
            return
        self._abort_requested = self._parser.abort_requested = True
        if self._entered and self._response is not None:
            await self._request_abort()
        else:
            await trio.lowlevel.checkpoint()

    # -- internals --------------------------------------------------------

    async def _request_abort(self) -> None:
        # Not bounded here: an engine slow to answer its abort call (busy with the very
        # streams being aborted) is still stopping them, and cutting the stream now would
        # lose the tokens in flight and leave the engine unaware. The caller bounds it
        # (the controller cuts a generation that does not end in time).
        self.abort_answered(await self._send_abort())

    def abort_answered(self, acknowledged: bool) -> None:
        """What the engine answered the abort call: a refusal cuts the stream."""
        if self._finish_queued:
            return  # the engine's finish came first: nothing is left to stop
        if not acknowledged:
            self._cut_stream("aborted; the stream was closed")
        elif self._parser.payloads == 0:
            # The engine may not have registered the request yet, making the abort a
            # no-op: send it again once the first event proves the request exists.
            self._resend_abort = True

    def _cut_stream(self, message: str) -> None:
        if self._cut is None:
            self._cut = message
        if self._response is not None:
            self._response.cut()  # a read waiting on it fails, and the loop reports the local finish

    def _failed(self, exc: TransportError) -> None:
        """A read failed: the error is raised once the events before it are delivered."""
        if self._cut is None:  # else _cut_stream: the loop reports the local finish
            error = backend_error(self.what, exc)
            error.__cause__ = exc
            self._error = error

    def _decode(self, more: bool, lying: tuple[bytearray, int, int] | None = None) -> None:
        """The events of the bytes a read brought (``more``: the body goes on; ``lying``: where they lie, when
        not in the decoder's buffer), queued.

        While relaying, a read of plain tokens only leaves them in the decoder's run (for
        :meth:`_relay` to hand over); with any event, or a failure, the run is queued too.
        """
        parser = self._parser
        if not more:
            self._body_ended = True
        out: list[GenerationEvent] = []
        failed = True
        try:
            if lying is None:
                parser.read(out, at_end=not more)
            elif not parser.read_lying(*lying, out):
                raw, start, stop = lying
                with memoryview(raw) as view:
                    parser.buffer += view[start:stop]
                parser.read(out, at_end=not more)
            failed = False
        finally:
            if out or failed:
                parser.run_into(out)  # (after the events: any earlier run went before them)
            if out:
                self._queue(out)  # the events before a failure are delivered first
            self._after_read()

    def _after_read(self) -> None:
        """What a subclass keeps of the events just read (the decoder's state is up to date)."""

    async def _drain(self) -> None:
        """Read what follows the finish (``[DONE]``, a usage chunk, the end of the
        chunked body), bounded, so the connection goes back to its pool.

        Closing a response before its end closes the connection: every turn would
        then open a new one. Stops short (the connection is then closed) on a payload
        :meth:`_tail_ok` refuses, past ``_DRAIN_LIMIT`` bytes, or on any error.
        """
        parser = self._parser
        read = 0
        while True:
            tail, parser.tail = parser.tail, []
            for payload in tail:
                if not isinstance(payload, Mapping) or not self._tail_ok(payload):
                    return
            if self._body_ended or self._response is None:
                return
            try:
                more = await self._response.receive_into(parser.buffer)
                read += len(parser.buffer)
                parser.read([], at_end=not more)
            except (TransportError, BackendError):
                return
            if not more:
                self._body_ended = True
            elif read > _DRAIN_LIMIT:
                return

    def _queue(self, events: list[GenerationEvent]) -> None:
        for event in events:
            if self._finish_queued:
                return
            self._pending.append(event)
            if type(event) is GenerateFinish:
                self._finish_queued = True

    async def _close_response(self) -> None:
        response, self._response = self._response, None
        if response is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(self._grace):
                await response.aclose()
