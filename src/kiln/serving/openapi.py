"""The OpenAPI 3.1 document of one server: built from the served model (its input shape, value
range, classes) and the server's limits, so a request the schema calls valid is one the server
accepts, and every status and body the server can return is written down.

Two rules of the protocol are relations JSON Schema cannot state, so the descriptions say them:
a v2 tensor's data holds exactly prod(shape) values (flat, or nested exactly as shape), and a
detector's images are rectangular (every row of one image the same length)."""

from __future__ import annotations

from typing import Any

import numpy as np
from prometheus_client import CONTENT_TYPE_LATEST

from kiln.config.infer import ServerConfig
from kiln.inference import Predictor
from kiln.preprocessing.image_list import MIN_SIDE
from kiln.serving.v2 import VERSION, signature

FLOAT32_MAX = 3.4028234663852886e38
MAX_EXAMPLE_VALUES = 4096  # an example image larger than this is left out of the document
DATA_MATCHES_SHAPE = (
    "data holds exactly prod(shape) values -- a shape [2, C, H, W] takes 2*C*H*W numbers -- "
    "flat in row-major order or nested exactly as shape; any other count is answered 400"
)
JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nested(leaf: dict, sizes: list[int]) -> dict:
    """An array nested as `sizes` (outermost first) around `leaf`."""
    schema = leaf
    for size in reversed(sizes):
        schema = {"type": "array", "items": schema, "minItems": size, "maxItems": size}
    return schema


def _pixel(predictor: Predictor) -> dict:
    low, high = predictor.preprocess.value_range or (-FLOAT32_MAX, FLOAT32_MAX)
    return {"type": "number", "minimum": low, "maximum": high}


def _image(predictor: Predictor) -> dict:
    """One raw image as kiln's v1 API takes it."""
    pixel = _pixel(predictor)
    kind = predictor.preprocess.input_kind
    if kind == "image_list":
        side = {"minItems": MIN_SIDE, "maxItems": predictor.preprocess.max_side}
        row = {"type": "array", "items": pixel, **side}
        channel = {"type": "array", "items": row, **side}
        return {
            "type": "array",
            "items": channel,
            "minItems": 3,
            "maxItems": 3,
            "description": "(3, H, W) raw pixels; every row of an image the same length",
        }
    shape = list(predictor.preprocess.shape)
    forms = [_nested(pixel, shape)]
    if shape[0] == 1:
        forms.append(_nested(pixel, shape[1:]))  # (H, W) for one-channel images
    return {"anyOf": forms, "description": f"raw pixels, (C, H, W) = {tuple(shape)}"}


def _takes_files(predictor: Predictor) -> bool:
    return getattr(predictor.preprocess, "takes_files", False)


ENCODED_FILE = {
    "type": "string",
    "contentEncoding": "base64",
    "description": "an image file (PNG, JPEG, WEBP, ...) as base64: decoded and transformed "
    "exactly as the training's evaluation data was",
}


def _input_item(predictor: Predictor) -> dict:
    if predictor.preprocess.input_kind == "tokens":
        return {"type": "string", "description": "a text"}
    if _takes_files(predictor):  # an image file, as base64 or TF Serving's {"b64": ...}
        wrapped = {
            "type": "object",
            "required": ["b64"],
            "additionalProperties": False,
            "properties": {"b64": ENCODED_FILE},
        }
        return {"anyOf": [ENCODED_FILE, wrapped, _image(predictor)]}
    return _image(predictor)


def _v1_prediction(predictor: Predictor) -> dict:
    names = {"type": "string", "enum": predictor.class_names}
    number = {"type": "number"}
    if predictor.task == "detection":
        box = {"type": "array", "items": number, "minItems": 4, "maxItems": 4}
        return {
            "type": "object",
            "required": ["boxes", "labels", "scores"],
            "properties": {
                "boxes": {"type": "array", "items": box, "description": "x1, y1, x2, y2 pixels"},
                "labels": {"type": "array", "items": names},
                "scores": {"type": "array", "items": number},
            },
        }
    k = predictor.spec.num_classes
    if predictor.spec.multi_label:
        return {
            "type": "object",
            "required": ["labels", "scores", "probs"],
            "properties": {
                "labels": {"type": "array", "items": names, "description": "the predicted set"},
                "scores": {"type": "array", "items": number, "description": "their probs"},
                "probs": {"type": "array", "items": number, "minItems": k, "maxItems": k},
            },
        }
    return {
        "type": "object",
        "required": ["label", "probs"],
        "properties": {
            "label": names,
            "probs": {"type": "array", "items": number, "minItems": k, "maxItems": k},
        },
    }


