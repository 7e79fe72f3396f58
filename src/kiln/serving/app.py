"""The FastAPI app: kiln's /v1 routes, the Open Inference Protocol v2 routes, one DynamicBatcher
behind both, Prometheus metrics counting every answer, and an OpenAPI document
(kiln.serving.openapi) that describes every status and body the app returns."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kiln.config.infer import ServerConfig, validate_server
from kiln.inference import Predictor
from kiln.inference.predictor import join
from kiln.serving.batcher import DynamicBatcher
from kiln.serving.example import add_example_route, example_paths
from kiln.serving.metrics import CountStatuses, ServingMetrics
from kiln.serving.openapi import openapi_document
from kiln.serving.state import ServingState
from kiln.serving.v1 import add_v1_routes
from kiln.serving.v2 import add_v2_routes

log = logging.getLogger(__name__)

WARMUP_TIMEOUT_S = 600.0  # the first model call may compile kernels; it must not hang forever


async def _internal_error(request: Request, err: Exception) -> JSONResponse:
    """A bug, not a user mistake: logged with its traceback, answered 500 in the API's error
    body (never the bare text page), and counted like every other answer."""
    log.error("unhandled error on %s", request.url.path, exc_info=err)
    key = "error" if request.url.path.startswith("/v2") else "detail"
    return JSONResponse({key: f"internal error: {type(err).__name__}"}, status_code=500)


class CloseWhenDraining:
    """ASGI middleware: once the server drains, every answer says Connection: close, so a
    kept-alive client opens no further request on a connection that is about to close."""

    def __init__(self, app, state: ServingState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message):
            if message["type"] == "http.response.start" and self.state.draining:
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, receive, send_closing)


def create_app(predictor: Predictor, config: ServerConfig | None = None, **overrides) -> FastAPI:
    """The app for one predictor. `overrides` replace fields of `config` (e.g. max_batch_size=8);
    the result is validated as `python infer.py mode=serve` would."""
    config = dataclasses.replace(config or ServerConfig(), **overrides)
    validate_server(config)
    metrics = ServingMetrics()
    batcher = DynamicBatcher(
        predictor.run,
        join,
        max_batch_size=config.max_batch_size,
        max_delay_ms=config.max_delay_ms,
        max_queue_size=config.max_queue_size,
        metrics=metrics,
    )
    state = ServingState(predictor, batcher, metrics, config)
    batcher.more_coming = lambda: bool(state.arriving)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        await batcher.start()
        # Warm-up: one real input through the model before readiness says yes.
        example = predictor.convert([predictor.example_input()])
        await batcher.submit(example, 1, time.monotonic() + WARMUP_TIMEOUT_S)
        # The objects of start-up (torch, the model, the web stack: millions) never become
        # garbage: frozen, the collector stops re-scanning them, which was a pause of tens of
        # milliseconds that every request in flight waited out (the p99).
        gc.collect()
        gc.freeze()
        state.ready = True
        log.info("model %s ready (%s)", config.model_name, predictor.backend.platform)
        try:
            yield
        finally:
            state.ready = False
            await batcher.stop()
            state.close()

    app = FastAPI(
        title=f"kiln: {config.model_name}",
        version="1",
        lifespan=lifespan,
        docs_url=None,  # the document itself is at /openapi.json
        redoc_url=None,
    )
    app.state.kiln = state
    app.add_exception_handler(Exception, _internal_error)
    add_v1_routes(app, state)
    add_v2_routes(app, state)
    add_example_route(app, state)
    document = openapi_document(predictor, config)
    document["paths"].update(example_paths())
    app.openapi = lambda: document
    app.add_middleware(CountStatuses, metrics=metrics)
    app.add_middleware(CloseWhenDraining, state=state)
    return app
