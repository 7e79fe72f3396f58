"""Prometheus metrics for one app, and the middleware that counts every answer by status. Each
app owns its registry, so several apps (tests, the benchmark) can live in one process without
their counters colliding."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ServingMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "kiln_requests",
            "HTTP requests answered, by route and status (499: the client left first)",
            ["endpoint", "status"],
            registry=r,
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
            "Time a request waits in the batching queue before its first model call starts",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.inference = Histogram(
            "kiln_inference_seconds",
            "Time of one batched model call",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("kiln_queue_depth", "Inputs waiting to be batched", registry=r)
        self.queued_requests = Gauge(
            "kiln_queued_requests", "Requests with inputs waiting to be batched", registry=r
        )
        self.failed_batches = Counter("kiln_failed_batches", "Model calls that raised", registry=r)
        self.batch_splits = Counter(
            "kiln_batch_splits",
            "Failed model calls split in halves and retried (to find the failing input)",
            registry=r,
        )
        self.loop_errors = Counter(
            "kiln_batcher_loop_errors",
            "Errors inside the batching loop (it carried on)",
            registry=r,
        )
        self.abandoned = Counter(
            "kiln_abandoned_requests",
            "Requests whose client left before the answer; their unrun inputs left the queue",
            registry=r,
        )
        self.deadline_exceeded = Counter(
            "kiln_deadline_exceeded",
            "Requests past their deadline (504); their unrun inputs left the queue",
            registry=r,
        )
        self.header_timeouts = Counter(
            "kiln_header_timeouts",
            "Connections closed because a request's headers did not arrive within "
            "server.header_timeout_s",
            registry=r,
        )
        self.decode_seconds = Histogram(
            "kiln_decode_seconds",
            "Time a decode thread took for one image file (header, decode, eval transform)",
            buckets=SECONDS_BUCKETS,
            registry=r,
        )
        self.decode_queue_depth = Gauge(
            "kiln_decode_queue_depth", "Image files waiting for a decode thread", registry=r
        )
        self.decoding = Gauge("kiln_decoding", "Image files in a decode thread now", registry=r)
        self.bad_image_files = Counter(
            "kiln_bad_image_files",
            "Image files refused (too many pixels, unreadable, truncated, empty); each failed "
            "its request with a 4xx naming the item",
            registry=r,
        )
        self.warmup_decode = Gauge(
            "kiln_warmup_decode_seconds",
            "Seconds a decode thread took for the warm-up's image of each format, before ready",
            ["format"],
            registry=r,
        )
        self.draining = Gauge("kiln_draining", "1 while shutting down (SIGTERM seen)", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)


ENDPOINT_KEY = "kiln.endpoint"  # the scope's route template, for routes FastAPI does not label


def add_plain_route(app, path: str, endpoint, methods: list[str]) -> None:
    """`endpoint(request)` as a plain Starlette route: no FastAPI dependency solving per
    request (a share of every inference request; kiln.serving.openapi documents the route).
    FastAPI does not put such a route in the scope, so its template is put there for
    CountStatuses' label."""

    async def labelled(request):
        request.scope[ENDPOINT_KEY] = path
        return await endpoint(request)

    app.add_route(path, labelled, methods=methods)


class CountStatuses:
    """ASGI middleware: every HTTP answer counted by route template and status -- including
    those other middleware sends (413) and 500 from an exception no handler caught."""

    def __init__(self, app, metrics: ServingMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status, counted = None, False

        async def send_counted(message):
            nonlocal status, counted
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                # Counted before the last byte leaves: a client that reads /metrics right after
                # its answer must find it there (counting after the app returns raced that).
                counted = True
                self.record(scope, status, time.perf_counter() - started)
            await send(message)

        try:
            await self.app(scope, receive, send_counted)
        except Exception:  # counted as a 500, re-raised
            status = status or 500  # the server-error middleware outside answers 500
            raise
        finally:
            if not counted:
                self.record(scope, status or 500, time.perf_counter() - started)

    def record(self, scope, status: int, seconds: float) -> None:
        # The route template (/v2/models/{name}) keeps label cardinality bounded.
        endpoint = scope.get(ENDPOINT_KEY) or getattr(scope.get("route"), "path", "unmatched")
        self.metrics.requests.labels(endpoint, str(status)).inc()
        if status >= 400:
            self.metrics.errors.labels(endpoint).inc()
        self.metrics.latency.labels(endpoint).observe(seconds)
