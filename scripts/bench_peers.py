"""kiln against its peers on the same work: PyTorch Lightning and a plain hand-written loop, each in
its own process, in one interleaved run (the sides' order rotates every round, so a neighbour's
load hits them alike; every ratio is taken within a round).

The sides share everything but the loop: kiln's config (composed once, here) gives the data (kiln's
build_data: the same tensors), the model (kiln's build_model after the same seed: the same initial
weights), the optimizer's settings and the LR schedule (kiln's builders; the peers step torch's own
optimizer class, as their users write it, or kiln's with --peer-optimizer kiln: the same fused
kernel either way), the batch size, fp32 on the CPU, one intra-op thread each, and the same
shuffled order (DistributedSampler with kiln's seed, as kiln's own sampler draws it). kiln runs as
a user runs it (`train.py`'s main, its guards on, its files written); Lightning as its docs show (a
LightningModule, Trainer.fit, a CSV logger and a ModelCheckpoint of the best and last weights); the
plain loop as a textbook (zero_grad, forward, loss, backward, step, schedule; an evaluation and a
torch.save at each epoch end). Per side and round it measures:

    steps/s  samples/s over the training steps: the time between consecutive step ends inside an
             epoch, after the warm-up steps (the step, its data, its bookkeeping, its log lines)
    run/s    samples/s over the whole run: from building the config, data and model to the end
             of the last write (probes, evaluations, checkpoints, pictures included)
    wall s   the whole process, from its launch to its exit (interpreter, imports, tear-down)

and it checks that the sides computed the same losses: each step's training loss against
kiln's, bitwise or within --loss-rtol. Lightning lives in a bench-only venv (.bench/lightning,
made on first use by scripts/bench_venv.py); without it (--peers kiln,plain) the table says so.

    python scripts/bench_peers.py                          # resnet18 and the digits MLP, 5 rounds
    python scripts/bench_peers.py --works mlp --rounds 3 --out peers.json
    python scripts/bench_peers.py --peers kiln,plain --tiny   # seconds: what the test suite runs
    python scripts/bench_peers.py --contention 1   # each side quiet and beside 1 busy process

--contention N: in every round each side runs twice, quiet and beside N busy processes (the same
N for every side, started before it and stopped after it; which of the two goes first alternates
with the rounds), and the table gives each side's slowdown, loaded over quiet, per round. In this
mode no side's threads are pinned: each runs with its own defaults, as its users run it (kiln's
trainer.threads=auto; torch's own pool for Lightning and the plain loop). The floor: kiln's
slowdown at most the plain loop's. The losses are still compared, but the sides' thread counts
differ by design there, so a difference is reported, not failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from contention import busy_processes, their_defaults  # noqa: E402
from provenance import stamp  # noqa: E402

SIDES = ("kiln", "lightning", "plain")
LIGHTNING = ("pytorch-lightning==2.6.6",)  # its other requirements are in kiln's environment
LOSS_RTOL = 1e-6  # the loss check's tolerance, relative; the sides normally agree bitwise


@dataclass(frozen=True)
class Work:
    """One row group of the table: a kiln command line and its step count."""

    label: str
    overrides: tuple[str, ...]
    steps: int
    warmup: int  # steps left out of steps/s: allocations, first-touch, caches

    def kiln_overrides(self) -> list[str]:
        return [
            *self.overrides,
            f"trainer.max_steps={self.steps}",
            "trainer.max_epochs=10000",  # max_steps ends the run
            "precision=fp32",
            "device=cpu",
            "env.progress_bar=false",
        ]


def works(tiny: bool, resnet_steps: int, mlp_steps: int) -> dict[str, Work]:
    if tiny:  # the test suite's setting: seconds, not minutes
        return {
            "resnet18": Work(
                "resnet18 (8 px, small stem), batch 8",
                (
                    "data=synthetic_images",
                    "model=resnet18",
                    "model.small_input_stem=true",
                    "data.image_size=8",
                    "data.batch_size=8",
                    "data.num_train=32",
                    "data.num_val=16",
                ),
                4,
                1,
            ),
            "mlp": Work(
                "digits MLP, batch 64",
                ("data=digits", "model=mlp"),
                mlp_steps if mlp_steps != 300 else 30,
                3,
            ),
        }
    return {
        "resnet18": Work(
            "resnet18 (32 px, small stem), batch 64",
            (
                "data=synthetic_images",
                "model=resnet18",
                "model.small_input_stem=true",
                "data.image_size=32",
                "data.batch_size=64",
                f"data.num_train={64 * resnet_steps}",
                "data.num_val=256",
            ),
            resnet_steps,
            5,
        ),
        "mlp": Work("digits MLP, batch 64", ("data=digits", "model=mlp"), mlp_steps, 10),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--works", default="resnet18,mlp", help="comma-separated: resnet18,mlp")
    parser.add_argument("--peers", default="kiln,lightning,plain", help="sides, kiln first")
    parser.add_argument("--resnet-steps", type=int, default=40)
    parser.add_argument("--mlp-steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads, every side")
    parser.add_argument(
        "--contention",
        type=int,
        default=0,
        help="N busy processes beside each side's second run of a round; sides unpinned",
    )
    parser.add_argument(
        "--peer-optimizer",
        choices=("torch", "kiln"),
        default="torch",
        help="the peers' optimizer class: torch's own, as their users write it (default), or "
        "kiln's (the same arithmetic either way: only the loops differ then)",
    )
    parser.add_argument("--tiny", action="store_true", help="a few steps of tiny models")
    parser.add_argument("--loss-rtol", type=float, default=LOSS_RTOL)
    parser.add_argument("--out", type=Path, default=None, help="also write the result as JSON")
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="also write the table as docs/benchmarks.md holds it (date, commit, machine)",
    )
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--job", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if os.environ.get("KILN_SMOKE") == "1":  # the README's own test: a run that proves it works
        args.tiny, args.rounds = True, 1
    args.sides = [s.strip() for s in args.peers.split(",") if s.strip()]
    unknown = [s for s in args.sides if s not in SIDES]
    if unknown or not args.sides or args.sides[0] != "kiln":
        parser.error(f"--peers: kiln first, then any of lightning, plain (got {args.peers!r})")
    args.work_names = [w.strip() for w in args.works.split(",") if w.strip()]
    bad = [w for w in args.work_names if w not in ("resnet18", "mlp")]
    if bad or not args.work_names:
        parser.error(f"--works: resnet18 and/or mlp (got {args.works!r})")
    for name in ("rounds", "resnet_steps", "mlp_steps", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.contention < 0:
        parser.error("--contention must be >= 0")
    return args


# --------------------------------------------------------------------------- in each worker


@dataclass
class StepLog:
    """Each training step's end time, epoch, samples and loss (a tensor: read once, at exit)."""

    ends: list[float] = field(default_factory=list)
    cpu_ends: list[float] = field(default_factory=list)  # the process's CPU time (all threads)
    epochs: list[int] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    losses: list = field(default_factory=list)
    started: float = 0.0  # after the side's imports: its run begins
    extra: dict = field(default_factory=dict)

    def begin(self) -> None:
        self.started = time.perf_counter()

    def step(self, loss, epoch: int, samples: int) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())
        self.epochs.append(int(epoch))
        self.samples.append(int(samples))
        self.losses.append(loss.detach())


