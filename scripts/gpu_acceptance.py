"""One script for every CUDA path kiln has, for a machine with a GPU (at most ~8 minutes on one
H200): each path runs for real and its row says ok, FAIL or skipped; then the speed figures.
It prints one table and exits 1 when any path failed. On a machine without CUDA the CUDA-only
rows are skipped and the rest run (the test suite runs it that way, with --quick).

    python scripts/gpu_acceptance.py             # everything this machine can run
    python scripts/gpu_acceptance.py --quick     # shorter runs (the suite uses it on CPU)

Rows: fp16 + GradScaler with a provoked skipped step; bf16; pin_memory with non-blocking copies;
channels_last; torch.compile; no host sync between log lines (cuda sync debug mode); DDP over nccl
(one rank under torchrun); ONNX export with parity on the CUDA execution provider; infer.py and
the server with device=cuda; a provoked OOM with its [FAIL] line; then engine vs hand-written loop
(resnet50, bf16, batch 256), AMP vs fp32 and compile vs eager speed-ups, and MFU."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()
QUIET = ["env.progress_bar=false", "logger=none"]


@dataclass
class Row:
    name: str
    status: str  # ok | FAIL | skipped
    figure: str = ""
    detail: str = ""


class Skip(Exception):  # noqa: N818
    """This row cannot run here (no CUDA, no CUDA execution provider, ...)."""


def needs_cuda() -> None:
    if not CUDA:
        raise Skip("no CUDA device")


def train_in_process(overrides: list[str], run_dir: Path, prepare: Callable | None = None):
    """kiln's own train(), optionally with a hook on the built trainer (to provoke things)."""
    from kiln.config import load_config
    from kiln.engine import run as engine_run

    cfg = load_config([*QUIET, *overrides])
    if prepare is None:
        return engine_run.train(cfg, run_dir)
    build = engine_run.build_run

    def build_and_prepare(*args, **kwargs):
        built = build(*args, **kwargs)
        prepare(built.trainer)
        return built

    engine_run.build_run = build_and_prepare
    try:
        return engine_run.train(cfg, run_dir)
    finally:
        engine_run.build_run = build


