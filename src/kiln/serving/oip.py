"""The Open Inference Protocol v2 wire format (KServe / Triton), both flavours:

- JSON: the whole body is the request object; tensor `data` is flat or nested, row-major.
- The binary tensor data extension: the body is the JSON object followed by raw tensor bytes; the
  `Inference-Header-Content-Length` header says where the JSON ends, and each input holding bytes
  says how many in `parameters.binary_data_size` (in input order). An output is sent as bytes when
  it asks (`outputs[i].parameters.binary_data`) or by default when the request says
  `parameters.binary_data_output`; the answer then carries the same header.

Datatypes are converted exactly: FP32 data must be JSON numbers (no strings, booleans or null) or
little-endian float32 bytes; BYTES are JSON strings, or 4-byte little-endian lengths each followed
by that many bytes, which must be UTF-8 text. Anything else is a `BadRequest` naming the field.
The content type is not looked at: clients send JSON and binary bodies under many."""

from __future__ import annotations

import base64
import binascii
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from kiln.serving.errors import BadRequest

HEADER_LENGTH = "Inference-Header-Content-Length"
NUMPY_TYPES = {
    "BOOL": np.dtype("?"),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
DATATYPES = (*NUMPY_TYPES, "BYTES")
# model_name / model_version: KServe's client sends them in every body (they must name the
# model the path names).
REQUEST_KEYS = {"id", "model_name", "model_version", "parameters", "inputs", "outputs"}
REQUEST_PARAMETERS = {"binary_data_output": bool, "timeout": int}
INPUT_KEYS = {"name", "shape", "datatype", "data", "parameters"}
OUTPUT_KEYS = {"name", "parameters"}
OUTPUT_PARAMETERS = {"binary_data": bool, "classification": int}


@dataclass(frozen=True)
class TensorSpec:
    """A model input or output as metadata describes it; -1 marks a dimension of any size."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    # Image models trained on image files also take this input as BYTES of shape [N]: the
    # encoded files (binary extension: raw bytes; JSON: base64 strings).
    image_files: bool = False

    def metadata(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}

    def files_variant(self) -> TensorSpec:
        return TensorSpec(self.name, "BYTES", (-1,))


@dataclass
class Tensor:
    """A decoded tensor: a numpy array, or a flat list of str for BYTES."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray | list[str]


@dataclass
class WantedOutput:
    name: str
    binary: bool
    class_count: int | None = None  # the classification extension: top-k "score:index:label"


@dataclass
class InferRequest:
    id: str | None
    inputs: list[Tensor]
    outputs: list[WantedOutput]  # every output the answer holds, in order
    timeout_us: int | None = None  # the request's own deadline, if it set one


@dataclass
class OutputTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: np.ndarray | list[str]  # numeric array, or str / bytes items for BYTES


@dataclass
class Encoded:
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)
    media_type: str = "application/json"


# ---------------------------------------------------------------------------------------------
# Requests


def base64_file(text: str, where: str) -> bytes:
    """An encoded file sent as a base64 string in JSON (padding and line breaks tolerated)."""
    try:
        return base64.b64decode(text, validate=False)
    except (binascii.Error, ValueError) as err:
        message = f"{where}: not base64 ({err}); send the file's bytes base64-encoded"
        raise BadRequest(message) from None


def loads_json(text: bytes) -> Any:
    """Strict JSON: NaN and Infinity literals (which Python's json accepts) are refused. orjson
    parses (several times faster on a body of numbers); what it refuses -- integers beyond 64
    bits, a lone surrogate, and invalid JSON -- is parsed again by Python's json, so those keep
    their exact messages (an integer too large is out of range, not invalid JSON)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        pass

    def refuse(constant: str):
        raise ValueError(f"{constant} is not valid JSON")

    try:
        return json.loads(text, parse_constant=refuse)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError too
        raise BadRequest(f"the body is not valid JSON: {err}") from None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise BadRequest(message)


def _is_int(value: Any) -> bool:
    """JSON Schema's integer: also a number with no fractional part (2.0), never a boolean."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())