def worker(side: str, job_file: Path) -> None:
    job = json.loads(job_file.read_text())
    log = StepLog()
    if side == "kiln":
        run_kiln(job, log)
    else:
        run_peer(side, job, log)
    finished = time.perf_counter()
    started = log.started
    import torch

    result = {
        "run_s": finished - started,
        "to_first_step_s": log.ends[0] - started if log.ends else None,
        # on the wall clock, which the parent shares: its launch to this process's first step
        "first_step_unix": time.time() - (time.perf_counter() - log.ends[0]) if log.ends else None,
        "after_last_step_s": finished - log.ends[-1] if log.ends else None,
        "ends": [t - started for t in log.ends],
        "cpu_ends": log.cpu_ends,
        "epochs": log.epochs,
        "samples": log.samples,
        "losses": torch.stack(log.losses).tolist() if log.losses else [],
        "threads": torch.get_num_threads(),
        **log.extra,
    }
    Path(job["result"]).write_text(json.dumps(result))


def run_kiln(job: dict, log: StepLog) -> None:
    """train.py's main, as a user runs it; each step's end recorded as it returns."""
    from kiln.cli.train import main
    from kiln.engine.trainer import Trainer

    train_step = Trainer.train_step
    checks = log.extra  # kiln's start-up checks, as the trainer timed them

    def recorded(self, batches, window):
        checks["probes_s"], checks["flops_s"] = self.probe_time_s, self.flops_time_s
        checks["batches_per_epoch"] = self.batches_per_epoch
        result = train_step(self, batches, window)
        log.step(result.loss, self.state.epoch, result.samples)
        return result

    Trainer.train_step = recorded
    import kiln.engine.run  # noqa: F401 -- imports are the wall's, not the run's

    import_builders()
    log.begin()
    try:
        main([*job["kiln_overrides"], f"hydra.run.dir={job['run_dir']}"])
    finally:
        Trainer.train_step = train_step
    summary = json.loads((Path(job["run_dir"]) / "summary.json").read_text())
    checks["startup_s"] = summary.get("startup_s")  # its own start-up line, by phase


