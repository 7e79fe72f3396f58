"""The end of a run, for a person: what happened in one line, where it is, and what to type next.
Printed in every profile (production's quiet console included); summary.json has the rest."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

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
        f"run directory: {where(run_dir, link)}",
        f"curves: {run_dir / 'curves.png'}",
        *test_report(summary),
        "next:",
        f"  python infer.py ckpt={ckpt} input=<.npy or .csv>   # predict",
        f"  python infer.py mode=evaluate ckpt={ckpt} data=<labelled folder or .csv>   # report",
        f"  python infer.py mode=export ckpt={ckpt}            # ONNX, parity-checked",
        f"  python infer.py mode=serve ckpt={ckpt}             # HTTP on 127.0.0.1:8000",
        f"  python train.py {resume_command(overrides)}   # continue it",
    ]
    return "\n".join(lines)


def test_report(summary: dict) -> list[str]:
    """The test split's headline numbers and where its report is (or why there is none)."""
    if summary.get("test_eval_error"):
        return [f"test report failed (the training result stands): {summary['test_eval_error']}"]
    if "test_eval_dir" not in summary:
        return []
    names = {
        "test_acc": "accuracy",
        "test_top5_acc": "top-5",
        "test_macro_f1": "macro-F1",
        "test_map": "mAP",
        "test_map50": "mAP@0.5",
    }
    numbers = ", ".join(f"{name} {short(summary[k])}" for k, name in names.items() if k in summary)
    return [
        f"test split ({summary.get('test_count')} inputs): {numbers}; report: "
        f"{summary['test_eval_dir']}/"
    ]


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
