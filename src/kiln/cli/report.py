"""The end of a run, for a person: what happened in one line, where it is, and what to type next,
each command with what it does. Every command works as printed (kiln.commands) and every path
printed exists. Printed in every profile (production's quiet console included); summary.json has
the rest."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from kiln.commands import RunCommand, infer, plugin_override, shown
from kiln.config.overrides import override

log = logging.getLogger("kiln")

DATA_REPORT = "data_report.json"
LATEST = "latest"  # <output_root>/latest: a link to the newest run's directory
COMMENT_COLUMN = 72  # where the `# what it does` comments line up


def link_latest(output_root: str, run_dir: Path) -> Path | None:
    """Point <output_root>/latest at `run_dir`, so commands can name the newest run. A run
    without best.pt (it never evaluated) is not linked: the commands printed for the newest run
    need it."""
    if not (run_dir / "checkpoints" / "best.pt").is_file():
        return None
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
    return f"{shown(run_dir)}" + (f"  (also {link})" if link is not None else "")


def commented(command: str, what: str) -> str:
    return f"  {command:<{COMMENT_COLUMN}}  # {what}"


def finished(
    summary: dict, run_dir: Path, link: Path | None, command: RunCommand, config: dict
) -> str:
    seconds = summary.get("train_time_s") or 0.0
    speed = f"{short(summary.get('samples_per_s') or 0)} samples/s"
    lines = [
        f"run {summary['status']}: {outcome(summary)}, {summary['steps']} steps, "
        f"{summary['epochs']} epochs, {duration(seconds)} training, {speed}",
        *([f"at chance: {summary['at_chance']}"] if summary.get("at_chance") else []),
        *data_lines(run_dir),
        f"run directory: {where(run_dir, link)}",
        *test_report(summary),
        *baseline_report(summary, run_dir),
    ]
    if (run_dir / "curves.png").is_file():
        lines.append(f"curves: {shown(run_dir / 'curves.png')}")
    triage = (
        [commented(f"kiln triage {link or run_dir}", "why it learned nothing")]
        if summary["status"] == "at_chance"
        else []
    )
    if summary.get("baseline_below") and summary.get("baseline_override"):
        triage.append(
            commented(
                command.train(summary["baseline_override"]),
                "the model is below the linear baseline: try this",
            )
        )
    commands = [*triage, *next_commands(run_dir, link, command, config)]
    return "\n".join([*lines, "next:", *commands])


def outcome(summary: dict) -> str:
    """best.pt's metric first (what is exported and served) and the epoch it is from, then the
    last evaluation's where it differs, and whether early stopping ended the run."""
    monitor = summary.get("monitor")
    if not monitor:
        return "no evaluation"
    last, best, epoch = summary.get(monitor), summary.get("best"), summary.get("best_epoch")
    if best is None:
        return f"{monitor} {short(last)} (no best.pt: no finite {monitor})"
    text = f"best.pt {monitor} {short(best)}" + (f" from epoch {epoch}" if epoch else "")
    if epoch != summary.get("epochs") or last != best:
        text += f", last {short(last)}"
    if summary.get("stopped_early"):
        text += f" (stopped early: no better {monitor} in {summary['epochs'] - epoch} epochs)"
    return text


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


def baseline_report(summary: dict, run_dir: Path) -> list[str]:
    """The linear baseline beside the model on the validation texts (text data), and the
    verdict when the model is below it; baseline.json has the rest (per class too)."""
    if summary.get("baseline_error"):
        return [f"baseline failed (the training result stands): {summary['baseline_error']}"]
    if "baseline_acc" not in summary:
        return []
    line = (
        f"baseline (TF-IDF + LinearSVC, same training split, validation texts): accuracy "
        f"{summary['baseline_acc']:.4f}, macro-F1 {summary['baseline_macro_f1']:.4f}; the model "
        f"{summary['baseline_model_acc']:.4f} / {summary['baseline_model_macro_f1']:.4f}; per "
        f"class: {run_dir / 'baseline.json'}"
    )
    if not summary.get("baseline_below"):
        return [line]
    verdict = "the model is below the linear baseline: train again with"
    return [line, f"{verdict} {summary['baseline_override']} (the first command below)"]