def import_builders() -> None:
    """What `built` uses, imported before the run's clock starts (imports are the wall's)."""
    import kiln.config
    import kiln.data
    import kiln.data.digits
    import kiln.data.synthetic
    import kiln.engine.finetune
    import kiln.engine.optim
    import kiln.models  # noqa: F401


def built(job: dict):
    """What kiln builds from the same config: data, model (same seed, same initial weights),
    optimizer and schedule, the shuffled order (its sampler's), the batch size."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from kiln.config import option_from_dict
    from kiln.data import build_data
    from kiln.engine.finetune import parameter_groups
    from kiln.engine.optim import build_optimizer, build_scheduler
    from kiln.models import build_model
    from kiln.preprocessing.pretrained import pretrained_input

    cfg = {
        group: option_from_dict(group, job["config"][group])
        for group in ("data", "model", "optimizer", "scheduler")
    }
    seed = job["config"]["seed"]
    torch.manual_seed(seed)  # as kiln's build_run: seed, data, model
    # a pretrained model's preprocessing, for the data that follows it (None for the rest)
    bundle = build_data(cfg["data"], pretrained=pretrained_input(cfg["model"]))
    model = build_model(bundle.spec, cfg["model"])
    opt_cfg = cfg["optimizer"]

    def optimizer_and_schedule(module):
        groups = parameter_groups(module, opt_cfg, cfg["model"].name)
        if job["peer_optimizer"] == "kiln":
            optimizer = build_optimizer(groups, opt_cfg)
        else:
            optimizer = torch_optimizer(groups, opt_cfg)
        return optimizer, build_scheduler(optimizer, cfg["scheduler"], job["steps"])

    batch = cfg["data"].batch_size
    sampler = DistributedSampler(bundle.train, num_replicas=1, rank=0, shuffle=True, seed=seed)
    train = DataLoader(
        bundle.train,
        batch_size=batch,
        sampler=sampler,
        collate_fn=bundle.collate_fn,
        generator=torch.Generator().manual_seed(seed),  # the global RNG stays the model's
    )
    val = DataLoader(
        bundle.val,
        batch_size=batch,
        collate_fn=bundle.collate_fn,
        generator=torch.Generator().manual_seed(seed),  # its iterators' seeds: not the model's
    )
    torch.manual_seed(seed)  # kiln re-seeds before training (dropout's stream)
    return model, optimizer_and_schedule, sampler, train, val


def torch_optimizer(groups: list, cfg):
    """torch's own class under kiln's optimizer, with the settings kiln's builder gave it (the
    same fused kernel: the same arithmetic)."""
    import inspect

    from kiln.engine.optim import build_optimizer

    ours = build_optimizer([dict(group) for group in groups], cfg)
    theirs = next(c for c in type(ours).__mro__[1:] if c.__module__.startswith("torch.optim."))
    accepted = inspect.signature(theirs).parameters
    return theirs(groups, **{k: v for k, v in ours.defaults.items() if k in accepted})


def batch_loss(model, batch):
    """The training loss as the peers' users write it: cross-entropy on the logits, or the sum
    of the loss terms of a model that computes its own (torchvision's detectors, whose
    batches are (images, targets))."""
    import torch.nn.functional as F

    from kiln.models import logits_of

    inputs, targets = batch
    if getattr(model, "computes_own_loss", False):
        return sum(model(inputs, targets).values())
    return F.cross_entropy(logits_of(model(inputs)), targets)


def run_peer(side: str, job: dict, log: StepLog) -> None:
    if side == "plain":
        run_plain(job, log)
    else:
        run_lightning(job, log)


def run_plain(job: dict, log: StepLog) -> None:
    """The textbook loop: an evaluation and a checkpoint at every epoch end and at the end."""
    import torch
    import torch.nn.functional as F

    from kiln.models import logits_of

    import_builders()
    if os.environ.get("BENCH_PLAIN_MALLOC") == "1":  # a diagnosis: the allocator's share
        from kiln.engine.host_memory import keep_freed_host_memory

        keep_freed_host_memory()
    log.begin()
    model, optimizer_and_schedule, sampler, train, val = built(job)
    optimizer, scheduler = optimizer_and_schedule(model)
    out = Path(job["run_dir"])
    out.mkdir(parents=True, exist_ok=True)

    def evaluate_and_save(step: int) -> None:
        model.eval()
        loss_sum, correct, count = 0.0, 0, 0
        with torch.no_grad():
            for x, y in val:
                if getattr(model, "computes_own_loss", False):  # a detector: its predictions
                    model(x)
                    continue
                logits = logits_of(model(x))
                loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
                correct += int((logits.argmax(-1) == y).sum())
                count += len(y)
        if count:
            print(f"step {step}: val_loss {loss_sum / count:.4f} val_acc {correct / count:.4f}")
        state = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "step": step,
        }
        torch.save(state, out / "last.pt")

    step, epoch = 0, 0
    while step < job["steps"]:
        sampler.set_epoch(epoch)
        model.train()
        for batch in train:
            optimizer.zero_grad(set_to_none=True)
            loss = batch_loss(model, batch)
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            log.step(loss, epoch, len(batch[1]))
            if step % 10 == 0:
                print(f"step {step}: loss {loss.item():.4f}")
            if step == job["steps"]:
                break
        epoch += 1
        evaluate_and_save(step)


def run_lightning(job: dict, log: StepLog) -> None:
    """A LightningModule and Trainer.fit, as Lightning's docs write them."""
    import pytorch_lightning as pl
    import torch.nn.functional as F
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.loggers import CSVLogger

    from kiln.models import logits_of

    import_builders()
    log.begin()
    model, optimizer_and_schedule, _, train, val = built(job)

    own_loss = getattr(model, "computes_own_loss", False)  # a detector: no accuracy

    class Classifier(pl.LightningModule):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            loss = batch_loss(self.net, batch)
            self.log("train_loss", loss, batch_size=len(batch[1]))
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            log.step(outputs["loss"], self.current_epoch, len(batch[1]))

        def validation_step(self, batch, batch_idx):
            x, y = batch
            if own_loss:
                self.net(x)  # its predictions
                return
            logits = logits_of(self.net(x))
            self.log("val_loss", F.cross_entropy(logits, y))
            self.log("val_acc", (logits.argmax(-1) == y).float().mean())

        def configure_optimizers(self):
            optimizer, scheduler = optimizer_and_schedule(self.net)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
            }

    class SanityClock(pl.Callback):
        """Lightning's own check before training: its sanity validation (2 batches), timed."""

        def on_sanity_check_start(self, trainer, pl_module):
            self.started = time.perf_counter()

        def on_sanity_check_end(self, trainer, pl_module):
            log.extra["sanity_s"] = time.perf_counter() - self.started

    out = Path(job["run_dir"])
    monitor = None if own_loss else "val_acc"
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=job["steps"],
        max_epochs=-1,
        precision="32-true",
        logger=CSVLogger(out, name="lightning"),
        callbacks=[
            ModelCheckpoint(out / "checkpoints", monitor=monitor, mode="max", save_last=True),
            SanityClock(),
        ],
        log_every_n_steps=10,
        enable_progress_bar=False,
        default_root_dir=out,
    )
    trainer.fit(Classifier(model), train, val)


