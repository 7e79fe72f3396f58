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
        "next:",
        f"  python infer.py ckpt={ckpt} input=<.npy or .csv>   # predict",
        f"  python infer.py mode=export ckpt={ckpt}            # ONNX, parity-checked",
        f"  python infer.py mode=serve ckpt={ckpt}             # HTTP on 127.0.0.1:8000",
        f"  python train.py {resume_command(overrides)}   # continue it",
    ]
    return "\n".join(lines)


def resume_command(overrides: list[str]) -> str:
    kept = [o for o in overrides if not o.startswith(("resume=", "hydra.run.", "hydra.sweep."))]
    return " ".join(shlex.quote(o) for o in [*kept, "resume=auto"])


def failed(run_dir: Path) -> str:
    return f"next: kiln triage {run_dir}   # the likely causes, ranked"


def preempted(run_dir: Path, overrides: list[str], interrupted: bool = False) -> str:
    how = "interrupted (Ctrl-C)" if interrupted else "preempted"
    return (
        f"run {how}; its state is in {run_dir}/checkpoints/last.pt\n"
        f"next: python train.py {resume_command(overrides)}"
    )


def stopped_at_once(run_dir: Path, overrides: list[str]) -> str:
    """A second Ctrl-C (or one before the first step): no checkpoint at this point."""
    newest = newest_checkpoint(run_dir)
    kept = f"the newest checkpoint is {newest}" if newest else "no checkpoint was written yet"
    next_command = f"python train.py {resume_command(overrides)}" if newest else "the same command"
    return f"run interrupted (Ctrl-C), stopped at once; {kept}\nnext: {next_command}"


def newest_checkpoint(run_dir: Path) -> str | None:
    from kiln.checkpoint import candidates

    found = candidates(Path(run_dir) / "checkpoints")
    return str(found[0]) if found else None
