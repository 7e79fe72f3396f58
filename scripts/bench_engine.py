"""Benchmark the kiln engine against a minimal hand-written PyTorch loop, in one process.

Both sides train the same model (a fresh copy with the same initial weights), on the same
DataLoader's batches in the same order, with the same batch size, optimizer, LR schedule and
precision. The engine side is `Trainer.train_epoch` (what `fit` runs per epoch, minus evaluation
and checkpoints): every per-step check it really does is timed (loss finiteness, grad norm,
scaler, scheduler, the bookkeeping in `after_step`). The baseline is the textbook loop:

    for x, y in batches:
        opt.zero_grad(); with autocast: loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward(); scaler.step(opt); scaler.update(); sched.step()

Each repeat times the engine then the baseline, and then the other order, so drift in machine load
hits both sides alike; the medians give samples/s for each and ratio = engine / baseline. The
engine's overhead budget is 3% (ratio >= 0.97). Speed is reported, never asserted, unless --check.

    python scripts/bench_engine.py                       # resnet18, synthetic 32x32, fp32, 1 thread
    python scripts/bench_engine.py --precision bf16 --steps 30 --out bench.json
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
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import islice
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
from kiln.engine.run import build_trainer
from kiln.engine.seeding import set_deterministic
from kiln.engine.trainer import Trainer
from kiln.models import build_model, logits_of

THRESHOLD = 0.97  # engine samples/s over baseline samples/s: at most 3% overhead


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
    # The defaults finish in a few minutes on 2 busy CPU cores (resnet18, batch 64: ~2-5 s/step).
    parser.add_argument("--steps", type=int, default=6, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per side first")
    parser.add_argument(
        "--repeats", type=int, default=3, help="rounds; each times both orders (A,B then B,A)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        # One thread by default: on a small shared CPU, two threads stall each other and the
        # run-to-run spread (~10%) swamps a 3% budget; the same setting holds for both sides.
        help="torch intra-op threads, the same for both sides (default: %(default)s)",
    )
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON")
    parser.add_argument(
        "--threshold", type=float, default=THRESHOLD, help="the budget: %(default)s"
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when the ratio is below the threshold"
    )
    parser.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. optimizer=sgd")
    args = parser.parse_args(argv)
    for name in ("steps", "repeats", "batch_size", "image_size", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def hydra_overrides(args: argparse.Namespace) -> list[str]:
    """The benchmark's settings as Hydra overrides; an extra override of the same key wins."""
    # Enough epochs that the LR schedule covers warm-up plus every timed run (OneCycleLR raises
    # when stepped past its total), with one timed run per epoch (limit_train_batches).
    epochs = 2 * args.repeats + math.ceil(args.warmup / args.steps) + 1
    ours = {
        "data": args.data,
        "model": args.model,
        "precision": args.precision,
        "logger": "none",
        "device": args.device,
        "data.batch_size": str(args.batch_size),
        "trainer.limit_train_batches": str(args.steps),
        "trainer.max_epochs": str(epochs),
        "env.progress_bar": "false",
    }
    if args.data == "synthetic_images":
        ours["data.image_size"] = str(args.image_size)
        # Full batches for every timed step of a run (one run is one epoch).
        ours["data.num_train"] = str(max(2048, args.steps * args.batch_size))
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


def build_baseline(cfg, trainer: Trainer) -> Baseline:
    """A fresh model built the way build_trainer builds it, with the engine's initial weights."""
    spec = build_data(cfg.data).spec
    aux_head = any(name.startswith("aux.") for name in trainer.raw_model.state_dict())
    model = build_model(spec, cfg.model, aux_head=aux_head)
    model.load_state_dict(trainer.raw_model.state_dict())
    model.to(trainer.device)
    optimizer = build_optimizer(model.parameters(), cfg.optimizer)
    scheduler = build_scheduler(optimizer, cfg.scheduler, trainer.state.planned_steps)
    scaler = torch.amp.GradScaler(trainer.device.type, enabled=trainer.precision.use_grad_scaler)
    return Baseline(model, optimizer, scheduler, scaler, trainer.precision, trainer.device)


