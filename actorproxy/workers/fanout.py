"""The control plane across workers: what the trainer and the operator ask is answered for ALL workers.

Whichever worker receives ``/v1/rollout/pause|resume|pause_state``, ``/trajectory/read`` (of no
particular session), ``/trajectory/stats``, ``/sessions``, ``/metrics``, ``/health``, ``/ready`` or
``/ui/api/overview`` sends the same request (method, path, query, headers, body) to every worker's
private HTTP socket (a Unix socket serving that worker's own app, its own answer included), waits
for all of them and merges the answers (:mod:`.merge`). A pause is acknowledged only once every
worker has acknowledged it. Nothing is silently partial: if a worker cannot be reached the answer is
``503 worker_unavailable`` (``Retry-After: 1``) naming it, and if a worker answers an error that
error is the answer. Two exceptions say what is missing instead (``missing_workers``): a draining
read (the workers that answered deliver their part; the missing ones keep theirs for the next drain)
and ``/health`` (``degraded``: a liveness probe must not fail the whole proxy while one worker
restarts). Pause and resume are idempotent, so the trainer retries them as they are.

A draining read of the whole store runs in two phases (:meth:`FanOut.drain`, :mod:`.holds`): every
worker holds its part under a token until the merged reply was sent but for its last byte, then each
deletes it (or lets it go, if the reply did not go out): a trainer whose connection breaks loses nothing.
A leased one is settled by the trainer's ``POST /trajectory/ack`` instead, which any worker takes: a
lease's id names the worker that keeps it (:func:`lease_prefix`), and another sends it on there.

A fanned-out request gets the single process's checks first, before its body is read: another
method (``POST /health``, ``HEAD``, ``OPTIONS``), a caller without the admin token, a
``Content-Length`` past the body limit are answered by this worker's own app, as the single
process answers them (405, 401, 413), and the body is discarded as it arrives. A ``GET``'s body
is discarded too (never sent on); a ``POST``'s is read up to the limit (413 past it) and sent
to each worker from the one copy.

The Claw-R1 gateway routes (``/init_trajectory``, ``/generate``, ``/trajectory/fetch_batch``, ...)
group trajectories by prompt across sessions and keep their hand-off queue in one process: with
more than one worker they answer ``404 not_served_with_workers`` (run them with ``--workers 1``).
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import socket
from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import trio
from werkzeug.exceptions import RequestEntityTooLarge

from ..errors import TooManyLeases, Unauthorized
from ..http.cycle import delivered
from ..http.h1 import MAX_RESPONSE_HEAD, ProtocolError, head_end, parse_response
from ..protocols.trainer import ReadBody
from ..runtime.holds import lease_lead
from ..schema import jsonio
from ..schema.converter import structure
from ..server.admission import Admission, RequestHeaders
from ..server.drain import ASGIApp, Message, Receive, Send
from .merge import ReadSpool, merge_history, merge_json, merge_metrics, read_reply
from .routing import FANOUT_ROUTES, body_session, default_admission, is_gateway

if TYPE_CHECKING:
    from ..runtime.holds import Holds
    from .holds import HoldMetrics

log = logging.getLogger("actorproxy.workers")

#: The request header that names a drain's hold token (:mod:`.holds`: honoured on the private socket alone).
HOLD_HEADER = b"x-actorproxy-hold"
#: The private socket's route that settles a hold (:mod:`.holds`).
SETTLE_PATH = "/_workers/settle"
#: The request header beside :data:`HOLD_HEADER` that says the hold is a leased drain's, of that many seconds: the
#: worker holds its part that much longer (:mod:`.holds`).
LEASE_HEADER = b"x-actorproxy-hold-lease"
#: The trainer's acknowledgement of a leased drain: sent on to the worker that made the lease.
ACK_PATH = "/trajectory/ack"
#: Request headers not forwarded (this hop's own framing, and a caller's hold token: the fan-out sets its own).
_HOP = frozenset({b"connection", b"content-length", b"transfer-encoding", b"expect", b"keep-alive", b"host",
                  HOLD_HEADER, LEASE_HEADER})
#: How long a worker may take to answer a fanned-out request (a pause waits for every generation to end).
ASK_TIMEOUT = 900.0
#: How long a worker may take to settle a drain (to delete what it held, committed).
SETTLE_TIMEOUT = 60.0


def control_path(directory: str, index: int) -> str:
    return os.path.join(directory, f"w{index}.http")


def lease_prefix(index: int) -> str:
    """What the ids of the leases worker ``index`` makes begin with (``runtime/holds.py``: ``Holds.prefix``)."""
    return f"w{index}."


def lease_worker(lease: str, workers: int) -> int | None:
    """The worker whose lease ``lease`` is (:func:`lease_prefix`); ``None`` if it names none of ``workers``."""
    head, dot, _ = lease.partition(".")
    number = head[1:]
    if not (dot and head[:1] == "w" and 0 < len(number) <= 6 and number.isascii() and number.isdigit()):
        return None
    index = int(number)
    return index if index < workers else None


class WorkerUnavailable(Exception):
    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"worker {index} did not answer ({reason}); nothing was merged: retry")
        self.index = index


class Answer:
    """One worker's HTTP answer."""

    __slots__ = ("status", "headers", "body", "spool", "invalid")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body
        #: A read's answer (:func:`ask` with ``spool``): its body's arrays, spooled as they came.
        self.spool: ReadSpool | None = None
        #: Why that body is not a read's answer (it was not read on).
        self.invalid: str | None = None

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key == name), None)


