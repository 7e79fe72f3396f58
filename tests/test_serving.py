"""A real uvicorn server on 127.0.0.1 (free port, in a thread) serving a tiny digits checkpoint:
v1 and Open Inference Protocol v2 routes, health, metrics, dynamic batching under concurrent
load, clear 4xx errors, and a clean shutdown. The batcher's failure handling is tested directly."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time

import httpx
import numpy as np
import pytest
import uvicorn

from kiln.inference import Predictor
from kiln.serving import create_app
from kiln.serving.batcher import BatcherClosed, BatchFailed, DynamicBatcher
from kiln.serving.metrics import ServingMetrics

from .inference_helpers import digits_run, raw_digits_val

NUM_CONCURRENT = 20
STARTUP_TIMEOUT_S = 30


class LiveServer:
    """uvicorn in a thread on a socket bound here, so the port is ours before it starts."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:
            assert self.thread.is_alive(), "the server thread died during start-up"
            assert time.monotonic() < deadline, "the server did not start in time"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def predictor(tmp_path_factory):
    run_dir, _ = digits_run(tmp_path_factory)
    return Predictor.from_checkpoint(run_dir / "checkpoints" / "best.pt")


@pytest.fixture(scope="module")
def server(predictor):
    live = LiveServer(create_app(predictor, max_batch_size=8, max_delay_ms=10))
    live.start()
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def images():
    raw_val, _ = raw_digits_val()
    return raw_val[:NUM_CONCURRENT]


