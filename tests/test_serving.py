"""A real uvicorn server on 127.0.0.1 (free port, in a thread) serving a tiny digits checkpoint:
v1 and Open Inference Protocol v2 routes, health, metrics, dynamic batching under concurrent
load, clear 4xx errors, and a clean shutdown. The batcher's failure isolation and fairness are
also tested on their own, with plain functions standing in for the model."""

from __future__ import annotations

import asyncio
import re
import threading
import time

import httpx
import numpy as np
import pytest

from kiln.inference import InputError, Predictor
from kiln.inference.predictor import join
from kiln.serving import create_app
from kiln.serving.batcher import DynamicBatcher
from kiln.serving.errors import BatcherClosed, DeadlineExceeded, ModelFailed, QueueFull
from kiln.serving.metrics import ServingMetrics

from .inference_helpers import LiveServer, digits_run, raw_digits_val

NUM_CONCURRENT = 20


@pytest.fixture(scope="module")
def predictor(tmp_path_factory):
    run_dir, _ = digits_run(tmp_path_factory)
    return Predictor.from_checkpoint(run_dir / "checkpoints" / "best.pt")


@pytest.fixture(scope="module")
def server(predictor):
    live = LiveServer(create_app(predictor, max_batch_size=8, max_delay_ms=10)).start()
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
    assert client.post("/v1/predict", json={"inputs": [np.zeros((8, 8)).tolist()]}).is_success
    client.post("/v1/predict", json={"inputs": [[[0.0] * 3]]})  # one error, at least
    text = client.get("/metrics").text
    for name in (
        'kiln_requests_total{endpoint="/v1/predict",status="200"}',
        'kiln_requests_total{endpoint="/v1/predict",status="422"}',
        'kiln_errors_total{endpoint="/v1/predict"}',
        "kiln_batch_size_bucket",
        "kiln_queue_wait_seconds_bucket",
        'kiln_request_latency_seconds_bucket{endpoint="/v1/predict"',
        "kiln_inference_seconds_count",
        "kiln_queue_depth",
        "kiln_abandoned_requests_total",
        "kiln_deadline_exceeded_total",
    ):
        assert name in text, name


def test_bad_input_is_422_naming_the_item(client):
    good = np.zeros((8, 8)).tolist()
    response = client.post("/v1/predict", json={"inputs": [good, good, np.zeros((3, 8)).tolist()]})
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert "item 2" in detail and "(1, 8, 8)" in detail and "got (3, 8)" in detail
    response = client.post("/v1/predict", json={"images": []})
    assert response.status_code == 422 and "images" in response.json()["detail"]


@pytest.mark.parametrize(
    ("pixel", "expected"),
    [
        ('"1.5"', "not strings, booleans or null"),
        ("true", "not strings, booleans or null"),
        ("null", "not strings, booleans or null"),
        ("1" + "0" * 400, "is out of range (beyond float32"),  # an integer beyond any float
        (str(2**70), "outside the training data's raw range"),  # beyond int64, not a float's
        ("1e39", "beyond float32"),  # a float beyond float32
        ("NaN", "not valid JSON"),  # Python's json would read it; JSON has no NaN
    ],
)
def test_v1_pixels_must_be_numbers_in_range(client, pixel, expected):
    """Numeric strings, booleans and numbers beyond float32 were silently coerced or gave 500."""
    row = "[" + ", ".join(["0"] * 7 + [pixel]) + "]"
    image = "[" + ", ".join([row] * 8) + "]"
    good = "[" + ", ".join(["[" + ", ".join(["0"] * 8) + "]"] * 8) + "]"
    body = '{"inputs": [' + good + ", " + image + "]}"
    response = client.post("/v1/predict", content=body)
    assert response.status_code == 422, response.text
    detail = response.json()["detail"]
    assert expected in detail
    assert "item 1" in detail or "JSON" in detail


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
    assert response.status_code == 400 and "shape must be [-1, 1, 8, 8]" in response.json()["error"]
    body["inputs"][0]["shape"] = [2, 1, 8, 8]
    response = client.post("/v2/models/kiln/infer", json=body)
    assert response.status_code == 400
    assert "holds 128 values, data has 64" in response.json()["error"]
    body["inputs"][0]["shape"] = [1, 1, 8, 8]
    body["inputs"][0]["data"] = [17.0] * 64  # outside digits' raw range 0..16
    response = client.post("/v2/models/kiln/infer", json=body)
    assert response.status_code == 400 and "item 0: pixel values span" in response.json()["error"]


def test_server_shuts_down_cleanly(predictor):
    app = create_app(predictor, model_name="other")
    live = LiveServer(app).start()
    with httpx.Client(base_url=live.url) as c:
        assert c.get("/v2/models/other/ready").json() == {"name": "other", "ready": True}
    live.stop()
    assert not live.thread.is_alive()
    assert app.state.kiln.ready is False


