"""The FastAPI app: /v1/predict, health and readiness, Prometheus /metrics, and the Open
Inference Protocol v2 routes (kiln.serving.v2). Requests go through one DynamicBatcher."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from kiln.inference import InputError, Predictor
from kiln.serving.batcher import BatcherClosed, BatchFailed, DynamicBatcher, QueueFull
from kiln.serving.metrics import ServingMetrics

log = logging.getLogger(__name__)


class PredictRequest(BaseModel):
    inputs: list[Any]  # images: nested lists (C, H, W) or (H, W); texts: strings


@dataclass
class ServingState:
    predictor: Predictor
    batcher: DynamicBatcher
    metrics: ServingMetrics
    model_name: str
    ready: bool = False

    async def predict(self, inputs: list[Any]) -> list[dict[str, Any]]:
        """Validates first (InputError names the item), then waits for its batch."""
        self.predictor.validate(inputs)
        if not inputs:
            return []
        return await self.batcher.submit(inputs)


def error_status(err: Exception) -> int:
    if isinstance(err, InputError):
        return 422
    if isinstance(err, QueueFull | BatcherClosed):
        return 503
    return 500


def create_app(
    predictor: Predictor,
    *,
    max_batch_size: int = 32,
    max_delay_ms: float = 5,
    model_name: str = "kiln",
    max_queue_size: int = 1024,
) -> FastAPI:
    metrics = ServingMetrics()
    batcher = DynamicBatcher(
        predictor.predict,
        max_batch_size=max_batch_size,
        max_delay_ms=max_delay_ms,
        max_queue_size=max_queue_size,
        metrics=metrics,
    )
    state = ServingState(predictor, batcher, metrics, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await batcher.start()
        # Warm-up: one real predict through the whole path before /readyz says yes.
        await state.predict([predictor.example_input()])
        state.ready = True
        log.info("model %s ready (%s)", model_name, predictor.backend.platform)
        try:
            yield
        finally:
            state.ready = False
            await batcher.stop()

    app = FastAPI(title=f"kiln: {model_name}", lifespan=lifespan)
    app.state.kiln = state
    _add_metrics_middleware(app, metrics)
    _add_v1_routes(app, state)
    from kiln.serving.v2 import add_v2_routes

    add_v2_routes(app, state)
    return app


def _add_metrics_middleware(app: FastAPI, metrics: ServingMetrics) -> None:
    @app.middleware("http")
    async def count_requests(request: Request, call_next):
        started = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        # The route template (/v2/models/{name}) keeps label cardinality bounded.
        endpoint = getattr(route, "path", "unmatched")
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        if response.status_code >= 400:
            metrics.errors.labels(endpoint).inc()
        metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
        return response


def _add_v1_routes(app: FastAPI, state: ServingState) -> None:
    @app.post("/v1/predict")
    async def predict(body: PredictRequest):
        try:
            predictions = await state.predict(body.inputs)
        except (InputError, QueueFull, BatcherClosed, BatchFailed) as err:
            return JSONResponse({"detail": str(err)}, status_code=error_status(err))
        return {"predictions": predictions}

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ready", "model": state.model_name}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