def _check_keys(obj: Any, allowed: set[str], where: str) -> None:
    _require(isinstance(obj, dict), f"{where} must be a JSON object")
    unknown = sorted(set(obj) - allowed)
    _require(not unknown, f"{where}: unknown field(s) {unknown}; allowed: {sorted(allowed)}")


def _parameters(container: dict, allowed: dict[str, type], where: str) -> dict[str, Any]:
    """container["parameters"], checked; {} when absent (null is not absent: refused)."""
    if "parameters" not in container:
        return {}
    obj = container["parameters"]
    _check_keys(obj, set(allowed), f"{where}.parameters")
    for key, value in obj.items():
        kind = allowed[key]
        ok = isinstance(value, bool) if kind is bool else _is_int(value) and value >= 0
        wanted = "a boolean" if kind is bool else "a non-negative integer"
        _require(ok, f"{where}.parameters.{key} must be {wanted}")
    return {k: v if isinstance(v, bool) else int(v) for k, v in obj.items()}


def split_body(body: bytes, header_length: str | None) -> tuple[Any, bytes]:
    """(the JSON request object, the binary part after it)."""
    if header_length is None:
        return loads_json(body), b""
    try:
        length = int(header_length)
    except ValueError:
        length = -1
    _require(
        0 <= length <= len(body),
        f"{HEADER_LENGTH}: {header_length!r} is not a byte count within the body's "
        f"{len(body)} bytes",
    )
    return loads_json(body[:length]), body[length:]


@dataclass(frozen=True)
class ModelPath:
    """The model (and version) the request's path names, and the version served."""

    name: str
    version: str | None  # None: the path names no version
    served_version: str

    @property
    def path(self) -> str:
        versioned = f"/versions/{self.version}" if self.version is not None else ""
        return f"/v2/models/{self.name}{versioned}/infer"


def _check_model_fields(obj: dict, model: ModelPath) -> None:
    """model_name / model_version in the body, if there, must agree with the path."""
    if "model_name" in obj:
        name = obj["model_name"]
        _require(
            name == model.name,
            f"model_name {name!r} in the body does not match the model {model.name!r} of the "
            f"path {model.path}; send the same name (or leave model_name out)",
        )
    if "model_version" in obj:
        version = obj["model_version"]
        wanted = model.version if model.version is not None else model.served_version
        _require(
            version == wanted,
            f"model_version {version!r} in the body does not match the version {wanted!r} of "
            f"the path {model.path}; send the same version (or leave model_version out)",
        )


def parse_infer_request(
    body: bytes,
    header_length: str | None,
    model: ModelPath,
    inputs: dict[str, TensorSpec],
    outputs: dict[str, TensorSpec],
    max_inputs: int,
    max_elements_per_input: int,
) -> InferRequest:
    """A v2 inference request, checked against the path's model and its signature: at most
    `max_inputs` along the batch axis, each of at most `max_elements_per_input` values (so a
    lying shape cannot make us allocate)."""
    obj, binary = split_body(body, header_length)
    _check_keys(obj, REQUEST_KEYS, "the request")
    _check_model_fields(obj, model)
    request_id = obj.get("id")
    _require("id" not in obj or isinstance(request_id, str), "id must be a string")
    parameters = _parameters(obj, REQUEST_PARAMETERS, "the request")
    tensors_in = obj.get("inputs")
    _require(isinstance(tensors_in, list), "inputs must be a list of tensors")
    names = [t.get("name") if isinstance(t, dict) else None for t in tensors_in]
    _require(
        all(isinstance(n, str) for n in names) and sorted(names) == sorted(inputs),
        f"this model takes exactly the input(s) {sorted(inputs)}; the request has {names}",
    )
    decoded, offset = [], 0
    for i, tensor in enumerate(tensors_in):
        where = f"inputs[{i}] ({tensor['name']!r})"
        limits = (max_inputs, max_elements_per_input)
        tensor_obj, used = _decode_input(
            tensor, inputs[tensor["name"]], binary[offset:], where, limits
        )
        decoded.append(tensor_obj)
        offset += used
    _require(
        offset == len(binary),
        f"the body holds {len(binary) - offset} bytes after the tensors' binary data "
        f"(binary_data_size of the inputs add up to {offset})",
    )
    requested = obj.get("outputs")
    _require("outputs" not in obj or isinstance(requested, list), "outputs must be a list")
    wanted = _wanted_outputs(requested, outputs, parameters.get("binary_data_output"))
    return InferRequest(request_id, decoded, wanted, parameters.get("timeout"))


