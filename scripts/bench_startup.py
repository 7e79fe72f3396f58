"""kiln's start-up against a plain PyTorch script and Lightning on the same work, and infer.py
against the server on the same rows (issue 45), in one interleaved run: every round runs each
side of each work in its own process, the sides' order rotating with the rounds, so a
neighbour's load hits them alike; every ratio is taken within a round.

The training sides are scripts/bench_peers.py's (its workers: kiln's `train.py` main as a user
runs it, Lightning as its docs write it, the textbook loop; the same data, initial weights,
optimizer, schedule, batches and one intra-op thread). Per work and side:

    first step s   from the process's launch to the end of its first optimizer step (the
                   interpreter, the imports, the config, the data, the model, the checks)
    checks s       the checks before step 1: kiln's probes (Trainer.probe_time_s) and its FLOP
                   count; Lightning's sanity check (2 validation batches); the plain loop: none
    run s          the whole process, launch to exit

and kiln's own start-up line (summary.json's startup_s, by phase). The works: the default run
(`python train.py`: the digits MLP, 10 epochs), resnet18 on digits (20 steps), Faster R-CNN
(model=torchvision_detection data=shapes_detection, 10 steps) and model=hf with a BERT-base-sized
config built from scratch (12 layers, 768 wide, 12 heads; 20 steps of 16 texts of the demo
corpus). The floors, on kiln's medians over the rounds:

    - the pre-step phase (the probes and the FLOP count) at most 2% of the first epoch (its
      steps at kiln's measured step time) and at most 15 s;
    - kiln's first step at most 1.5x Lightning's (the median of the per-round ratios).

infer.py: `python infer.py ckpt=... input=<CSV of --rows texts>` from a text model the bench
trains first (--infer-model, on the demo corpus), against `python infer.py mode=serve` answering
the same rows once ready (requests of server.max_batch_size rows, --concurrency at once).
Per round: infer.py's first model call and its end (from its launch), the model's load
(Predictor.from_checkpoint), `import torch` alone (a process of its own), the server's time to
be ready and to answer. Floors: infer.py starts predicting within 2x (import torch + the model
load), and predicts the rows within 1.5x the server's time (this bench's reading of "at the
batched rate").

Floors are reported, met or not; --check exits 1 when one is missed.

    python scripts/bench_startup.py                       # every work, 3 rounds, with Lightning
    python scripts/bench_startup.py --works default,infer --rounds 2 --out s.json --markdown s.md
    python scripts/bench_startup.py --tiny --peers kiln,plain   # seconds: what the test runs
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
import bench_peers  # noqa: E402
from bench_peers import Work  # noqa: E402
from provenance import stamp, write_report  # noqa: E402

CHECKS_SHARE_FLOOR = 0.02  # the pre-step phase, of the first epoch's estimated time
CHECKS_SECONDS_FLOOR = 15.0
FIRST_STEP_RATIO_FLOOR = 1.5  # kiln's first step over Lightning's
INFER_START_FLOOR = 2.0  # infer.py's first model call over (import torch + the model load)
INFER_RATE_FLOOR = 1.5  # infer.py's prediction time over the server's for the same rows
TRAINING_WORKS = ("default", "resnet18", "fasterrcnn", "hf")
BERT_BASE = (
    "+model.config.hidden_size=768",
    "+model.config.num_hidden_layers=12",
    "+model.config.num_attention_heads=12",
    "+model.config.intermediate_size=3072",
)


def works(tiny: bool) -> dict[str, Work]:
    """The training works: bench_peers' Work (a kiln command line, its steps, warm-up steps)."""
    if tiny:  # the test suite's setting: seconds
        return {"default": Work("digits MLP, 30 steps", ("data=digits", "model=mlp"), 30, 3)}
    return {
        "default": Work(
            "the default run: digits MLP, 10 epochs", ("data=digits", "model=mlp"), 230, 10
        ),
        "resnet18": Work("resnet18 on digits, 20 steps", ("data=digits", "model=resnet18"), 20, 3),
        "fasterrcnn": Work(
            "Faster R-CNN (mobilenet v3, 320) on shapes_detection, 10 steps",
            ("data=shapes_detection", "model=torchvision_detection"),
            10,
            2,
        ),
        "hf": Work(
            "model=hf, BERT-base-sized from scratch, 20 steps of 16 texts, lr 1e-4",
            (
                "data=csv_text",
                "model=hf",
                "model.arch=bert",
                *BERT_BASE,
                "data.batch_size=16",
                "data.bucket_by_length=false",  # the peers' sampler's order
                "optimizer.lr=0.0001",  # the default 3e-3 diverges: the learn probe says so
            ),
            20,
            3,
        ),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument(
        "--works",
        default=",".join([*TRAINING_WORKS, "infer"]),
        help=f"comma-separated: {', '.join(TRAINING_WORKS)}, infer",
    )
    parser.add_argument("--peers", default="kiln,lightning,plain", help="sides, kiln first")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads, every side")
    parser.add_argument("--rows", type=int, default=1000, help="infer: rows predicted")
    parser.add_argument("--infer-model", default="text_bow", help="infer: the model trained")
    parser.add_argument("--concurrency", type=int, default=4, help="infer: requests in flight")
    parser.add_argument("--tiny", action="store_true", help="seconds: the default run shortened")
    parser.add_argument("--check", action="store_true", help="exit 1 when a floor is missed")
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON")
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="also write the tables as docs/benchmarks.md holds them (date, commit, machine)",
    )
    parser.add_argument("--infer-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.infer_worker:
        return args
    if os.environ.get("KILN_SMOKE") == "1":  # the README's own test: a run that proves it works
        args.tiny, args.rounds, args.rows = True, 1, 100
    args.sides = [s.strip() for s in args.peers.split(",") if s.strip()]
    if not args.sides or args.sides[0] != "kiln" or set(args.sides) - set(bench_peers.SIDES):
        parser.error(f"--peers: kiln first, then any of lightning, plain (got {args.peers!r})")
    args.work_names = [w.strip() for w in args.works.split(",") if w.strip()]
    known = works(args.tiny)
    bad = [w for w in args.work_names if w not in (*TRAINING_WORKS, "infer")]
    if bad or not args.work_names:
        parser.error(f"--works: any of {', '.join(TRAINING_WORKS)}, infer (got {args.works!r})")
    args.work_names = [w for w in args.work_names if w in known or w == "infer"]
    for name in ("rounds", "threads", "rows", "concurrency"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


# --------------------------------------------------------------------------- training works


def training_round(name: str, work: Work, config: dict, args, order: list[str], tmp: Path):
    """Each side of one work, once, in `order`: bench_peers' run_side (its own process)."""
    results = {}
    for side in order:
        result = bench_peers.run_side(side, args.pythons[side], work, config, args, tmp)
        result["checks_s"] = checks_seconds(side, result)
        print(
            f"  {name} {side}: first step {result['launch_to_first_step_s']:.2f} s from launch, "
            f"checks {result['checks_s']:.2f} s, run {result['wall_s']:.2f} s",
            flush=True,
        )
        results[side] = result
    return results


def checks_seconds(side: str, result: dict) -> float:
    """The checks a side runs before its first step: kiln's probes and FLOP count, Lightning's
    sanity validation, none for the plain loop."""
    if side == "kiln":
        return result.get("probes_s", 0.0) + result.get("flops_s", 0.0)
    return result.get("sanity_s", 0.0)


def step_time_s(result: dict, warmup: int) -> float:
    """The median time between consecutive step ends within an epoch, after the warm-up."""
    ends, epochs = result["ends"], result["epochs"]
    gaps = [
        ends[i] - ends[i - 1]
        for i in range(max(1, warmup), len(ends))
        if epochs[i] == epochs[i - 1]
    ]
    return statistics.median(gaps) if gaps else float("nan")


def spread(values: list[float]) -> dict:
    return bench_peers.spread([float(v) for v in values])


def summarize_work(rounds: list[dict], sides: list[str], work: Work) -> dict:
    """Per side: the medians over the rounds; kiln's start-up by phase, its first epoch's
    estimated time, and kiln over each peer within each round."""
    row: dict = {}
    for side in sides:
        per = [r[side] for r in rounds]
        row[side] = {
            "first_step_s": spread([p["launch_to_first_step_s"] for p in per]),
            "checks_s": spread([p["checks_s"] for p in per]),
            "run_s": spread([p["wall_s"] for p in per]),
        }
    kiln = [r["kiln"] for r in rounds]
    epochs = [k["batches_per_epoch"] * step_time_s(k, work.warmup) for k in kiln]
    row["kiln"]["first_epoch_s"] = spread(epochs)
    row["kiln"]["checks_share"] = spread(
        [k["checks_s"] / e for k, e in zip(kiln, epochs, strict=True)]
    )
    phases = [k["startup_s"] for k in kiln if k.get("startup_s")]
    if phases:
        row["kiln"]["startup_s"] = {p: statistics.median(s[p] for s in phases) for p in phases[0]}
    for peer in sides[1:]:
        row[f"kiln/{peer}"] = {
            "first_step": spread(
                [
                    r["kiln"]["launch_to_first_step_s"] / r[peer]["launch_to_first_step_s"]
                    for r in rounds
                ]
            ),
            "run": spread([r["kiln"]["wall_s"] / r[peer]["wall_s"] for r in rounds]),
        }
    return row


def training_floors(name: str, row: dict) -> list[dict]:
    kiln = row["kiln"]
    checks, epoch = kiln["checks_s"]["median"], kiln["first_epoch_s"]["median"]
    floors = [
        floor(
            f"pre-step phase <= {CHECKS_SHARE_FLOOR:.0%} of the first epoch",
            name,
            f"{checks:.2f} s = {100 * checks / epoch:.1f}% of {epoch:.2f} s",
            checks <= CHECKS_SHARE_FLOOR * epoch,
        ),
        floor(
            f"pre-step phase <= {CHECKS_SECONDS_FLOOR:.0f} s",
            name,
            f"{checks:.2f} s",
            checks <= CHECKS_SECONDS_FLOOR,
        ),
    ]
    if "kiln/lightning" in row:
        ratio = row["kiln/lightning"]["first_step"]
        floors.append(
            floor(
                f"kiln's first step <= {FIRST_STEP_RATIO_FLOOR}x Lightning's",
                name,
                _ratio(ratio),
                ratio["median"] <= FIRST_STEP_RATIO_FLOOR,
            )
        )
    return floors


def floor(what: str, work: str, measured: str, met: bool) -> dict:
    return {"floor": what, "work": work, "measured": measured, "met": bool(met)}


# --------------------------------------------------------------------------- infer vs serve


def infer_setup(args, tmp: Path) -> dict:
    """A text model trained on the demo corpus (train.py, as a user trains it) and a CSV of
    --rows of its texts, cycled."""
    from kiln.data.text_corpus import demo_corpus

    run_dir = tmp / "infer-model"
    command = [
        sys.executable,
        str(REPO / "train.py"),
        "data=csv_text",
        f"model={args.infer_model}",
        "trainer.max_epochs=2",
        f"data.cache_dir={tmp / 'cache'}",
        "logger=none",
        "env.progress_bar=false",
        f"hydra.run.dir={run_dir}",
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=quiet_env())
    if done.returncode != 0:
        raise RuntimeError(f"training the infer model failed:\n{done.stdout}{done.stderr}")
    texts, _ = demo_corpus()
    rows = tmp / "rows.csv"
    with open(rows, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text"])
        writer.writerows([texts[i % len(texts)]] for i in range(args.rows))
    return {"ckpt": str(run_dir / "checkpoints" / "best.pt"), "rows": str(rows)}


def quiet_env() -> dict:
    return {**os.environ, "PYTHONWARNINGS": "ignore", "KILN_OVERRIDES": ""}


def infer_side(setup: dict, tmp: Path) -> dict:
    """`python infer.py ckpt=... input=rows.csv`, through a worker that times its model load
    and its model calls (on the wall clock, which this process shares)."""
    job = Path(tempfile.mkdtemp(prefix="infer-", dir=tmp))
    (job / "job.json").write_text(json.dumps({**setup, "out": str(job / "preds.csv")}))
    launched = time.time()
    done = subprocess.run(
        [sys.executable, __file__, "--infer-worker", str(job / "job.json")],
        capture_output=True,
        text=True,
        env=quiet_env(),
        cwd=job,
    )
    wall = time.time() - launched
    if done.returncode != 0:
        raise RuntimeError(f"infer.py failed:\n{done.stdout}{done.stderr}")
    times = json.loads((job / "times.json").read_text())
    calls = times["calls"]
    return {
        "wall_s": wall,
        "first_call_s": calls[0][0] - launched,  # launch to the first model call
        "predict_s": calls[-1][1] - calls[0][0],
        "load_s": times["load"][1] - times["load"][0],
        "model_calls": len(calls),
        "labels": read_labels(job / "preds.csv"),
    }


def infer_worker(job_file: Path) -> None:
    """infer.py's main with Predictor.from_checkpoint and Predictor.run timed."""
    job = json.loads(job_file.read_text())
    times: dict = {"calls": []}
    from kiln.inference.predictor import Predictor

    load, run = Predictor.from_checkpoint.__func__, Predictor.run

    def timed_load(cls, *a, **k):
        started = time.time()
        predictor = load(cls, *a, **k)
        times["load"] = (started, time.time())
        return predictor

    def timed_run(self, items):
        started = time.time()
        outputs = run(self, items)
        times["calls"].append((started, time.time()))
        return outputs

    Predictor.from_checkpoint, Predictor.run = classmethod(timed_load), timed_run
    from kiln.cli.infer import main

    main([f"ckpt={job['ckpt']}", f"input={job['rows']}", f"output={job['out']}"])
    Path(job_file.parent / "times.json").write_text(json.dumps(times))


def read_labels(path: Path) -> list[str]:
    with open(path, newline="", encoding="utf-8") as f:
        return [row["label"] for row in csv.DictReader(f)]


def import_torch_s() -> float:
    """A process that imports torch and exits, launch to exit."""
    started = time.time()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, env=quiet_env())
    return time.time() - started


def server_side(setup: dict, concurrency: int) -> dict:
    """`python infer.py mode=serve` (scripts/loadtest.py's Server); once ready, the same rows in
    requests of server.max_batch_size, `concurrency` at once; the time to the last answer."""
    import httpx
    from loadtest import Server

    with open(setup["rows"], newline="", encoding="utf-8") as f:
        texts = [row["text"] for row in csv.DictReader(f)]
    size = 32  # server.max_batch_size's default: one model call a request
    chunks = [texts[i : i + size] for i in range(0, len(texts), size)]
    launched = time.time()
    server = Server(Path(setup["ckpt"]), [])
    ready = time.time() - launched
    try:
        with httpx.Client(timeout=300) as client:

            def ask(chunk: list[str]) -> list[str]:
                answer = client.post(f"{server.url}/v1/predict", json={"inputs": chunk})
                answer.raise_for_status()
                return [p["label"] for p in answer.json()["predictions"]]

            started = time.time()
            with ThreadPoolExecutor(concurrency) as pool:
                labels = [label for answer in pool.map(ask, chunks) for label in answer]
            answered = time.time() - started
    finally:
        server.stop()
    return {"ready_s": ready, "answer_s": answered, "labels": labels}


def infer_round(setup: dict, args, r: int, tmp: Path) -> dict:
    result = {"import_torch_s": import_torch_s()}
    for side in ("infer", "server") if r % 2 == 0 else ("server", "infer"):
        result[side] = (
            infer_side(setup, tmp) if side == "infer" else server_side(setup, args.concurrency)
        )
    infer, server = result["infer"], result["server"]
    pairs = zip(infer.pop("labels"), server.pop("labels"), strict=True)
    result["same_labels"] = sum(a == b for a, b in pairs)  # the same model: every row
    print(
        f"  infer: first model call {infer['first_call_s']:.2f} s from launch (import torch "
        f"{result['import_torch_s']:.2f} s, model load {infer['load_s']:.2f} s), predict "
        f"{infer['predict_s']:.2f} s, wall {infer['wall_s']:.2f} s; server ready "
        f"{server['ready_s']:.2f} s, answered in {server['answer_s']:.2f} s",
        flush=True,
    )
    return result


def summarize_infer(rounds: list[dict]) -> dict:
    keys = {
        "import_torch_s": lambda r: r["import_torch_s"],
        "load_s": lambda r: r["infer"]["load_s"],
        "first_call_s": lambda r: r["infer"]["first_call_s"],
        "predict_s": lambda r: r["infer"]["predict_s"],
        "wall_s": lambda r: r["infer"]["wall_s"],
        "server_ready_s": lambda r: r["server"]["ready_s"],
        "server_answer_s": lambda r: r["server"]["answer_s"],
        "start_ratio": lambda r: (
            r["infer"]["first_call_s"] / (r["import_torch_s"] + r["infer"]["load_s"])
        ),
        "rate_ratio": lambda r: r["infer"]["predict_s"] / r["server"]["answer_s"],
    }
    return {key: spread([get(r) for r in rounds]) for key, get in keys.items()}


def infer_floors(row: dict) -> list[dict]:
    start, rate = row["start_ratio"]["median"], row["rate_ratio"]["median"]
    return [
        floor(
            f"infer.py's first model call <= {INFER_START_FLOOR:.0f}x (import torch + model load)",
            "infer",
            f"{row['first_call_s']['median']:.2f} s = {start:.2f}x "
            f"({row['import_torch_s']['median']:.2f} + {row['load_s']['median']:.2f} s)",
            start <= INFER_START_FLOOR,
        ),
        floor(
            f"infer.py's prediction <= {INFER_RATE_FLOOR}x the server's answer",
            "infer",
            f"{row['predict_s']['median']:.2f} s vs {row['server_answer_s']['median']:.2f} s "
            f"= {rate:.2f}x",
            rate <= INFER_RATE_FLOOR,
        ),
    ]


# --------------------------------------------------------------------------- the report


def markdown(report: dict, chosen: dict[str, Work], args) -> str:
    sides = report["sides"]
    lines = []
    if report["training"]:
        lines += [
            "| work | side | first step s (from launch) | checks before step 1, s | "
            "whole run s | kiln / side, first step |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for name, row in report["training"].items():
            for side in sides:
                cell = row[side]
                ratio = row.get(f"kiln/{side}", {}).get("first_step")
                lines.append(
                    f"| {chosen[name].label if side == sides[0] else ''} | {side} | "
                    f"{_range(cell['first_step_s'])} | {cell['checks_s']['median']:.2f} | "
                    f"{_range(cell['run_s'])} | "
                    f"{_ratio(ratio) if ratio else ''} |"
                )
        lines.append("")
        for name, row in report["training"].items():
            phases = row["kiln"].get("startup_s")
            if phases:
                shown = ", ".join(f"{p} {s:.2f}" for p, s in phases.items() if p != "total")
                lines.append(f"- kiln's start-up, {name}: {phases['total']:.2f} s ({shown})")
    if report["infer"]:
        row = report["infer"]["table"]
        lines += [
            "",
            f"infer.py on {args.rows} texts ({args.infer_model}, trained on the demo corpus) "
            f"against the server answering the same rows ({args.concurrency} requests of 32 "
            "in flight):",
            "",
            "| import torch s | model load s | infer.py first model call s | infer.py predict s "
            "| infer.py wall s | server ready s | server answer s |",
            "|---:|---:|---:|---:|---:|---:|---:|",
            "| "
            + " | ".join(
                _range(row[k])
                for k in (
                    "import_torch_s",
                    "load_s",
                    "first_call_s",
                    "predict_s",
                    "wall_s",
                    "server_ready_s",
                    "server_answer_s",
                )
            )
            + " |",
        ]
    lines += ["", "| floor | work | measured | met |", "|---|---|---|---|"]
    for f in report["floors"]:
        lines.append(
            f"| {f['floor']} | {f['work']} | {f['measured']} | {'yes' if f['met'] else 'NO'} |"
        )
    lines += ["", f"- {report['note']}"]
    return "\n".join(lines) + "\n"


def _range(cell: dict) -> str:
    if cell["min"] == cell["max"]:
        return f"{cell['median']:.2f}"
    return f"{cell['median']:.2f} ({cell['min']:.2f}-{cell['max']:.2f})"


def _ratio(cell: dict) -> str:
    if cell["min"] == cell["max"]:
        return f"{cell['median']:.2f}x"
    return f"{cell['median']:.2f}x ({cell['min']:.2f}-{cell['max']:.2f})"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.infer_worker:
        infer_worker(args.infer_worker)
        return 0
    chosen = {n: w for n, w in works(args.tiny).items() if n in args.work_names}
    sides = list(args.sides)
    # what bench_peers.run_side reads from its arguments
    args.peer_optimizer, args.contention = "torch", 0
    args.pythons = {side: bench_peers.side_python(side) for side in sides}
    configs = {name: bench_peers.compose_config(work) for name, work in chosen.items()}
    load_before = os.getloadavg()
    training_rounds: dict[str, list[dict]] = {name: [] for name in chosen}
    infer_rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kiln-startup-") as tmp_name:
        tmp = Path(tmp_name)
        setup = infer_setup(args, tmp) if "infer" in args.work_names else None
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", flush=True)
            order = sides[r % len(sides) :] + sides[: r % len(sides)]  # who goes first rotates
            for name, work in chosen.items():
                rounds = training_rounds[name]
                rounds.append(training_round(name, work, configs[name], args, order, tmp))
            if setup is not None:
                infer_rounds.append(infer_round(setup, args, r, tmp))
    load_after = os.getloadavg()
    training = {
        name: summarize_work(training_rounds[name], sides, work) for name, work in chosen.items()
    }
    floors = [f for name, row in training.items() for f in training_floors(name, row)]
    infer = None
    if infer_rounds:
        infer = {"rounds": infer_rounds, "table": summarize_infer(infer_rounds)}
        floors += infer_floors(infer["table"])
    missing = [s for s in bench_peers.SIDES if s not in sides]
    note = (
        f"{args.rounds} interleaved rounds, medians (min-max); fp32, CPU, {args.threads} "
        f"intra-op thread(s) a side; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after, on {os.cpu_count()} CPUs"
        + (f"; not run: {', '.join(missing)} (--peers)" if missing else "")
    )
    report = {
        "sides": sides,
        "works": {name: vars(work) for name, work in chosen.items()},
        "training": training,
        "training_rounds": training_rounds,
        "infer": infer,
        "floors": floors,
        "note": note,
        "load_average": {"before": load_before, "after": load_after},
        "not_run": missing,
    }
    text = stamp(load_after) + "\n\n" + markdown(report, chosen, args)
    write_report(report, text, args.out)  # report["markdown"]: docs/benchmarks.md's figures
    print(text, end="")
    if args.markdown is not None:
        args.markdown.write_text(text)
    missed = [f for f in floors if not f["met"]]
    for f in missed:
        print(f"floor missed: {f['floor']} ({f['work']}): {f['measured']}", flush=True)
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
