"""Prometheus metrics of the API process (latencies per request, engine gauges from SchedulerStats)."""
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tandem.engine.protocol import RequestTimes, SchedulerStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class ServerMetrics:
    """One registry per app, so several servers (or tests) in one process do not collide."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("tandem:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("tandem:time_per_output_token_seconds", "Mean time per output token of a request",
                              labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("tandem:inter_token_latency_seconds", "Time between two outputs of a request",
                             labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("tandem:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("tandem:prompt_tokens", "Prompt tokens processed", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("tandem:generation_tokens", "Tokens generated", labels,
                                         registry=r).labels(model_name)
        self._finished = Counter("tandem:request_success", "Engine requests finished, by finish reason",
                                 labels + ["finished_reason"], registry=r)
        # where finished requests' time went inside the engine (vLLM's request_*_time_seconds)
        self._phases = {
            phase: Histogram(f"tandem:request_{phase}_time_seconds", doc, labels, buckets=_LATENCY_BUCKETS,
                             registry=r).labels(model_name)
            for phase, doc in [
                ("queue", "Time from schedulable (arrival, or the prompt KV landed) to first scheduled"),
                ("prefill", "Time from first scheduled to the first token the engine sampled"),
                ("decode", "Time from the first token the engine sampled to the last"),
                ("inference", "Time from first scheduled to the last token"),
                ("kv_transfer_wait", "PD decode: time waiting for the prompt KV from the prefill instance"),
            ]
        }
        self._model_name = model_name
        # Kernels compiled while serving: each one stalled a request (kernels/compile_watch.py).
        self.kernel_compilations = Counter("tandem:kernel_compilations_after_ready",
                                           "Triton kernel variants compiled after the server was ready",
                                           labels, registry=r).labels(model_name)
        self._kernel_compilations_seen = 0
        self._gauges = {
            name: Gauge(f"tandem:{name}", doc, labels, registry=r).labels(model_name)
            for name, doc in [
                ("num_requests_running", "Requests running in the engine"),
                ("num_requests_waiting", "Requests waiting in the engine"),
                ("num_requests_waiting_for_remote_kvs", "Requests whose prompt KV is arriving"),
                ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1)"),
                ("kv_cache_free_blocks", "Free KV cache blocks"),
                ("kv_cache_total_blocks", "Total KV cache blocks"),
                ("num_preemptions", "Preemptions since start"),
                ("num_remote_prefills", "Requests whose prompt KV came from a prefill instance, since start"),
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
            ]
        }

    def observe_finished(self, finish_reason: str, arrival: float, first_token: float | None, end: float,
                         num_prompt_tokens: int, num_output_tokens: int) -> None:
        self._finished.labels(self._model_name, finish_reason).inc()
        self.e2e.observe(end - arrival)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)
        if first_token is not None and num_output_tokens > 1:
            self.tpot.observe((end - first_token) / (num_output_tokens - 1))

    def observe_times(self, times: RequestTimes) -> None:
        """A finished request's engine phases (RequestOutput.times), each that began."""
        for phase in RequestTimes.__struct_fields__:
            value = getattr(times, phase)
            if value is not None:
                self._phases[phase].observe(value)

    def observe_aborted(self, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """A request abandoned by its client (disconnect) or failed by an error."""
        self._finished.labels(self._model_name, "abort").inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_output_tokens)

    def set_engine_stats(self, stats: SchedulerStats) -> None:
        g = self._gauges
        g["num_requests_running"].set(stats.num_running)
        g["num_requests_waiting"].set(stats.num_waiting)
        g["num_requests_waiting_for_remote_kvs"].set(stats.num_waiting_for_remote_kvs)
        g["kv_cache_usage_perc"].set(stats.kv_cache_usage)
        g["kv_cache_free_blocks"].set(stats.num_free_blocks)
        g["kv_cache_total_blocks"].set(stats.num_total_blocks)
        g["num_preemptions"].set(stats.num_preempted_total)
        g["num_remote_prefills"].set(stats.num_remote_prefills_total)
        g["prefix_cache_queries"].set(stats.prefix_cache_queries)
        g["prefix_cache_hits"].set(stats.prefix_cache_hits)
        new = stats.num_kernel_compilations_after_ready - self._kernel_compilations_seen
        if new > 0:
            self.kernel_compilations.inc(new)
            self._kernel_compilations_seen += new

    def render(self) -> bytes:
        return generate_latest(self.registry)
