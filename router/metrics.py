"""Prometheus metrics of one router replica, named and meant as vLLM's, under two prefixes at once:
`vllm:` so that vLLM's Grafana dashboards and autoscaling rules work unchanged, and `pagedserve:` for
our own dashboards and the names this project started with (the values are the same).

Two sources:
  * the scheduler's Stats heartbeat — queue gauges, cumulative counters and the per-step token histogram.
    These are engine-wide, so every replica reports the same values; a custom Collector reads the latest
    Stats at scrape time, which keeps them exact (no delta bookkeeping, no drift when a replica starts late).
  * what this replica observes itself — per-request latencies and sizes, and finished requests.

Each app owns its own CollectorRegistry so that tests (and several apps in one process) never collide.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from common.protocol import ITERATION_TOKEN_BUCKETS, EngineOutput

PREFIXES = ("vllm:", "pagedserve:")

# (metric name, Stats.values key, help); vLLM's older names of the same gauge follow in ALIASES
_GAUGES = [
    ("num_requests_running", "running", "Number of requests currently running on the workers."),
    ("num_requests_waiting", "waiting", "Number of requests waiting to be scheduled."),
    ("num_requests_swapped", "swapped", "Number of requests swapped out to host memory."),
    ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage: the fraction of blocks in use (1 = full)."),
    ("num_free_blocks", "num_free_blocks", "Number of free KV cache blocks."),
    ("num_blocks", "num_blocks", "Total number of KV cache blocks."),
]
_ALIASES = {"kv_cache_usage_perc": ("gpu_cache_usage_perc",)}    # vLLM before 0.10; dashboards still ask
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
N_BUCKETS = [1, 2, 5, 10, 20]


def buckets_1_2_5(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    out, base = [], 1
    while True:
        for m in (1, 2, 5):
            if m * base > limit:
                return out
            out.append(float(m * base))
        base *= 10


class EngineStatsCollector:
    """Exposes the latest scheduler Stats (zeros until the first heartbeat), under every prefix."""

    def __init__(self, client: Any, model_name: str):
        self.client, self.model_name = client, model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.client.stats
        values: dict[str, Any] = stats.values if stats is not None else {}
        for prefix in PREFIXES:
            yield from self._families(prefix, values)

    def _families(self, prefix: str, values: dict[str, Any]) -> Iterator[Metric]:
        for name, key, doc in _GAUGES:
            for n in (name, *_ALIASES.get(name, ())):
                m = GaugeMetricFamily(prefix + n, doc, labels=["model_name"])
                m.add_metric([self.model_name], float(values.get(key, 0) or 0))
                yield m
        for name, key, doc in _COUNTERS:
            m = CounterMetricFamily(prefix + name, doc, labels=["model_name"])
            m.add_metric([self.model_name], float(values.get(key, 0) or 0))
            yield m
        per_pos = CounterMetricFamily(prefix + "spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted draft tokens at each draft position.", labels=["model_name", "position"])
        for pos, count in enumerate(values.get("spec_accepted_per_pos") or []):
            per_pos.add_metric([self.model_name, str(pos)], float(count))
        yield per_pos
        yield self._iteration_tokens(prefix, values)
        if values.get("max_lora"):
            yield from self._lora(prefix, values)

    def _iteration_tokens(self, prefix: str, values: dict[str, Any]) -> Metric:
        """Tokens per engine step, a histogram kept by the scheduler (vLLM's name ends in _total)."""
        h = HistogramMetricFamily(prefix + "iteration_tokens_total", "Histogram of number of tokens per engine step.",
                                  labels=["model_name"])
        counts = values.get("iteration_tokens") or [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        cumulative, buckets = 0, []
        for le, c in zip([*map(str, map(float, ITERATION_TOKEN_BUCKETS)), "+Inf"], counts):
            cumulative += c
            buckets.append((le, float(cumulative)))
        h.add_metric([self.model_name], buckets, float(values.get("iteration_tokens_sum", 0)))
        return h

    def _lora(self, prefix: str, values: dict[str, Any]) -> Iterator[Metric]:
        """vLLM's lora_requests_info (adapter names in labels, the time as value), and requests per adapter."""
        info = GaugeMetricFamily(prefix + "lora_requests_info", "Running and waiting LoRA adapters.",
                                 labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([",".join(values.get("lora_running", [])), ",".join(values.get("lora_waiting", [])),
                         str(values["max_lora"])], time.time())
        yield info
        per = CounterMetricFamily(prefix + "lora_requests", "Requests accepted per LoRA adapter.",
                                  labels=["model_name", "lora_name"])
        for name, count in sorted((values.get("lora_requests") or {}).items()):
            per.add_metric([self.model_name, name], float(count))
        yield per

    describe = collect


class Twin:
    """One histogram or counter under every prefix, observed once."""

    def __init__(self, metrics: list[Any]):
        self.metrics = metrics

    def observe(self, value: float) -> None:
        for m in self.metrics:
            m.observe(value)


class RouterMetrics:
    def __init__(self, client: Any, model_name: str, max_model_len: int = 1 << 17):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(client, model_name))
        tokens = buckets_1_2_5(max_model_len)

        def hist(name: str, doc: str, buckets: list[float], *also: str) -> Twin:
            return Twin([Histogram(p + n, doc, ["model_name"], buckets=buckets, registry=self.registry)
                         .labels(model_name) for p in PREFIXES for n in (name, *also)])

        self.ttft = hist("time_to_first_token_seconds", "Time to first token, as seen by the router.", TTFT_BUCKETS)
        # time_per_output_token_seconds: vLLM's name for the same intervals before 0.10 (its Grafana dashboard)
        self.itl = hist("inter_token_latency_seconds", "Time between successive outputs of a sequence.", ITL_BUCKETS,
                        "time_per_output_token_seconds")
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency, as seen by the router.",
                        REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Time requests spent waiting before first scheduled.",
                               REQUEST_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "Time from first scheduled to the first token.",
                                 REQUEST_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "Time from the first token to the last.",
                                REQUEST_BUCKETS)
        self.inference_time = hist("request_inference_time_seconds", "Time from first scheduled to the last token.",
                                   REQUEST_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.generation_tokens = hist("request_generation_tokens", "Generated tokens per request (all choices).",
                                      tokens)
        self.max_generation_tokens = hist("request_max_num_generation_tokens",
                                          "The longest choice of each request, in tokens.", tokens)
        self.params_n = hist("request_params_n", "The n of each request.", N_BUCKETS)
        self.params_max_tokens = hist("request_params_max_tokens", "The max_tokens of each request.", tokens)
        self._success = [Counter(p + "request_success", "Finished sequences (choices) by finish reason.",
                                 ["model_name", "finished_reason"], registry=self.registry) for p in PREFIXES]
        self._rejected = Counter(PREFIXES[1] + "router_admission_rejections",
                                 "Requests this replica answered 429 because the scheduler rejected them.",
                                 ["model_name"], registry=self.registry).labels(model_name)

    def finished(self, reason: str) -> None:
        for c in self._success:
            c.labels(self.model_name, reason).inc()

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
        self.scheduled: float | None = None     # arrival + the engine's queue time
        self.first_token: float | None = None
        self._last: dict[int, float] = {}       # choice index -> time of its last output with tokens

    def on_output(self, eo: EngineOutput, now: float) -> None:
        if eo.queue_time is not None and self.scheduled is None:
            self.scheduled = self.arrival + eo.queue_time
            self.m.queue_time.observe(eo.queue_time)
        if not eo.new_token_ids:
            return
        if self.first_token is None:
            self.first_token = now
            self.m.ttft.observe(now - self.arrival)
        last = self._last.get(eo.index)
        if last is not None:
            self.m.itl.observe(now - last)
        self._last[eo.index] = now

    def on_choice_finished(self, reason: str) -> None:
        self.m.finished(reason)

    def on_request_finished(self, now: float, tracker: Any) -> None:
        """`tracker`: the request's RequestTracker (its prompt, params and choices)."""
        m = self.m
        m.e2e.observe(now - self.arrival)
        scheduled = self.scheduled if self.scheduled is not None else self.arrival
        first = self.first_token if self.first_token is not None else now
        m.prefill_time.observe(max(0.0, first - scheduled))
        m.decode_time.observe(max(0.0, now - first))
        m.inference_time.observe(max(0.0, now - scheduled))
        lengths = [len(c.token_ids) for c in tracker.choices]
        m.prompt_tokens.observe(len(tracker.prompt_token_ids))
        m.generation_tokens.observe(sum(lengths))
        m.max_generation_tokens.observe(max(lengths, default=0))
        m.params_n.observe(tracker.params.n)
        if tracker.params.max_tokens is not None:
            m.params_max_tokens.observe(tracker.params.max_tokens)