async def ask(directory: str, index: int, method: str, target: bytes, headers: list[tuple[bytes, bytes]],
              body: bytes, *, seconds: float = ASK_TIMEOUT, hold: bytes = b"", lease: float | None = None,
              spool: bool = False, spool_dir: str | None = None) -> Answer:
    """One HTTP/1.1 request to worker ``index``'s private socket (``connection: close``), its whole answer
    (``hold``: a drain's hold token, :mod:`.holds`, ``lease``: its lease's seconds; ``spool``: a read of the whole
    store, its successful answer's body given to a :class:`.merge.ReadSpool` as it arrives, never held whole, its
    temporary files in ``spool_dir``)."""
    lines = [f"{method} ".encode() + target + b" HTTP/1.1", b"host: worker", b"connection: close",
             b"content-length: " + str(len(body)).encode()]
    lines += [name + b": " + value for name, value in headers if name not in _HOP]
    if hold:
        lines.append(HOLD_HEADER + b": " + hold)
    if lease is not None:
        lines.append(LEASE_HEADER + b": " + repr(lease).encode())
    try:
        with trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock, trio.fail_after(seconds):
            await sock.connect(control_path(directory, index))
            stream = trio.SocketStream(sock)
            await stream.send_all(b"\r\n".join(lines) + b"\r\n\r\n")
            if body:
                await stream.send_all(body)  # the one copy every worker is sent
            return await _answer(index, stream, spool, spool_dir)
    except (OSError, trio.BrokenResourceError, trio.TooSlowError) as exc:
        raise WorkerUnavailable(index, str(exc) or type(exc).__name__) from exc


async def _answer(index: int, stream: trio.SocketStream, spool: bool, directory: str | None) -> Answer:
    """The answer coming on ``stream``, read with the HTTP/1.1 codec (``http/h1.py``): with ``spool``, a successful
    one's body fed to a :class:`.merge.ReadSpool` piece by piece (one that is not a read's is not read on:
    ``invalid`` says why); any other read whole."""
    buf = bytearray()
    while (end := head_end(buf)) < 0 and len(buf) <= MAX_RESPONSE_HEAD:
        if not (data := await stream.receive_some(1 << 16)):
            break
        buf += data
    try:
        if end < 0:
            raise ProtocolError("no head")
        status, _, fields, framing = parse_response(buf, end, "POST")
        if framing is None:
            raise ProtocolError("a 1xx head")
    except ProtocolError as exc:
        raise WorkerUnavailable(index, f"no complete answer: {exc}") from exc
    answer = Answer(status, [(k.encode(), v.encode("latin-1")) for k, v in fields.items()], b"")
    reading = ReadSpool(directory) if spool and 200 <= status < 300 else None
    body = bytearray()
    try:
        while not framing.done:
            piece = framing.read(buf)
            if piece is None:
                if data := await stream.receive_some(1 << 16):
                    buf += data
                else:
                    framing.eof()
            elif reading is not None:
                reading.feed(piece)
            else:
                body += piece
        if reading is not None:
            reading.end()
    except BaseException as exc:
        if reading is not None:
            reading.close()
        if isinstance(exc, ProtocolError):
            raise WorkerUnavailable(index, f"no complete answer: {exc}") from exc
        if reading is None or not isinstance(exc, ValueError):
            raise
        answer.invalid, reading = str(exc), None  # not a read's answer (ReadSpool's ValueError)
    answer.body, answer.spool = bytes(body), reading
    return answer


