"""The failure matrix: every registered model on every dataset whose inputs it accepts, x {one
process, DDP with 2 ranks under torchrun} x {amp off, amp on}, a few steps each with every loss
branch forced on, through the real train.py, as many cells at a time as the cores allow.

    python scripts/matrix.py                       # the whole matrix -> outputs/matrix/<stamp>/
    python scripts/matrix.py --reduced             # each model once, plus one DDP and one amp cell
    python scripts/matrix.py --plugins my_parts hydra.searchpath=[file://$PWD/conf]  # yours too
    python scripts/matrix.py --models resnet18 --data digits --single   # one cell

One line per cell, [OK] or the run's own [FAIL] line (same grammar), then matrix.md (a table)
and failures.log in the output folder; the exit code is 1 when any cell failed."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = ("trainer.max_steps=3", "trainer.max_epochs=1", "trainer.limit_val_batches=2")
QUIET = ("logger=none", "env.progress_bar=false")
# Batches of 4; an amp cell's of 2: on a CPU without bf16 instructions oneDNN emulates bf16, a
# convolution 65 times an fp32 one, and torchvision's detector's box head costs what its batch
# does, whatever the image size.
BATCH = {False: "data.batch_size=4", True: "data.batch_size=2"}
# Small inputs: a cell proves a mode (one process or DDP, amp or not) runs a model on a data
# kind, not what its default size costs. On a CPU, amp is bf16 autocast, many times slower than
# fp32 where the CPU has no bf16 instructions: at coco's default 512 px one amp cell of
# torchvision_detection took 336 s, the whole matrix more than 25 min on 2 cores.
SMALL_INPUTS = {
    "coco": ("data.image_size=96",),
    "yolo": ("data.image_size=96",),
    "shapes_detection": ("data.image_size=96", "data.min_image_size=64"),
}
# Datasets that read the user's files get the ones the repo ships.
DETECTION = REPO / "examples/detection"
DATA_FILES = {
    "image_folder": (f"data.train_dir={REPO / 'examples/photos/train'}", "data.image_size=32"),
    "coco": (
        f"data.train_json={DETECTION / 'coco/train.json'}",
        f"data.train_images={DETECTION / 'coco/images/train'}",
    ),
    "yolo": (f"data.train_dir={DETECTION / 'yolo/images/train'}",),
}


@dataclass(frozen=True)
class Cell:
    model: str
    data: str
    ddp: bool
    amp: bool

    @property
    def name(self) -> str:
        mode = "DDP" if self.ddp else "single"
        return f"{self.data}-{self.model} | {mode} | amp={self.amp}"

    @property
    def folder(self) -> str:
        return f"{self.model}-on-{self.data}-{'ddp' if self.ddp else 'single'}-amp{int(self.amp)}"


@dataclass
class Outcome:
    cell: Cell
    ok: bool
    seconds: float
    line: str  # [OK] ... or the run's [FAIL] line
    detail: str


def cells(
    plugins: list[str],
    reduced: bool,
    models: list[str],
    single: bool = False,
    datasets: list[str] = (),
) -> list[Cell]:
    from kiln.registry import compatible_pairs, load_plugins

    load_plugins(plugins)
    pairs = [
        (m, d)
        for m, d in compatible_pairs()
        if (not models or m in models) and (not datasets or d in datasets)
    ]
    if single:  # one process, fp32: what a model's own cell says, without DDP's or amp's cost
        return [Cell(m, d, False, False) for m, d in pairs]
    if reduced:  # each model once, on data the repo generates rather than files it reads
        first = {}
        for model, data in sorted(pairs, key=lambda pair: pair[1] in DATA_FILES):
            first.setdefault(model, data)
        chosen = [Cell(m, d, False, False) for m, d in first.items()]
        model, data = next(iter(first.items()))  # one DDP cell and one amp cell
        return [*chosen, Cell(model, data, True, False), Cell(model, data, False, True)]
    return [
        Cell(m, d, ddp, amp) for m, d in pairs for ddp in (False, True) for amp in (False, True)
    ]


def command(
    cell: Cell, out: Path, plugins: list[str], extra: list[str], python: str = sys.executable
) -> list[str]:
    launcher = [python]
    if cell.ddp:  # the ranks start as `python` does too, not as torchrun's sys.executable -u
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        launcher += ["--no-python", python]  # unbuffered all the same: run() sets the variable
    args = [
        f"model={cell.model}",
        f"data={cell.data}",
        f"precision={'amp' if cell.amp else 'fp32'}",
        *DATA_FILES.get(cell.data, ()),
        *SMALL_INPUTS.get(cell.data, ()),
        "loss.force_all_branches=true",
        *STEPS,
        *QUIET,
        BATCH[cell.amp],
        f"hydra.run.dir={out / cell.folder}",
        f"output_root={out}",
    ]
    if cell.ddp:
        args.append("trainer=ddp")
    if plugins:
        args.append(f"plugins=[{','.join(plugins)}]")
    return [*launcher, str(REPO / "train.py"), *args, *extra]


def run(
    cell: Cell, out: Path, plugins: list[str], extra: list[str], timeout: int, python: str
) -> Outcome:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command(cell, out, plugins, extra, python),
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=Path.cwd(),
        )
        code, stderr = done.returncode, done.stderr
    except subprocess.TimeoutExpired:
        code, stderr = -1, f"[FAIL] {cell.name} | timeout after {timeout} s @ step ?"
    seconds = time.perf_counter() - started
    if code == 0:
        return Outcome(cell, True, seconds, f"[OK] {cell.name} | {seconds:.1f} s", "")
    lines = stderr.strip().splitlines()
    fail = [i for i, line in enumerate(lines) if line.startswith("[FAIL]")]
    if fail:
        i = fail[0]
        detail = lines[i + 1].strip() if i + 1 < len(lines) else ""
        return Outcome(cell, False, seconds, lines[i], detail)
    last = lines[-1] if lines else f"exit code {code}"
    return Outcome(cell, False, seconds, f"[FAIL] {cell.name} | exit {code} @ step ?", last)


def write_report(outcomes: list[Outcome], out: Path, wall_s: float) -> Path:
    rows = ["| model | data | mode | amp | result | s | detail |", "|---|---|---|---|---|---|---|"]
    for o in outcomes:
        c = o.cell
        result = "ok" if o.ok else o.line.split(" | ", 4)[-1]
        detail = o.detail.replace("|", "\\|")
        mode = "DDP" if c.ddp else "single"
        rows.append(
            f"| {c.model} | {c.data} | {mode} | {c.amp} | {result} | {o.seconds:.1f} | {detail} |"
        )
    failed = sum(not o.ok for o in outcomes)
    header = f"# Failure matrix\n\n{len(outcomes)} cells, {failed} failed, {wall_s:.0f} s wall.\n\n"
    path = out / "matrix.md"
    path.write_text(header + "\n".join(rows) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reduced", action="store_true", help="each model once + 1 DDP + 1 amp")
    parser.add_argument("--plugins", nargs="*", default=[], help="your modules that register")
    parser.add_argument("--models", nargs="*", default=[], help="only these models")
    parser.add_argument("--data", nargs="*", default=[], help="only these datasets")
    parser.add_argument("--single", action="store_true", help="single-process fp32 cells only")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="cells at a time")
    parser.add_argument("--out", type=Path, default=None, help="default: outputs/matrix/<stamp>")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="the interpreter each cell starts train.py (or torchrun) with; default: this one",
    )
    parser.add_argument("overrides", nargs="*", help="extra overrides for every cell")
    args = parser.parse_args(argv)
    if os.environ.get("KILN_SMOKE") == "1":  # the README's own test: the reduced matrix
        args.reduced = True
    out = args.out or Path("outputs/matrix") / datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    todo = cells(args.plugins, args.reduced, args.models, args.single, args.data)
    print(f"{len(todo)} cells, {args.jobs} at a time -> {out}", flush=True)
    started = time.perf_counter()
    outcomes = []
    # A DDP cell runs two processes, so DDP cells run half as many at a time.
    for ddp, jobs in ((False, args.jobs), (True, args.jobs // 2)):
        batch = [c for c in todo if c.ddp == ddp]
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for outcome in pool.map(
                lambda c: run(c, out, args.plugins, args.overrides, args.timeout, args.python),
                batch,
            ):
                detail = f"\n  {outcome.detail}" if outcome.detail else ""
                print(outcome.line + detail, flush=True)
                outcomes.append(outcome)
    wall = time.perf_counter() - started
    report = write_report(outcomes, out, wall)
    failures = [o for o in outcomes if not o.ok]
    (out / "failures.log").write_text("".join(f"{o.line}\n  {o.detail}\n" for o in failures))
    print(f"{len(outcomes) - len(failures)}/{len(outcomes)} cells ok in {wall:.0f} s; {report}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