def _decode_input(
    tensor: dict, spec: TensorSpec, binary: bytes, where: str, limits: tuple[int, int]
) -> tuple[Tensor, int]:
    """(the tensor, how many bytes of `binary` it used)."""
    _check_keys(tensor, INPUT_KEYS, where)
    datatype, shape = tensor.get("datatype"), tensor.get("shape")
    files = spec.image_files and datatype == "BYTES"
    if files:
        spec = spec.files_variant()
    _require(
        datatype == spec.datatype,
        f"{where}: datatype must be {spec.datatype}"
        + (" (or BYTES: encoded image files)" if spec.image_files else "")
        + f", got {datatype!r}",
    )
    _require(
        isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape),
        f"{where}: shape must be a list of non-negative integers, got {shape!r}",
    )
    shape = [int(d) for d in shape]
    _require(
        len(shape) == len(spec.shape)
        and all(want in (-1, got) for want, got in zip(spec.shape, shape, strict=True)),
        f"{where}: shape must be {list(spec.shape)} (-1: any size), got {shape}",
    )
    max_inputs, max_per_input = limits
    _require(
        shape[0] <= max_inputs,
        f"{shape[0]} inputs in one request; server.max_inputs_per_request is {max_inputs}",
    )
    count = math.prod(shape)
    _require(
        count <= shape[0] * max_per_input,
        f"{where}: shape {shape} holds more than {max_per_input} values per input",
    )
    parameters = _parameters(tensor, {"binary_data_size": int}, where)
    size = parameters.get("binary_data_size")
    _require(
        (size is None) != ("data" not in tensor),
        f"{where}: give either data (JSON) or parameters.binary_data_size (binary), not "
        + ("both" if size is not None else "neither"),
    )
    if size is None:
        data = _json_data(tensor["data"], datatype, shape, where)
        if files:
            data = [base64_file(text, f"{where} element {i}") for i, text in enumerate(data)]
        return Tensor(spec.name, datatype, tuple(shape), data), 0
    _require(
        size <= len(binary),
        f"{where}: binary_data_size is {size} but only {len(binary)} bytes follow",
    )
    data = _binary_data(binary[:size], datatype, count, where, text=not files)
    return Tensor(spec.name, datatype, tuple(shape), data), size


def _flatten(data: Any, shape: list[int], where: str) -> list:
    """Flat data as it is; nested data must nest exactly as `shape` (then flattened row-major)."""
    _require(isinstance(data, list), f"{where}: data must be a list")
    if not any(isinstance(x, list) for x in data):
        return data
    flat: list = []

    def walk(node: Any, depth: int) -> None:
        _require(
            isinstance(node, list) and len(node) == shape[depth],
            f"{where}: nested data must nest exactly as shape {shape}",
        )
        if depth == len(shape) - 1:
            _require(
                not any(isinstance(x, list) for x in node),
                f"{where}: nested data is deeper than shape {shape}",
            )
            flat.extend(node)
            return
        for child in node:
            walk(child, depth + 1)

    walk(data, 0)
    return flat