# --------------------------------------------------------------------------- the parent


def side_python(side: str) -> Path:
    if side != "lightning":
        return Path(sys.executable)
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_venv import bench_python

    return bench_python("lightning", LIGHTNING)


def compose_config(work: Work) -> dict:
    from kiln.config import load_config, to_plain

    return to_plain(load_config(work.kiln_overrides()))


def run_side(
    side: str,
    python: Path,
    work: Work,
    config: dict,
    args: argparse.Namespace,
    tmp: Path,
    busy: int = 0,
) -> dict:
    """One run of one side, beside `busy` busy processes; in --contention mode unpinned."""
    run_dir = Path(tempfile.mkdtemp(prefix=f"{side}-", dir=tmp))
    threads = args.threads
    job = {
        "kiln_overrides": work.kiln_overrides(),
        "config": config,
        "steps": work.steps,
        "peer_optimizer": args.peer_optimizer,
        "run_dir": str(run_dir / "run"),
        "result": str(run_dir / "result.json"),
    }
    (run_dir / "job.json").write_text(json.dumps(job))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONWARNINGS": "ignore",
        "KILN_OVERRIDES": "",
        # Each run probes as a model's first run does: the probe cache would spare a repeated
        # one nearly all of it (trainer.probe_cache), and the rounds would measure the cache.
        "KILN_PROBE_CACHE": str(run_dir / "probe-cache"),
    }
    if args.contention:
        env = their_defaults(env)
    command = [str(python), __file__, "--worker", side, "--job", str(run_dir / "job.json")]
    with busy_processes(busy):
        started, launched = time.perf_counter(), time.time()
        proc = subprocess.run(command, cwd=run_dir, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"the {side} side failed ({work.label}):\n{proc.stdout}{proc.stderr}")
    result = json.loads((run_dir / "result.json").read_text())
    result["wall_s"] = wall
    if result.get("first_step_unix") is not None:  # the interpreter and imports included
        result["launch_to_first_step_s"] = result["first_step_unix"] - launched
    result.update(rates(result, work.warmup))
    return result


