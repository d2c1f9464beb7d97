"""GET /metrics in Prometheus' text format (prometheus-client), under the names vLLM uses where
it has one, so dashboards made for vLLM work: the scheduler's gauges and token counters are
read from its stats at each scrape; per-request latencies are observed as outputs leave the
scheduler (MeteredBridge). hybridmoe_* are this engine's own (the expert cache)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hybridmoe.engine.scheduler import RequestOutput
from hybridmoe.engine.stats import GenerationStats
from hybridmoe.server.generation import OutputBridge

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


class ServerMetrics:
    """The metrics of one server, in a registry of its own (two apps in a process, as in the
    tests, never share counters). `stats` gives the scheduler's counters since serving began."""

    def __init__(self, model_id: str, stats: Callable[[], GenerationStats]) -> None:
        self.registry = CollectorRegistry()
        self.model_id = model_id
        labels = {"labelnames": ("model_name",), "registry": self.registry}
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Seconds from a request's submission to its first output.",
            buckets=LATENCY_BUCKETS_S,
            **labels,
        ).labels(model_id)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Seconds from a request's submission to its last output.",
            buckets=LATENCY_BUCKETS_S,
            **labels,
        ).labels(model_id)
        self.success = Counter(
            "vllm:request_success",
            "Requests that finished, by finish reason.",
            labelnames=("model_name", "finished_reason"),
            registry=self.registry,
        )
        self.registry.register(_SchedulerCollector(model_id, stats))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def observe(self, output: RequestOutput, submitted_s: float, first: bool) -> None:
        elapsed_s = time.perf_counter() - submitted_s
        if first:
            self.ttft.observe(elapsed_s)
        if output.finished:
            self.e2e.observe(elapsed_s)
            if output.error is None:
                self.success.labels(self.model_id, output.finish_reason).inc()


class MeteredBridge(OutputBridge):
    """An OutputBridge that also times each request's first and last output."""

    def __init__(self, metrics: ServerMetrics) -> None:
        super().__init__()
        self.metrics = metrics

    def sender(self, queue) -> Callable[[RequestOutput], None]:
        send = super().sender(queue)
        submitted_s, first = time.perf_counter(), [True]

        def metered(output: RequestOutput) -> None:
            self.metrics.observe(output, submitted_s, first[0])
            first[0] = False
            send(output)

        return metered


class _SchedulerCollector(Collector):
    def __init__(self, model_id: str, stats: Callable[[], GenerationStats]) -> None:
        self.model_id, self.stats = model_id, stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        label = {"labels": ["model_name"]}
        values = [self.model_id]
        for metric, value in [
            (GaugeMetricFamily("vllm:num_requests_running", "Requests holding a KV row.", **label),
             s.requests_running),
            (GaugeMetricFamily("vllm:num_requests_waiting", "Requests queued for a row.", **label),
             s.requests_waiting),
            (CounterMetricFamily("vllm:prompt_tokens", "Prompt tokens prefilled.", **label),
             s.prompt_tokens),
            (CounterMetricFamily("vllm:generation_tokens", "Tokens generated.", **label),
             s.completion_tokens),
            (CounterMetricFamily("hybridmoe_requests_failed", "Requests ended by an error.",
                                 **label), s.requests_failed),
            (CounterMetricFamily("hybridmoe_requests_cancelled", "Requests whose client left.",
                                 **label), s.requests_cancelled),
        ]:  # fmt: skip
            metric.add_metric(values, value)
            yield metric
        yield from self._experts(s, values)

    def _experts(self, s: GenerationStats, values: list[str]) -> Iterator[Metric]:
        if s.experts is None:  # the decode target computes no expert on the CPU, caches none
            return
        label = {"labels": ["model_name"]}
        hit_rate = GaugeMetricFamily(
            "hybridmoe_expert_cache_hit_rate", "Share of routes served by a cached expert.", **label
        )
        hit_rate.add_metric(values, s.experts.hit_rate)
        routes = CounterMetricFamily("hybridmoe_expert_routes", "Expert routes decoded.", **label)
        routes.add_metric(values, s.experts.routes)
        cpu = CounterMetricFamily("hybridmoe_expert_cpu_routes", "Routes run on the CPU.", **label)
        cpu.add_metric(values, s.experts.cpu_routes)
        yield from (hit_rate, routes, cpu)