class FanOut:
    """ASGI middleware of a worker's public app: control routes answered for every worker (see the module doc)."""

    def __init__(self, app: ASGIApp, workers: int, directory: str, admission: Admission | None = None, *,
                 index: int = 0, leases: Holds | None = None, metrics: HoldMetrics | None = None,
                 spool_dir: str | None = None) -> None:
        self.app, self.workers, self.directory = app, workers, directory
        #: This worker's: an acknowledgement of a lease another worker made goes there (:meth:`acknowledge`).
        self.index = index
        #: This worker's runtime's leases (``Runtime.leases``): a leased drain of the whole store fanned out here
        #: is kept there, its acknowledgement settling every worker (:meth:`drain`); None: such a drain is refused.
        self.leases = leases
        #: Where the answers to a read of the whole store are spooled past a MiB (None: the system's temporary
        #: directory; a worker gives its store's, a disk, where a tmpfs would hold them in memory).
        self.spool_dir = spool_dir
        #: Where the settles that failed are counted (this worker's ``/metrics``).
        self.metrics = metrics
        #: The app's own admission step: a request it refuses is answered by this worker's app, as one process does.
        self.admission = admission or default_admission()

    async def __call__(self, scope: Any, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if is_gateway(path):
            await reply(send, 404, error_body(
                "the Claw-R1 gateway routes are not served with several workers: their prompt groups span "
                "sessions, which several workers serve; run it with --workers 1 (docs/workers.md)",
                "not_served_with_workers", "invalid_request_error"))
            return
        method = "POST" if path == ACK_PATH else FANOUT_ROUTES.get(path)
        if method is None or method != scope["method"] or not self.admitted(scope):
            await self.app(scope, receive, send)  # answered as the single process answers it, before any body
            return
        if method == "GET":
            await self.fan_out(scope, receive, send)  # a GET's body: the server drops it after the answer
            return
        body = await read_body(receive, self.admission.max_body)
        if body is None:
            failed = self.admission.refusal(RequestEntityTooLarge(), method="POST", path=path)
            await reply(send, failed.status, jsonio.dumps(failed.data), close=True)
            return
        if path == ACK_PATH:
            await self.acknowledge(scope, receive, send, body)
            return
        if path == "/trajectory/read" and body_session(body) is not None:  # one session: its owner routed it here
            await self.app(scope, _replay(body, receive), send)  # (a leased one: its lease is made there)
            return
        if path == "/trajectory/read" and self.leases is None and _leases(body):
            await reply(send, 400, error_body(
                "'lease' with a drain of the whole store is not served by this fan-out (it keeps no leases): lease "
                "one session's drain at a time (session_id)", "not_served_with_workers", "invalid_request_error",
                param="lease"))
            return
        await self.fan_out(scope, receive, send, body)

    async def acknowledge(self, scope: Any, receive: Receive, send: Send, body: bytes) -> None:
        """``POST /trajectory/ack``: a lease another worker made (its id names it: :func:`lease_worker`) is
        acknowledged there, over its private socket, its answer relayed as it is (that worker's keeper remembers how
        the lease ended: a repeat answers as the first did); any other (this worker's, or one
        naming no worker: 404 ``unknown_lease``, a bad body: 400) is this worker's app's to answer."""
        lease = _read_field(body, "lease")
        index = lease_worker(lease, self.workers) if isinstance(lease, str) else None
        if index is None or index == self.index:
            await self.app(scope, _replay(body, receive), send)
            return
        try:  # (within ASK_TIMEOUT: the answer waits for every worker's settle there, each within SETTLE_TIMEOUT)
            answer = await ask(self.directory, index, "POST", _target(scope), list(scope["headers"]), body)
        except WorkerUnavailable as exc:
            await reply(send, 503, error_body(
                f"the worker that holds lease {lease!r} did not answer its acknowledgement: {exc} (retry it: a "
                "repeated acknowledgement is answered as the first was, once that one is settled)",
                "worker_unavailable", "server_error"), retry_after=True)
            return
        await reply(send, answer.status, answer.body, content_type=answer.header(b"content-type"))

    def admitted(self, scope: Any) -> bool:
        """Whether the app's admission step lets the request in, its announced body within the limit (else the
        worker's own app refuses it: 401, 413)."""
        headers = RequestHeaders(scope["headers"])
        client = scope.get("client")
        try:
            self.admission.admit(scope["path"], headers, client[0] if client else None)
            self.admission.check_length(headers)
        except (Unauthorized, RequestEntityTooLarge):
            return False
        return True

    async def fan_out(self, scope: Any, receive: Receive, send: Send, body: bytes = b"") -> None:
        """Ask every worker, merge their answers (see the module doc); a drain's in two phases (:meth:`drain`)."""
        path = scope["path"]
        if path == "/trajectory/read" and _drains(body):
            await self.drain(scope, send, body)
            return
        reading = path == "/trajectory/read"
        results = await self.ask_all(scope["method"], _target(scope), list(scope["headers"]), body, spool=reading)
        if reading:
            try:
                pieces = await self.read(send, results, draining=False)
                if pieces is not None:
                    await _reply_pieces(send, pieces, end=b"}")
            finally:
                _close(results)
            return
        merged = await self.merged(send, path, results)
        if merged is not None:
            await reply(send, 200, jsonio.dumps(merged))

    async def answered(self, send: Send, path: str, results: list[Answer | WorkerUnavailable], *,
                       draining: bool = False) -> tuple[list[Answer], list[int]] | None:
        """The workers that answered and those missing (``None``: the answer was sent: a failure, see the module
        doc; only a drain and ``/health`` go on without every worker)."""
        answers = [r for r in results if isinstance(r, Answer) and 200 <= r.status < 300]
        missing = [i for i, r in enumerate(results) if not (isinstance(r, Answer) and 200 <= r.status < 300)]
        if missing and not (answers and (draining or path == "/health")):
            failed = results[missing[0]]
            if isinstance(failed, WorkerUnavailable):
                await reply(send, 503, error_body(str(failed), "worker_unavailable", "server_error"), retry_after=True)
            else:  # the same refusal every worker gives (auth, a bad body), or one worker's error
                await reply(send, failed.status, failed.body, content_type=failed.header(b"content-type"))
            return None
        return answers, missing

    async def read(self, send: Send, results: list[Answer | WorkerUnavailable], *,
                   draining: bool, lead: bytes = b"") -> Iterator[bytes] | None:
        """A read of the whole store: the workers' spooled answers spliced (:func:`.merge.read_reply`), in pieces
        but for the closing ``}`` (``None``: the answer was sent: a failure). A drain that could not reach every
        worker says which ones in ``missing_workers``: their data is still in their stores, for the next drain
        (the others' goes out now)."""
        found = await self.answered(send, "/trajectory/read", results, draining=draining)
        if found is None:
            return None
        answers, missing = found
        invalid = next((a.invalid for a in answers if a.invalid is not None), None)
        if invalid is not None:  # (a worker of another build?) nothing is merged, nothing drained
            await reply(send, 502, error_body(f"a worker's read answer could not be merged: {invalid}",
                                              "worker_answer_invalid", "server_error"))
            return None
        pieces = read_reply([a.spool for a in answers if a.spool is not None], lead)
        if not missing:
            return pieces
        log.warning("a draining read could not reach worker(s) %s: their data waits for the next read", missing)
        return itertools.chain(pieces, [b',"missing_workers":' + jsonio.dumps(missing)])

    async def merged(self, send: Send, path: str, results: list[Answer | WorkerUnavailable]) -> Any:
        """The workers' answers merged (``None``: the answer was sent: a failure, or ``/metrics``)."""
        found = await self.answered(send, path, results)
        if found is None:
            return None
        answers, missing = found
        if path == "/metrics":
            text = merge_metrics([a.body.decode() for a in answers])
            await reply(send, 200, text.encode(), content_type=answers[0].header(b"content-type"))
            return None
        merged = merge_json([jsonio.loads(a.body, check=False) for a in answers])
        if isinstance(merged, dict) and path != "/trajectory/read":
            merged["workers"] = self.workers
        if path == "/ui/api/overview" and isinstance(merged, dict) and isinstance(merged.get("history"), list):
            merged["history"] = merge_history(merged["history"])
        if missing:  # /health: a liveness probe must not fail the whole proxy while one worker restarts
            merged["missing_workers"] = missing
            merged["status"] = "degraded"
        return merged

    async def drain(self, scope: Any, send: Send, body: bytes) -> None:
        """A draining read of the whole store, in two phases: every worker answers under a hold token and deletes
        nothing (:mod:`.holds`); the merged reply goes out but for its last byte, then every worker is settled
        (what it answered deleted, or let go of if the reply did not go out), then that byte.

        A worker whose delete is not confirmed (it died, its disk failed, its hold expired) is named in the
        reply's ``unsettled_workers``: what it answered was not deleted there, and comes again in a later
        drain (at least once, never lost). A reply given up (the trainer gone, the request cancelled) lets go of
        everything the workers hold, for the next drain.

        A leased drain (``"lease": seconds``) is settled by the trainer's acknowledgement instead: the reply begins
        with ``"lease"``, and once it was delivered this worker's :attr:`leases` keep it (bounded, as one process's)
        until ``POST /trajectory/ack`` settles every worker (:meth:`settle_lease`) or its seconds pass (every
        worker lets go). Each worker holds its part that much longer than a plain drain's (:data:`LEASE_HEADER`)."""
        token, seconds = secrets.token_urlsafe(18), _lease(body) if self.leases is not None else None
        lease = lead = None
        if seconds is not None and self.leases is not None:
            try:
                lease = self.leases.new_lease()
            except TooManyLeases as exc:
                await reply(send, exc.status, jsonio.dumps(exc.to_openai()))  # (as one process answers it)
                return
            lead = lease_lead(lease, seconds)
        answered: list[int] = []
        results: list[Answer | WorkerUnavailable] = []
        kept = False
        try:
            results = await self.ask_all("POST", _target(scope), list(scope["headers"]), body, token.encode(),
                                         lease=seconds, spool=True)
            pieces = await self.read(send, results, draining=True, lead=lead or b"")
            if pieces is None:
                return
            answered = [i for i, r in enumerate(results) if isinstance(r, Answer) and 200 <= r.status < 300]
            await _reply_pieces(send, pieces)
            if not await delivered(scope):
                answered = []
                return  # the reply is left cut short: the server closes the connection
            if lease is not None and self.leases is not None:  # settled by the trainer's acknowledgement
                self.leases.keep(lease, (), seconds, elsewhere=partial(self.settle_lease, token, answered))
                kept = True
                unsettled = []
            else:
                unsettled = await self.settle_all(token, answered)
        except BaseException:
            answered = []
            raise
        finally:
            _close(results)
            if lease is not None and not kept and self.leases is not None:
                self.leases.drop(lease)
            if not answered:  # not delivered: every worker lets go of what it holds, for the next drain
                await self.settle_all(token, [])
        if unsettled:
            log.warning("a drain across workers was delivered but worker(s) %s did not confirm their delete: "
                        "what they answered comes again in a later drain (the reply says unsettled_workers)",
                        unsettled)
        end = b',"unsettled_workers":' + jsonio.dumps(unsettled) + b"}" if unsettled else b"}"
        await send({"type": "http.response.body", "body": end})

    async def settle_lease(self, token: str, answered: list[int], delivered: bool) -> list[int]:
        """A leased drain across workers acknowledged (``delivered``: deleted on the workers in ``answered``) or
        released, or its lease ended (every worker lets go); the workers that did not confirm their delete."""
        unsettled = await self.settle_all(token, answered if delivered else [])
        if unsettled:
            log.warning("a leased drain across workers was acknowledged but worker(s) %s did not confirm their "
                        "delete: what they answered comes again in a later drain", unsettled)
        return unsettled

    async def settle_all(self, token: str, answered: list[int]) -> list[int]:
        """Settle ``token`` on every worker: those in ``answered`` (their part of the reply went out) delete what
        they hold, the others let it go.

        Shielded (a cancelled reply still lets go) and bounded (``SETTLE_TIMEOUT``); returns the workers of
        ``answered`` that did not confirm their delete."""
        confirmed: set[int] = set()

        async def one(index: int) -> None:
            settle = jsonio.dumps({"token": token, "delivered": index in answered})
            try:
                answer = await ask(self.directory, index, "POST", SETTLE_PATH.encode(), [], settle,
                                   seconds=SETTLE_TIMEOUT)
            except WorkerUnavailable as exc:
                if index in answered:
                    log.warning("worker %d did not delete its part of a delivered drain: %s", index, exc)
                return  # (one that held nothing, or is down, has nothing to let go of: its hold expires if any)
            if answer.status == 200:
                confirmed.add(index)
            elif index in answered:
                log.warning("worker %d did not delete its part of a delivered drain (%d): %s", index, answer.status,
                            answer.body[:300].decode(errors="replace"))

        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for index in range(self.workers):
                    nursery.start_soon(one, index)
        unsettled = [i for i in answered if i not in confirmed]
        if self.metrics is not None:
            self.metrics.settles_failed += len(unsettled)
        return unsettled

    async def ask_all(self, method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
                      hold: bytes = b"", *, lease: float | None = None,
                      spool: bool = False) -> list[Answer | WorkerUnavailable]:
        """Every worker's answer (or why there is none), in worker order; all asked at once (``spool``: reads of
        the whole store, :func:`ask`; :func:`_close` them once used)."""
        results: list[Answer | WorkerUnavailable] = [WorkerUnavailable(i, "not asked") for i in range(self.workers)]

        async def one(index: int) -> None:
            try:
                results[index] = await ask(self.directory, index, method, target, headers, body, hold=hold,
                                           lease=lease, spool=spool, spool_dir=self.spool_dir)
            except WorkerUnavailable as exc:
                results[index] = exc

        async with trio.open_nursery() as nursery:
            for index in range(self.workers):
                nursery.start_soon(one, index)
        return results


async def _reply_pieces(send: Send, pieces: Iterator[bytes], *, end: bytes | None = None) -> None:
    """A JSON reply sent in ``pieces``, each let go of once sent, then ``end`` (``None``: its end is sent later)."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    for piece in pieces:
        await send({"type": "http.response.body", "body": piece, "more_body": True})
    if end is not None:
        await send({"type": "http.response.body", "body": end})


def _close(results: list[Answer | WorkerUnavailable]) -> None:
    """Let go of the answers' spools (their temporary files)."""
    for result in results:
        if isinstance(result, Answer) and result.spool is not None:
            result.spool.close()


def _target(scope: Any) -> bytes:
    target: bytes = scope["raw_path"] + (b"?" + scope["query_string"] if scope["query_string"] else b"")
    return target


def _drains(body: bytes) -> bool:
    return _read_field(body, "drain") is True


def _leases(body: bytes) -> bool:
    return _read_field(body, "lease") is not None


def _lease(body: bytes) -> float | None:
    """The seconds of the lease a drain asks for, read as the app reads them (``None``: none; a body the app
    refuses: the workers answer its 400)."""
    try:
        read = structure(jsonio.loads(body) if body.strip() else {}, ReadBody)
    except Exception:
        return None
    return read.lease if read.drain else None


def _read_field(body: bytes, name: str) -> Any:
    try:
        parsed = jsonio.loads(body) if body.strip() else {}
    except Exception:  # the workers answer the 400
        return None
    return parsed.get(name) if isinstance(parsed, dict) else None


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The request's body; ``None`` past ``limit`` bytes (what came is discarded)."""
    pieces, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        piece = message.get("body", b"")
        size += len(piece)
        if size > limit:
            return None
        pieces.append(piece)
        if not message.get("more_body", False):
            break
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def _replay(body: bytes, receive: Receive) -> Receive:
    given = False

    async def replay() -> Message:
        nonlocal given
        if given:
            return await receive()
        given = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay


def error_body(message: str, code: str, kind: str, param: str | None = None) -> bytes:
    return jsonio.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}})


async def reply(send: Send, status: int, body: bytes, *, content_type: bytes | None = None,
                 retry_after: bool = False, close: bool = False) -> None:
    headers = [(b"content-type", content_type or b"application/json")]
    if retry_after:
        headers.append((b"retry-after", b"1"))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
