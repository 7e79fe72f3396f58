"""Open Inference Protocol v2 (KServe / Triton), JSON flavour:

    GET  /v2/health/live, /v2/health/ready, /v2/models/{name}, /v2/models/{name}/ready
    POST /v2/models/{name}/infer
         {"inputs": [{"name": "input", "shape": [N, C, H, W], "datatype": "FP32", "data": [...]}]}
      -> {"model_name", "outputs": [{"name": "probs", ...}, {"name": "label", ...}]}

Image models take one FP32 (any numeric type) tensor of raw pixels, flat or nested data; text
models take a BYTES tensor of shape [N] holding the texts. Errors: {"error": "..."}."""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from kiln.inference import InputError
from kiln.serving.batcher import BatcherClosed, BatchFailed, QueueFull

INPUT_NAME = "input"
NUMERIC_TYPES = ("FP32", "FP64", "FP16", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16")


class TensorIn(BaseModel):
    name: str
    shape: list[int]
    datatype: str
    data: list[Any]
    parameters: dict[str, Any] | None = None


class RequestedOutput(BaseModel):
    name: str


class InferRequest(BaseModel):
    id: str | None = None
    inputs: list[TensorIn]
    outputs: list[RequestedOutput] | None = None
    parameters: dict[str, Any] | None = None


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def model_metadata(state) -> dict[str, Any]:
    spec = state.predictor.spec
    if spec.input_kind == "image":
        tensor_in = {
            "name": INPUT_NAME,
            "datatype": "FP32",
            "shape": [-1, spec.channels, *spec.image_size],
        }
    else:
        tensor_in = {"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}
    return {
        "name": state.model_name,
        "versions": ["1"],
        "platform": state.predictor.backend.platform,
        "inputs": [tensor_in],
        "outputs": [
            {"name": "probs", "datatype": "FP32", "shape": [-1, spec.num_classes]},
            {"name": "label", "datatype": "BYTES", "shape": [-1]},
        ],
        "parameters": {"class_names": list(spec.class_names)},
    }


def _items(tensor: TensorIn, input_kind: str) -> list[Any]:
    """The request tensor split into one raw input per batch row."""
    if tensor.name != INPUT_NAME:
        raise InputError(f"unknown input {tensor.name!r}; this model has one input, {INPUT_NAME!r}")
    if not tensor.shape or any(d < 0 for d in tensor.shape):
        raise InputError(f"input shape {tensor.shape} must be non-empty, with sizes >= 0")
    if input_kind == "tokens":
        if tensor.datatype != "BYTES" or len(tensor.shape) != 1:
            raise InputError(
                f"expected datatype BYTES with shape [N] (texts), got {tensor.datatype} "
                f"{tensor.shape}"
            )
        if len(tensor.data) != tensor.shape[0]:
            raise InputError(
                f"shape {tensor.shape} holds {tensor.shape[0]} texts, data has {len(tensor.data)}"
            )
        return list(tensor.data)
    if tensor.datatype not in NUMERIC_TYPES:
        raise InputError(f"datatype {tensor.datatype} is not numeric; send FP32 pixels")
    try:
        array = np.asarray(tensor.data, dtype=np.float32)
    except (ValueError, TypeError):
        raise InputError("data must be numbers (flat, or nested to match shape)") from None
    if array.size != int(np.prod(tensor.shape)):
        raise InputError(
            f"shape {tensor.shape} holds {int(np.prod(tensor.shape))} values, data has {array.size}"
        )
    return list(array.reshape(tensor.shape))


def _outputs(predictions: list[dict[str, Any]], num_classes: int, wanted: set[str] | None):
    n = len(predictions)
    probs = [p for pred in predictions for p in pred["probs"]]
    labels = [pred["label"] for pred in predictions]
    outputs = [
        {"name": "probs", "datatype": "FP32", "shape": [n, num_classes], "data": probs},
        {"name": "label", "datatype": "BYTES", "shape": [n], "data": labels},
    ]
    return [o for o in outputs if wanted is None or o["name"] in wanted]


def add_v2_routes(app: FastAPI, state) -> None:
    def unknown(name: str) -> JSONResponse | None:
        if name != state.model_name:
            return _error(f"unknown model {name!r}; this server serves {state.model_name!r}", 404)
        return None

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready():
        return JSONResponse({"ready": state.ready}, status_code=200 if state.ready else 503)

    @app.get("/v2/models/{name}")
    async def metadata(name: str):
        return unknown(name) or model_metadata(state)

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str):
        missing = unknown(name)
        if missing:
            return missing
        return JSONResponse(
            {"name": name, "ready": state.ready}, status_code=200 if state.ready else 503
        )

    @app.post("/v2/models/{name}/infer")
    async def infer(name: str, body: InferRequest):
        missing = unknown(name)
        if missing:
            return missing
        if len(body.inputs) != 1:
            return _error(
                f"expected exactly one input tensor ({INPUT_NAME!r}), got {len(body.inputs)}"
            )
        try:
            predictions = await state.predict(
                _items(body.inputs[0], state.predictor.spec.input_kind)
            )
        except InputError as err:
            return _error(str(err), 400)
        except (QueueFull, BatcherClosed) as err:
            return _error(str(err), 503)
        except BatchFailed as err:
            return _error(str(err), 500)
        wanted = {o.name for o in body.outputs} if body.outputs else None
        response = {
            "model_name": name,
            "model_version": "1",
            "outputs": _outputs(predictions, state.predictor.spec.num_classes, wanted),
        }
        if body.id is not None:
            response["id"] = body.id
        return response