def script(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# ---------------------------------------------------------------------------------------------
# The paths


def fp16_grad_scaler(tmp: Path, steps: int) -> str:
    needs_cuda()
    calls = {"n": 0}

    def provoke(trainer):  # one step's gradients overflow, as fp16 ones do
        def hook(grad):
            calls["n"] += 1
            return torch.full_like(grad, float("inf")) if calls["n"] == 2 else grad

        trainer.raw_model.head.weight.register_hook(hook)

    summary = train_in_process(
        ["precision=amp", "device=cuda", f"trainer.max_steps={steps}"], tmp / "fp16", provoke
    )
    if summary["scaler_skipped"] != 1:
        raise AssertionError(f"expected 1 skipped step, summary says {summary['scaler_skipped']}")
    return f"1 step skipped of {summary['steps']}"


def bf16(tmp: Path, steps: int) -> str:
    device = "cuda" if CUDA else "cpu"
    summary = train_in_process(
        ["precision=bf16", f"device={device}", f"trainer.max_steps={steps}"], tmp / "bf16"
    )
    return f"{summary['samples_per_s']:.0f} samples/s on {device}"


def pin_memory(tmp: Path, steps: int) -> str:
    needs_cuda()
    seen = {}

    def record(trainer):
        seen["pin"] = trainer.train_loader.pin_memory
        seen["non_blocking"] = trainer.non_blocking

    train_in_process(
        ["device=cuda", "data.pin_memory=true", "data.num_workers=2", f"trainer.max_steps={steps}"],
        tmp / "pin",
        record,
    )
    if not (seen["pin"] and seen["non_blocking"]):
        raise AssertionError(f"pinned/non-blocking not in effect: {seen}")
    return "pinned batches, non_blocking copies"


def channels_last(tmp: Path, steps: int) -> str:
    device = "cuda" if CUDA else "cpu"
    summary = train_in_process(
        [
            "model=resnet18",
            "data=synthetic_images",
            "data.num_train=512",
            "data.num_val=64",
            "trainer.channels_last=true",
            f"device={device}",
            f"trainer.max_steps={steps}",
        ],
        tmp / "channels_last",
    )
    return f"{summary['samples_per_s']:.0f} samples/s on {device}"


def compiled(tmp: Path, steps: int) -> str:
    device = "cuda" if CUDA else "cpu"
    started = time.perf_counter()
    summary = train_in_process(
        ["trainer.compile=true", f"device={device}", f"trainer.max_steps={steps}"],
        tmp / "compile",
    )
    return (
        f"ok in {time.perf_counter() - started:.0f} s incl. compilation ({summary['steps']} steps)"
    )


def no_host_sync(tmp: Path, steps: int) -> str:
    needs_cuda()

    def strict(trainer):  # sync debug mode "error" for the steps between two log lines
        step = trainer.train_step

        def checked(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return step(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")

        trainer.train_step = checked

    train_in_process(
        ["device=cuda", "trainer.log_every_n_steps=5", f"trainer.max_steps={max(steps, 10)}"],
        tmp / "sync",
        strict,
    )
    return "train_step ran under torch.cuda.set_sync_debug_mode('error')"


def ddp_nccl(tmp: Path, steps: int) -> str:
    needs_cuda()
    done = script(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "train.py",
        "trainer=ddp",
        "trainer.backend=nccl",
        "device=cuda",
        f"trainer.max_steps={steps}",
        f"hydra.run.dir={tmp / 'ddp'}",
        *QUIET,
    )
    if done.returncode:
        raise AssertionError(done.stderr[-800:])
    return "torchrun, 1 rank, nccl"


def trained_checkpoint(tmp: Path) -> Path:
    run_dir = tmp / "ckpt"
    if not (run_dir / "checkpoints" / "best.pt").is_file():
        train_in_process(["trainer.max_epochs=1"], run_dir)
    return run_dir / "checkpoints" / "best.pt"


def onnx_cuda_provider(tmp: Path, steps: int) -> str:
    needs_cuda()
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        raise Skip(f"onnxruntime has no CUDA provider here ({ort.get_available_providers()})")
    from kiln.inference.export import export

    report = export(trained_checkpoint(tmp), device="cuda")
    worst = max(check.max_abs_diff for check in report.parity)
    return f"parity on the CUDA EP: max |dprob| {worst:.1e}"


def infer_and_serve_cuda(tmp: Path, steps: int) -> str:
    needs_cuda()
    import numpy as np

    ckpt = trained_checkpoint(tmp)
    images = np.random.default_rng(0).uniform(0, 16, size=(8, 8, 8)).astype(np.float32)
    np.save(tmp / "x.npy", images)
    done = script(
        "infer.py",
        f"ckpt={ckpt}",
        f"input={tmp / 'x.npy'}",
        f"output={tmp / 'preds.csv'}",
        "device=cuda",
    )
    if done.returncode:
        raise AssertionError(done.stderr[-800:])
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "infer.py",
            "mode=serve",
            f"ckpt={ckpt}",
            "device=cuda",
            f"server.port={port}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        import httpx

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        answer = httpx.post(
            f"http://127.0.0.1:{port}/v1/predict", json={"inputs": images[:2].tolist()}
        )
        answer.raise_for_status()
    finally:
        server.terminate()
        server.wait(timeout=60)
    return f"infer.py and the server answered ({len(answer.json()['predictions'])} predictions)"


def provoked_oom(tmp: Path, steps: int) -> str:
    needs_cuda()
    # resnet50 keeps ~100 MB of activations per 224x224 image in fp32: 4096 of them cannot fit
    # (a 141 GB H200 included), while the batch itself is only 2.4 GB.
    done = script(
        "train.py",
        "data=synthetic_images",
        "data.image_size=224",
        "data.num_train=4096",
        "data.num_val=64",
        "data.batch_size=4096",
        "model=resnet50",
        "device=cuda",
        "trainer.max_steps=2",
        "trainer.probe_sizes=false",
        f"hydra.run.dir={tmp / 'oom'}",
        f"output_root={tmp}",
        *QUIET,
    )
    fail = [line for line in done.stderr.splitlines() if line.startswith("[FAIL]")]
    if done.returncode != 1 or not fail or "| OOM @ step" not in fail[0]:
        raise AssertionError(f"no OOM line: {done.stderr[-800:]}")
    if not (tmp / "oom" / "oom.json").is_file():
        raise AssertionError("no oom.json beside the run")
    return fail[0].split(" | ", 3)[-1]


# ---------------------------------------------------------------------------------------------
# The speed figures


def engine_vs_loop(tmp: Path, steps: int) -> str:
    needs_cuda()
    out = tmp / "bench.json"
    done = script(
        "scripts/bench_engine.py",
        "--model",
        "resnet50",
        "--precision",
        "bf16",
        "--batch-size",
        "256",
        "--image-size",
        "64",
        "--steps",
        str(steps * 3),
        "--device",
        "cuda",
        "--out",
        str(out),
        timeout=900,
    )
    if done.returncode:
        raise AssertionError(done.stderr[-800:])
    (r,) = json.loads(out.read_text())["comparisons"]
    low, high = r["ratio_ci95"]
    return f"ratio {r['ratio_median']:.3f} [{low:.3f}, {high:.3f}] ({r['verdict']})"


def speedups(tmp: Path, steps: int) -> str:
    needs_cuda()
    rates = {}
    for label, extra in (
        ("fp32", ["precision=fp32"]),
        ("amp", ["precision=amp"]),
        ("compiled amp", ["precision=amp", "trainer.compile=true"]),
    ):
        summary = train_in_process(
            [
                "model=resnet50",
                "data=synthetic_images",
                "data.image_size=64",
                "data.num_train=8192",
                "data.batch_size=256",
                "device=cuda",
                f"trainer.max_steps={steps * 3}",
                "trainer.peak_tflops=989",
                *extra,
            ],
            tmp / label.replace(" ", "_"),
        )
        rates[label] = summary
    amp = rates["amp"]["samples_per_s"] / rates["fp32"]["samples_per_s"]
    comp = rates["compiled amp"]["samples_per_s"] / rates["amp"]["samples_per_s"]
    mfu = rates["compiled amp"].get("mfu")
    return f"amp/fp32 x{amp:.2f}; compile/eager x{comp:.2f}; MFU {mfu:.1%} (compiled amp)"


PATHS: list[tuple[str, Callable[[Path, int], str]]] = [
    ("fp16 + GradScaler (provoked skip)", fp16_grad_scaler),
    ("bf16", bf16),
    ("pin_memory + non_blocking", pin_memory),
    ("channels_last", channels_last),
    ("torch.compile", compiled),
    ("no host sync between log lines", no_host_sync),
    ("DDP over nccl (1 rank)", ddp_nccl),
    ("ONNX parity on the CUDA EP", onnx_cuda_provider),
    ("infer.py + server, device=cuda", infer_and_serve_cuda),
    ("provoked OOM", provoked_oom),
    ("engine vs loop (resnet50 bf16 256)", engine_vs_loop),
    ("AMP, compile speed-ups and MFU", speedups),
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_row(name: str, fn, tmp: Path, steps: int) -> Row:
    started = time.perf_counter()
    try:
        figure = fn(tmp, steps)
        status, detail = "ok", ""
    except Skip as reason:
        status, figure, detail = "skipped", "", str(reason)
    except Exception as err:  # a path that fails is a row, and the exit code
        status, figure = "FAIL", ""
        detail = f"{type(err).__name__}: {err}".splitlines()[0][:300]
        traceback.print_exc()
    seconds = time.perf_counter() - started
    row = Row(name, status, figure, detail)
    print(f"  {status:<7} {name} ({seconds:.0f} s) {figure or detail}", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps per path")
    parser.add_argument("--only", nargs="*", default=[], help="run only rows whose name has this")
    parser.add_argument("--out", type=Path, default=None, help="also write the table as JSON")
    args = parser.parse_args(argv)
    steps = 3 if args.quick else 20
    device = torch.cuda.get_device_name(0) if CUDA else "no CUDA device"
    print(f"kiln GPU acceptance on {device}, torch {torch.__version__}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-gpu-") as tmp:
        for name, fn in PATHS:
            if args.only and not any(part in name for part in args.only):
                continue
            rows.append(run_row(name, fn, Path(tmp), steps))
    width = max(len(r.name) for r in rows)
    print(f"\n| {'path':<{width}} | status  | figure / reason |")
    print(f"|{'-' * (width + 2)}|---------|-----------------|")
    for r in rows:
        print(f"| {r.name:<{width}} | {r.status:<7} | {r.figure or r.detail} |")
    if args.out:
        args.out.write_text(json.dumps([r.__dict__ for r in rows], indent=2) + "\n")
    return 1 if any(r.status == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