def _v2_data(predictor: Predictor) -> dict:
    (spec,) = signature(predictor)[0].values()
    if spec.datatype == "BYTES":
        return {"type": "array", "items": {"type": "string"}}
    if predictor.preprocess.input_kind == "image_list":
        return {"type": "array", "items": {"anyOf": [_pixel(predictor), _image(predictor)]}}
    flat = {"type": "array", "items": _pixel(predictor)}
    nested = {"type": "array", "items": _nested(_pixel(predictor), list(spec.shape[1:]))}
    return {"anyOf": [flat, nested]}


def _v2_examples(predictor: Predictor) -> list[dict]:
    """A valid request of one input (the warm-up input, a detector's at its smallest size):
    its data count is prod(shape). None for images too large to print in a document."""
    (spec,) = signature(predictor)[0].values()
    if spec.datatype == "BYTES":
        shape, data = [1], [str(predictor.example_input())]
    else:
        example = np.asarray(predictor.example_input())
        if predictor.preprocess.input_kind == "image_list":
            example = example[:, :MIN_SIDE, :MIN_SIDE]
        if example.size > MAX_EXAMPLE_VALUES:
            return []
        shape, data = [1, *example.shape], example.ravel().tolist()
    tensor = {"name": spec.name, "shape": shape, "datatype": spec.datatype, "data": data}
    return [{"inputs": [tensor]}]


def _v2_input(predictor: Predictor, config: ServerConfig) -> dict:
    pixels = _v2_tensor_input(predictor, config)
    if not _takes_files(predictor):
        return pixels
    return {"anyOf": [_v2_files_input(predictor, config), pixels]}


def _v2_files_input(predictor: Predictor, config: ServerConfig) -> dict:
    """The image files themselves: BYTES of shape [N], base64 in JSON, raw bytes in the binary
    extension (with parameters.binary_data_size)."""
    (spec,) = signature(predictor)[0].values()
    batch = {"type": "integer", "minimum": 0, "maximum": config.max_inputs_per_request}
    return {
        "type": "object",
        "required": ["name", "shape", "datatype", "data"],
        "additionalProperties": False,
        "description": "image files: " + DATA_MATCHES_SHAPE,
        "properties": {
            "name": {"const": spec.name},
            "datatype": {"const": "BYTES"},
            "shape": {
                "type": "array",
                "prefixItems": [batch],
                "items": False,
                "minItems": 1,
                "maxItems": 1,
            },
            "data": {"type": "array", "items": ENCODED_FILE, "description": DATA_MATCHES_SHAPE},
        },
    }


def _v2_tensor_input(predictor: Predictor, config: ServerConfig) -> dict:
    (spec,) = signature(predictor)[0].values()
    batch = {"type": "integer", "minimum": 0, "maximum": config.max_inputs_per_request}
    dims = [batch] + [
        {"type": "integer", "minimum": MIN_SIDE, "maximum": predictor.preprocess.max_side}
        if d == -1
        else {"const": d}
        for d in spec.shape[1:]
    ]
    return {
        "type": "object",
        "required": ["name", "shape", "datatype", "data"],
        "additionalProperties": False,
        "description": DATA_MATCHES_SHAPE,
        "examples": [example["inputs"][0] for example in _v2_examples(predictor)],
        "properties": {
            "name": {"const": spec.name},
            "datatype": {"const": spec.datatype},
            "shape": {
                "type": "array",
                "prefixItems": dims,
                "items": False,
                "minItems": len(dims),
                "maxItems": len(dims),
            },
            "data": {**_v2_data(predictor), "description": DATA_MATCHES_SHAPE},
        },
    }


def _v2_outputs(predictor: Predictor) -> dict:
    choices = []
    for name, spec in signature(predictor)[1].items():
        parameters = {"binary_data": {"type": "boolean"}}
        if name == "probs":
            parameters["classification"] = {"type": "integer", "minimum": 1}
        choices.append(
            {
                "type": "object",
                "required": ["name"],
                "additionalProperties": False,
                "properties": {
                    "name": {"const": spec.name},
                    "parameters": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": parameters,
                    },
                },
            }
        )
    return {"type": "array", "items": {"oneOf": choices}}


