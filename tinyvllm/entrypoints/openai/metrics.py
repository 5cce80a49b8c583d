"""Prometheus metrics for /metrics, in a registry of the app's own (several apps in one process, as in
the tests, never collide). Names follow vLLM's with our prefix.

The engine's own numbers (requests running and waiting, KV cache usage, token and preemption counters,
prefix-cache queries and hits, speculative decoding's proposals and accepted tokens) are read from
engine.get_stats() at scrape time by a custom collector;
the per-request latencies (time to first token, inter-token latency, ...) are histograms observed as
each request's outputs reach the server. request_success_total counts every completion once, by its finish
reason, "abort" for those that ended unfinished (the client went away, the server shut down), as vLLM's.

With several API server processes (--api-server-count) the launcher sets PROMETHEUS_MULTIPROC_DIR: each
process then writes its histograms and counters there (prometheus_client's multiprocess mode) and /metrics,
whichever process answers it, reads them all; the engine's figures are the one engine core's."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from tinyvllm.engine.async_engine import AsyncLLMEngine
from tinyvllm.outputs import RequestOutput

PREFIX = "tinyvllm:"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                    480.0, 960.0)

# (engine stat, metric name, help, kind)
_ENGINE_STATS = (
    ("num_requests_running", "num_requests_running", "Requests in the running batch.", "gauge"),
    ("num_requests_waiting", "num_requests_waiting", "Requests waiting to be scheduled.", "gauge"),
    ("kv_cache_usage", "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = all).", "gauge"),
    ("num_free_blocks", "num_free_kv_blocks", "KV cache blocks free.", "gauge"),
    ("num_blocks", "num_kv_blocks", "KV cache blocks in the pool.", "gauge"),
    ("num_preemptions", "num_preemptions", "Sequences preempted (their blocks freed, to recompute).", "counter"),
    ("prompt_tokens", "prompt_tokens", "Prompt tokens computed (prefill).", "counter"),
    ("generation_tokens", "generation_tokens", "Tokens generated.", "counter"),
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "counter"),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache.", "counter"),
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Speculative decoding: sequence-steps that verified "
     "proposed tokens.", "counter"),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Speculative decoding: tokens proposed.",
     "counter"),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Speculative decoding: proposed tokens "
     "accepted (mean acceptance length: 1 + accepted / drafts).", "counter"),
)


class _EngineCollector:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.get_stats()
        for key, name, help_text, kind in _ENGINE_STATS:
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_type(PREFIX + name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], float(stats.get(key, 0)))
            yield family


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()  # what /metrics renders
        self.registry.register(_EngineCollector(engine, model_name))  # type: ignore[arg-type]
        registry = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            multiprocess.MultiProcessCollector(self.registry)  # every API process's files
            registry = CollectorRegistry()  # (this process's own metrics: their values are in the files)

        def histogram(name: str, help_text: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, help_text, ["model_name"], buckets=buckets,
                             registry=registry).labels(model_name)

        self.time_to_first_token = histogram("time_to_first_token_seconds", "Time to first token.",
                                             _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Time between consecutive tokens.",
                                             _LATENCY_BUCKETS)
        self.time_per_output_token = histogram("request_time_per_output_token_seconds",
                                               "Per request: decode time over output tokens after the first.",
                                               _LATENCY_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Arrival to last token.", _REQUEST_BUCKETS)
        # (vLLM's: both in the engine core, so that time to first token less these two is the way between the
        # API process and the core, there and back)
        self.queue_time = histogram("request_queue_time_seconds", "Queued in the engine core to first scheduled.",
                                    _LATENCY_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds",
                                      "First scheduled to first token, in the engine core.", _LATENCY_BUCKETS)
        self._success = Counter(PREFIX + "request_success", "Requests finished, by finish reason.",
                                ["model_name", "finished_reason"], registry=registry)
        self.requests_in_server = Gauge(PREFIX + "num_requests_in_server", "HTTP requests being served.",
                                        ["model_name"], registry=registry, multiprocess_mode="livesum"
                                        ).labels(model_name)
        self._model_name = model_name

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def tracker(self, request_ids: Iterable[str], n: int) -> RequestTracker:
        return RequestTracker(self, request_ids, n)

    def record_finish(self, reason: str | None, count: int = 1) -> None:
        self._success.labels(self._model_name, reason or "abort").inc(count)


class RequestTracker:
    """Observes the delta outputs of the engine requests of one HTTP request (n completions each), as they
    arrive; `close()` (once it is over, however it ended) counts the completions that never finished as
    aborted."""

    def __init__(self, metrics: ServerMetrics, request_ids: Iterable[str], n: int) -> None:
        self.metrics = metrics
        self._open = True
        metrics.requests_in_server.inc()
        self._last_token_time: dict[str, float] = {}
        self._num_tokens: dict[str, int] = {}  # per engine request: tokens of its longest completion
        self._unfinished = {(request_id, index) for request_id in request_ids for index in range(n)}

    def close(self) -> None:
        if self._open:
            self._open = False
            self.metrics.requests_in_server.dec()
        if self._unfinished:
            self.metrics.record_finish("abort", len(self._unfinished))
            self._unfinished.clear()

    def observe(self, output: RequestOutput) -> None:
        for completion in output.outputs:
            key = (output.request_id, completion.index)
            if completion.finish_reason is not None and key in self._unfinished:
                self._unfinished.discard(key)
                self.metrics.record_finish(completion.finish_reason)
        m = output.metrics
        if m is None or m.last_token_time is None:
            return
        previous = self._last_token_time.get(output.request_id)
        new_tokens = max(len(c.token_ids) for c in output.outputs)
        # One inter-token interval per token after the first: tokens that arrive together (several engine
        # steps in one delta) share the time since the last delta, or, in the first delta, since the first token.
        intervals = new_tokens if previous is not None else new_tokens - 1
        if previous is None and m.first_token_time is not None:
            self.metrics.time_to_first_token.observe(m.first_token_time - m.arrival_time)
            if m.first_scheduled_time is not None and m.queued_time is not None:
                self.metrics.queue_time.observe(m.first_scheduled_time - m.queued_time)
                if m.first_token_engine_time is not None:
                    self.metrics.prefill_time.observe(m.first_token_engine_time - m.first_scheduled_time)
        since = previous if previous is not None else m.first_token_time
        if intervals > 0 and since is not None and m.last_token_time >= since:
            gap = (m.last_token_time - since) / intervals
            for _ in range(intervals):
                self.metrics.inter_token_latency.observe(gap)
        self._last_token_time[output.request_id] = m.last_token_time
        num_tokens = self._num_tokens.get(output.request_id, 0) + new_tokens
        self._num_tokens[output.request_id] = num_tokens
        if output.finished:
            end = m.finished_time or m.last_token_time
            self.metrics.e2e_latency.observe(end - m.arrival_time)
            if m.first_token_time is not None and num_tokens > 1:
                self.metrics.time_per_output_token.observe((m.last_token_time - m.first_token_time)
                                                           / (num_tokens - 1))
