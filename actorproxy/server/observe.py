"""What operators watch: a log line per request, Prometheus metrics, a rolling history for the dashboard.

:class:`Observer` hooks into the Quart app. Every request gets a
:class:`RequestInfo` (held in a context variable, so the turn machinery can
fill in what only it knows: the session, the token counts, the time of the
first token) and, when it ends, one log line (``actorproxy.access``) and its
metrics. A streamed reply ends when its last byte is sent, not when the view
returns: its body is wrapped so the line is written then.

Metrics live in a registry of this app's own (never the global one): request
and turn counters, latency and time-to-first-token histograms, token counters,
and, read from the actors at scrape time, the sessions, store, pause state and
engines. ``GET /metrics`` serves them in Prometheus' text format.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import attrs
import orjson
import trio
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from quart import Response, request
from quart.wrappers.response import IterableBody
from quart_trio import QuartTrio

from ..http.cycle import SLOW_BODY_EXTENSION
from ..runtime.runtime import ClientGone, Runtime
from ..schema.converter import CONVERTER
from ..telemetry import CURRENT, RequestInfo
from .request_metrics import RequestMetrics

log = logging.getLogger("actorproxy.access")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
#: Sessions whose recent activity the dashboard can rank.
_ACTIVITY_MEMORY = 2000
#: Seconds of per-second history the dashboard can chart.
HISTORY_SECONDS = 600


@attrs.define
class _Second:
    at: int
    requests: int = 0
    turns: int = 0
    errors: int = 0
    latency_ms_sum: float = 0.0
    turn_latency_ms: list[float] = attrs.field(factory=list)
    sampled_tokens: int = 0


class Observer:
    """Access log, metrics and history of one app."""

    def __init__(self, *, repeat_limit: int = 5, repeat_window: float = 10.0) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.metrics = RequestMetrics(_LATENCY_BUCKETS)
        self.registry.register(self.metrics)
        self._snapshot = _Snapshot()
        self.registry.register(self._snapshot)
        self.history: deque[_Second] = deque(maxlen=HISTORY_SECONDS)
        self._repeat_limit, self._repeat_window = repeat_limit, repeat_window
        self._repeats: dict[tuple[Any, ...], tuple[float, int]] = {}
        #: Recent activity per session, least recently active first (bounded).
        self.activity: OrderedDict[str, dict[str, Any]] = OrderedDict()
        #: The trainer's hand-off, when the gateway routes are mounted (its counters go to /metrics).
        self.handoff: Any = None
        #: The gateway's token-in generations waiting for /submit_steps (``TokenInGenerations``).
        self.generations: Any = None

    # -- hooks -------------------------------------------------------------------------

    def install(self, app: QuartTrio) -> None:
        @app.before_request
        async def _begin() -> None:
            rule = request.url_rule.rule if request.url_rule is not None else "<unmatched>"
            args = request.view_args or {}
            info = RequestInfo(request.method, request.path, rule, time.perf_counter())
            info.session = args.get("url_session") or request.headers.get("X-Session-Id")
            CURRENT.set(info)

        @app.after_request
        async def _end(response: Response) -> Response:
            info = CURRENT.get()
            if info is None:  # a request that failed before routing (a 404/405 of the router)
                info = RequestInfo(request.method, request.path, "<unmatched>", time.perf_counter())
            info.status = response.status_code
            body = response.response
            if response.status_code >= 400 and info.error_code is None and not isinstance(body, IterableBody):
                # Not a refusal of the error handlers (they set the proxy's code): what the body says.
                info.error_code = error_code(await response.get_data(as_text=False))
            if isinstance(body, IterableBody):
                body.iter = self._finish_after(body.iter, info)
            else:
                self.finish(info)
            return response

        @app.teardown_request
        async def _torn_down(_: BaseException | None) -> None:
            # Cancelled before any response (its body never came, or the client went away): counted and logged
            # all the same. Async and without a checkpoint: it runs inside the cancelled request's teardown.
            info = CURRENT.get()
            if info is None or info.finished or info.status is not None:
                return
            extensions: Any = request.scope.get("extensions") or {}
            too_slow = extensions.get(SLOW_BODY_EXTENSION)
            if too_slow is not None and too_slow() is not None:
                info.status, info.error_code = 408, "request_timeout"
            else:  # as nginx's 499: the client closed the request
                info.status, info.error_code = 499, "client_disconnected"
            self.finish(info)

    async def _finish_after(self, body: AsyncIterator[bytes], info: RequestInfo) -> AsyncIterator[bytes]:
        """``body``, the request counted and logged once it ended. Its head said its status, but a body closed
        before its end (the client gone, its connection broken) is a 499 ``client_disconnected``, as a turn's
        is (nginx's "client closed request"); one whose own reading failed keeps its status, marked
        ``reply_cut_short``."""
        try:
            async for chunk in body:
                yield chunk
        except ClientGone:  # the body found its client gone (a drain's, before it deletes): it ends
            info.status, info.error_code = 499, "client_disconnected"
        except (GeneratorExit, trio.Cancelled):
            info.status, info.error_code = 499, "client_disconnected"
            raise
        except BaseException:
            info.error_code = "reply_cut_short"
            raise
        finally:
            self.finish(info)
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                await aclose()

    def finish(self, info: RequestInfo) -> None:
        """Count and log one request (once)."""
        if info.finished:
            return
        info.finished = True
        now = time.perf_counter()
        status = info.status or 0
        seconds = now - info.started
        metrics = self.metrics
        metrics.request(info.route, info.method, str(status), seconds)
        second = self._second(int(time.time()))
        second.requests += 1
        second.latency_ms_sum += seconds * 1000
        if status >= 400:
            second.errors += 1
        if info.sampled_tokens is not None or (info.route.endswith(_TURN_ROUTES) and status):
            metrics.turn(info.route, str(status))
            second.turns += 1
            second.turn_latency_ms.append(seconds * 1000)
        if info.sampled_tokens is not None and info.session:
            seen = self.activity.pop(info.session, None) or {"session_id": info.session, "turns": 0, "tokens": 0}
            seen["turns"] += 1
            seen["tokens"] += info.sampled_tokens
            seen["last_seen"] = time.time()
            self.activity[info.session] = seen
            while len(self.activity) > _ACTIVITY_MEMORY:
                self.activity.popitem(last=False)
        if info.sampled_tokens is not None:
            metrics.prompt_tokens += info.prompt_tokens or 0
            metrics.sampled_tokens += info.sampled_tokens
            second.sampled_tokens += info.sampled_tokens
        if info.first_token_at is not None:
            metrics.first_token(info.route, info.first_token_at - info.started)
        self._log(info, now)

    def _second(self, at: int) -> _Second:
        if not self.history or self.history[-1].at != at:
            self.history.append(_Second(at))
        return self.history[-1]

    def _log(self, info: RequestInfo, now: float) -> None:
        status = info.status or 0
        level = logging.WARNING if status >= 500 else logging.INFO
        if not log.isEnabledFor(level):
            return
        fields: dict[str, Any] = {
            "method": info.method,
            "path": info.path,
            "session": info.session,
            "status": status,
            "ms": round(info.elapsed_ms(now), 1),
        }
        if info.prompt_tokens is not None:
            fields["prompt_tokens"], fields["sampled_tokens"] = info.prompt_tokens, info.sampled_tokens
        if info.first_token_at is not None:
            fields["ttft_ms"] = round((info.first_token_at - info.started) * 1000, 1)
        if info.error_code:
            fields["error"] = info.error_code
            if info.error_detail:
                fields["detail"] = _Quoted(info.error_detail[:300])
        if status >= 400 and self._suppressed((status, info.error_code, info.route), now):
            return
        log.log(level, _AccessLine(fields), extra={"fields": fields})

    def _suppressed(self, key: tuple[Any, ...], now: float) -> bool:
        """Rate-limit identical error lines: ``repeat_limit`` per window, then one summary."""
        start, count = self._repeats.get(key, (now, 0))
        if now - start > self._repeat_window:
            if count > self._repeat_limit:
                log.info("%d more %s responses (error %s on %s) in the last %.0f s were not logged",
                         count - self._repeat_limit, key[0], key[1], key[2], now - start)
            start, count = now, 0
        count += 1
        self._repeats[key] = (start, count)
        if len(self._repeats) > 1000:  # bounded: forget the oldest keys
            for old in list(self._repeats)[:500]:
                del self._repeats[old]
        return count > self._repeat_limit

    # -- scraping ------------------------------------------------------------------------

    def render(self, state: Mapping[str, Any]) -> bytes:
        """The metrics text, with ``state`` (gathered from the actors just now) as gauges."""
        self._snapshot.state = state
        try:
            return generate_latest(self.registry)
        finally:
            self._snapshot.state = {}

    def busiest(self, window: float = 300.0, top: int = 10) -> list[dict[str, Any]]:
        """The sessions that sampled the most tokens among those active in the last ``window`` seconds."""
        cutoff = time.time() - window
        recent = [dict(s) for s in self.activity.values() if s["last_seen"] >= cutoff]
        return sorted(recent, key=lambda s: s["tokens"], reverse=True)[:top]

    def recent(self, seconds: int = 300) -> list[dict[str, Any]]:
        """Per-second aggregates of the last ``seconds`` (for the dashboard's charts)."""
        cutoff = int(time.time()) - seconds
        out = []
        for s in self.history:
            if s.at < cutoff:
                continue
            latencies = sorted(s.turn_latency_ms)
            out.append({
                "t": s.at,
                "requests": s.requests,
                "turns": s.turns,
                "errors": s.errors,
                "sampled_tokens": s.sampled_tokens,
                "p50_ms": latencies[len(latencies) // 2] if latencies else None,
                "p99_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else None,
            })
        return out


async def gather_state(runtime: Runtime) -> dict[str, Any]:
    """What the actors report right now (sessions, store, pause state, engines)."""
    statistics = getattr(runtime.backend, "statistics", None)
    return {
        "census": await runtime.census(),
        "store": await runtime.store_stats(),
        "pause": CONVERTER.unstructure(await runtime.pause_state()),
        "engines": statistics()["engines"] if statistics is not None else [],
        "last_pause_seconds": runtime.last_pause_seconds,
        "leases": {"open": len(runtime.leases), "expired": runtime.leases.expired},
    }


def _with_handoff(state: dict[str, Any], observer: Observer) -> dict[str, Any]:
    if observer.handoff is not None:
        state["handoff"] = observer.handoff.statistics()
    if observer.generations is not None:
        state["token_in"] = observer.generations.statistics()
    return state


def add_metrics_route(app: QuartTrio, runtime: Runtime, observer: Observer) -> None:
    """``GET /metrics``: Prometheus' text format (the admin's, like every route but the agents')."""

    @app.get("/metrics")
    async def metrics() -> Response:
        body = observer.render(_with_handoff(await gather_state(runtime), observer))
        return Response(body, status=200, content_type=CONTENT_TYPE_LATEST)


class _Quoted(str):
    """A field the text line quotes, as JSON (it has spaces); a JSON line has it as the string it is."""

    __slots__ = ()

    def __format__(self, spec: str) -> str:
        return orjson.dumps(str(self)).decode()


class _AccessLine:
    """An access line's text, written only when a handler formats the record (``key=value`` pairs)."""

    __slots__ = ("fields",)

    def __init__(self, fields: dict[str, Any]) -> None:
        self.fields = fields

    def __str__(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.fields.items() if v is not None)


#: Route endings that are model calls.
_TURN_ROUTES = ("/v1/chat/completions", "/v1/messages", "/v1/responses", "/generate")


def error_code(body: bytes) -> str | None:
    try:
        data = orjson.loads(body)
    except ValueError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("code") or error.get("type") or "") or None
    return None


class _Snapshot:
    """Gauges read from the actors at scrape time (set by :meth:`Observer.render`)."""

    def __init__(self) -> None:
        self.state: Mapping[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        state = self.state
        census = state.get("census", {})
        yield _gauge("actorproxy_active_sessions", "Live session actors", census.get("active_sessions"))
        for key in ("sessions_started", "sessions_evicted", "sessions_failed"):
            yield _counter(f"actorproxy_{key}", f"Sessions {key.split('_')[1]}", census.get(key))
        store = state.get("store", {})
        yield _gauge("actorproxy_store_sessions", "Sessions held by the store", store.get("sessions"))
        yield _gauge("actorproxy_store_segments", "Segments held by the store", store.get("segments"))
        yield _gauge("actorproxy_store_tokens", "Tokens held by the store", store.get("tokens"))
        yield _gauge("actorproxy_store_bytes", "Bytes held by the store", store.get("bytes"))
        yield _gauge("actorproxy_store_failed", "1 while the store's disk fails (new turns refused)",
                     int(bool(store.get("failed"))))
        yield _gauge("actorproxy_store_pending_writes", "Writes kept in memory while the store's disk fails",
                     store.get("pending_writes"))
        for key in ("segments_stored", "steps_stored", "segments_drained", "dropped_sessions", "dropped_segments",
                    "dropped_tokens", "recovered_steps", "superseded_steps", "commit_failures"):
            yield _counter(f"actorproxy_store_{key}", f"Store: {key.replace('_', ' ')}", store.get(key))
        yield _labelled(CounterMetricFamily, "actorproxy_segment_boundaries",
                        "Segments started by a broken append-only contract, by reason", "reason",
                        store.get("boundaries"))
        yield _labelled(CounterMetricFamily, "actorproxy_prefix_rebuilds",
                        "Prefixes rebuilt in place (--on-history-rewrite recompute), by reason", "reason",
                        store.get("rebuilds"))
        yield _labelled(CounterMetricFamily, "actorproxy_echoes_tolerated",
                        "Echoed replies matched although the client rewrote them, by rewrite", "rewrite",
                        store.get("echo_tolerated"))
        yield _labelled(CounterMetricFamily, "actorproxy_segments_by_close_reason",
                        "Segments stored, by what closed them", "reason", store.get("closed_by"))
        verify = store.get("verify") or {}
        yield _labelled(CounterMetricFamily, "actorproxy_verify_findings",
                        "--verify-tito differences, by kind", "kind", verify.get("by_kind"))
        pause = state.get("pause", {})
        yield _gauge("actorproxy_paused", "1 while generation is paused", 1 if pause.get("state") == "paused" else 0)
        yield _gauge("actorproxy_weight_epoch", "Weight epoch", pause.get("epoch"))
        yield _gauge("actorproxy_generations_in_flight", "Generations in flight", pause.get("in_flight"))
        yield _gauge("actorproxy_turns_waiting_for_resume", "Turns waiting for resume", pause.get("waiting"))
        yield _counter("actorproxy_pauses", "Pauses", pause.get("pauses"))
        yield _counter("actorproxy_aborted_generations", "Generations aborted by pauses", pause.get("aborted_total"))
        yield _gauge("actorproxy_last_pause_ack_seconds", "How long the last pause took to be acknowledged",
                     state.get("last_pause_seconds"))
        engines = state.get("engines") or []
        for name, key, text in (("healthy", "healthy", "1 when the engine is healthy"),
                                ("in_flight", "in_flight", "Generations running on the engine"),
                                ("queued", "queued", "Generations waiting for the engine")):
            family = GaugeMetricFamily(f"actorproxy_engine_{name}", text, labels=["engine"])
            for engine in engines:
                value = engine.get(key)
                if value is not None:
                    family.add_metric([str(engine.get("name"))], float(value))
            yield family
        handoff = state.get("handoff") or {}
        yield _gauge("actorproxy_handoff_pending_groups", "Prompt groups waiting for the trainer",
                     handoff.get("pending_groups"))
        yield _counter("actorproxy_handoff_dropped_groups", "Prompt groups dropped (--max-pending-groups)",
                       handoff.get("dropped_groups"))
        leases = state.get("leases") or {}
        yield _gauge("actorproxy_drain_leases_open", "Leased drains waiting for the trainer's acknowledgement",
                     leases.get("open"))
        yield _counter("actorproxy_drain_leases_expired",
                       "Leased drains not acknowledged in time: what they read was given back", leases.get("expired"))
        token_in = state.get("token_in") or {}
        yield _gauge("actorproxy_token_in_generations_waiting",
                     "Token-in /generate results waiting for the /submit_steps that claims them",
                     token_in.get("waiting"))
        yield _counter("actorproxy_token_in_generations_unclaimed",
                       "Token-in /generate results never claimed, stored as steps of their own sessions",
                       token_in.get("unclaimed_stored"))


def _gauge(name: str, text: str, value: Any) -> Metric:
    family = GaugeMetricFamily(name, text)
    if isinstance(value, int | float) and not isinstance(value, bool):
        family.add_metric([], float(value))
    return family


def _counter(name: str, text: str, value: Any) -> Metric:
    family = CounterMetricFamily(name, text)
    if isinstance(value, int | float) and not isinstance(value, bool):
        family.add_metric([], float(value))
    return family


def _labelled(kind: Any, name: str, text: str, label: str, values: Any) -> Metric:
    family: CounterMetricFamily | GaugeMetricFamily = kind(name, text, labels=[label])
    if isinstance(values, Mapping):
        for key, value in values.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                family.add_metric([str(key)], float(value))
    return family
