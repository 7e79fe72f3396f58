"""Open Inference Protocol v2 routes (KServe / Triton); kiln.serving.oip holds the wire format.

    GET  /v2                                       server metadata
    GET  /v2/health/live, /v2/health/ready
    GET  /v2/models/{name}[/versions/1]            model metadata
    GET  /v2/models/{name}[/versions/1]/ready
    GET  /v2/models/{name}[/versions/1]/config     Triton's model configuration extension
    POST /v2/models/{name}[/versions/1]/infer      JSON or binary tensor data, any content type

The model's one input is `input`: FP32 raw pixels [N, C, H, W] for image classifiers, BYTES [N]
texts for text models, FP32 [N, 3, H, W] for detectors (any H, W; one size per request). Models
that take image files (trained on image folders; detectors) also take BYTES [N]: the files.
Outputs: `probs` FP32 [N, K] and `label` BYTES [N] (classifiers; `probs` also answers Triton's
classification extension); `boxes` FP32 [M, 4], `scores` FP32 [M], `labels` BYTES [M] and
`num_detections` INT64 [N] (detectors: M boxes over the N images, image by image).
Errors are {"error": "..."}: 400 for a bad request or input, 404, 413, 415, 499, 500, 503 (with
Retry-After), 504."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

import kiln
from kiln.data.multilabel import join_labels
from kiln.inference import Predictor
from kiln.preprocessing import InputError
from kiln.serving.errors import ServingError
from kiln.serving.metrics import add_plain_route
from kiln.serving.oip import (
    HEADER_LENGTH,
    ModelPath,
    OutputTensor,
    TensorSpec,
    answer_tensors,
    encode_response,
    parse_infer_request,
)
from kiln.serving.state import ServingState

VERSION = "1"
EXTENSIONS = ["binary_tensor_data", "classification", "model_configuration"]
MAX_DETECTION_SIDE_ELEMENTS = 3  # channels of a detector's input


def signature(predictor: Predictor) -> tuple[dict[str, TensorSpec], dict[str, TensorSpec]]:
    """The model's inputs and outputs as v2 metadata describes them."""
    spec = predictor.spec
    kind = predictor.preprocess.input_kind
    if kind == "tokens":
        pairs = getattr(predictor.preprocess.recipe, "pair_column", None) is not None
        inputs = [TensorSpec("input", "BYTES", (-1, 2) if pairs else (-1,))]
    elif kind == "image_list":  # pixels of any size, or the image files themselves
        inputs = [TensorSpec("input", "FP32", (-1, spec.channels, -1, -1), True)]
    else:
        files = getattr(predictor.preprocess, "takes_files", False)
        inputs = [TensorSpec("input", "FP32", (-1, spec.channels, *spec.image_size), files)]
    if predictor.task == "detection":
        outputs = [
            TensorSpec("boxes", "FP32", (-1, 4)),
            TensorSpec("scores", "FP32", (-1,)),
            TensorSpec("labels", "BYTES", (-1,)),
            TensorSpec("num_detections", "INT64", (-1,)),
        ]
    elif spec.multi_label:  # the predicted set, joined by the training's label separator
        outputs = [
            TensorSpec("probs", "FP32", (-1, spec.num_classes)),
            TensorSpec("labels", "BYTES", (-1,)),
        ]
    else:
        outputs = [
            TensorSpec("probs", "FP32", (-1, spec.num_classes)),
            TensorSpec("label", "BYTES", (-1,)),
        ]
    return {t.name: t for t in inputs}, {t.name: t for t in outputs}


def max_elements_per_input(predictor: Predictor) -> int:
    """The most values one input may hold (bounds what a request's shape may claim)."""
    kind = predictor.preprocess.input_kind
    if kind == "tokens":  # a text, or a pair model's two
        return 2 if getattr(predictor.preprocess.recipe, "pair_column", None) else 1
    if kind == "image_list":
        return MAX_DETECTION_SIDE_ELEMENTS * predictor.preprocess.max_side**2
    return math.prod(predictor.preprocess.shape)


