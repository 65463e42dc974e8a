"""Prometheus metrics of the front end (both protocols), in their own registry, served over HTTP.

1. `ServerMetrics()` declares every metric once in a private `CollectorRegistry` (so two servers in
   one process, as in the tests, never collide on the global registry).
2. The engine thread sets the load gauges after every step (`observe_step`); the event loop
   records per-request timings as deltas arrive (`observe_*`) and the finish of each sample.
3. `start_http(port)` serves `/metrics` (`port=0` picks a free port; `.port` says which).
4. vLLM's metrics (`serving/vllm_metrics.py`, `vllm:*` with a `model_name` label) are fed beside
   ours from the same observations (`self.vllm`), so vLLM dashboards and routers read us.

Rates are left to Prometheus (`rate(jaxinfer_generation_tokens_total[1m])`); the
`jaxinfer_generation_tokens_per_second` gauge is the server's own recent window, for dashboards
without PromQL and for the once-a-second log line.
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from jaxinfer.engine.types import EngineStats
from serving.vllm_metrics import VllmMetrics

# Latency buckets in seconds: CPU decode steps are tens of ms, accelerator steps a few ms, and a
# long prompt's TTFT can take seconds.
_TOKEN_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
_REQUEST_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    320.0,
)

FINISH_LABELS = ("stop", "length", "abort", "cancelled", "error")


class ServerMetrics:
    """Every metric of the front end; `model_name` labels the `vllm:*` ones (`vllm.bind`)."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = r = CollectorRegistry()
        self.vllm = VllmMetrics(r)
        self.vllm.bind(model_name)
        self.requests = Counter(
            "jaxinfer_requests",
            "Finished samples by finish reason (stop, length, abort: by the "
            "server, cancelled: by the client or its deadline, error: INTERNAL)",
            ["finish_reason"],
            registry=r,
        )
        self.lora_requests = Counter(
            "jaxinfer_lora_requests",
            "Requests admitted per LoRA adapter (the OpenAI model field or gRPC lora_name)",
            ["lora_name"],
            registry=r,
        )
        self.rejected = Counter(
            "jaxinfer_requests_rejected",
            "Requests refused before admission, by gRPC status code",
            ["code"],
            registry=r,
        )
        self.ttft = Histogram(
            "jaxinfer_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "jaxinfer_inter_token_latency_seconds",
            "Gap between consecutive generated tokens of a sample (after the first)",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "jaxinfer_e2e_request_latency_seconds",
            "Arrival to last token of a sample",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            "jaxinfer_engine_step_seconds",
            "Wall time of one engine step that emitted tokens",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.step_failures = Counter(
            "jaxinfer_engine_step_failures", "Engine steps that raised", registry=r
        )
        # NOTE: the step histogram sees only steps that emitted tokens (the core reports those);
        # this counter follows the core's own step count, prefill-chunk steps included.
        self.steps = Counter(
            "jaxinfer_engine_steps", "Engine steps that computed something", registry=r
        )
        self.running = Gauge(
            "jaxinfer_num_requests_running", "Sequences (samples) running in the engine", registry=r
        )
        self.waiting = Gauge(
            "jaxinfer_num_requests_waiting",
            "Sequences (samples) waiting or preempted in the engine",
            registry=r,
        )
        self.in_flight = Gauge(
            "jaxinfer_num_requests_in_flight",
            "Sequences admitted by the server and not finished (the queue bound applies to this)",
            registry=r,
        )
        self.pages_used = Gauge(
            "jaxinfer_kv_cache_pages_used", "KV-cache pages referenced by requests", registry=r
        )
        # NOTE: not "_total": that suffix is for counters (promtool check metrics).
        self.pages_total = Gauge(
            "jaxinfer_kv_cache_pages_capacity", "Usable KV-cache pages", registry=r
        )
        self.prompt_tokens = Counter(
            "jaxinfer_prompt_tokens", "Prompt tokens of finished samples", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "jaxinfer_prompt_tokens_cached",
            "Prompt tokens served from the prefix cache",
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "jaxinfer_prefix_cache_hit_rate",
            "Cached / all prompt tokens of finished samples since start",
            registry=r,
        )
        self.generation_tokens = Counter(
            "jaxinfer_generation_tokens", "Generated tokens", registry=r
        )
        self.throughput = Gauge(
            "jaxinfer_generation_tokens_per_second",
            "Generated tokens per second over the last few seconds",
            registry=r,
        )
        self.compiled_programs = Gauge(
            "jaxinfer_compiled_programs", "Step programs compiled by the runner", registry=r
        )
        self.spec_draft_tokens = Counter(
            "jaxinfer_spec_decode_num_draft_tokens",
            "Tokens proposed by speculative decoding",
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            "jaxinfer_spec_decode_num_accepted_tokens",
            "Proposed tokens the target model accepted",
            registry=r,
        )
        self.spec_steps = Counter(
            "jaxinfer_spec_decode_num_drafts",
            "Request-steps that verified proposed tokens",
            registry=r,
        )
        self.spec_acceptance_rate = Gauge(
            "jaxinfer_spec_decode_acceptance_rate",
            "Accepted / proposed tokens since start",
            registry=r,
        )
        self.spec_mean_accepted_length = Gauge(
            "jaxinfer_spec_decode_mean_accepted_length",
            "Tokens emitted per verifying request-step (accepted proposals + 1) since start",
            registry=r,
        )
        self.ready = Gauge(
            "jaxinfer_ready", "1 once weights are loaded and programs compiled", registry=r
        )
        for label in FINISH_LABELS:
            self.requests.labels(label)  # export zeros, so rate() works from the first scrape
        self._lock = threading.Lock()
        self._prompt, self._cached = 0, 0
        self._spec_seen = (0, 0, 0)  # the core's cumulative spec counters at the last step
        self._steps_seen = 0
        self._preemptions_seen = 0
        self._http: Any = None
        self.port: int | None = None

    def observe_load(self, stats: EngineStats) -> None:
        """The load gauges of one engine step's `stats` (every data replica)."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.pages_used.set(stats.pages_used)
        v = self.vllm
        v.running.set(stats.running)
        v.waiting.set(stats.waiting)
        if stats.pages_total:
            v.kv_usage.set(stats.pages_used / stats.pages_total)
        if stats.preemptions > self._preemptions_seen:
            v.preemptions.inc(stats.preemptions - self._preemptions_seen)
            self._preemptions_seen = stats.preemptions
        if stats.lora is not None:
            v.set_lora_info(*stats.lora)

    def observe_spec(self, stats: EngineStats) -> None:
        """The step counter and the speculative-decoding counters from the engine core's
        cumulative `stats()`."""
        if stats.steps > self._steps_seen:
            self.steps.inc(stats.steps - self._steps_seen)
            self._steps_seen = stats.steps
        steps, drafts = stats.spec_steps, stats.spec_draft_tokens
        accepted = stats.spec_accepted_tokens
        totals = (steps, drafts, accepted)
        for counter, total, seen in zip(
            (self.spec_steps, self.spec_draft_tokens, self.spec_accepted_tokens),
            totals,
            self._spec_seen,
        ):
            if total > seen:
                counter.inc(total - seen)
        self._spec_seen = totals
        if drafts:
            self.spec_acceptance_rate.set(accepted / drafts)
            self.spec_mean_accepted_length.set(1 + accepted / steps)

    def observe_finish(self, reason: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.requests.labels(reason).inc()
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
            self.cached_prompt_tokens.inc(cached_tokens)
            self.vllm.prompt_tokens.inc(prompt_tokens)
            self.vllm.prefix_queries.inc(prompt_tokens)
            self.vllm.prefix_hits.inc(cached_tokens)
            with self._lock:
                self._prompt += prompt_tokens
                self._cached += cached_tokens
                self.prefix_hit_rate.set(self._cached / self._prompt)

    @property
    def hit_rate(self) -> float:
        with self._lock:
            return self._cached / self._prompt if self._prompt else 0.0

    def start_http(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serves /metrics on `port` (0: a free one); returns the port."""
        self._http, _ = start_http_server(port, addr=addr, registry=self.registry)
        self.port = self._http.server_port
        return self.port

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