def baseline_steps(b: Baseline, batches: Iterable) -> int:
    """The minimal loop. Returns the number of samples trained on."""
    model, optimizer, scheduler, scaler = b.model, b.optimizer, b.scheduler, b.scaler
    dtype = b.precision.autocast_dtype
    model.train()
    samples = 0
    for inputs, targets in batches:
        if isinstance(inputs, torch.Tensor):
            inputs = inputs.to(b.device, non_blocking=True)
        else:  # token dicts / lists of tensors
            inputs = move_to(inputs, b.device, non_blocking=True)
        targets = targets.to(b.device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        autocast = torch.autocast(b.device.type, dtype=dtype) if dtype else contextlib.nullcontext()
        with autocast:
            loss = F.cross_entropy(logits_of(model(inputs)), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if scheduler is not None:
            scheduler.step()
        samples += len(targets)
    return samples


def endless(loader: Iterable) -> Iterator:
    while True:
        yield from loader


def timed(fn: Callable[[], int], device: torch.device) -> float:
    """samples/s of one call of `fn` (which returns the samples it trained on)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    samples = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return samples / (time.perf_counter() - start)


def benchmark(args: argparse.Namespace, cfg) -> dict:
    set_deterministic(cfg.trainer.deterministic)  # as train() does (cudnn.benchmark)
    device = resolve_device(str(cfg.device))
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as run_dir:
        trainer = build_trainer(cfg, Path(run_dir), DistInfo(), device, lambda metrics, step: None)
        check_comparable(cfg, trainer)
        baseline = build_baseline(cfg, trainer)
        loader = trainer.train_loader
        steps = trainer.batches_per_epoch  # = --steps unless the dataset is smaller

        def engine_run() -> int:
            # One epoch of train_epoch, limited to `steps` batches by limit_train_batches; the
            # epoch index stays 0 so both sides see the same batches in the same order.
            trainer.state.batch_in_epoch = 0
            before = trainer.state.samples_seen
            trainer.train_epoch()
            return trainer.state.samples_seen - before

        def baseline_run() -> int:
            loader.sampler.set_epoch(trainer.state.epoch)  # what train_epoch does first
            loader.generator.manual_seed(trainer.seed * 1000 + trainer.state.epoch)
            return baseline_steps(baseline, islice(loader, steps))

        if args.warmup:  # first-call allocations, kernel choice, optimizer state
            engine_batches = endless(loader)
            for _ in range(args.warmup):
                trainer.train_step(engine_batches, window=1)
            baseline_steps(baseline, islice(endless(loader), args.warmup))
        runs: dict[str, list[float]] = {"engine": [], "baseline": []}
        sides = {"engine": engine_run, "baseline": baseline_run}
        for _ in range(args.repeats):
            for order in (("engine", "baseline"), ("baseline", "engine")):
                for side in order:
                    runs[side].append(timed(sides[side], device))
    engine, base = statistics.median(runs["engine"]), statistics.median(runs["baseline"])
    ratio = engine / base
    threshold = args.threshold
    return {
        "engine_samples_per_s": engine,
        "baseline_samples_per_s": base,
        "ratio": ratio,
        "threshold": threshold,
        "within_budget": ratio >= threshold,
        "engine_runs": runs["engine"],
        "baseline_runs": runs["baseline"],
        "paired_ratios": [e / b for e, b in zip(runs["engine"], runs["baseline"], strict=True)],
        "model": cfg.model.name,
        "data": cfg.data.name,
        "image_size": getattr(cfg.data, "image_size", None),
        "batch_size": cfg.data.batch_size,
        "precision": cfg.precision.name,
        "optimizer": cfg.optimizer.name,
        "scheduler": cfg.scheduler.name,
        "steps": steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "device": str(device),
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
    }


def print_table(result: dict) -> None:
    r = result
    print(
        f"{r['model']} on {r['data']} {r['image_size']}px, batch {r['batch_size']}, "
        f"{r['precision']}, {r['optimizer']}+{r['scheduler']}, {r['device']} "
        f"({r['torch_threads']} threads): {r['steps']} steps x {len(r['engine_runs'])} runs "
        f"per side (both orders), after {r['warmup']} warm-up steps"
    )
    rows = [
        ("engine samples/s", f"{r['engine_samples_per_s']:.1f}"),
        ("baseline samples/s", f"{r['baseline_samples_per_s']:.1f}"),
        ("ratio engine/baseline", f"{r['ratio']:.3f}"),
        (f"ratio >= {r['threshold']}", "yes" if r["within_budget"] else "NO"),
    ]
    for label, value in rows:
        print(f"  {label:<24}{value:>10}")
    runs = ", ".join(
        f"{e:.1f}/{b:.1f}" for e, b in zip(r["engine_runs"], r["baseline_runs"], strict=True)
    )
    print(f"  runs (engine/baseline): {runs}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(hydra_overrides(args))
    result = benchmark(args, cfg)
    print_table(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 1 if args.check and not result["within_budget"] else 0


if __name__ == "__main__":
    sys.exit(main())
