"""The end of a run, for a person: what happened in one line, where it is, and what to type next.
Printed in every profile (production's quiet console included); summary.json has the rest."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

DATA_REPORT = "data_report.json"
LATEST = "latest"  # <output_root>/latest: a link to the newest run's directory


def link_latest(output_root: str, run_dir: Path) -> Path | None:
    """Point <output_root>/latest at `run_dir`, so commands can name the newest run."""
    root = Path(output_root)
    link = root / LATEST
    try:
        root.mkdir(parents=True, exist_ok=True)
        target = os.path.relpath(run_dir.resolve(), root.resolve())
        tmp = root / f".{LATEST}.{os.getpid()}"
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(target, target_is_directory=True)
        os.replace(tmp, link)  # atomic: a reader never sees no link
        return link
    except OSError:  # a filesystem without links: the printed run directory still says it
        return None


def short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 600:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min"


def where(run_dir: Path, link: Path | None) -> str:
    return f"{run_dir}" + (f"  (also {link})" if link is not None else "")


def finished(summary: dict, run_dir: Path, link: Path | None, overrides: list[str]) -> str:
    monitor = summary.get("monitor")
    value, best = summary.get(monitor), summary.get("best")
    seconds = summary.get("train_time_s") or 0.0
    ckpt = f"{link or run_dir}/checkpoints/best.pt"
    metric = f"{monitor} {short(value)} (best {short(best)})" if monitor else "no evaluation"
    speed = f"{short(summary.get('samples_per_s') or 0)} samples/s"
    lines = [
        f"run {summary['status']}: {metric}, {summary['steps']} steps, {summary['epochs']} "
        f"epochs, {duration(seconds)} training, {speed}",
        *data_lines(run_dir),
        f"run directory: {where(run_dir, link)}",
        f"curves: {run_dir / 'curves.png'}",
        "next:",
        f"  python infer.py ckpt={ckpt} input=<.npy or .csv>   # predict",
        f"  python infer.py mode=export ckpt={ckpt}            # ONNX, parity-checked",
        f"  python infer.py mode=serve ckpt={ckpt}             # HTTP on 127.0.0.1:8000",
        f"  python train.py {resume_command(overrides)}   # continue it",
    ]
    return "\n".join(lines)


def data_lines(run_dir: Path) -> list[str]:
    """What the data report sums up (records read, kept, dropped per reason), one line a file."""
    path = run_dir / DATA_REPORT
    try:
        summary = json.loads(path.read_text()).get("summary", [])
    except (OSError, ValueError):
        return []
    return [f"data: {line}" for line in summary]


def resume_command(overrides: list[str]) -> str:
    kept = [o for o in overrides if not o.startswith(("resume=", "hydra.run.", "hydra.sweep."))]
    return " ".join(shlex.quote(o) for o in [*kept, "resume=auto"])


def failed(run_dir: Path) -> str:
    return f"next: kiln triage {run_dir}   # the likely causes, ranked"


def preempted(run_dir: Path, overrides: list[str]) -> str:
    return (
        f"run preempted; its state is in {run_dir}/checkpoints/last.pt\n"
        f"next: python train.py {resume_command(overrides)}"
    )
