"""The per-request metrics as plain numbers, turned into Prometheus families only when scraped.

Why not ``prometheus_client``'s ``Counter`` and ``Histogram``: every ``inc`` and
``observe`` takes a lock and validates its amount, and ``labels()`` validates and
locks too; a request updated six of them, about 15 µs of the ingress's CPU per
request. Here a request adds to a few dict entries (one event loop, no threads:
no lock needed), and :meth:`RequestMetrics.collect` builds the same families
(names, labels, buckets) when ``/metrics`` is read.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


class Histogram:
    """Counts per bucket (``le`` bounds, then +Inf) and the sum of what was observed."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # the first bucket whose bound is >= value
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip([*map(floatToGoString, self.bounds), "+Inf"], self.counts, strict=True):
            running += count
            out.append((bound, float(running)))
        return out


#: The methods a request is counted under; any other (a client may send any token) is ``other``.
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE"})


def method_label(method: str) -> str:
    """``method`` as a label: one of :data:`METHODS`, else ``other``."""
    return method if method in METHODS else "other"


def status_label(status: str) -> str:
    """A status as a label: its three digits (100-599), else ``other``."""
    return status if len(status) == 3 and "100" <= status <= "599" and status.isdigit() else "other"


class RequestMetrics:
    """Requests, turns, latencies and tokens, by route (a Prometheus collector of its own).

    Every label takes its values from a fixed set, whatever clients send: the route
    is the URL map's rule (``<unmatched>`` for a path it does not know), the method
    one of :data:`METHODS` or ``other``, the status three digits the server chose.
    """

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.requests: dict[tuple[str, str, str], int] = {}  # (route, method, status) -> count
        self.turns: dict[tuple[str, str], int] = {}  # (route, status) -> count
        self.latency: dict[str, Histogram] = {}  # route -> seconds from request to last byte
        self.ttft: dict[str, Histogram] = {}  # route -> seconds from request to the first sampled token
        self.prompt_tokens = 0
        self.sampled_tokens = 0

    def request(self, route: str, method: str, status: str, seconds: float) -> None:
        key = (route, method_label(method), status_label(status))
        self.requests[key] = self.requests.get(key, 0) + 1
        self._histogram(self.latency, route).observe(seconds)

    def turn(self, route: str, status: str) -> None:
        key = (route, status_label(status))
        self.turns[key] = self.turns.get(key, 0) + 1

    def first_token(self, route: str, seconds: float) -> None:
        self._histogram(self.ttft, route).observe(seconds)

    def _histogram(self, by_route: dict[str, Histogram], route: str) -> Histogram:
        histogram = by_route.get(route)
        if histogram is None:
            histogram = by_route[route] = Histogram(self.buckets)
        return histogram

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily("actorproxy_requests", "HTTP requests by route, method and status",
                                       labels=["route", "method", "status"])
        for (route, method, status), count in self.requests.items():
            requests.add_metric([route, method, status], float(count))
        yield requests
        yield _histograms("actorproxy_request_duration_seconds", "Time from request to last byte, by route",
                          self.latency)
        yield _histograms("actorproxy_time_to_first_token_seconds",
                          "Time from request to the first sampled token, by route", self.ttft)
        turns = CounterMetricFamily("actorproxy_turns", "Model calls (turns) by route and status",
                                    labels=["route", "status"])
        for (route, status), count in self.turns.items():
            turns.add_metric([route, status], float(count))
        yield turns
        yield CounterMetricFamily("actorproxy_prompt_tokens", "Prompt tokens sent to engines",
                                  value=float(self.prompt_tokens))
        yield CounterMetricFamily("actorproxy_sampled_tokens", "Tokens sampled by engines",
                                  value=float(self.sampled_tokens))


def _histograms(name: str, text: str, by_route: dict[str, Histogram]) -> Metric:
    family = HistogramMetricFamily(name, text, labels=["route"])
    for route, histogram in by_route.items():
        family.add_metric([route], histogram.cumulative(), histogram.total)
    return family