def output_tensors(predictor: Predictor, outputs: Any) -> list[OutputTensor]:
    names = predictor.class_names
    if predictor.task == "detection":
        boxes = [d["boxes"] for d in outputs]
        labels = [names[int(k) - 1] for d in outputs for k in d["labels"]]
        total = len(labels)
        return [
            OutputTensor(
                "boxes", "FP32", (total, 4), np.concatenate(boxes) if boxes else np.zeros((0, 4))
            ),
            OutputTensor(
                "scores",
                "FP32",
                (total,),
                np.concatenate([d["scores"] for d in outputs]) if outputs else np.zeros(0),
            ),
            OutputTensor("labels", "BYTES", (total,), labels),
            OutputTensor(
                "num_detections", "INT64", (len(outputs),), np.array([len(b) for b in boxes])
            ),
        ]
    probs = np.asarray(outputs, dtype=np.float32)
    if predictor.multi_label is not None:  # per input its predicted set, joined
        separator = predictor.multi_label[0]
        sets = [join_labels(answer["labels"], separator) for answer in predictor.answers(probs)]
        return [
            OutputTensor("probs", "FP32", probs.shape, probs),
            OutputTensor("labels", "BYTES", (len(probs),), sets),
        ]
    labels = [names[int(i)] for i in probs.argmax(axis=1)] if len(probs) else []
    return [
        OutputTensor("probs", "FP32", probs.shape, probs),
        OutputTensor("label", "BYTES", (len(probs),), labels),
    ]


def model_metadata(state: ServingState) -> dict[str, Any]:
    """The v2 model metadata. A model trained on image files lists its input twice: FP32 raw
    pixels, then BYTES [-1], the encoded files themselves -- the two forms the server takes."""
    inputs, outputs = signature(state.predictor)
    forms = [t.metadata() for t in inputs.values()]
    forms += [t.files_variant().metadata() for t in inputs.values() if t.image_files]
    return {
        "name": state.model_name,
        "versions": [VERSION],
        "platform": state.predictor.backend.platform,
        "inputs": forms,
        "outputs": [t.metadata() for t in outputs.values()],
    }


def model_config(state: ServingState) -> dict[str, Any]:
    """Triton's model configuration (the JSON form of config.pbtxt) for this model."""
    inputs, outputs = signature(state.predictor)

    def entry(t: TensorSpec) -> dict[str, Any]:
        data_type = "TYPE_STRING" if t.datatype == "BYTES" else f"TYPE_{t.datatype}"
        return {"name": t.name, "data_type": data_type, "dims": list(t.shape[1:])}

    return {
        "name": state.model_name,
        "platform": state.predictor.backend.platform,
        "max_batch_size": state.config.max_batch_size,
        "input": [entry(t) for t in inputs.values()],
        "output": [entry(t) for t in outputs.values()],
        "dynamic_batching": {
            "max_queue_delay_microseconds": round(state.config.max_delay_ms * 1000)
        },
    }


def v2_error(err: Exception) -> JSONResponse:
    if isinstance(err, InputError):
        return JSONResponse({"error": str(err)}, status_code=400)
    return JSONResponse({"error": str(err)}, status_code=err.status, headers=err.headers)


def not_found(name: str, version: str | None, state: ServingState) -> JSONResponse | None:
    if name != state.model_name:
        message = f"unknown model {name!r}; this server serves {state.model_name!r}"
        return JSONResponse({"error": message}, status_code=404)
    if version is not None and version != VERSION:
        message = f"model {name!r} has no version {version!r}; versions: [{VERSION!r}]"
        return JSONResponse({"error": message}, status_code=404)
    return None