def rates(result: dict, warmup: int) -> dict:
    """samples/s over the training steps (consecutive ends within an epoch, after warm-up) and
    over the whole run."""
    ends, epochs, samples = result["ends"], result["epochs"], result["samples"]
    cpu = result["cpu_ends"]
    counted = [i for i in range(max(1, warmup), len(ends)) if epochs[i] == epochs[i - 1]]
    step_time = sum(ends[i] - ends[i - 1] for i in counted)
    cpu_time = sum(cpu[i] - cpu[i - 1] for i in counted)
    counted_samples = sum(samples[i] for i in counted)
    return {
        "steps_sps": counted_samples / step_time if step_time > 0 else math.nan,
        # Per CPU-second: what a neighbour's load takes from the wall clock is not in it.
        "steps_cpu_sps": counted_samples / cpu_time if cpu_time > 0 else math.nan,
        "run_sps": sum(samples) / result["run_s"],
        "num_steps": len(ends),
    }


def loss_check(reference: list[float], other: list[float], rtol: float) -> dict:
    if len(reference) != len(other):
        return {
            "steps": [len(reference), len(other)],
            "bitwise": False,
            "within": False,
            "max_abs_diff": math.inf,
        }
    diffs = [abs(a - b) for a, b in zip(reference, other, strict=True)]
    within = all(d <= rtol * max(abs(a), 1e-12) for d, a in zip(diffs, reference, strict=True))
    return {
        "steps": len(reference),
        "bitwise": reference == other,
        "within": within,
        "max_abs_diff": max(diffs, default=0.0),
    }


METRICS = (  # (key, label, higher is better)
    ("steps_sps", "samples/s, training steps", True),
    ("steps_cpu_sps", "samples per CPU-s, training steps", True),
    ("run_sps", "samples/s, whole run", True),
    ("wall_s", "wall s, whole process", False),
)


def spread(values: list[float]) -> dict:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def summarize(rounds: list[dict], sides: list[str], work_names: list[str]) -> dict:
    """Per work and metric: each side's median over the rounds, and kiln over each peer per
    round (samples/s: kiln/peer, >1 is kiln faster; wall: kiln/peer, <1 is kiln faster)."""
    table = {}
    for name in work_names:
        per = [r[name] for r in rounds]
        rows = {}
        for key, _, _ in METRICS:
            row = {side: spread([p[side][key] for p in per]) for side in sides}
            for peer in sides[1:]:
                row[f"kiln/{peer}"] = spread([p["kiln"][key] / p[peer][key] for p in per])
            rows[key] = row
        checks = {peer: [p["loss_check"][peer] for p in per] for peer in sides[1:]}
        startup = [
            (p["kiln"].get("probes_s", 0.0) + p["kiln"].get("flops_s", 0.0), p["kiln"]["run_s"])
            for p in per
        ]
        table[name] = {
            "metrics": rows,
            "loss_check": checks,
            "kiln_checks_s": spread([s for s, _ in startup]),
            "kiln_checks_share": spread([s / run for s, run in startup]),
        }
    return table


