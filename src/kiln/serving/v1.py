"""kiln's own API: POST /v1/predict {"inputs": [...]} -> {"predictions": [...]}, plus /healthz,
/readyz and /metrics. Errors are {"detail": "<what, where, what was expected>"}: 422 for a bad
request or input, 413, 499, 500, 503 (with Retry-After) and 504 as the limits say."""

from __future__ import annotations

import base64
import binascii
import json

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from kiln.preprocessing import InputError
from kiln.serving.errors import ServingError
from kiln.serving.metrics import add_plain_route
from kiln.serving.oip import loads_json
from kiln.serving.state import ServingState

PER_INPUT_BYTES = 1024  # a rough answer size per input: decides whether rendering is offloaded


def v1_error(err: Exception) -> JSONResponse:
    if isinstance(err, InputError):
        return JSONResponse({"detail": str(err)}, status_code=422)
    status = err.status if err.status != 400 else 422  # v1 answers a bad request with 422
    return JSONResponse({"detail": str(err)}, status_code=status, headers=err.headers)


def parse_inputs(body: bytes, max_inputs: int) -> list:
    request = loads_json(body)
    expected = 'send a JSON object {"inputs": [<one input>, ...]}'
    if not isinstance(request, dict):
        raise InputError(f"the body is a JSON {type(request).__name__}; {expected}")
    if "inputs" not in request:
        raise InputError(f"the body has no 'inputs' (it has {sorted(request)}); {expected}")
    unknown = sorted(set(request) - {"inputs"})
    if unknown:
        raise InputError(f"unknown field(s) {unknown}; the body holds only 'inputs'")
    inputs = request["inputs"]
    if not isinstance(inputs, list):
        raise InputError(f"inputs must be a list, got {type(inputs).__name__}")
    if len(inputs) > max_inputs:
        raise InputError(
            f"{len(inputs)} inputs in one request; server.max_inputs_per_request is {max_inputs}"
        )
    return inputs


def encoded_file(item, index: int):
    """A v1 input of an image-file model: a base64 string or {"b64": <base64>} becomes the
    file's bytes; pixel arrays pass through."""
    if isinstance(item, dict) and set(item) == {"b64"}:
        item = item["b64"]
    if not isinstance(item, str):
        return item
    try:
        return base64.b64decode(item, validate=False)
    except (binascii.Error, ValueError) as err:
        raise InputError(
            f"item {index}: a string input must be an image file, base64-encoded ({err})", index
        ) from None


def add_v1_routes(app: FastAPI, state: ServingState) -> None:
    predictor = state.predictor
    config = state.config

    takes_files = getattr(predictor.preprocess, "takes_files", False)

    def parse(body: bytes) -> list:
        inputs = parse_inputs(body, config.max_inputs_per_request)
        if takes_files:  # image files as base64 strings (or {"b64": ...}, as TF Serving sends)
            inputs = [encoded_file(item, i) for i, item in enumerate(inputs)]
        return inputs

    def render(outputs) -> bytes:
        answers = predictor.answers(outputs)
        return json.dumps({"predictions": answers}, separators=(",", ":"), allow_nan=False).encode()

    async def predict(request: Request) -> Response:
        try:
            async with state.admitted() as deadline:
                body = await state.read_body(request, deadline)
                inputs = await state.offload(len(body), parse, body)
                items = await state.convert(request, inputs, len(body), deadline)
                count = len(inputs)
                outputs = await state.infer(request, items, count, deadline)
                answer = await state.offload(count * PER_INPUT_BYTES, render, outputs)
        except (InputError, ServingError) as err:
            await state.pace(err)
            return v1_error(err)
        return Response(answer, media_type="application/json")

    add_plain_route(app, "/v1/predict", predict, ["POST"])

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not state.ready:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ready", "model": state.model_name}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