def next_commands(run_dir: Path, link: Path | None, command: RunCommand, config: dict) -> list:
    """Predict, export and serve its best.pt; train longer from its last weights."""
    lines = []
    best = Path(link or run_dir) / "checkpoints" / "best.pt"
    if best.is_file():
        ckpt_args = f"ckpt={shown(best)}", *plugin_override(config)
        example = predict_input(best, run_dir, link, config)
        if example is not None:
            lines.append(
                commented(
                    infer(*ckpt_args, *example),
                    "predict: writes preds.csv (input= also takes your .npy, .csv, images)",
                )
            )
        lines += [
            commented(
                infer("mode=evaluate", *ckpt_args),
                "the evaluation report (eval/): its test split, else validation; data= yours",
            ),
            commented(
                infer("mode=export", *ckpt_args),
                "ONNX: model.onnx beside it, checked against torch",
            ),
            commented(
                infer("mode=serve", *ckpt_args),
                "HTTP on 127.0.0.1:8000; GET /v1/example: a body to POST",
            ),
        ]
    last = run_dir / "checkpoints" / "last.pt"
    if last.is_file():
        lines.append(
            commented(
                command.train(override("init_from", shown(last))),
                "train longer: a new run from these weights (new optimizer and schedule)",
            )
        )
    return lines


def predict_input(best: Path, run_dir: Path, link: Path | None, config: dict) -> list | None:
    """input= (and text_column=) for the predict command: the run's own CSV for text data read
    from one, else an example input of the right shape written into the run directory."""
    data = config.get("data", {})
    if data.get("test_dir") and Path(data["test_dir"]).is_dir():  # image folders: its test photos
        return [f"input={shown(data['test_dir'])}"]
    train_path = data.get("train_path")
    if train_path and Path(train_path).is_file():
        column = data.get("text_column", "text")
        return [f"input={shown(train_path)}", *([f"text_column={column}"] * (column != "text"))]
    try:
        from kiln.inference.examples import write_example_input

        path = write_example_input(best, run_dir)
    except Exception:  # a convenience: it must never be why a finished run reports failure
        log.warning("could not write an example input into %s", run_dir, exc_info=True)
        return None
    return [f"input={shown(Path(link or run_dir) / path.name)}"]


def data_lines(run_dir: Path) -> list[str]:
    """What the data report sums up (records read, kept, dropped per reason), one line a file."""
    path = run_dir / DATA_REPORT
    try:
        summary = json.loads(path.read_text()).get("summary", [])
    except (OSError, ValueError):
        return []
    return [f"data: {line}" for line in summary]


def failed(run_dir: Path) -> str:
    triage = f"kiln triage {shown(run_dir)}"
    return f"next: {triage}   # the likely causes, ranked, each with the override to try"


def preempted(run_dir: Path, command: RunCommand, interrupted: bool = False) -> str:
    how = "interrupted (Ctrl-C)" if interrupted else "preempted"
    return (
        f"run {how}; its state is in {run_dir}/checkpoints/last.pt\n"
        f"next: {command.train('resume=auto')}   # continue it from that state, in {run_dir}"
    )


def stopped_at_once(run_dir: Path, command: RunCommand) -> str:
    """A second Ctrl-C (or one before the first step): no checkpoint at this point."""
    newest = newest_checkpoint(run_dir)
    kept = f"the newest checkpoint is {newest}" if newest else "no checkpoint was written yet"
    next_command = command.train("resume=auto") if newest else "the same command"
    return f"run interrupted (Ctrl-C), stopped at once; {kept}\nnext: {next_command}"


def newest_checkpoint(run_dir: Path) -> str | None:
    from kiln.checkpoint import candidates

    found = candidates(Path(run_dir) / "checkpoints")
    return str(found[0]) if found else None
