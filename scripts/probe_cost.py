"""What the probes before step 1 (rules 1-3, the logits check, the behaviour checks, the learn
probe, the device and fp16 probes) cost a run: `probe_time_s` from summary.json against the wall
time of the whole `python train.py` (start-up to exit) and against its training time, with each
check's share, over several runs of the same command. The figures are written, with the date,
the commit and the machine's load, to scripts/probe_cost.json (one entry per command): the one
place they live.

    python scripts/probe_cost.py                      # the default run (digits + mlp), 5 times
    python scripts/probe_cost.py --against ../main    # interleaved with another checkout: a ratio
    python scripts/probe_cost.py --runs 1 -- model=resnet18 precision=amp

Each run is a fresh `python train.py` (OMP_NUM_THREADS=1 unless set); with --against the two
checkouts take turns, so a neighbour's load hits both alike, and the report is the ratio of their
medians."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
RECORD = Path(__file__).with_suffix(".json")


def one_run(checkout: Path, overrides: list[str], run_dir: Path) -> dict:
    env = {"OMP_NUM_THREADS": "1", **os.environ, "PYTHONPATH": str(checkout / "src")}
    cmd = [
        sys.executable,
        str(checkout / "train.py"),
        f"hydra.run.dir={run_dir}",
        "env.progress_bar=false",
        "logger=none",
        *overrides,
    ]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=run_dir.parent, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: the run failed:\n{done.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "wall_s": wall,
        "probe_s": summary["probe_time_s"],
        "train_s": summary["train_time_s"],
        "checks_s": summary.get("probe_times_s", {}),
        "status": summary["status"],
        "steps": summary["steps"],
    }


def commit(checkout: Path) -> str:
    found = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return found.stdout.strip() or "unknown"


def summarise(runs: list[dict]) -> dict:
    median = statistics.median
    checks = sorted({c for r in runs for c in r["checks_s"]})
    return {
        "runs": len(runs),
        "wall_s": median(r["wall_s"] for r in runs),
        "probe_s": median(r["probe_s"] for r in runs),
        "train_s": median(r["train_s"] for r in runs),
        "probe_share_of_wall": median(r["probe_s"] / r["wall_s"] for r in runs),
        "probe_share_of_training": median(r["probe_s"] / max(r["train_s"], 1e-9) for r in runs),
        "checks_s": {c: median(r["checks_s"].get(c, 0.0) for r in runs) for c in checks},
        "status": runs[-1]["status"],
        "steps": runs[-1]["steps"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--against", type=Path, help="another checkout, measured in turn")
    parser.add_argument("--no-record", action="store_true", help=f"do not write {RECORD.name}")
    parser.add_argument("overrides", nargs="*", help="train.py overrides (after --)")
    args = parser.parse_args()
    checkouts = {"this": HERE} | ({"other": args.against.resolve()} if args.against else {})
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    with tempfile.TemporaryDirectory(prefix="probe-cost-") as scratch:
        for i in range(args.runs):
            order = list(checkouts.items())
            for name, checkout in order if i % 2 == 0 else order[::-1]:
                runs[name].append(one_run(checkout, args.overrides, Path(scratch) / f"{name}-{i}"))
    results = {name: summarise(found) for name, found in runs.items()}
    for name, checkout in checkouts.items():
        r = results[name]
        shown = ", ".join(f"{c} {s:.2f}" for c, s in r["checks_s"].items())
        print(
            f"{name} ({checkout}): probes {r['probe_s']:.2f} s of a {r['wall_s']:.1f} s run "
            f"({100 * r['probe_share_of_wall']:.1f}% of the wall time, "
            f"{100 * r['probe_share_of_training']:.0f}% of the training time), median of "
            f"{r['runs']} runs; per check: {shown}"
        )
    if args.against:
        ratio = results["this"]["probe_s"] / results["other"]["probe_s"]
        print(f"probe time, this / other: {ratio:.2f}x")
    if not args.no_record:
        record = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
        key = "python train.py " + " ".join(args.overrides) if args.overrides else "python train.py"
        record[key.strip()] = {
            "date": datetime.date.today().isoformat(),
            "commit": commit(HERE),
            "load_average": os.getloadavg()[0],
            "cores": os.cpu_count(),
            **results["this"],
        }
        RECORD.write_text(json.dumps(record, indent=2) + "\n")
        print(f"written to {RECORD}")


if __name__ == "__main__":
    main()
