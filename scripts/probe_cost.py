"""What the pre-step probes (rules 1-3, the logits check) cost on a run: `probe_time_s` from
summary.json against the run's training time, over several runs of the same command.

    python scripts/probe_cost.py                      # the default run (digits + mlp), 5 times
    python scripts/probe_cost.py --against ../main    # interleaved with another checkout: a ratio
    python scripts/probe_cost.py -- model=resnet18 data=synthetic_images

Each run is a fresh `python train.py` (OMP_NUM_THREADS=1); with --against the two checkouts take
turns, so a neighbour's load hits both alike, and the report is the ratio of their medians."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def one_run(checkout: Path, overrides: list[str], run_dir: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(checkout / "src")}
    cmd = [sys.executable, str(checkout / "train.py"), f"hydra.run.dir={run_dir}",
           "env.progress_bar=false", "logger=none", *overrides]  # fmt: skip
    done = subprocess.run(cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: the run failed:\n{done.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--against", type=Path, help="another checkout, measured in turn")
    parser.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = parser.parse_args()
    checkouts = {"this": HERE} | ({"other": args.against.resolve()} if args.against else {})
    probes: dict[str, list[float]] = {name: [] for name in checkouts}
    shares: dict[str, list[float]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory(prefix="probe-cost-") as scratch:
        for i in range(args.runs):
            order = list(checkouts.items())
            for name, checkout in order if i % 2 == 0 else order[::-1]:
                summary = one_run(checkout, args.overrides, Path(scratch) / f"{name}-{i}")
                probes[name].append(summary["probe_time_s"])
                shares[name].append(summary["probe_time_s"] / summary["train_time_s"])
    for name, checkout in checkouts.items():
        values = probes[name]
        print(
            f"{name} ({checkout}): probe_time_s median {statistics.median(values):.3f} "
            f"(min {min(values):.3f}, max {max(values):.3f}) over {len(values)} runs; "
            f"{100 * statistics.median(shares[name]):.1f}% of the training time"
        )
    if args.against:
        ratio = statistics.median(probes["this"]) / statistics.median(probes["other"])
        print(f"probe time, this / other: {ratio:.2f}x")


if __name__ == "__main__":
    main()
