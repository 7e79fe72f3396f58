"""Shared by the inference and serving tests: tiny trained checkpoints (each trained once per
pytest session, in-process, from the real config shrunk), raw validation inputs as a user would
send them, and the real server -- uvicorn on 127.0.0.1, in a thread or as `python infer.py
mode=serve` in its own process."""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import uvicorn

from kiln.cli.paths import REPO_ROOT
from kiln.engine.run import train
from kiln.serving.server import uvicorn_config

from .conftest import compose_config, python_process

TINY = ("trainer.max_epochs=1", "env.progress_bar=false", "logger=none", "device=cpu")
# A detector trained for a few steps on small images: enough to exercise every inference path.
TINY_DETECTION = (
    "data=shapes_detection",
    "model=detector",
    "data.num_train=8",
    "data.num_val=4",
    "data.image_size=64",
    "data.min_image_size=40",
    "data.batch_size=4",
    "model.width=8",
    "trainer.max_steps=2",
)
STARTUP_TIMEOUT_S = 60
_RUNS: dict[str, tuple[Path, dict]] = {}


def trained_run(tmp_path_factory, name: str, *overrides: str) -> tuple[Path, dict]:
    """(run_dir, summary) of a one-epoch run, trained on first use in this session."""
    if name not in _RUNS:
        run_dir = tmp_path_factory.mktemp(name)
        summary = train(compose_config(*TINY, *overrides), run_dir)
        _RUNS[name] = (run_dir, summary)
    return _RUNS[name]


def digits_run(tmp_path_factory) -> tuple[Path, dict]:
    return trained_run(tmp_path_factory, "infer_digits", "data=digits", "model=mlp")


def text_run(tmp_path_factory) -> tuple[Path, dict]:
    return trained_run(tmp_path_factory, "infer_text", "data=csv_text", "model=text_bow")


def detector_run(tmp_path_factory) -> tuple[Path, dict]:
    return trained_run(tmp_path_factory, "infer_detector", *TINY_DETECTION)


def raw_digits_val(val_fraction: float = 0.2, split_seed: int = 0):
    """The digits validation split as raw pixels (N, 8, 8) in 0..16, as a user would send them:
    the same split kiln.data.digits makes, before normalisation."""
    # Imported here, not at the top: scikit-learn's import (2 CPU-s) was paid by every xdist
    # worker collecting the suite, most of which never call this.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    raw = load_digits()
    _, x_val, _, y_val = train_test_split(
        raw.images.astype(np.float32),
        raw.target,
        test_size=val_fraction,
        random_state=split_seed,
        stratify=raw.target,
    )
    return x_val, y_val


def mixed_size_images(count: int = 4, seed: int = 0) -> list[np.ndarray]:
    """Raw (3, H, W) images in [0, 1], each its own size, drawn like shapes_detection's."""
    from kiln.data.shapes_detection import make_image

    rng = np.random.default_rng(seed)
    sizes = [(40 + 7 * i, 64 - 5 * i) for i in range(count)]
    return [
        make_image(rng, h, w, max_objects=3, num_classes=2)[0].numpy().astype(np.float32)
        for h, w in sizes
    ]


def assert_boxes_agree(
    got: list[dict], expected: list[dict], names=("torch", "the other"), max_corner_px=None
) -> None:
    """Two runs of a detector on the same images, box for box as the export's parity check
    matches them (kiln.inference.box_agreement): twins by label, score and place, near-tied
    scores a tie, at least one box compared."""
    from kiln.inference.box_agreement import match_images

    agreement = match_images(expected, got, names)
    assert agreement.problem(max_corner_px) is None, agreement.problem(max_corner_px)


def binary_request(pixels: np.ndarray) -> tuple[bytes, dict[str, str]]:
    """A v2 request body over the binary extension (the pixels as FP32 bytes after the JSON
    head), asking for the labels only, and its headers."""
    tensor = {
        "name": "input",
        "shape": list(pixels.shape),
        "datatype": "FP32",
        "parameters": {"binary_data_size": pixels.nbytes},
    }
    head = json.dumps({"inputs": [tensor], "outputs": [{"name": "label"}]}).encode()
    return head + pixels.tobytes(), {"Inference-Header-Content-Length": str(len(head))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """uvicorn in a thread on a socket bound here, so the port is ours before it starts."""

    def __init__(self, app):
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        # The stack `python infer.py mode=serve` runs: uvloop, the guarded httptools protocol.
        config = uvicorn_config(app, app.state.kiln.config, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]})

    def start(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self.server.started:
            assert self.thread.is_alive(), "the server thread died during start-up"
            assert time.monotonic() < deadline, "the server did not start in time"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    @property
    def state(self):
        return self.app.state.kiln


@contextlib.contextmanager
def live_server(app):
    server = LiveServer(app).start()
    try:
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def serve_process(ckpt: Path, *overrides: str):
    """`python infer.py mode=serve ckpt=...` as a user starts it; yields (Popen, url) once
    /readyz says ready. The caller stops it (or it is killed on the way out)."""
    port = free_port()
    cmd = [sys.executable, str(REPO_ROOT / "infer.py"), "mode=serve", f"ckpt={ckpt}"]
    cmd += [f"server.port={port}", *overrides]
    proc = python_process(cmd, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S * 2
        while True:
            assert proc.poll() is None, f"the server exited during start-up:\n{proc.stdout.read()}"
            assert time.monotonic() < deadline, "the server was not ready in time"
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
