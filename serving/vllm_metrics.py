"""vLLM V1's Prometheus metrics, beside ours in the same registry, so vLLM's Grafana dashboards
and the Gateway API Inference Extension (which routes on `vllm:num_requests_waiting` and
`vllm:kv_cache_usage_perc`) read this server as they read vLLM.

1. `VllmMetrics(registry)` declares each metric once with vLLM's name, type, help text, buckets
   and labels (`model_name`, `engine`); `bind(model_name)` picks the label values (the model id
   clients name; `engine` is "0": one engine core serves every data-parallel replica).
2. `ServerMetrics` feeds them from the same places as our `jaxinfer_*` metrics: the load gauges
   and the preemption count after each engine step (from the core's `EngineStats`, summed over
   every data replica's scheduler budget and page pool), token counters and latencies as
   deltas arrive, per-request phase times at a sample's finish; with LoRA on,
   `vllm:lora_requests_info` (labels `max_lora`, `running_lora_adapters`, `waiting_lora_adapters`:
   comma-joined adapter names; value: the time of the last step) after each step.

Phases (vLLM's definitions): queue = arrival in the engine core to first scheduled (measured in
the core, `TokenOutput.queue_s`); prefill = first scheduled to first token; decode = first token
to last token; e2e = arrival at the server to last token. Prefix-cache queries and hits count
prompt tokens (vLLM counts them at admission; we count them when the sample finishes).

NOTE: vLLM's names are a contract: never rename these (our own `jaxinfer_*` names may change).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards' histogram_quantile reads the same.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
LABELS = ("model_name", "engine")


class VllmMetrics:
    """vLLM's metric families (see the module docstring); use the bound children
    (`running`, `waiting`, ...) after `bind`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=r)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r)

        self._families = {
            "running": gauge("vllm:num_requests_running", "Number of requests in model execution batches."),
            "waiting": gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
            "kv_usage": gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
            "prefix_queries": counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
            "prefix_hits": counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
            "preemptions": counter("vllm:num_preemptions", "Cumulative number of preemption from the engine."),
            "prompt_tokens": counter("vllm:prompt_tokens", "Number of prefill tokens processed."),
            "generation_tokens": counter("vllm:generation_tokens", "Number of generation tokens processed."),
            "ttft": histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS),
            "itl": histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
            "e2e": histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS),
            "queue": histogram("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", REQUEST_BUCKETS),
            "prefill": histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", REQUEST_BUCKETS),
            "decode": histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", REQUEST_BUCKETS),
        }  # fmt: skip
        self._registry = r
        self._lora_info: Gauge | None = None  # declared by the first `set_lora_info` (LoRA on)
        self._lora_labels: tuple[str, str, str] | None = None
        self.model_name: str | None = None
        self.bind("")

    def set_lora_info(self, max_lora: int, running: str, waiting: str) -> None:
        """`vllm:lora_requests_info` after a step: the adapters (comma-joined names) of running
        and waiting requests, set to the current time; only the current label set is kept.
        Declared on the first call, so a server without LoRA exports no such family (as vLLM)."""
        if self._lora_info is None:
            # NOTE: vLLM's labels, no model_name; the value is the time of the last update
            # (routers such as the Inference Extension read the newest series).
            self._lora_info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ("max_lora", "waiting_lora_adapters", "running_lora_adapters"),
                registry=self._registry,
            )
        labels = (str(max_lora), waiting, running)
        if labels != self._lora_labels:
            self._lora_info.clear()
            self._lora_labels = labels
        self._lora_info.labels(*labels).set_to_current_time()

    def bind(self, model_name: str) -> None:
        """Label every metric with this model id (exported from now on; a previous id's series
        are dropped: a server serves one model)."""
        if model_name == self.model_name:
            return
        for key, family in self._families.items():
            if self.model_name is not None:
                family.remove(self.model_name, "0")
            setattr(self, key, family.labels(model_name, "0"))
        self.model_name = model_name
