"""Inference backends compared in one run: torch eager vs ONNX Runtime fp32 vs ONNX Runtime int8
(dynamically quantised weights), at batch 1 and 32, for resnet18 (32x32 images) and the text
models (text_bow, text_transformer). Reported per model, backend and batch size: median and p99
latency of one call, and the ratio eager / backend (above 1: faster than eager); fp32 must agree
with eager (max |dprob| <= 1e-4, else the exit status is 1), int8's argmax agreement is shown.

Speed is reported, never asserted, unless --check asks (a ratio below --min-ratio exits 1).

    python scripts/bench_infer.py                  # trains tiny checkpoints of the three models
    python scripts/bench_infer.py --ckpt resnet18=outputs/<run>/checkpoints/best.pt --threads 2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from provenance import stamp, write_report
from tiny_checkpoints import REPO, checkpoints

sys.path.insert(0, str(REPO / "src"))

TINY_RUNS = {
    "resnet18": [
        "data=synthetic_images",
        "data.image_size=32",
        "data.num_train=64",
        "data.num_val=64",
        "model=resnet18",
        "trainer.max_steps=2",
    ],
    "text_bow": ["data=csv_text", "model=text_bow", "trainer.max_epochs=1"],
    "text_transformer": ["data=csv_text", "model=text_transformer", "trainer.max_epochs=1"],
}
FP32_TOLERANCE = 1e-4
NUM_AGREEMENT_INPUTS = 256
BACKENDS = ("eager", "onnx_fp32", "onnx_int8")


@dataclass
class Row:
    model: str
    backend: str
    batch_size: int
    median_ms: float
    p99_ms: float
    samples_per_s: float
    ratio_to_eager: float  # eager median / this median
    agreement: float  # fp32: max |dprob| vs eager; int8: share of argmax agreeing with eager


def model_inputs(record, count: int) -> torch.Tensor:
    """What the network takes: standardised images, or token ids of real texts."""
    from kiln.inference.export import random_examples, validation_examples

    if record.spec.input_kind == "tokens":
        examples, _ = validation_examples(record, count)
        return examples
    return random_examples(record, count)


def time_calls(fn, batch, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn(batch)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn(batch)
        times.append(time.perf_counter() - started)
    return times


def bench_model(name: str, ckpt: Path, workdir: Path, args) -> list[Row]:
    from kiln.inference.backends import ProbabilityHead, ort_session
    from kiln.inference.export import export, quantize_int8
    from kiln.inference.record import read_checkpoint, rebuild_model

    record, state = read_checkpoint(ckpt)
    net = ProbabilityHead(rebuild_model(record, state)).eval()
    onnx_path = export(ckpt, workdir / f"{name}.onnx").onnx_path  # parity-checked
    int8_path = quantize_int8(onnx_path, workdir / f"{name}.int8.onnx")
    sessions = {
        "onnx_fp32": ort_session(onnx_path, "cpu", args.threads),
        "onnx_int8": ort_session(int8_path, "cpu", args.threads),
    }

    @torch.inference_mode()
    def eager(batch):
        return net(batch)[1].numpy()

    calls = {"eager": eager}
    for backend, session in sessions.items():
        calls[backend] = lambda batch, s=session: s.run(["probs"], {"input": batch.numpy()})[0]

    inputs = model_inputs(record, max(NUM_AGREEMENT_INPUTS, max(args.batch_sizes)))
    reference = eager(inputs)
    agreement = {
        "eager": 0.0,
        "onnx_fp32": float(np.abs(calls["onnx_fp32"](inputs) - reference).max()),
        "onnx_int8": float((calls["onnx_int8"](inputs).argmax(1) == reference.argmax(1)).mean()),
    }
    rows = []
    for batch_size in args.batch_sizes:
        batch = inputs[:batch_size].contiguous()
        medians = {}
        for backend in BACKENDS:
            times = time_calls(calls[backend], batch, args.repeats, args.warmup)
            median = float(np.median(times))
            medians[backend] = median
            rows.append(
                Row(
                    model=name,
                    backend=backend,
                    batch_size=batch_size,
                    median_ms=median * 1000,
                    p99_ms=float(np.quantile(times, 0.99)) * 1000,
                    samples_per_s=batch_size / median,
                    ratio_to_eager=medians["eager"] / median,
                    agreement=agreement[backend],
                )
            )
            print_row(rows[-1])
    return rows


def print_row(r: Row) -> None:
    agree = f"{r.agreement:.1e} max|dp|" if r.backend == "onnx_fp32" else ""
    agree = f"{r.agreement:.1%} argmax" if r.backend == "onnx_int8" else agree
    print(
        f"{r.model:<17} {r.backend:<10} {r.batch_size:>5} {r.median_ms:>9.3f} {r.p99_ms:>9.3f} "
        f"{r.samples_per_s:>10.0f} {r.ratio_to_eager:>7.2f}  {agree}",
        flush=True,
    )


def markdown(rows: list[Row], threads: int, repeats: int) -> str:
    """The table of docs/benchmarks.md's "Inference backends", with its provenance line."""
    lines = [
        stamp(),
        "",
        f"{threads} thread(s) each, median and p99 of {repeats} calls, ratio eager / backend:",
        "",
        "| model | backend | batch | median ms | p99 ms | x eager | agreement |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        agree = f"max abs dprob {r.agreement:.1e}" if r.backend == "onnx_fp32" else ""
        agree = f"argmax {r.agreement:.0%}" if r.backend == "onnx_int8" else agree
        backend = {"onnx_fp32": "onnx fp32", "onnx_int8": "onnx int8"}.get(r.backend, r.backend)
        lines.append(
            f"| {r.model} | {backend} | {r.batch_size} | {r.median_ms:.3g} | {r.p99_ms:.3g} "
            f"| {r.ratio_to_eager:.2f} | {agree} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ckpt",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a checkpoint to compare (repeatable); default: train tiny ones of the three models",
    )
    parser.add_argument("--batch-sizes", default="1,32")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch and ONNX Runtime threads")
    parser.add_argument("--check", action="store_true", help="exit 1 below --min-ratio")
    parser.add_argument("--min-ratio", type=float, default=1.0, help="fp32 at the largest batch")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the table as docs/benchmarks.md holds it (date, commit, machine) at the end",
    )
    args = parser.parse_args(argv)
    if os.environ.get("KILN_SMOKE") == "1":  # the README's own test: proves the path, quickly
        args.repeats, args.warmup, args.batch_sizes = 3, 1, "1,4"
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        f"{'model':<17} {'backend':<10} {'batch':>5} {'median ms':>9} {'p99 ms':>9} "
        f"{'samples/s':>10} {'x eager':>7}  agreement"
    )
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = checkpoints(args.ckpt, TINY_RUNS, Path(tmp))
        rows = []
        for name, ckpt in ckpts.items():
            rows += bench_model(name, ckpt, Path(tmp), args)
    text = markdown(rows, args.threads, args.repeats)
    # report["markdown"]: what docs/benchmarks.md's figures block shows (kiln.cli.docs)
    write_report({"rows": [asdict(r) for r in rows]}, text, args.out)
    if args.markdown:
        print("\n" + text)
    disagree = [r for r in rows if r.backend == "onnx_fp32" and not r.agreement <= FP32_TOLERANCE]
    if disagree:
        print(f"ONNX Runtime fp32 disagrees with eager beyond {FP32_TOLERANCE:g}: {disagree}")
        return 1
    largest = max(args.batch_sizes)
    slow = [r for r in rows if r.backend == "onnx_fp32" and r.batch_size == largest]
    if args.check and any(r.ratio_to_eager < args.min_ratio for r in slow):
        print(f"fp32 at batch {largest} below {args.min_ratio:g}x eager")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
