"""The server's Prometheus metrics (``GET /metrics``).

Counted by the server as requests pass: requests by endpoint and HTTP
status, prompt and generated tokens, requests in flight, and histograms of
the time to the first token, the time between tokens and the whole
request.  Read from the engine at each scrape (:meth:`Engine.stats`):
sequences running and waiting, KV blocks used and in all, and the share of
the KV cache in use.

Each app has its own registry, so several servers (tests) live in one
process.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily

__all__ = ["ServerMetrics", "CONTENT_TYPE", "ENGINE_GAUGES"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

#: metric name -> (EngineStats attribute, help)
ENGINE_GAUGES = {
    "ptxgen_sequences_running": ("running", "sequences in the running batch"),
    "ptxgen_sequences_waiting": ("waiting", "sequences waiting for admission"),
    "ptxgen_kv_blocks_used": ("blocks_used", "KV cache blocks held by sequences"),
    "ptxgen_kv_blocks_total": ("blocks_total", "KV cache blocks in the pool"),
}

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
                    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector:
    """The engine's gauges, read when scraped (nothing while it loads)."""

    def __init__(self, state):
        self.state = state

    def collect(self):
        engine = self.state.engine
        if engine is None:
            return
        stats = engine.stats()
        values = {}
        for name, (attr, help_text) in ENGINE_GAUGES.items():
            value = getattr(stats, attr, None)
            if value is None:
                continue
            values[attr] = value
            g = GaugeMetricFamily(name, help_text)
            g.add_metric([], float(value))
            yield g
        if values.get("blocks_total"):
            g = GaugeMetricFamily("ptxgen_kv_cache_usage_ratio",
                                  "share of the KV cache's blocks in use (0..1)")
            g.add_metric([], values.get("blocks_used", 0) / values["blocks_total"])
            yield g


class ServerMetrics:
    """The metrics of one app; ``state`` has the ``engine`` (None while loading)."""

    def __init__(self, state):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ptxgen_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("ptxgen_prompt_tokens", "prompt tokens of admitted requests",
                                     registry=r)
        self.generation_tokens = Counter("ptxgen_generation_tokens", "tokens generated",
                                         registry=r)
        self.in_flight = Gauge("ptxgen_requests_in_flight",
                               "generation requests the server is answering", registry=r)
        self.ttft = Histogram("ptxgen_time_to_first_token_seconds",
                              "from the request's arrival to its first generated token",
                              buckets=_TTFT_BUCKETS, registry=r)
        self.inter_token = Histogram("ptxgen_inter_token_latency_seconds",
                                     "between successive generated tokens of a sequence",
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram("ptxgen_request_duration_seconds",
                                         "from the request's arrival to its last token",
                                         buckets=_REQUEST_BUCKETS, registry=r)
        r.register(_EngineCollector(state))

    def render(self) -> bytes:
        return generate_latest(self.registry)