def _schemas(predictor: Predictor, config: ServerConfig) -> dict[str, Any]:
    string, integer = {"type": "string"}, {"type": "integer"}
    tensor_meta = {
        "type": "object",
        "required": ["name", "datatype", "shape"],
        "properties": {
            "name": string,
            "datatype": string,
            "shape": {"type": "array", "items": integer},
        },
    }
    return {
        "V1Request": {
            "type": "object",
            "required": ["inputs"],
            "additionalProperties": False,
            "properties": {
                "inputs": {
                    "type": "array",
                    "items": _input_item(predictor),
                    "maxItems": config.max_inputs_per_request,
                }
            },
        },
        "V1Response": {
            "type": "object",
            "required": ["predictions"],
            "properties": {"predictions": {"type": "array", "items": _v1_prediction(predictor)}},
        },
        "V1Error": {
            "type": "object",
            "required": ["detail"],
            "properties": {"detail": {"type": "string", "description": "what, where, expected"}},
        },
        "V2Error": {
            "type": "object",
            "required": ["error"],
            "properties": {"error": {"type": "string", "description": "what, where, expected"}},
        },
        "ServerMetadata": {
            "type": "object",
            "required": ["name", "version", "extensions"],
            "properties": {
                "name": string,
                "version": string,
                "extensions": {"type": "array", "items": string},
            },
        },
        "ModelMetadata": {
            "type": "object",
            "required": ["name", "platform", "inputs", "outputs"],
            "properties": {
                "name": {"const": config.model_name},
                "versions": {"type": "array", "items": string},
                "platform": string,
                "inputs": {"type": "array", "items": tensor_meta},
                "outputs": {"type": "array", "items": tensor_meta},
            },
        },
        "ModelConfig": {
            "type": "object",
            "required": ["name", "platform", "max_batch_size", "input", "output"],
            "properties": {
                "name": {"const": config.model_name},
                "platform": string,
                "max_batch_size": integer,
                "input": {"type": "array", "items": {"type": "object"}},
                "output": {"type": "array", "items": {"type": "object"}},
                "dynamic_batching": {"type": "object"},
            },
        },
        "InferRequest": {
            "type": "object",
            "required": ["inputs"],
            "additionalProperties": False,
            "description": (
                "A tensor's data holds exactly prod(shape) values, flat or nested as shape; "
                "model_name and model_version, when sent, name the path's model and version."
            ),
            "examples": _v2_examples(predictor),
            "properties": {
                "id": string,
                "model_name": {"const": config.model_name},
                "model_version": {"const": VERSION},
                "parameters": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"binary_data_output": {"type": "boolean"}},
                },
                "inputs": {
                    "type": "array",
                    "items": _v2_input(predictor, config),
                    "minItems": 1,
                    "maxItems": 1,
                },
                "outputs": _v2_outputs(predictor),
            },
        },
        "InferResponse": {
            "type": "object",
            "required": ["model_name", "outputs"],
            "properties": {
                "model_name": {"const": config.model_name},
                "model_version": {"const": VERSION},
                "id": string,
                "outputs": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "datatype", "shape"],
                        "properties": {
                            "name": string,
                            "datatype": string,
                            "shape": {"type": "array", "items": integer},
                            "data": {"type": "array"},
                            "parameters": {
                                "type": "object",
                                "properties": {"binary_data_size": integer},
                            },
                        },
                    },
                },
            },
        },
    }


def _json(schema: dict, description: str, headers: dict | None = None) -> dict:
    response = {"description": description, "content": {JSON: {"schema": schema}}}
    if headers:
        response["headers"] = headers
    return response


RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before retrying",
        "required": True,
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    }
}


def _errors(error: str, bad_request: int) -> dict[str, dict]:
    """The error answers of an inference route, each with the API's error body."""
    body = _ref(error)
    return {
        str(bad_request): _json(body, "the request or one of its inputs is invalid (named)"),
        "413": _json(body, "the body is over server.max_body_bytes"),
        "415": _json(body, "a Content-Encoding other than identity, gzip or deflate"),
        "499": _json(body, "the client left before its answer (never received; in /metrics)"),
        "500": _json(body, "the model failed on this request's input alone"),
        "503": _json(
            body, "queue (or image decode queue) full, model loading or draining", RETRY_AFTER
        ),
        "504": _json(
            body, "no answer within server.timeout_ms (decoding included); unrun inputs left"
        ),
    }


def _name_params(config: ServerConfig, versioned: bool) -> list[dict]:
    """The one model this server serves (any other name or version: 404)."""
    name = {"type": "string", "enum": [config.model_name]}
    params = [{"name": "name", "in": "path", "required": True, "schema": name}]
    if versioned:
        version = {"type": "string", "enum": [VERSION]}
        params.append({"name": "version", "in": "path", "required": True, "schema": version})
    return params