def _json_data(data: Any, datatype: str, shape: list[int], where: str) -> np.ndarray | list[str]:
    count = math.prod(shape)
    flat = _flatten(data, shape, where)
    _require(
        len(flat) == count,
        f"{where}: shape holds {count} values, data has {len(flat)}",
    )
    if datatype == "BYTES":
        bad = next((i for i, v in enumerate(flat) if not isinstance(v, str)), None)
        _require(bad is None, f"{where}: BYTES data must be strings; element {bad} is not")
        return flat
    kinds = set(map(type, flat))
    if datatype == "BOOL":
        _require(kinds <= {bool}, f"{where}: BOOL data must be true or false")
        return np.asarray(flat, dtype=bool)
    _require(
        kinds <= {int, float},
        f"{where}: {datatype} data must be JSON numbers, not "
        + ", ".join(sorted(k.__name__ for k in kinds - {int, float})),
    )
    if datatype.startswith("FP"):
        try:
            values = np.asarray(flat, dtype=np.float64)
        except OverflowError:
            bad = next(i for i, v in enumerate(flat) if isinstance(v, int) and abs(v) > 2**1023)
            raise BadRequest(f"{where}: element {bad} is beyond {datatype}'s range") from None
        with np.errstate(over="ignore"):
            array = values.astype(NUMPY_TYPES[datatype])
        # JSON has no Inf: a non-finite value here was a literal like 1e400, beyond the type.
        beyond = ~np.isfinite(array)
        if beyond.any():
            raise BadRequest(
                f"{where}: element {int(beyond.argmax())} is beyond {datatype}'s range"
            )
        return array
    _require(float not in kinds, f"{where}: {datatype} data must be integers")
    info = np.iinfo(NUMPY_TYPES[datatype])
    bad = next((i for i, v in enumerate(flat) if not info.min <= v <= info.max), None)
    _require(bad is None, f"{where}: element {bad} is outside {datatype}'s range")
    return np.asarray(flat, dtype=NUMPY_TYPES[datatype])


def _binary_data(
    raw: bytes, datatype: str, count: int, where: str, text: bool = True
) -> np.ndarray | list[str] | list[bytes]:
    if datatype == "BYTES":
        return _bytes_elements(raw, count, where, text)
    dtype = NUMPY_TYPES[datatype]
    _require(
        len(raw) == count * dtype.itemsize,
        f"{where}: shape holds {count} {datatype} values ({count * dtype.itemsize} bytes), "
        f"binary_data_size is {len(raw)}",
    )
    return np.frombuffer(raw, dtype=dtype)


def _bytes_elements(raw: bytes, count: int, where: str, text: bool = True) -> list:
    """BYTES: each element a 4-byte little-endian length then that many bytes (UTF-8 text, or
    kept as bytes when not `text`: encoded image files)."""
    texts, offset = [], 0
    for i in range(count):
        _require(offset + 4 <= len(raw), f"{where}: BYTES data ends before element {i}")
        (length,) = struct.unpack_from("<I", raw, offset)
        offset += 4
        _require(offset + length <= len(raw), f"{where}: BYTES element {i} runs past the data")
        if not text:
            texts.append(raw[offset : offset + length])
            offset += length
            continue
        try:
            texts.append(raw[offset : offset + length].decode("utf-8"))
        except UnicodeDecodeError as err:
            raise BadRequest(
                f"{where}: BYTES element {i} is not UTF-8 text ({err.reason})"
            ) from None
        offset += length
    _require(offset == len(raw), f"{where}: {len(raw) - offset} bytes after the {count} elements")
    return texts


