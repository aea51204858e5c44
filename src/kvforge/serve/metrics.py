"""Prometheus metrics of one app (its own registry, so several apps can live in one process, as in tests)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)

_TIME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class Metrics:
    """Requests, errors, TTFT/latency histograms, reuse hits per kind, tokens, queue depth and store bytes; plus the
    vLLM-named series (``vllm:*``, label ``model_name``) that existing vLLM dashboards read."""

    def __init__(
        self,
        queue_depth: Callable[[], int],
        store_stats: Callable[[], dict[str, Any] | None],
        model_name: str = "kvforge",
        num_running: Callable[[], int] | None = None,
        profile: Any = None,
    ) -> None:
        disable_created_metrics()  # no *_created series: they double the output and no dashboard reads them
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvforge_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.errors = Counter("kvforge_errors", "Requests answered with an error", ["endpoint", "status"], registry=r)
        self.rejected = Counter("kvforge_rejected", "Requests refused with 429 (queue full)", registry=r)
        self.aborted = Counter("kvforge_aborted", "Generations stopped early", ["reason"], registry=r)
        self.ttft = Histogram(
            "kvforge_ttft_seconds",
            "Time to first token (prefill + first pick)",
            ["endpoint"],
            buckets=_TIME_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "kvforge_request_latency_seconds",
            "Request latency including queueing",
            ["endpoint"],
            buckets=_TIME_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "kvforge_queue_wait_seconds", "Time spent waiting for the model", buckets=_TIME_BUCKETS, registry=r
        )
        self.reuse = Counter(
            "kvforge_reuse_lookups",
            "Reuse lookups by strategy and outcome (miss, prefix, semantic)",
            ["strategy", "outcome"],
            registry=r,
        )
        self.prompt_tokens = Counter("kvforge_prompt_tokens", "Prompt tokens received", registry=r)
        self.reused_tokens = Counter("kvforge_reused_tokens", "Prompt tokens served from reused KV", registry=r)
        self.completion_tokens = Counter("kvforge_completion_tokens", "Tokens generated", registry=r)
        self.queue_depth = Gauge("kvforge_queue_depth", "Requests waiting for the model", registry=r)
        self.queue_depth.set_function(lambda: float(queue_depth()))
        self.vllm = VLLMMetrics(r, model_name, queue_depth, num_running or (lambda: 0))
        self._hits: dict[str, list[int]] = {}  # strategy -> [hits, lookups]
        r.register(_DerivedCollector(self._hits, store_stats))
        if profile is not None:
            r.register(_ProfileCollector(profile))

    def observe_reuse(self, strategy: str, outcome: str) -> None:
        self.reuse.labels(strategy, outcome).inc()
        counts = self._hits.setdefault(strategy, [0, 0])
        counts[0] += outcome != "miss"
        counts[1] += 1

    def render(self) -> bytes:
        return generate_latest(self.registry)


class VLLMMetrics:
    """The series vLLM exports, under its names and with its ``model_name`` label (tokens for prefix-cache counts)."""

    def __init__(
        self, r: CollectorRegistry, model_name: str, waiting: Callable[[], int], running: Callable[[], int]
    ) -> None:
        label = ["model_name"]
        self.model_name = model_name
        gauges = [
            ("vllm:num_requests_running", "Requests in the model batch (prefilling or decoding)", running),
            ("vllm:num_requests_waiting", "Requests waiting for a place in the batch", waiting),
        ]
        for name, doc, fn in gauges:
            Gauge(name, doc, label, registry=r).labels(model_name).set_function(lambda fn=fn: float(fn()))

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, label, buckets=buckets, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, label, registry=r).labels(model_name)

        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token (queueing included)", _TIME_BUCKETS
        )
        self.itl = histogram("vllm:inter_token_latency_seconds", "Time between two output tokens", _ITL_BUCKETS)
        self.tpot = histogram(
            "vllm:time_per_output_token_seconds", "Time per output token (vLLM v0 name)", _ITL_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Request latency, arrival to last token", _TIME_BUCKETS
        )
        self.queue = histogram("vllm:request_queue_time_seconds", "Time waiting for the batch", _TIME_BUCKETS)
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the KV store")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the KV store")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self.success = Counter(
            "vllm:request_success", "Requests finished", ["model_name", "finished_reason"], registry=r
        )

    def observe(
        self,
        queue_s: float,
        ttft_s: float,
        e2e_s: float,
        token_times: list[float],
        prompt_tokens: int,
        completion_tokens: int,
        looked_up: bool,
        reused_tokens: int,
        finish_reason: str,
    ) -> None:
        """One finished request."""
        self.queue.observe(queue_s)
        self.ttft.observe(queue_s + ttft_s)
        self.e2e.observe(e2e_s)
        for a, b in itertools.pairwise(token_times):
            self.itl.observe(b - a)
            self.tpot.observe(b - a)
        if looked_up:
            self.prefix_queries.inc(prompt_tokens)
            self.prefix_hits.inc(reused_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.success.labels(self.model_name, finish_reason).inc()


class _DerivedCollector(Collector):
    """Values computed at scrape time: hit rate per reuse strategy, bytes and entries per store tier."""

    def __init__(self, hits: dict[str, list[int]], store_stats: Callable[[], dict[str, Any] | None]) -> None:
        self.hits = hits
        self.store_stats = store_stats

    def collect(self) -> Iterator[GaugeMetricFamily]:
        rate = GaugeMetricFamily(
            "kvforge_reuse_hit_rate", "Fraction of lookups that hit, per strategy", labels=["strategy"]
        )
        for strategy, (num_hits, num) in sorted(self.hits.items()):
            rate.add_metric([strategy], num_hits / num if num else 0.0)
        yield rate
        size = GaugeMetricFamily("kvforge_store_bytes", "Bytes held by each store tier", labels=["tier"])
        entries = GaugeMetricFamily("kvforge_store_entries", "Entries held by each store tier", labels=["tier"])
        try:
            stats = self.store_stats()
        except Exception as e:  # a store that cannot answer must not break the scrape
            logger.warning("store stats unavailable: %s", e)
            stats = None
        for tier, s in store_tiers(stats):
            if isinstance(s.get("bytes"), (int, float)):
                size.add_metric([tier], float(s["bytes"]))
            if isinstance(s.get("entries"), (int, float)):
                entries.add_metric([tier], float(s["entries"]))
        yield size
        yield entries


class _ProfileCollector(Collector):
    """The model thread's :class:`~kvforge.serve.worker.ThreadProfile`: seconds per phase and its counts."""

    def __init__(self, profile: Any) -> None:
        self.profile = profile

    def collect(self) -> Iterator[CounterMetricFamily]:
        seconds = CounterMetricFamily(
            "kvforge_model_thread_seconds", "Model thread time per phase (admit, prefill, decode...)", labels=["phase"]
        )
        for phase, value in sorted(dict(self.profile.seconds).items()):
            seconds.add_metric([phase], value)
        yield seconds
        for name, value in sorted(dict(self.profile.counts).items()):
            yield CounterMetricFamily(f"kvforge_model_thread_{name}", f"Model thread {name.replace('_', ' ')}", value)


def store_tiers(stats: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """``[(tier label, stats)]``: one per tier of a tiered store (``"0:memory"``), else the store itself."""
    if not stats:
        return []
    tiers = stats.get("tiers")
    if isinstance(tiers, list):
        return [(f"{i}:{t.get('backend', '?')}", t) for i, t in enumerate(tiers) if isinstance(t, dict)]
    return [(f"0:{stats.get('backend', '?')}", stats)]
