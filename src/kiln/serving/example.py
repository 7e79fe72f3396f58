"""GET /v1/example: a request body that works for the served model, so nobody has to guess an
input's shape. It is the preprocessing's own example input (what the server warms up with), in
the form each API takes:

    curl -s localhost:8000/v1/example | curl -s localhost:8000/v1/predict -d @-
    curl -s 'localhost:8000/v1/example?api=v2' | curl -s localhost:8000/v2/models/kiln/infer -d @-

The v2 body names the input, datatype and shape that GET /v2/models/<name> lists."""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from kiln.inference import Predictor
from kiln.inference.examples import example_items
from kiln.serving.state import ServingState
from kiln.serving.v2 import signature

APIS = ("v1", "v2")


def example_bodies(predictor: Predictor, count: int = 1) -> dict[str, dict[str, Any]]:
    """{"v1": the body for POST /v1/predict, "v2": the body for POST /v2/models/<name>/infer}."""
    items = example_items(predictor.preprocess, count)
    (tensor,) = signature(predictor)[0].values()
    if isinstance(items[0], str):  # text models: BYTES [N]
        v1, shape, data = list(items), [len(items)], list(items)
    elif isinstance(items[0], list):  # a pair model's texts: BYTES [N, 2]
        v1, shape, data = list(items), [len(items), 2], [t for pair in items for t in pair]
    else:  # images [N, C, H, W]; a detector's images share a size here
        arrays = np.stack(items).astype(np.float32)
        v1, shape, data = arrays.tolist(), list(arrays.shape), arrays.ravel().tolist()
    v2 = {"name": tensor.name, "shape": shape, "datatype": tensor.datatype, "data": data}
    return {"v1": {"inputs": v1}, "v2": {"inputs": [v2]}}


def add_example_route(app: FastAPI, state: ServingState) -> None:
    bodies = example_bodies(state.predictor)

    @app.get("/v1/example")
    async def example(api: str = "v1"):
        if api not in APIS:
            return JSONResponse({"detail": f"api={api!r}: choose v1 or v2"}, status_code=422)
        return bodies[api]


def example_paths() -> dict[str, Any]:
    """The route's OpenAPI path item (kiln.serving.openapi documents the others)."""
    body = {"type": "object", "required": ["inputs"], "properties": {"inputs": {"type": "array"}}}
    error = {"$ref": "#/components/schemas/V1Error"}
    return {
        "/v1/example": {
            "get": {
                "summary": "a request body that works: for POST /v1/predict, or with api=v2 "
                "for POST /v2/models/<name>/infer",
                "parameters": [
                    {
                        "name": "api",
                        "in": "query",
                        "required": False,
                        "schema": {"type": "string", "enum": list(APIS), "default": "v1"},
                    }
                ],
                "responses": {
                    "200": {
                        "description": "the body, ready to POST",
                        "content": {"application/json": {"schema": body}},
                    },
                    "422": {
                        "description": "api is neither v1 nor v2",
                        "content": {"application/json": {"schema": error}},
                    },
                },
            }
        }
    }
