"""Benchmark the kiln engine against a minimal hand-written PyTorch loop, step by step, in one
process.

Both sides train the same model (a fresh copy with the same initial weights), on the same batches,
with the same batch size, optimizer, LR schedule and precision. The engine side is one
`Trainer.train_step` plus its `after_step` bookkeeping (device-side metric sums, the non-finite
flag, the scheduler); the baseline is the textbook loop:

    opt.zero_grad(); with autocast: loss = F.cross_entropy(model(x), y)
    scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); sched.step()

The two sides are interleaved step by step (alternating which goes first), so a neighbour's load
hits both alike; each pair gives a ratio (baseline time / engine time, i.e. engine throughput over
baseline throughput). The report is the median of the paired ratios with a distribution-free 95%
confidence interval (order statistics of the binomial), and a verdict against the overhead budget
(ratio >= 0.97): within, over, or inconclusive when the interval straddles it. With --compile both
sides are also compared with torch.compile. Speed is reported, never asserted, unless --check.

    python scripts/bench_engine.py                       # resnet18, synthetic 32x32, fp32, 1 thread
    python scripts/bench_engine.py --compile both --steps 60 --out bench.json
    python scripts/bench_engine.py --model mlp --image-size 8 optimizer=sgd  # extra Hydra overrides
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config import load_config
from kiln.data import build_data
from kiln.device import resolve_device
from kiln.engine.batches import move_to
from kiln.engine.distributed import DistInfo
from kiln.engine.loss import ClassificationCriterion
from kiln.engine.optim import build_optimizer, build_scheduler
from kiln.engine.precision import Precision
from kiln.engine.run import build_run
from kiln.engine.seeding import set_deterministic
from kiln.engine.trainer import Trainer
from kiln.models import build_model, logits_of

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import stamp  # noqa: E402

THRESHOLD = 0.97  # engine throughput over baseline throughput: at most 3% overhead


@dataclass
class Baseline:
    """The hand-written side: its own model copy, optimizer, schedule and scaler."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    scaler: torch.amp.GradScaler
    precision: Precision
    device: torch.device


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Anything after the options is passed to Hydra as overrides (key=value).",
    )
    parser.add_argument("--model", default="resnet18", help="model group option")
    parser.add_argument("--data", default="synthetic_images", help="data group option")
    parser.add_argument("--image-size", type=int, default=32, help="synthetic image side (px)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "amp", "bf16"])
    parser.add_argument("--steps", type=int, default=30, help="timed step pairs")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per side first")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        # One thread by default: on a small shared CPU, two threads stall each other; the same
        # setting holds for both sides.
        help="torch intra-op threads, the same for both sides (default: %(default)s)",
    )
    parser.add_argument(
        "--compile",
        choices=["off", "on", "both"],
        default="off",
        help="compare eager sides, compiled sides (torch.compile), or both",
    )
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON")
    parser.add_argument("--threshold", type=float, default=THRESHOLD, help="the budget")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 unless every comparison is within budget"
    )
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the table as docs/benchmarks.md holds it (date, commit, machine) at the end",
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. optimizer=sgd")
    args = parser.parse_args(argv)
    if os.environ.get("KILN_SMOKE") == "1":  # the README's own test: a run that proves it works
        args.model, args.image_size, args.batch_size, args.steps, args.warmup = "mlp", 8, 16, 3, 1
    for name in ("steps", "batch_size", "image_size", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def hydra_overrides(args: argparse.Namespace, compiled: bool) -> list[str]:
    """The benchmark's settings as Hydra overrides; an extra override of the same key wins."""
    ours = {
        "data": args.data,
        "model": args.model,
        "precision": args.precision,
        "logger": "none",
        "device": args.device,
        "data.batch_size": str(args.batch_size),
        "trainer.max_epochs": "1",
        "trainer.log_every_n_steps": str(10**6),  # no log line inside the timed steps
        "trainer.compile": str(compiled).lower(),
        "env.progress_bar": "false",
    }
    if args.data == "synthetic_images":
        ours["data.image_size"] = str(args.image_size)
        # Full batches for every warm-up and timed step of both sides.
        ours["data.num_train"] = str(2 * (args.steps + args.warmup + 1) * args.batch_size)
    extra_keys = {item.split("=", 1)[0].lstrip("+~") for item in args.overrides}
    kept = [f"{key}={value}" for key, value in ours.items() if key not in extra_keys]
    return kept + list(args.overrides)


def check_comparable(cfg, trainer: Trainer) -> None:
    """The baseline is a single-process, one-batch-per-step classification loop."""
    if not isinstance(trainer.criterion, ClassificationCriterion):
        raise ValueError(f"model={cfg.model.name} computes its own loss; pick a classifier")
    if trainer.cfg.accumulate_grad_batches != 1:
        raise ValueError("the baseline steps every batch; drop trainer.accumulate_grad_batches")
    if trainer.dist.enabled:
        raise ValueError("run the benchmark in one process (no trainer=ddp, no torchrun)")


def build_baseline(cfg, trainer: Trainer, compiled: bool) -> Baseline:
    """A fresh model built the way build_run builds it, with the engine's initial weights."""
    spec = build_data(cfg.data).spec
    aux_head = any(name.startswith("aux.") for name in trainer.raw_model.state_dict())
    model = build_model(spec, cfg.model, aux_head=aux_head)
    model.load_state_dict(trainer.raw_model.state_dict())
    model.to(trainer.device)
    optimizer = build_optimizer(model.parameters(), cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.scheduler, trainer.state.planned_steps)
    scaler = torch.amp.GradScaler(trainer.device.type, enabled=trainer.precision.use_grad_scaler)
    if compiled:
        model = torch.compile(model)
    return Baseline(model, optimizer, scheduler, scaler, trainer.precision, trainer.device)


def baseline_step(b: Baseline, batch) -> int:
    """The minimal loop's step. Returns the number of samples trained on."""
    inputs, targets = move_to(batch, b.device, non_blocking=True)
    dtype = b.precision.autocast_dtype
    b.model.train()
    b.optimizer.zero_grad(set_to_none=True)
    autocast = torch.autocast(b.device.type, dtype=dtype) if dtype else contextlib.nullcontext()
    with autocast:
        loss = F.cross_entropy(logits_of(b.model(inputs)), targets)
    b.scaler.scale(loss).backward()
    b.scaler.step(b.optimizer)
    b.scaler.update()
    if b.scheduler is not None:
        b.scheduler.step()
    return len(targets)


def timed(fn: Callable[[], int], device: torch.device) -> float:
    """Seconds of one call of `fn`, the device drained before and after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def median_ci(ratios: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """Median and a distribution-free ~95% interval for it (binomial order statistics)."""
    ordered = sorted(ratios)
    n = len(ordered)
    k = max(0, math.floor((n - 1 - z * math.sqrt(n)) / 2))
    return statistics.median(ordered), ordered[k], ordered[n - 1 - k]


def verdict(low: float, high: float, threshold: float) -> str:
    if low >= threshold:
        return "within budget"
    if high < threshold:
        return "over budget"
    return (
        f"inconclusive: the interval straddles {threshold}; run more --steps on a quieter machine"
    )


def compare(args: argparse.Namespace, compiled: bool) -> dict:
    cfg = load_config(hydra_overrides(args, compiled))
    set_deterministic(cfg.trainer.deterministic)  # as train() does (cudnn.benchmark)
    device = resolve_device(str(cfg.device))
    label = "compiled" if compiled else "eager"
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as run_dir:
        built = build_run(cfg, Path(run_dir), DistInfo(), device, lambda metrics, step: None)
        trainer = built.trainer
        check_comparable(cfg, trainer)
        baseline = build_baseline(cfg, trainer, compiled)
        loader = trainer.train_loader
        loader.sampler.set_epoch(0)
        engine_batches: Iterator = iter(loader)
        baseline_batches: Iterator = iter(loader)  # the same batches, in the same order

        def engine_step() -> int:
            result = trainer.train_step(engine_batches, 1)
            trainer.state.global_step += 1
            trainer.after_step(result, None)
            return result.samples

        def base_step() -> int:
            return baseline_step(baseline, next(baseline_batches))

        for _ in range(args.warmup):  # allocations, kernel choice, compilation, optimizer state
            engine_step()
            base_step()
        ratios, engine_s, baseline_s = [], [], []
        for i in range(args.steps):
            sides = [("engine", engine_step), ("baseline", base_step)]
            times = dict((name, timed(fn, device)) for name, fn in sides[:: 1 if i % 2 else -1])
            engine_s.append(times["engine"])
            baseline_s.append(times["baseline"])
            ratios.append(times["baseline"] / times["engine"])
            if (i + 1) % max(1, args.steps // 5) == 0:
                print(f"  {label}: {i + 1}/{args.steps} step pairs", flush=True)
    median, low, high = median_ci(ratios)
    return {
        "mode": label,
        "ratio_median": median,
        "ratio_ci95": [low, high],
        "verdict": verdict(low, high, args.threshold),
        "within_budget": low >= args.threshold,
        "engine_samples_per_s": args.batch_size / statistics.median(engine_s),
        "baseline_samples_per_s": args.batch_size / statistics.median(baseline_s),
        "paired_ratios": ratios,
        "model": cfg.model.name,
        "data": cfg.data.name,
        "image_size": getattr(cfg.data, "image_size", None),
        "batch_size": cfg.data.batch_size,
        "precision": cfg.precision.name,
        "optimizer": cfg.optimizer.name,
        "scheduler": cfg.scheduler.name,
        "steps": args.steps,
        "warmup": args.warmup,
        "threshold": args.threshold,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }


def table(results: list[dict]) -> str:
    """The setting, then one row per comparison (eager, compiled): samples/s of each side, the
    median paired ratio engine / baseline with its 95% interval, and the verdict."""
    r = results[0]
    lines = [
        f"{r['model']} on {r['data']} {r['image_size']}px, batch {r['batch_size']}, "
        f"{r['precision']}, {r['optimizer']}+{r['scheduler']}, {r['device']} "
        f"({r['torch_threads']} threads): {r['steps']} interleaved step pairs after "
        f"{r['warmup']} warm-up steps a side, budget ratio >= {r['threshold']:g}",
        "",
        "| mode | engine samples/s | baseline samples/s | ratio (median) | 95% CI low | "
        "95% CI high | verdict |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        low, high = r["ratio_ci95"]
        engine, base = r["engine_samples_per_s"], r["baseline_samples_per_s"]
        lines.append(
            f"| {r['mode']} | {engine:.1f} | {base:.1f} | {r['ratio_median']:.3f} | {low:.3f} "
            f"| {high:.3f} | {r['verdict']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()
    torch.set_num_threads(args.threads)
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    results = []
    for compiled in modes:
        print(f"benchmarking {'compiled' if compiled else 'eager'} sides ...", flush=True)
        results.append(compare(args, compiled))
    print(table(results), flush=True)
    if args.markdown:
        print("\n" + stamp(load) + "\n\n" + table(results), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"comparisons": results}, indent=2) + "\n")
    return 1 if args.check and not all(r["within_budget"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
