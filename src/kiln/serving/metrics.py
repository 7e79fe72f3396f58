"""Prometheus metrics for one app. Each app owns its registry, so several apps (tests, the
benchmark) can live in one process without their counters colliding."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ServingMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kiln_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.errors = Counter(
            "kiln_errors", "HTTP requests answered with status >= 400", ["endpoint"], registry=r
        )
        self.latency = Histogram(
            "kiln_request_latency_seconds",
            "Time from request arrival to response",
            ["endpoint"],
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "kiln_batch_size", "Inputs per model call", buckets=BATCH_SIZE_BUCKETS, registry=r
        )
        self.queue_wait = Histogram(
            "kiln_queue_wait_seconds",
            "Time a request waits in the batching queue before its model call starts",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.inference = Histogram(
            "kiln_inference_seconds",
            "Time of one batched model call",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("kiln_queue_depth", "Requests waiting to be batched", registry=r)
        self.failed_batches = Counter("kiln_failed_batches", "Model calls that raised", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