def test_health_and_readiness(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    assert client.get("/readyz").json()["status"] == "ready"  # warmed up before serving
    assert client.get("/v2/health/live").json() == {"live": True}
    assert client.get("/v2/health/ready").json() == {"ready": True}


def test_v1_predict_matches_predictor(client, predictor, images):
    response = client.post("/v1/predict", json={"inputs": [images[0].tolist(), images[1].tolist()]})
    assert response.status_code == 200
    got = response.json()["predictions"]
    expected = predictor.predict(images[:2])
    assert [p["label"] for p in got] == [p["label"] for p in expected]
    np.testing.assert_allclose([p["probs"] for p in got], [p["probs"] for p in expected], atol=1e-6)


def _batch_sizes(metrics_text: str) -> dict[str, float]:
    """Cumulative bucket counts of kiln_batch_size: {"1.0": n, ..., "+Inf": total}."""
    pattern = r'^kiln_batch_size_bucket\{le="([^"]+)"\} (\S+)$'
    return {le: float(n) for le, n in re.findall(pattern, metrics_text, flags=re.MULTILINE)}


def test_concurrent_requests_are_batched_and_answered_correctly(server, predictor, images):
    expected = [p["label"] for p in predictor.predict(images)]
    answers: list[str | None] = [None] * NUM_CONCURRENT
    start_together = threading.Barrier(NUM_CONCURRENT)

    def one_request(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            start_together.wait(timeout=30)
            response = c.post("/v1/predict", json={"inputs": [images[i].tolist()]})
            answers[i] = response.json()["predictions"][0]["label"]

    threads = [threading.Thread(target=one_request, args=(i,)) for i in range(NUM_CONCURRENT)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert answers == expected  # every request got its own prediction back

    with httpx.Client(base_url=server.url) as c:
        buckets = _batch_sizes(c.get("/metrics").text)
    assert buckets["+Inf"] > buckets["1.0"], f"no model call ran more than one input: {buckets}"
    assert buckets["8.0"] == buckets["+Inf"]  # never above max_batch_size


def test_metrics_exposes_requests_errors_and_timings(client):
    client.post("/v1/predict", json={"inputs": [[[0.0] * 3]]})  # one error, at least
    text = client.get("/metrics").text
    for name in (
        'kiln_requests_total{endpoint="/v1/predict",status="200"}',
        'kiln_errors_total{endpoint="/v1/predict"}',
        "kiln_batch_size_bucket",
        "kiln_queue_wait_seconds_bucket",
        'kiln_request_latency_seconds_bucket{endpoint="/v1/predict"',
        "kiln_inference_seconds_count",
    ):
        assert name in text, name


def test_bad_input_is_422_naming_the_item(client):
    good = np.zeros((8, 8)).tolist()
    response = client.post("/v1/predict", json={"inputs": [good, good, np.zeros((3, 8)).tolist()]})
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert "item 2" in detail and "(1, 8, 8)" in detail and "got (3, 8)" in detail
    assert client.post("/v1/predict", json={"images": []}).status_code == 422


def test_v2_metadata_and_infer(client, predictor, images):
    meta = client.get("/v2/models/kiln").json()
    assert meta["name"] == "kiln"
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert {o["name"] for o in meta["outputs"]} == {"probs", "label"}

    pixels = images[:3].ravel().tolist()  # v2 data is flat, row-major
    tensor = {"name": "input", "shape": [3, 1, 8, 8], "datatype": "FP32", "data": pixels}
    body = {"id": "req-1", "inputs": [tensor]}
    response = client.post("/v2/models/kiln/infer", json=body)
    assert response.status_code == 200
    result = response.json()
    assert result["id"] == "req-1" and result["model_name"] == "kiln"
    outputs = {o["name"]: o for o in result["outputs"]}
    assert outputs["probs"]["shape"] == [3, 10] and len(outputs["probs"]["data"]) == 30
    assert outputs["label"]["data"] == [p["label"] for p in predictor.predict(images[:3])]


def test_v2_errors(client):
    assert client.get("/v2/models/resnet").status_code == 404
    body = {
        "inputs": [{"name": "input", "shape": [1, 1, 8, 8], "datatype": "FP32", "data": [0] * 64}]
    }
    assert client.post("/v2/models/resnet/infer", json=body).status_code == 404
    body["inputs"][0]["shape"] = [1, 1, 4, 16]
    response = client.post("/v2/models/kiln/infer", json=body)
    assert response.status_code == 400 and "item 0" in response.json()["error"]
    body["inputs"][0]["shape"] = [2, 1, 8, 8]
    response = client.post("/v2/models/kiln/infer", json=body)
    assert (
        response.status_code == 400 and "holds 128 values, data has 64" in response.json()["error"]
    )


def test_server_shuts_down_cleanly(predictor):
    app = create_app(predictor, model_name="other")
    live = LiveServer(app)
    live.start()
    with httpx.Client(base_url=live.url) as c:
        assert c.get("/v2/models/other/ready").json() == {"name": "other", "ready": True}
    live.stop()
    assert not live.thread.is_alive()
    assert app.state.kiln.ready is False


# ---------------------------------------------------------------------------------------------
# The batcher on its own: failures stay within their batch, nothing is dropped


def _predict_or_fail(inputs):
    if "boom" in inputs:
        raise RuntimeError("model exploded")
    return [x.upper() for x in inputs]


async def _submit_all(batcher, requests):
    return await asyncio.gather(*(batcher.submit(r) for r in requests), return_exceptions=True)


def test_failing_batch_fails_only_its_requests():
    async def scenario():
        batcher = DynamicBatcher(
            _predict_or_fail, max_batch_size=2, max_delay_ms=50, max_queue_size=10,
            metrics=ServingMetrics(),
        )  # fmt: skip
        await batcher.start()
        # Batches of two inputs, oldest first: [a, boom] fails together, [c, d] succeeds.
        results = await _submit_all(batcher, [["a"], ["boom"], ["c"], ["d"]])
        after = await batcher.submit(["e"])
        await batcher.stop()
        return results, after

    results, after = asyncio.run(scenario())
    assert isinstance(results[0], BatchFailed) and isinstance(results[1], BatchFailed)
    assert "model exploded" in str(results[1])
    assert results[2:] == [["C"], ["D"]] and after == ["E"]


def test_large_request_is_split_and_stop_fails_waiting_requests():
    async def scenario():
        batcher = DynamicBatcher(
            _predict_or_fail, max_batch_size=2, max_delay_ms=10_000, max_queue_size=10,
            metrics=ServingMetrics(),
        )  # fmt: skip
        await batcher.start()
        big = await batcher.submit(["a", "b", "c", "d", "e"])  # > max_batch_size: one request
        waiting = asyncio.ensure_future(batcher.submit(["x"]))  # waits for a 10 s deadline
        await asyncio.sleep(0.05)
        await batcher.stop()
        return big, await asyncio.gather(waiting, return_exceptions=True)

    big, (waiting,) = asyncio.run(scenario())
    assert big == ["A", "B", "C", "D", "E"]
    assert isinstance(waiting, BatcherClosed)


def test_serving_a_checkpoint_imports_no_training_data_stack(tmp_path_factory):
    """The server's import chain (app, predictor, preprocessing recipe, model) stays below the
    dataset modules: no pandas, scikit-learn or Hydra in a serving process."""
    import subprocess
    import sys

    from .conftest import SUBPROCESS_ENV

    run_dir, _ = digits_run(tmp_path_factory)
    code = (
        "import sys\n"
        "from kiln.inference import Predictor\n"
        "from kiln.serving import create_app\n"
        f"create_app(Predictor.from_checkpoint({str(run_dir / 'checkpoints' / 'best.pt')!r}))\n"
        "print(sorted(m for m in ('pandas', 'sklearn', 'hydra') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