def test_server_settings_are_checked_naming_the_key(predictor):
    from kiln.config.infer import ArgumentError

    for key, value, message in [
        ("port", 70000, "server.port=70000: must be in 1..65535"),
        ("max_queue_size", 0, "server.max_queue_size=0: must be >= 1"),
        ("max_inputs_per_request", 9000, "larger than server.max_queue_size=8192"),
        ("timeout_ms", 60_000, "server.drain_grace_s=30 must be longer than server.timeout_ms"),
        ("model_name", "a/b", "server.model_name='a/b'"),
    ]:
        with pytest.raises(ArgumentError, match=re.escape(message)):
            create_app(predictor, **{key: value})


# ---------------------------------------------------------------------------------------------
# The batcher on its own: failures stay with their request, big requests share, nothing is lost


def _upper_or_fail(inputs):
    if "boom" in inputs:
        raise RuntimeError("model exploded")
    if "bad" in inputs:
        raise InputError("not a word")
    return [x.upper() for x in inputs]


def _batcher(run=_upper_or_fail, **limits) -> DynamicBatcher:
    settings = {"max_batch_size": 4, "max_delay_ms": 20, "max_queue_size": 100, **limits}
    return DynamicBatcher(run, join, metrics=ServingMetrics(), **settings)


async def _submit(batcher, items, timeout_s: float = 30):
    return await batcher.submit(items, len(items), time.monotonic() + timeout_s)


async def _submit_all(batcher, requests):
    return await asyncio.gather(*(_submit(batcher, r) for r in requests), return_exceptions=True)


def test_a_failing_input_fails_only_its_own_request():
    """[a, boom, c, bad] share one model call, which raises: it is split and retried until
    only the requests holding 'boom' (500) and 'bad' (4xx) fail; a and c get their answers."""

    async def scenario():
        batcher = _batcher()
        await batcher.start()
        results = await _submit_all(batcher, [["a"], ["boom"], ["c"], ["x", "bad"]])
        after = await _submit(batcher, ["e"])  # the loop carries on
        await batcher.stop()
        return results, after, batcher.metrics

    results, after, metrics = asyncio.run(scenario())
    assert results[0] == ["A"] and results[2] == ["C"] and after == ["E"]
    assert isinstance(results[1], ModelFailed) and "model exploded" in str(results[1])
    assert isinstance(results[3], InputError) and "item 1" in str(results[3])
    assert metrics.batch_splits._value.get() >= 1


def test_a_large_request_is_split_and_small_ones_ride_along():
    calls = []

    def record(inputs):
        calls.append(list(inputs))
        time.sleep(0.01)
        return [x.upper() for x in inputs]

    async def scenario():
        batcher = _batcher(record, max_batch_size=4, max_delay_ms=0)
        await batcher.start()
        big = asyncio.ensure_future(_submit(batcher, [f"b{i}" for i in range(40)]))
        await asyncio.sleep(0.03)  # the big one is running
        small = await _submit(batcher, ["s"])
        small_done_while_big_ran = not big.done()
        result = await big
        await batcher.stop()
        return result, small, small_done_while_big_ran

    big, small, fair = asyncio.run(scenario())
    assert big == [f"B{i}" for i in range(40)] and small == ["S"]
    assert fair, "the small request waited for the whole large one"
    assert max(len(c) for c in calls) <= 4
    small_call = next(i for i, c in enumerate(calls) if "s" in c)
    assert small_call < len(calls) - 2  # it did not go last


def test_queue_full_deadline_and_stop_answer_every_request():
    def slow(inputs):
        time.sleep(0.2)
        return list(inputs)

    async def scenario():
        batcher = _batcher(slow, max_batch_size=1, max_delay_ms=0, max_queue_size=3)
        await batcher.start()
        first = asyncio.ensure_future(_submit(batcher, ["a"]))
        await asyncio.sleep(0.05)  # "a" is running; the queue is empty again
        queued = [asyncio.ensure_future(_submit(batcher, [x])) for x in "bc"]
        expiring = asyncio.ensure_future(_submit(batcher, ["d"], timeout_s=0.1))
        await asyncio.sleep(0)
        started = time.monotonic()
        full = (await asyncio.gather(_submit(batcher, ["e"]), return_exceptions=True))[0]
        refused_in_s = time.monotonic() - started
        (expired,) = await asyncio.gather(expiring, return_exceptions=True)
        answered = await asyncio.gather(first, queued[0], return_exceptions=True)
        await batcher.stop()  # "c" is still queued or running
        (stopped,) = await asyncio.gather(queued[1], return_exceptions=True)
        return full, refused_in_s, expired, answered, stopped

    full, refused_in_s, expired, answered, stopped = asyncio.run(scenario())
    assert isinstance(full, QueueFull) and full.status == 503, full
    assert int(full.headers["Retry-After"]) >= 1 and refused_in_s < 0.05  # at once
    assert isinstance(expired, DeadlineExceeded) and expired.status == 504
    assert answered == [["a"], ["b"]]
    assert stopped == ["c"] or isinstance(stopped, BatcherClosed)  # answered either way


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