def markdown(table: dict, works_: dict[str, Work], sides: list[str], note: str) -> str:
    peers = sides[1:]
    head = ["work", "measure", *sides, *(f"kiln / {p}" for p in peers)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, entry in table.items():
        for key, label, _ in METRICS:
            row = entry["metrics"][key]
            cells = [works_[name].label if key == "steps_sps" else "", label]
            fmt = "{:.2f}" if key == "wall_s" else "{:.0f}"
            cells += [fmt.format(row[s]["median"]) for s in sides]
            cells += [
                f"{row[f'kiln/{p}']['median']:.3f} ({row[f'kiln/{p}']['min']:.3f}–"
                f"{row[f'kiln/{p}']['max']:.3f})"
                for p in peers
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for name, entry in table.items():
        for peer, checks in entry["loss_check"].items():
            bitwise = all(c["bitwise"] for c in checks)
            worst = max(c["max_abs_diff"] for c in checks)
            verdict = "bitwise equal" if bitwise else f"max |diff| {worst:.3g}"
            ok = all(c["within"] for c in checks)
            lines.append(
                f"- loss check, {name}, {peer} vs kiln: {verdict} over "
                f"{checks[0]['steps']} steps x {len(checks)} rounds "
                f"({'within' if ok else 'OUTSIDE'} the tolerance)"
            )
    for name, entry in table.items():
        checks, share = entry["kiln_checks_s"], entry["kiln_checks_share"]
        lines.append(
            f"- kiln's start-up checks, {name} (rule 1 and 3 probes, FLOP count): "
            f"{checks['median']:.2f} s, {100 * share['median']:.1f}% of kiln's run"
        )
    lines.append(
        "- the data: kiln's loaders read an in-memory TensorDataset a batch at a time (one "
        "index per tensor: kiln.data.loaders.GatheredTensors); Lightning and the plain loop "
        "read the same dataset with the textbook DataLoader (a select per sample, then a stack)"
    )
    lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def contention_summary(rounds: list[dict], sides: list[str], work_names: list[str]) -> dict:
    """Per work and side: quiet and loaded medians, and the slowdown (loaded / quiet) of each
    round, on the whole process's wall and on the training-step rate."""
    table = {}
    for name in work_names:
        per = [r[name] for r in rounds]
        table[name] = {
            side: {
                "quiet_wall_s": spread([p[side]["wall_s"] for p in per]),
                "loaded_wall_s": spread([p[f"{side}+busy"]["wall_s"] for p in per]),
                "slowdown_wall": spread(
                    [p[f"{side}+busy"]["wall_s"] / p[side]["wall_s"] for p in per]
                ),
                "slowdown_steps": spread(
                    [p[side]["steps_sps"] / p[f"{side}+busy"]["steps_sps"] for p in per]
                ),
                "threads": [p[side]["threads"] for p in per],
                "loaded_threads": [p[f"{side}+busy"]["threads"] for p in per],
            }
            for side in sides
        }
    return table


def contention_floors(table: dict) -> dict[str, tuple[str, bool]]:
    """kiln's slowdown (wall, median over rounds) at most the plain loop's, per work."""
    out = {}
    for name, row in table.items():
        if "plain" not in row:
            continue
        kiln, plain = row["kiln"]["slowdown_wall"], row["plain"]["slowdown_wall"]
        out[f"{name}: kiln's slowdown <= the plain loop's"] = (
            f"{kiln['median']:.2f}x vs {plain['median']:.2f}x",
            kiln["median"] <= plain["median"],
        )
    return out


def contention_markdown(table: dict, works_: dict[str, Work], sides: list[str], busy: int) -> str:
    lines = [
        f"| work | side | threads quiet / loaded | wall s quiet | wall s beside {busy} busy | "
        "slowdown, wall (min-max) | slowdown, step rate (min-max) |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    for name, row in table.items():
        for side in sides:
            cell = row[side]
            wall, steps = cell["slowdown_wall"], cell["slowdown_steps"]
            threads = (
                f"{'/'.join(map(str, sorted(set(cell['threads']))))} / "
                f"{'/'.join(map(str, sorted(set(cell['loaded_threads']))))}"
            )
            lines.append(
                f"| {works_[name].label if side == sides[0] else ''} | {side} | {threads} | "
                f"{cell['quiet_wall_s']['median']:.2f} | {cell['loaded_wall_s']['median']:.2f} | "
                f"{wall['median']:.2f}x ({wall['min']:.2f}-{wall['max']:.2f}) | "
                f"{steps['median']:.2f}x ({steps['min']:.2f}-{steps['max']:.2f}) |"
            )
    lines += ["", "| floor | measured | met |", "|---|---:|---|"]
    for floor, (measured, met) in contention_floors(table).items():
        lines.append(f"| {floor} | {measured} | {'yes' if met else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args.job)
        return 0
    all_works = works(args.tiny, args.resnet_steps, args.mlp_steps)
    chosen = {name: all_works[name] for name in args.work_names}
    sides = list(args.sides)
    pythons = {side: side_python(side) for side in sides}
    configs = {name: compose_config(work) for name, work in chosen.items()}
    load_before = os.getloadavg()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="kiln-peers-") as tmp:
        for r in range(args.rounds):
            order = sides[r % len(sides) :] + sides[: r % len(sides)]  # who goes first rotates
            this_round = {}
            for name, work in chosen.items():
                results = {}
                for side in order:
                    # Quiet and loaded in turn, which first alternating with the rounds.
                    loads = [0, args.contention] if args.contention else [0]
                    for busy in loads if r % 2 == 0 else loads[::-1]:
                        key = f"{side}+busy" if busy else side
                        results[key] = run_side(
                            side, pythons[side], work, configs[name], args, Path(tmp), busy
                        )
                        print(
                            f"round {r + 1}/{args.rounds} {name} {key}: "
                            f"{results[key]['steps_sps']:.0f} samples/s (steps), "
                            f"{results[key]['wall_s']:.2f} s wall, "
                            f"{results[key]['threads']} thread(s)",
                            flush=True,
                        )
                reference = results["kiln"]["losses"]
                results["loss_check"] = {
                    peer: loss_check(reference, results[peer]["losses"], args.loss_rtol)
                    for peer in sides[1:]
                }
                this_round[name] = results
            rounds.append(this_round)
    load_after = os.getloadavg()
    table = summarize(rounds, sides, list(chosen))
    missing = [s for s in SIDES if s not in sides]
    note = (
        f"{args.rounds} interleaved rounds, medians (ratio: median (min–max) of the per-round "
        f"ratios); fp32, CPU, "
        + (
            "each side's own threads (unpinned: --contention)"
            if args.contention
            else f"{args.threads} intra-op thread(s) a side"
        )
        + "; the peers' optimizer: "
        f"{args.peer_optimizer}'s class (--peer-optimizer); loss tolerance "
        f"rtol {args.loss_rtol:g}; load average {load_before[0]:.2f} before, "
        f"{load_after[0]:.2f} after, on {os.cpu_count()} CPUs"
        + (f"; not run: {', '.join(missing)} (--peers)" if missing else "")
    )
    text = markdown(table, chosen, sides, note)
    if args.contention:
        slow = contention_summary(rounds, sides, list(chosen))
        text += "\n" + contention_markdown(slow, chosen, sides, args.contention)
    text = stamp(load_after) + "\n\n" + text  # as docs/benchmarks.md holds it: when, where
    print(text, end="")
    report = {
        "sides": sides,
        "works": {name: vars(work) for name, work in chosen.items()},
        "rounds": rounds,
        "table": table,
        "load_average": {"before": load_before, "after": load_after},
        "threads": args.threads,
        "peer_optimizer": args.peer_optimizer,
        "loss_rtol": args.loss_rtol,
        "not_run": missing,
    }
    if args.contention:
        floors = contention_floors(slow)
        report["contention"] = {"busy": args.contention, "table": slow, "floors": floors}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown is not None:
        args.markdown.write_text(text)
    checks = [c for e in table.values() for cs in e["loss_check"].values() for c in cs]
    if not args.contention and not all(c["within"] for c in checks):
        print("error: the sides computed different losses (see the loss check above)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