def _wanted_outputs(
    requested: Any, outputs: dict[str, TensorSpec], binary_default: bool | None
) -> list[WantedOutput]:
    binary_default = bool(binary_default)
    if requested is None:
        return [WantedOutput(name, binary_default) for name in outputs]
    _require(isinstance(requested, list), "outputs must be a list")
    wanted = []  # a name asked twice is answered twice (the schema cannot forbid it)
    for i, output in enumerate(requested):
        _check_keys(output, OUTPUT_KEYS, f"outputs[{i}]")
        name = output.get("name")
        _require(
            isinstance(name, str) and name in outputs,
            f"outputs[{i}]: unknown output {name!r}; this model has {sorted(outputs)}",
        )
        parameters = _parameters(output, OUTPUT_PARAMETERS, f"outputs[{i}]")
        class_count = parameters.get("classification")
        if class_count is not None:
            _require(
                outputs[name].shape[-1] > 0 and outputs[name].datatype.startswith("FP"),
                f"outputs[{i}]: the classification extension applies to class scores only",
            )
            _require(class_count >= 1, f"outputs[{i}]: classification must be >= 1")
        wanted.append(
            WantedOutput(name, parameters.get("binary_data", binary_default), class_count)
        )
    return wanted


# ---------------------------------------------------------------------------------------------
# Responses


def classification_strings(scores: np.ndarray, k: int, labels: list[str]) -> OutputTensor:
    """Triton's classification extension: per row the top k as "score:index:label"."""
    k = min(k, scores.shape[1])
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k].reshape(len(scores), k)
    rows = [f"{scores[r, c]:f}:{c}:{labels[c]}" for r in range(len(scores)) for c in top[r]]
    return OutputTensor("", "BYTES", (len(scores), k), rows)


def _bytes_payload(items: list) -> bytes:
    parts = []
    for item in items:
        raw = item if isinstance(item, bytes) else str(item).encode("utf-8")
        parts.append(struct.pack("<I", len(raw)) + raw)
    return b"".join(parts)


def _json_values(tensor: OutputTensor) -> list:
    if tensor.datatype == "BYTES":
        return [item.decode() if isinstance(item, bytes) else item for item in tensor.data]
    return np.asarray(tensor.data).ravel().tolist()


def answer_tensors(
    tensors: list[OutputTensor], wanted: list[WantedOutput], labels: list[str]
) -> list[tuple[WantedOutput, OutputTensor]]:
    """Each output asked for with its tensor; class scores asked with `classification` become
    Triton's top-k strings."""
    by_name = {tensor.name: tensor for tensor in tensors}
    pairs = []
    for want in wanted:
        tensor = by_name[want.name]
        if want.class_count:
            tensor = classification_strings(np.asarray(tensor.data), want.class_count, labels)
        pairs.append((want, tensor))
    return pairs


def encode_response(
    model_name: str, request_id: str | None, answers: list[tuple[WantedOutput, OutputTensor]]
) -> Encoded:
    """The response object for the outputs asked for, in the order asked; binary outputs
    appended after the JSON, which the Inference-Header-Content-Length header then measures."""
    response: dict[str, Any] = {"model_name": model_name, "model_version": "1"}
    if request_id is not None:
        response["id"] = request_id
    entries, payloads = [], []
    for want, tensor in answers:
        entry: dict[str, Any] = {"name": want.name, "datatype": tensor.datatype}
        entry["shape"] = list(tensor.shape)
        if want.binary:
            if tensor.datatype == "BYTES":
                payload = _bytes_payload(list(tensor.data))
            else:
                array = np.ascontiguousarray(tensor.data, dtype=NUMPY_TYPES[tensor.datatype])
                payload = array.tobytes()
            entry["parameters"] = {"binary_data_size": len(payload)}
            payloads.append(payload)
        else:
            entry["data"] = _json_values(tensor)
        entries.append(entry)
    response["outputs"] = entries
    header = json.dumps(response, separators=(",", ":"), allow_nan=False).encode()
    if not payloads:
        return Encoded(header)
    return Encoded(
        header + b"".join(payloads),
        {HEADER_LENGTH: str(len(header))},
        "application/octet-stream",
    )
