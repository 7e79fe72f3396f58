"""A request body nobody has to guess: GET /v1/example gives one that works for the served model
(both APIs), GET /v2/models/kiln agrees with it, and the `curl` lines of docs/serving.md ("Trying
the server") run as typed against the server of each shipped kind of model -- image (the digits
mlp), text and detection -- with one change, the port (a free one instead of 8000)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kiln.inference import Predictor
from kiln.serving import create_app

from .conftest import SUBPROCESS_ENV
from .inference_helpers import detector_run, digits_run, live_server, text_run

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "serving.md"
SECTION = "## Trying the server"
KINDS = {"image": digits_run, "text": text_run, "detection": detector_run}


def docs_curls() -> list[tuple[str | None, str]]:
    """(kind or None for any model, command) for each curl line of the page's section: the
    indented block's lines fit any model, the ```sh block's follow a `# <kind> ...` comment."""
    text = PAGE.read_text()
    section = text[text.index(SECTION) :].split("\n## ", 1)[0]
    found, kind = [], None
    for line in section.splitlines():
        if line.startswith("# "):
            kind = next(k for k in KINDS if line[2:].startswith(k))
        elif line.startswith("curl ") or " | curl " in line:
            found.append((kind, line))
        elif line.startswith("    curl "):
            found.append((None, re.split(r"\s{2,}#", line[4:])[0]))
    return found


CURLS = docs_curls()


def test_the_docs_show_a_curl_for_each_kind_of_model():
    assert {kind for kind, _ in CURLS} == {None, *KINDS}


@pytest.fixture(scope="module", params=sorted(KINDS))
def served(request, tmp_path_factory):
    run_dir, _ = KINDS[request.param](tmp_path_factory)
    predictor = Predictor.from_checkpoint(run_dir / "checkpoints" / "best.pt")
    with live_server(create_app(predictor, max_delay_ms=1)) as server:
        yield request.param, server


def test_the_example_bodies_work_and_match_the_v2_metadata(served):
    kind, server = served
    v1 = httpx.get(f"{server.url}/v1/example").json()
    answer = httpx.post(f"{server.url}/v1/predict", json=v1, timeout=60)
    assert answer.status_code == 200, answer.text[:500]
    assert len(answer.json()["predictions"]) == len(v1["inputs"])
    v2 = httpx.get(f"{server.url}/v1/example", params={"api": "v2"}).json()
    # the pixel form first; a model that takes image files (a detector) lists them second
    declared, *files = httpx.get(f"{server.url}/v2/models/kiln").json()["inputs"]
    assert files == (
        [{"name": "input", "datatype": "BYTES", "shape": [-1]}] if kind == "detection" else []
    )
    (sent,) = v2["inputs"]
    assert (sent["name"], sent["datatype"]) == (declared["name"], declared["datatype"])
    assert len(sent["shape"]) == len(declared["shape"])
    assert all(d in (-1, s) for d, s in zip(declared["shape"], sent["shape"], strict=True))
    answer = httpx.post(f"{server.url}/v2/models/kiln/infer", json=v2, timeout=60)
    assert answer.status_code == 200, answer.text[:500]
    refused = httpx.get(f"{server.url}/v1/example", params={"api": "v3"})
    assert refused.status_code == 422 and "v1 or v2" in refused.json()["detail"]
    assert "/v1/example" in httpx.get(f"{server.url}/openapi.json").json()["paths"]


def test_the_readme_curls_run_as_typed(served):
    kind, server = served
    port = server.url.rsplit(":", 1)[1]
    venv = Path(sys.executable).parent
    env = {**SUBPROCESS_ENV, "PATH": f"{venv}{os.pathsep}{os.environ['PATH']}"}
    ran = 0
    for for_kind, command in CURLS:
        if for_kind not in (None, kind):
            continue
        typed = command.replace("localhost:8000", f"127.0.0.1:{port}")
        done = subprocess.run(
            ["bash", "-c", typed], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, f"{command}\n{done.stderr[-2000:]}"
        answer = json.loads(done.stdout)
        assert "detail" not in answer and "error" not in answer, (command, answer)
        if "/v1/predict" in command:
            assert answer["predictions"], command
        elif "/infer" in command:
            assert answer["outputs"], command
        ran += 1
    assert ran >= 4  # the three for any model and at least one of its own kind
