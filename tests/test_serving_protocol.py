"""The Open Inference Protocol v2 as published clients speak it: Triton's own Python HTTP client
(tritonclient.http, unchanged) against the live server, over JSON and over the binary tensor data
extension, for an image and a text model; bodies under any content type; datatypes converted
exactly; metadata shaped as the protocol says."""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from kiln.inference import Predictor
from kiln.serving import create_app

from .conftest import SUBPROCESS_ENV
from .inference_helpers import digits_run, live_server, raw_digits_val, text_run

TEXTS = ["the home team won the final", "stir the sauce and add garlic", "new phone chip"]


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    run_dir, _ = digits_run(tmp_path_factory)
    predictor = Predictor.from_checkpoint(run_dir / "checkpoints" / "best.pt")
    with live_server(create_app(predictor, max_batch_size=8, max_delay_ms=2)) as server:
        yield predictor, server


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    run_dir, _ = text_run(tmp_path_factory)
    predictor = Predictor.from_checkpoint(run_dir / "checkpoints" / "best.pt")
    with live_server(create_app(predictor, max_batch_size=8, max_delay_ms=2)) as server:
        yield predictor, server


def triton_client(server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server.url.removeprefix("http://"))


def _infer(client, model_input: np.ndarray, datatype: str, binary: bool, **kwargs):
    tensor = triton.InferInput("input", list(model_input.shape), datatype)
    tensor.set_data_from_numpy(model_input, binary_data=binary)
    outputs = [triton.InferRequestedOutput(name, binary_data=binary) for name in ("probs", "label")]
    return client.infer("kiln", [tensor], outputs=outputs, **kwargs)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_image_model(digits, binary):
    """Today's code answered this client with 422: the route parsed only application/json, and
    the binary extension the client uses by default was not supported."""
    predictor, server = digits
    client = triton_client(server)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("kiln")
    images = raw_digits_val()[0][:5][:, None]  # (5, 1, 8, 8) raw pixels
    result = _infer(client, images, "FP32", binary, request_id="r-7")
    expected = predictor.predict_probs(images)
    np.testing.assert_allclose(result.as_numpy("probs"), expected, atol=1e-6)
    # BYTES come back as bytes over the binary extension, as str over JSON.
    labels = [x.decode() if isinstance(x, bytes) else x for x in result.as_numpy("label")]
    assert labels == [p["label"] for p in predictor.predict(images)]
    assert result.get_response()["id"] == "r-7"
    # No outputs named: the client asks for every output, in binary.
    default = client.infer("kiln", [_input(images, binary)])
    np.testing.assert_allclose(default.as_numpy("probs"), expected, atol=1e-6)


def _input(images, binary):
    tensor = triton.InferInput("input", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images, binary_data=binary)
    return tensor


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_text_model_sends_bytes(texts, binary):
    predictor, server = texts
    client = triton_client(server)
    result = _infer(client, np.array(TEXTS, dtype=object), "BYTES", binary)
    np.testing.assert_allclose(result.as_numpy("probs"), predictor.predict_probs(TEXTS), atol=1e-6)


def test_tritonclient_compression_and_classification_extension(digits):
    predictor, server = digits
    images = raw_digits_val()[0][:3][:, None]
    requested = [triton.InferRequestedOutput("probs", class_count=2)]
    result = triton_client(server).infer(
        "kiln",
        [_input(images, True)],
        outputs=requested,
        request_compression_algorithm="gzip",
    )
    top = result.as_numpy("probs")  # Triton's "score:index:label"
    probs = predictor.predict_probs(images)
    assert top.shape == (3, 2)
    for row, ranked in zip(probs, top, strict=True):
        score, index, label = ranked[0].decode().split(":")
        assert int(index) == int(row.argmax()) and label == predictor.class_names[int(index)]
        assert float(score) == pytest.approx(row.max(), abs=1e-6)


