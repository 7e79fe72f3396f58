"""The FastAPI app: kiln's /v1 routes, the Open Inference Protocol v2 routes, one DynamicBatcher
behind both, Prometheus metrics counting every answer, and an OpenAPI document
(kiln.serving.openapi) that describes every status and body the app returns."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import gc
import logging
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kiln.config.infer import (
    ServerConfig,
    decode_threads,
    validate_file_server,
    validate_server,
)
from kiln.inference import Predictor
from kiln.inference.predictor import join
from kiln.preprocessing import InputError
from kiln.serving.batcher import DynamicBatcher
from kiln.serving.decoding import DecodePool, header_pixels, warmup_files
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


def _file_decoder(predictor: Predictor, max_image_pixels: int):
    """(file bytes, index) -> the decoded, eval-transformed image, by the preprocessing's own
    `file_item` with this server's pixel limit (read from the header, before decoding);
    InputError naming the index. A model that takes no files refuses them."""
    if hasattr(predictor.preprocess, "file_item"):
        preprocess = copy.copy(predictor.preprocess)  # the limit is this app's, not the caller's
        preprocess.max_image_pixels = max_image_pixels
        return preprocess.file_item

    def refuse(data: bytes, index: int):
        kind = predictor.preprocess.input_kind
        raise InputError(f"item {index}: got the bytes of a file; this model takes {kind}", index)

    return refuse


async def warm_decoders(state: ServingState, deadline: float) -> list[str]:
    """A small image of every format Pillow writes (kiln.serving.decoding.warmup_files) decoded
    in the decode threads and run through the model, so the first request after ready does not
    set up a decoder (seconds of imports and library loading). Returns the formats warmed."""
    started = time.perf_counter()
    files = warmup_files()

    async def timed(fmt: str, data: bytes) -> Any:
        began = time.perf_counter()
        (image,) = (await state.decoder.decode([(0, data)], deadline)).values()
        state.metrics.warmup_decode.labels(fmt).set(time.perf_counter() - began)
        return image

    pending, results = list(files.items()), []
    while pending:  # as many at once as there are threads: none waits in the (bounded) queue
        chunk, pending = pending[: state.decoder.threads], pending[state.decoder.threads :]
        results += await asyncio.gather(*(timed(*f) for f in chunk), return_exceptions=True)
    warmed, images, skipped = [], [], []
    for fmt, result in zip(files, results, strict=True):
        if isinstance(result, InputError):  # Pillow reads it, kiln's decoder does not
            log.warning("warm-up: %s not decoded: %s", fmt, result)
            skipped.append(fmt)
            continue
        if isinstance(result, BaseException):
            raise result
        warmed.append(fmt)
        images.append(result)
    items = state.predictor.convert(images)
    await state.batcher.submit(items, len(images), deadline)
    log.info(
        "image decoders warmed in %.2f s: %s%s",
        time.perf_counter() - started,
        ", ".join(warmed),
        f" (not decoded: {', '.join(skipped)})" if skipped else "",
    )
    return warmed


def create_app(predictor: Predictor, config: ServerConfig | None = None, **overrides) -> FastAPI:
    """The app for one predictor. `overrides` replace fields of `config` (e.g. max_batch_size=8);
    the result is validated as `python infer.py mode=serve` would."""
    config = dataclasses.replace(config or ServerConfig(), **overrides)
    validate_server(config)
    takes_files = getattr(predictor.preprocess, "takes_files", False)
    if takes_files:
        validate_file_server(config)
    metrics = ServingMetrics()
    batcher = DynamicBatcher(
        predictor.run,
        join,
        max_batch_size=config.max_batch_size,
        max_delay_ms=config.max_delay_ms,
        max_queue_size=config.max_queue_size,
        metrics=metrics,
    )
    decoder = DecodePool(
        _file_decoder(predictor, config.max_image_pixels),
        pixels=header_pixels,
        max_pixels=config.max_image_pixels,
        threads=decode_threads(config.decode_threads),
        max_queued=config.max_decode_queue_size,
        metrics=metrics,
    )
    state = ServingState(predictor, batcher, decoder, metrics, config)
    batcher.more_coming = lambda: bool(state.arriving)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        await batcher.start()
        decoder.start()
        # Warm-up: one real input through the model before readiness says yes, and for a model
        # that takes image files, a file of every format through the decoders and the model.
        deadline = time.monotonic() + WARMUP_TIMEOUT_S
        example = predictor.convert([predictor.example_input()])
        await batcher.submit(example, 1, deadline)
        if takes_files:
            await warm_decoders(state, deadline)
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
