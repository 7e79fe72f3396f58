"""The OpenAPI document is the truth: schemathesis (`st run`, every check on) generates requests
from /openapi.json against the live server and finds nothing -- no 5xx, no status, content type,
header or body the document does not list, no schema-valid request refused, no schema-invalid
one accepted. A short run is in the default suite; the long one (more examples, every phase,
the text model too) runs with `make test-all`."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kiln.inference import Predictor
from kiln.serving import create_app

from .conftest import SUBPROCESS_ENV
from .inference_helpers import digits_run, live_server, text_run

REPO = Path(__file__).resolve().parents[1]
ST = Path(sys.executable).with_name("st")


def schemathesis_run(url: str, tmp_path: Path, *options: str) -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    env = {
        **SUBPROCESS_ENV,
        "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
        "PYTHONPATH": os.pathsep.join([str(REPO), SUBPROCESS_ENV.get("PYTHONPATH", "")]),
    }
    cmd = [str(ST), "run", f"{url}/openapi.json", "--checks", "all", "--workers", "1"]
    cmd += ["--no-color", "--report-dir", str(tmp_path), *options]
    # In tmp_path: schemathesis keeps a cache (.schemathesis/) in its working directory.
    return subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=3000)


def assert_nothing_found(run: subprocess.CompletedProcess) -> None:
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-6000:]
    assert "No issues found" in output or "passed" in output, output[-3000:]


@pytest.fixture(scope="module")
def digits_server(tmp_path_factory):
    run_dir, _ = digits_run(tmp_path_factory)
    predictor = Predictor.from_checkpoint(run_dir / "checkpoints" / "best.pt")
    with live_server(create_app(predictor, max_delay_ms=1)) as server:
        yield server


def test_the_document_lists_the_answers_the_review_found_missing(digits_server):
    """Undocumented 400/404, the v1 422 body, the /metrics content type."""
    document = httpx.get(f"{digits_server.url}/openapi.json").json()
    infer = document["paths"]["/v2/models/{name}/infer"]["post"]["responses"]
    assert {"200", "400", "404", "413", "415", "500", "503", "504"} <= set(infer)
    predict = document["paths"]["/v1/predict"]["post"]["responses"]
    assert predict["422"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/V1Error"
    }
    assert "text/plain" in document["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert "Retry-After" in infer["503"]["headers"]


def test_the_document_states_that_data_must_match_the_shape(digits_server):
    """schemathesis found schema-valid requests refused for a data count that does not match
    the shape: the document now says so, in descriptions and in an example the server takes."""
    url = digits_server.url
    schemas = httpx.get(f"{url}/openapi.json").json()["components"]["schemas"]
    request = schemas["InferRequest"]
    tensor = request["properties"]["inputs"]["items"]
    for described in (request, tensor, tensor["properties"]["data"]):
        assert "exactly prod(shape) values" in described["description"]
    (example,) = request["examples"]
    (example_tensor,) = example["inputs"]
    assert tensor["examples"] == [example_tensor]
    assert len(example_tensor["data"]) == math.prod(example_tensor["shape"]) == 64
    assert request["properties"]["model_name"] == {"const": "kiln"}
    assert httpx.post(f"{url}/v2/models/kiln/infer", json=example).status_code == 200
    short = {**example_tensor, "data": example_tensor["data"][:-1]}
    refused = httpx.post(f"{url}/v2/models/kiln/infer", json={"inputs": [short]})
    assert refused.status_code == 400 and "shape holds 64 values, data has 63" in refused.text


def test_schemathesis_short_run_finds_nothing(digits_server, tmp_path):
    run = schemathesis_run(
        digits_server.url,
        tmp_path,
        "--phases",
        "examples,fuzzing",
        "--max-examples",
        "8",
        "--seed",
        "1",
    )
    assert_nothing_found(run)


@pytest.mark.slow  # several minutes: every phase, 100 examples per operation, two models
@pytest.mark.timeout(3600)
def test_schemathesis_full_run_finds_nothing(digits_server, tmp_path_factory, tmp_path):
    options = ("--max-examples", "100", "--seed", "7")  # fixed: a failure replays
    assert_nothing_found(schemathesis_run(digits_server.url, tmp_path / "digits", *options))
    run_dir, _ = text_run(tmp_path_factory)
    predictor = Predictor.from_checkpoint(run_dir / "checkpoints" / "best.pt")
    with live_server(create_app(predictor, max_delay_ms=1)) as server:
        assert_nothing_found(schemathesis_run(server.url, tmp_path / "text", *options))