def test_metadata_match_the_protocol(digits):
    _, server = digits
    client = triton_client(server)
    server_meta = client.get_server_metadata()
    assert set(server_meta) == {"name", "version", "extensions"}
    assert "binary_tensor_data" in server_meta["extensions"]
    model_meta = client.get_model_metadata("kiln")
    assert set(model_meta) == {"name", "versions", "platform", "inputs", "outputs"}
    for tensor in model_meta["inputs"] + model_meta["outputs"]:
        assert set(tensor) == {"name", "datatype", "shape"}
    assert client.get_model_metadata("kiln", model_version="1") == model_meta
    config = client.get_model_config("kiln")
    assert config["max_batch_size"] == 8 and config["input"][0]["dims"] == [1, 8, 8]
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.get_model_metadata("other")


def _v2_body(images: np.ndarray, **extra) -> dict:
    tensor = {"name": "input", "shape": list(images.shape), "datatype": "FP32"}
    return {"inputs": [{**tensor, "data": images.ravel().tolist()}], **extra}


@pytest.mark.parametrize(
    "content_type", [None, "application/json", "text/plain", "application/octet-stream"]
)
def test_any_content_type_is_read(digits, content_type):
    predictor, server = digits
    images = raw_digits_val()[0][:2][:, None]
    headers = {"content-type": content_type} if content_type else {}
    body = json.dumps(_v2_body(images)).encode()
    response = httpx.post(f"{server.url}/v2/models/kiln/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    labels = response.json()["outputs"][1]["data"]
    assert labels == [p["label"] for p in predictor.predict(images)]


def test_binary_request_and_outputs_by_hand(digits):
    """The extension's layout, written without the client: JSON, then the FP32 bytes."""
    predictor, server = digits
    images = raw_digits_val()[0][:2][:, None].astype("<f4")
    header = {
        "inputs": [
            {
                "name": "input",
                "shape": [2, 1, 8, 8],
                "datatype": "FP32",
                "parameters": {"binary_data_size": images.nbytes},
            }
        ],
        "outputs": [{"name": "probs", "parameters": {"binary_data": True}}, {"name": "label"}],
    }
    head = json.dumps(header).encode()
    response = httpx.post(
        f"{server.url}/v2/models/kiln/infer",
        content=head + images.tobytes(),
        headers={"Inference-Header-Content-Length": str(len(head))},
    )
    assert response.status_code == 200, response.text
    length = int(response.headers["Inference-Header-Content-Length"])
    answer = json.loads(response.content[:length])
    probs_meta, label_meta = answer["outputs"]
    assert probs_meta["parameters"]["binary_data_size"] == 2 * 10 * 4 and "data" not in probs_meta
    probs = np.frombuffer(response.content[length:], dtype="<f4").reshape(2, 10)
    np.testing.assert_allclose(probs, predictor.predict_probs(images), atol=1e-6)
    assert label_meta["data"] == [p["label"] for p in predictor.predict(images)]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda b: b["inputs"][0]["data"].__setitem__(3, "1.5"), "must be JSON numbers, not str"),
        (lambda b: b["inputs"][0]["data"].__setitem__(3, True), "must be JSON numbers, not bool"),
        (lambda b: b["inputs"][0]["data"].__setitem__(3, None), "NoneType"),
        (lambda b: b["inputs"][0].__setitem__("datatype", "INT32"), "datatype must be FP32"),
        (lambda b: b.__setitem__("outputs", [{"name": "logits"}]), "unknown output 'logits'"),
        (lambda b: b["inputs"][0].__setitem__("name", "pixels"), "takes exactly the input"),
        (lambda b: b.__setitem__("priority", 1), "unknown field(s) ['priority']"),
    ],
)
def test_datatypes_and_names_are_exact(digits, change, message):
    """Numeric strings and booleans were accepted as FP32; an unknown output name returned 200
    with no outputs."""
    _, server = digits
    body = _v2_body(np.zeros((1, 1, 8, 8), dtype=np.float32))
    change(body)
    response = httpx.post(f"{server.url}/v2/models/kiln/infer", json=body)
    assert response.status_code == 400, response.text
    assert message in response.json()["error"]