def add_v2_routes(app: FastAPI, state: ServingState) -> None:
    predictor, config = state.predictor, state.config
    inputs, outputs = signature(predictor)
    (input_spec,) = inputs.values()
    per_input = max_elements_per_input(predictor)

    def parse(body: bytes, header_length: str | None, model: ModelPath):
        """(the request, its items): numeric tensors converted here, BYTES (texts, or an image
        model's files) left as they are for `state.convert`."""
        request = parse_infer_request(
            body, header_length, model, inputs, outputs, config.max_inputs_per_request, per_input
        )
        tensor = request.inputs[0]
        if tensor.datatype == "BYTES":
            if len(input_spec.shape) == 2:  # a pair model's [N, 2] texts: one pair per row
                data = list(tensor.data)
                return request, [data[i : i + 2] for i in range(0, len(data), 2)]
            return request, tensor.data
        return request, predictor.convert_tensor(np.asarray(tensor.data).reshape(tensor.shape))

    def render(request, results) -> tuple[bytes, dict[str, str], str]:
        tensors = output_tensors(predictor, results)
        answers = answer_tensors(tensors, request.outputs, predictor.class_names)
        encoded = encode_response(state.model_name, request.id, answers)
        return encoded.body, encoded.headers, encoded.media_type

    async def infer(request: Request, name: str, version: str | None):
        missing = not_found(name, version, state)
        if missing:
            return missing
        try:
            async with state.admitted() as deadline:
                body = await state.read_body(request, deadline)
                header_length = request.headers.get(HEADER_LENGTH)
                model = ModelPath(name, version, VERSION)
                parsed, items = await state.offload(len(body), parse, body, header_length, model)
                if parsed.timeout_us is not None:  # the client's own deadline, if sooner
                    deadline = min(deadline, time.monotonic() + parsed.timeout_us / 1e6)
                tensor = parsed.inputs[0]
                if tensor.datatype == "BYTES":  # image files: decoded in the decode pool
                    items = await state.convert(request, items, len(body), deadline)
                results = await state.infer(request, items, tensor.shape[0], deadline)
                answer, headers, media_type = await state.offload(
                    len(body), render, parsed, results
                )
        except (InputError, ServingError) as err:
            await state.pace(err)
            return v2_error(err)
        return Response(answer, headers=headers, media_type=media_type)

    @app.get("/v2")
    async def server_metadata():
        return {"name": "kiln", "version": kiln.__version__, "extensions": EXTENSIONS}

    @app.get("/v2/health/live")
    async def live():
        return {"live": True}

    @app.get("/v2/health/ready")
    async def ready():
        is_ready = state.ready and not state.draining
        return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)

    @app.get("/v2/models/{name}")
    async def metadata(name: str):
        return not_found(name, None, state) or model_metadata(state)

    @app.get("/v2/models/{name}/versions/{version}")
    async def version_metadata(name: str, version: str):
        return not_found(name, version, state) or model_metadata(state)

    async def readiness(name: str, version: str | None):
        missing = not_found(name, version, state)
        if missing:
            return missing
        is_ready = state.ready and not state.draining
        body = {"name": name, "ready": is_ready}
        return JSONResponse(body, status_code=200 if is_ready else 503)

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str):
        return await readiness(name, None)

    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def version_ready(name: str, version: str):
        return await readiness(name, version)

    @app.get("/v2/models/{name}/config")
    async def config_route(name: str):
        return not_found(name, None, state) or model_config(state)

    @app.get("/v2/models/{name}/versions/{version}/config")
    async def version_config(name: str, version: str):
        return not_found(name, version, state) or model_config(state)

    async def infer_route(request: Request) -> Response:
        return await infer(request, request.path_params["name"], None)

    async def version_infer(request: Request) -> Response:
        params = request.path_params
        return await infer(request, params["name"], params["version"])

    add_plain_route(app, "/v2/models/{name}/infer", infer_route, ["POST"])
    add_plain_route(app, "/v2/models/{name}/versions/{version}/infer", version_infer, ["POST"])
