"""Prometheus metrics of one router replica, named and meant as vLLM's (prefix `pagedserve:`).

Two sources:
  * the scheduler's Stats heartbeat — queue gauges and cumulative counters. These are engine-wide, so
    every replica reports the same values; a custom Collector reads the latest Stats at scrape time, which
    keeps them exact (no delta bookkeeping, no drift when a replica starts late).
  * what this replica observes itself — latency histograms and finished requests.

Each app owns its own CollectorRegistry so that tests (and several apps in one process) never collide.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from common.protocol import EngineOutput

PREFIX = "pagedserve:"

# (metric name, Stats.values key, help)
_GAUGES = [
    ("num_requests_running", "running", "Number of requests currently running on the workers."),
    ("num_requests_waiting", "waiting", "Number of requests waiting to be scheduled."),
    ("num_requests_swapped", "swapped", "Number of requests swapped out to host memory."),
    ("kv_cache_usage_perc", "kv_cache_usage", "Fraction of KV cache blocks in use (1 = full)."),
    ("num_free_blocks", "num_free_blocks", "Number of free KV cache blocks."),
    ("num_blocks", "num_blocks", "Total number of KV cache blocks."),
]
_COUNTERS = [
    ("prompt_tokens", "prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens", "generation_tokens", "Number of generation tokens processed."),
    ("num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("admission_rejections", "admission_rejections", "Requests the scheduler rejected because it was full."),
    ("spec_decode_num_drafts", "spec_num_drafts", "Number of spec decoding drafts (sequence steps that verified some)."),
    ("spec_decode_num_draft_tokens", "spec_num_draft_tokens", "Number of draft tokens."),
    ("spec_decode_num_accepted_tokens", "spec_num_accepted_tokens", "Number of accepted draft tokens."),
]

# vLLM's buckets, reaching minutes (TTFT under load) and hours (long generations).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0]


class EngineStatsCollector:
    """Exposes the latest scheduler Stats (zeros until the first heartbeat)."""

    def __init__(self, client: Any, model_name: str):
        self.client, self.model_name = client, model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.client.stats
        values: dict[str, Any] = stats.values if stats is not None else {}
        for name, key, doc in _GAUGES:
            m = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            m.add_metric([self.model_name], float(values.get(key, 0) or 0))
            yield m
        for name, key, doc in _COUNTERS:
            m = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            m.add_metric([self.model_name], float(values.get(key, 0) or 0))
            yield m
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens at each draft position.", labels=["model_name", "position"])
        for pos, count in enumerate(values.get("spec_accepted_per_pos") or []):
            per_pos.add_metric([self.model_name, str(pos)], float(count))
        yield per_pos
        if values.get("max_lora"):
            yield from self._lora(values)

    def _lora(self, values: dict[str, Any]) -> Iterator[Metric]:
        """vLLM's lora_requests_info (adapter names in labels, the time as value), and requests per adapter."""
        info = GaugeMetricFamily(PREFIX + "lora_requests_info", "Running and waiting LoRA adapters.",
                                 labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([",".join(values.get("lora_running", [])), ",".join(values.get("lora_waiting", [])),
                         str(values["max_lora"])], time.time())
        yield info
        per = CounterMetricFamily(PREFIX + "lora_requests", "Requests accepted per LoRA adapter.",
                                  labels=["model_name", "lora_name"])
        for name, count in sorted((values.get("lora_requests") or {}).items()):
            per.add_metric([self.model_name, name], float(count))
        yield per

    describe = collect


class RouterMetrics:
    def __init__(self, client: Any, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(client, model_name))
        labels = ["model_name"]

        def hist(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token, as seen by the router.", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between successive outputs of a sequence.", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency, as seen by the router.",
                        REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Time requests spent waiting before first scheduled.",
                               REQUEST_BUCKETS)
        self._success = Counter(PREFIX + "request_success", "Finished sequences (choices) by finish reason.",
                                labels + ["finished_reason"], registry=self.registry)
        self._rejected = Counter(PREFIX + "router_admission_rejections",
                                 "Requests this replica answered 429 because the scheduler rejected them.",
                                 labels, registry=self.registry).labels(model_name)

    def finished(self, reason: str) -> None:
        self._success.labels(self.model_name, reason).inc()

    def rejected(self) -> None:
        self._rejected.inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def timer(self) -> "RequestTimer":
        return RequestTimer(self)


class RequestTimer:
    """Latency bookkeeping for one engine request (all of its choices)."""

    def __init__(self, metrics: RouterMetrics):
        self.m = metrics
        self.arrival = time.monotonic()
        self._first_token = False
        self._queue_seen = False
        self._last: dict[int, float] = {}       # choice index -> time of its last output with tokens

    def on_output(self, eo: EngineOutput, now: float) -> None:
        if eo.queue_time is not None and not self._queue_seen:
            self._queue_seen = True
            self.m.queue_time.observe(eo.queue_time)
        if not eo.new_token_ids:
            return
        if not self._first_token:
            self._first_token = True
            self.m.ttft.observe(now - self.arrival)
        last = self._last.get(eo.index)
        if last is not None:
            self.m.itl.observe(now - last)
        self._last[eo.index] = now

    def on_choice_finished(self, reason: str) -> None:
        self.m.finished(reason)

    def on_request_finished(self, now: float) -> None:
        self.m.e2e.observe(now - self.arrival)