def test_binary_bytes_must_be_utf8_text(texts):
    _, server = texts
    raw = [b"fine text", b"\xff\xfe not utf-8"]
    payload = b"".join(struct.pack("<I", len(r)) + r for r in raw)
    header = {
        "inputs": [
            {
                "name": "input",
                "shape": [2],
                "datatype": "BYTES",
                "parameters": {"binary_data_size": len(payload)},
            }
        ]
    }
    head = json.dumps(header).encode()
    response = httpx.post(
        f"{server.url}/v2/models/kiln/infer",
        content=head + payload,
        headers={"Inference-Header-Content-Length": str(len(head))},
    )
    assert response.status_code == 400
    assert "BYTES element 1 is not UTF-8 text" in response.json()["error"]


# --- KServe's own client -----------------------------------------------------------------------


KSERVE_CLIENT = """
import asyncio, json, sys
import numpy as np
from kserve import InferenceRESTClient, InferInput, InferRequest, RESTConfig
from kserve.protocol.infer_type import RequestedOutput

url, binary = sys.argv[1], sys.argv[2] == "binary"
images = np.asarray(json.loads(sys.stdin.read()), dtype=np.float32)
tensor = InferInput("input", list(images.shape), "FP32")
tensor.set_data_from_numpy(images, binary_data=binary)
outputs = [RequestedOutput(name, {"binary_data": binary}) for name in ("probs", "label")]
body = InferRequest("kiln", [tensor], request_id="k-1", request_outputs=outputs,
                    model_version="1")

async def call():
    client = InferenceRESTClient(RESTConfig(protocol="v2", timeout=30))
    try:
        return await client.infer(url, body, model_name="kiln")
    finally:
        await client.close()

result = asyncio.run(call())
found = {o.name: o.as_numpy() for o in result.outputs}
labels = [x.decode() if isinstance(x, bytes) else x for x in found["label"].tolist()]
print(json.dumps({"id": result.id, "model_name": result.model_name,
                  "probs": found["probs"].tolist(), "labels": labels}))
"""


def _kserve_infer(server, images: np.ndarray, binary: bool) -> dict:
    """kserve.InferenceRESTClient (v2), unchanged -- its InferRequest always sends model_name --
    in a process of its own: kserve's and tritonclient.grpc's protobufs both define the
    package `inference`, and cannot be loaded into one process."""
    done = subprocess.run(
        [sys.executable, "-c", KSERVE_CLIENT, server.url, "binary" if binary else "json"],
        input=json.dumps(images.tolist()),
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_kserve_client_image_model(digits, binary):
    """Today: 400 on every inference -- "unknown field(s) ['model_name']"."""
    predictor, server = digits
    images = raw_digits_val()[0][:5][:, None]
    result = _kserve_infer(server, images, binary)
    np.testing.assert_allclose(result["probs"], predictor.predict_probs(images), atol=1e-6)
    assert result["labels"] == [p["label"] for p in predictor.predict(images)]
    assert result["id"] == "k-1" and result["model_name"] == "kiln"


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("model_name", "other", "model_name 'other' in the body does not match the model 'kiln'"),
        ("model_version", "2", "model_version '2' in the body does not match the version '1'"),
        ("model_name", None, "model_name None in the body does not match the model 'kiln'"),
    ],
)
def test_body_model_fields_must_match_the_path(digits, field, value, message):
    _, server = digits
    body = _v2_body(np.zeros((1, 1, 8, 8), dtype=np.float32), **{field: value})
    response = httpx.post(f"{server.url}/v2/models/kiln/versions/1/infer", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error and "/v2/models/kiln/versions/1/infer" in error