def _v2_model_paths(config: ServerConfig, versioned: bool) -> dict[str, dict]:
    base = "/v2/models/{name}" + ("/versions/{version}" if versioned else "")
    params = _name_params(config, versioned)
    missing = _json(_ref("V2Error"), "no such model (or version)")
    ready = {
        "type": "object",
        "required": ["name", "ready"],
        "properties": {"name": {"type": "string"}, "ready": {"type": "boolean"}},
    }
    infer_description = (
        "Open Inference Protocol v2. JSON as below under any content type, or the binary tensor "
        "data extension: the JSON object followed by the tensors' bytes, with the "
        "Inference-Header-Content-Length header giving the JSON's length and each binary input "
        "its parameters.binary_data_size. A tensor's data holds exactly prod(shape) values. "
        "Outputs asked for as binary come after the answer's JSON (octet-stream)."
    )
    binary_answer = {
        "schema": {"type": "string", "format": "binary"},
        "description": "the answer's JSON, then the binary outputs",
    }
    return {
        base: {
            "get": {
                "summary": "model metadata",
                "parameters": params,
                "responses": {"200": _json(_ref("ModelMetadata"), "metadata"), "404": missing},
            }
        },
        f"{base}/ready": {
            "get": {
                "summary": "model readiness",
                "parameters": params,
                "responses": {
                    "200": _json(ready, "ready"),
                    "404": missing,
                    "503": _json(ready, "loading or draining"),
                },
            }
        },
        f"{base}/config": {
            "get": {
                "summary": "Triton model configuration",
                "parameters": params,
                "responses": {"200": _json(_ref("ModelConfig"), "configuration"), "404": missing},
            }
        },
        f"{base}/infer": {
            "post": {
                "summary": "inference",
                "description": infer_description,
                "parameters": params,
                "requestBody": {
                    "required": True,
                    "content": {JSON: {"schema": _ref("InferRequest")}},
                },
                "responses": {
                    "200": {
                        "description": "the outputs",
                        "headers": {
                            "Inference-Header-Content-Length": {
                                "description": "length of the JSON part (binary outputs only)",
                                "required": False,
                                "schema": {"type": "string"},
                            }
                        },
                        "content": {
                            JSON: {"schema": _ref("InferResponse")},
                            "application/octet-stream": binary_answer,
                        },
                    },
                    "404": missing,
                    **_errors("V2Error", 400),
                },
            }
        },
    }


def openapi_document(predictor: Predictor, config: ServerConfig) -> dict[str, Any]:
    status = {"type": "object", "properties": {"status": {"type": "string"}}}
    live = {"type": "object", "properties": {"live": {"type": "boolean"}}}
    ready = {"type": "object", "properties": {"ready": {"type": "boolean"}}}
    metrics_type = CONTENT_TYPE_LATEST.split(";")[0]
    paths = {
        "/v1/predict": {
            "post": {
                "summary": "predict (kiln's API)",
                "requestBody": {"required": True, "content": {JSON: {"schema": _ref("V1Request")}}},
                "responses": {
                    "200": _json(_ref("V1Response"), "one prediction per input, in order"),
                    **_errors("V1Error", 422),
                },
            }
        },
        "/healthz": {"get": {"summary": "alive", "responses": {"200": _json(status, "alive")}}},
        "/readyz": {
            "get": {
                "summary": "model loaded and warm, not draining",
                "responses": {
                    "200": _json(status, "ready"),
                    "503": _json(status, "loading or draining"),
                },
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics",
                "responses": {
                    "200": {
                        "description": "Prometheus text exposition format",
                        "content": {metrics_type: {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/openapi.json": {
            "get": {
                "summary": "this document",
                "responses": {"200": _json({"type": "object"}, "OpenAPI 3.1")},
            }
        },
        "/v2": {
            "get": {
                "summary": "server metadata",
                "responses": {"200": _json(_ref("ServerMetadata"), "metadata")},
            }
        },
        "/v2/health/live": {
            "get": {"summary": "server liveness", "responses": {"200": _json(live, "alive")}}
        },
        "/v2/health/ready": {
            "get": {
                "summary": "server readiness",
                "responses": {
                    "200": _json(ready, "ready"),
                    "503": _json(ready, "loading or draining"),
                },
            }
        },
        **_v2_model_paths(config, versioned=False),
        **_v2_model_paths(config, versioned=True),
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": f"kiln: {config.model_name}",
            "version": "1",
            "description": (
                f"Serving the {predictor.spec.task} model {config.model_name!r}. Limits: "
                f"server.max_inputs_per_request={config.max_inputs_per_request}, "
                f"server.max_body_bytes={config.max_body_bytes}, "
                f"server.timeout_ms={config.timeout_ms:g}, "
                f"server.max_queue_size={config.max_queue_size} (inputs)."
            ),
        },
        "paths": paths,
        "components": {"schemas": _schemas(predictor, config)},
    }
