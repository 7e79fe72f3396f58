"""The checkpoints the inference benchmarks measure: the user's (`--ckpt NAME=PATH`, repeatable)
or tiny ones trained here through the real train.py. Speed does not depend on the weights, so a
few training steps are enough. Shared by loadtest.py and bench_infer.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train_tiny(runs: dict[str, list[str]], workdir: Path) -> dict[str, Path]:
    ckpts = {}
    for name, overrides in runs.items():
        run_dir = workdir / name
        cmd = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}"]
        cmd += [*overrides, "logger=none", "env.progress_bar=false", "device=cpu"]
        print(f"training a tiny {name} checkpoint: {' '.join(cmd[2:])}", flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        ckpts[name] = run_dir / "checkpoints" / "best.pt"
    return ckpts


def checkpoints(specs: list[str], runs: dict[str, list[str]], workdir: Path) -> dict[str, Path]:
    """`NAME=PATH` specs as given, or tiny checkpoints of `runs` when there are none."""
    given = {name: Path(path) for name, path in (spec.split("=", 1) for spec in specs)}
    return given or train_tiny(runs, workdir)
