"""SIGTERM, SIGUSR1 and Ctrl-C honoured within seconds in every phase of a run: the imports, the
data scan, tokenizing, the probes (also while a native call holds the main thread), an
evaluation, a checkpoint write and infer.py's export. Each case is the real train.py (or
infer.py) in a subprocess, signalled at a random moment inside the phase: a test plugin makes
the phase long and marks when it begins (KILN_TEST_PHASE, KILN_TEST_MARKERS), or the test
watches the phase's own files appear. The moment is drawn from a seed printed on failure."""

from __future__ import annotations

import csv
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln import checkpoint as files
from kiln.cli.paths import REPO_ROOT
from kiln.engine.preemption import (
    SIGNALS,
    Preempted,
    PreemptedBeforeStart,
    PreemptionFlag,
)

from .conftest import SUBPROCESS_ENV, python_process, read_summary, train_in_process

# The assertion's bound on signal -> exit: the goal is 2 s (measured: see the report in
# docs/engine.md), with room for a machine that other processes keep busy.
EXIT_BOUND_S = 5.0

PLUGIN = '''
"""Parts whose phase KILN_TEST_PHASE takes long; each marks (a file in KILN_TEST_MARKERS)
when it begins."""
import os
import pathlib
import time

PHASE = os.environ.get("KILN_TEST_PHASE", "")
MARKERS = pathlib.Path(os.environ.get("KILN_TEST_MARKERS", "."))


def mark(name):
    (MARKERS / name).touch()


if PHASE == "imports":
    mark("imports")  # torch's import comes next

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import TensorDataset

from kiln.config.data import DataConfig
from kiln.config.model import ClassifierConfig
from kiln.data import DataBundle, DataSpec
from kiln.preprocessing import ImageRecipe
from kiln.registry import register_dataset, register_model


@dataclass(frozen=True, kw_only=True)
class PhaseNetConfig(ClassifierConfig):
    """One linear layer, and a buffer of ballast_floats zeros (large checkpoints)."""

    ballast_floats: int = 0  # floats of the ballast buffer


class PhaseNet(nn.Module):
    def __init__(self, spec, ballast_floats):
        super().__init__()
        self.fc = nn.Linear(spec.channels * math.prod(spec.image_size), spec.num_classes)
        self.register_buffer("ballast", torch.zeros(ballast_floats))

    def forward(self, x):
        if PHASE == "probes":  # every forward of the probes takes a while
            mark("probes")
            time.sleep(0.3)
        if PHASE == "native" and not (MARKERS / "native").exists():
            rotation, _ = torch.linalg.qr(torch.randn(2000, 2000))
            mark("native")
            torch.linalg.matrix_power(rotation, 2**40)  # one native call of many seconds
        if PHASE == "evaluation" and not self.training:
            time.sleep(0.3)
        return self.fc(x.flatten(1))


@register_model("phase_net", config=PhaseNetConfig)
def build_phase_net(spec, cfg, *, aux_head=False):
    return PhaseNet(spec, cfg.ballast_floats)


@dataclass(frozen=True, kw_only=True)
class PhaseBlobsConfig(DataConfig):
    """Two Gaussian blobs as 1x4x4 images."""

    num_samples: int = 256  # samples per split


@register_dataset("phase_blobs", config=PhaseBlobsConfig)
def build_phase_blobs(cfg):
    if PHASE == "scan":  # a folder of files, read one by one
        mark("scan")
        for _ in range(100):
            time.sleep(0.05)

    def split(seed):
        gen = torch.Generator().manual_seed(seed)
        y = torch.randint(0, 2, (cfg.num_samples,), generator=gen)
        x = torch.randn(cfg.num_samples, 1, 4, 4, generator=gen) + 3 * y.view(-1, 1, 1, 1)
        return TensorDataset(x, y)

    names = ("left", "right")
    spec = DataSpec("classification", "image", 2, names, channels=1, image_size=(4, 4))
    recipe = ImageRecipe((0.0,), (1.0,), 1, (4, 4), names)
    return DataBundle(spec, split(cfg.split_seed), split(cfg.split_seed + 1), recipe)
'''

QUIET = ("env.progress_bar=false", "logger=none")
PARTS = ("plugins=[phase_parts]", "model=phase_net", "data=phase_blobs")
LONG = ("scheduler=none", "trainer.max_epochs=1000")  # runs until the test stops it


@pytest.fixture
def project(tmp_path):
    (tmp_path / "phase_parts.py").write_text(PLUGIN)
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "phase_net.yaml").write_text("ballast_floats: 0\n")
    (tmp_path / "conf" / "data" / "phase_blobs.yaml").write_text("batch_size: 32\n")
    (tmp_path / "markers").mkdir()
    return tmp_path


def searchpath(project: Path) -> str:
    return f"hydra.searchpath=[file://{project}/conf]"


class Run:
    """A real train.py or infer.py process, its output in files (a pipe nobody reads could
    fill and hold it up), stopped by a signal at a moment the test picks."""

    def __init__(self, script: str, args: list[str], cwd: Path, phase: str = ""):
        self.out, self.err = cwd / f"{script}.out", cwd / f"{script}.err"
        env = {
            **SUBPROCESS_ENV,
            "KILN_TEST_PHASE": phase,
            "KILN_TEST_MARKERS": str(cwd / "markers"),
            "XDG_CACHE_HOME": str(cwd / "cache"),  # the token store's, built anew
        }
        command = [sys.executable, str(REPO_ROOT / script), *args]
        with self.out.open("w") as out, self.err.open("w") as err:
            if phase == "imports":  # the signal comes during the imports: a fresh interpreter
                self.proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=err)
            else:
                self.proc = python_process(command, cwd, env, stdout=out, stderr=err)

    def wait_for(self, ready, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"it ended first ({self.proc.returncode}): {self.stderr()}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError("the phase never began")
            time.sleep(0.01)

    def stop(self, signum: int) -> float:
        """Sends `signum`; the seconds until the process has exited."""
        sent = time.monotonic()
        self.proc.send_signal(signum)
        try:
            self.proc.wait(timeout=60)
        finally:
            self.proc.kill()
        return time.monotonic() - sent

    def stdout(self) -> str:
        return self.out.read_text()

    def stderr(self) -> str:
        return self.err.read_text()[-3000:]


def marker(project: Path, name: str):
    return lambda: (project / "markers" / name).exists()


def big_csv(path: Path, rows: int) -> Path:
    """Texts of 40 words drawn from 20,000 made-up ones: tokenizing them takes seconds."""
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(3, 10))) for _ in range(20_000)]
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        for i in range(rows):
            writer.writerow([" ".join(rng.choices(words, k=40)), "ab"[i % 2]])
    return path


def building_token_store(project: Path):
    """The token store's temporary folder exists while the CSV is read, tokenized, encoded."""
    root = project / "cache" / "kiln" / "text"
    return lambda: root.is_dir() and any(p.name.startswith(".") for p in root.iterdir())


# The phase, the signal, the overrides, what says the phase began, and the latest moment in
# it (s) to send the signal at (each phase lasts longer than that).
TOKENIZING = ("data=csv_text", "model=text_bow", "data.tokenizer=bpe", "data.train_path=big.csv")
BEFORE_START = {
    "imports": (signal.SIGTERM, PARTS, "imports", 0.3),
    "scan": (signal.SIGUSR1, PARTS, "scan", 3.0),
    "tokenizing": (signal.SIGINT, TOKENIZING, None, 1.5),
    "probes": (signal.SIGTERM, PARTS, "probes", 1.5),
    "native": (signal.SIGTERM, PARTS, "native", 0.5),
}


@pytest.mark.parametrize("phase", list(BEFORE_START))
def test_a_signal_before_step_1_stops_the_run_at_once_saying_nothing_was_trained(project, phase):
    signum, overrides, began, latest = BEFORE_START[phase]
    if phase == "tokenizing":
        big_csv(project / "big.csv", 20_000)
    seed = random.randrange(2**32)
    delay = random.Random(seed).uniform(0.0, latest)
    args = ["hydra.run.dir=run", *QUIET, *overrides, searchpath(project)]
    args += ["plugins=[phase_parts]"] if "plugins=[phase_parts]" not in overrides else []
    run = Run("train.py", args, project, phase)
    run.wait_for(marker(project, began) if began else building_token_store(project))
    time.sleep(delay)
    took = run.stop(signum)
    print(f"{phase}: {signal.Signals(signum).name} {delay:.2f} s in, exit after {took:.2f} s")
    context = f"seed {seed} ({delay:.2f} s into the {phase}): {run.stderr()}"
    interrupted = signum == signal.SIGINT
    assert run.proc.returncode == (130 if interrupted else 75), context
    assert took < EXIT_BOUND_S, f"{took:.2f} s: {context}"
    assert "Traceback" not in run.stderr(), context
    how = "interrupted (Ctrl-C)" if interrupted else "preempted"
    typed = shlex.join(args)
    line = f"{how} before step 1: nothing was trained; start it again with: "
    stopped = [text for text in run.stdout().splitlines() if text.startswith(line)]
    assert stopped == [f"{line}python {REPO_ROOT / 'train.py'} {typed}"], run.stdout()
    run_dir = project / "run"
    assert not list(run_dir.glob("checkpoints/*.pt")), "a checkpoint before step 1"
    if (run_dir / ".hydra").is_dir():  # Hydra made the run directory: the stop is on record
        summary = read_summary(run_dir)
        assert summary["status"] == ("interrupted" if interrupted else "preempted"), context
        assert summary["steps"] == 0 and "nothing was trained" in summary["error"]


def test_a_signal_during_an_evaluation_ends_it_and_checkpoints_that_step(project):
    args = ["hydra.run.dir=run", *QUIET, *PARTS, *LONG, searchpath(project)]
    args += ["trainer.limit_train_batches=2", "trainer.limit_val_batches=10"]
    args += ["trainer.log_every_n_steps=1"]
    run = Run("train.py", args, project, "evaluation")
    metrics = project / "run" / "metrics.jsonl"
    # Step 2 ends the first epoch; its evaluation (10 batches of 0.3 s) follows.
    run.wait_for(lambda: metrics.is_file() and '"step": 2' in metrics.read_text())
    seed = random.randrange(2**32)
    delay = random.Random(seed).uniform(0.1, 2.0)
    time.sleep(delay)
    took = run.stop(signal.SIGTERM)
    print(f"evaluation: SIGTERM {delay:.2f} s in, exit after {took:.2f} s")
    context = f"seed {seed} ({delay:.2f} s into the evaluation): {run.stderr()}"
    assert run.proc.returncode == 75, context
    assert took < EXIT_BOUND_S, f"{took:.2f} s: {context}"
    assert "eval after epoch" not in (project / "run" / "train.log").read_text()  # cut short
    state = files.load_checkpoint(project / "run" / "checkpoints" / "last.pt")["state"]
    assert state["global_step"] == read_summary(project / "run")["steps"] == 2
    assert "run preempted; its state is in" in run.stdout()


def test_a_signal_during_a_checkpoint_write_leaves_whole_files(project):
    (project / "conf" / "model" / "phase_net.yaml").write_text("ballast_floats: 25000000\n")
    args = ["hydra.run.dir=run", *QUIET, *PARTS, *LONG, searchpath(project)]
    args += ["trainer.checkpoint_every_n_steps=1", "trainer.learn_probe=false"]
    run = Run("train.py", args, project)
    checkpoints = project / "run" / "checkpoints"
    run.wait_for(lambda: checkpoints.is_dir() and any(checkpoints.glob(".*.tmp")))
    took = run.stop(signal.SIGTERM)  # 100 MB being written
    print(f"checkpoint write: SIGTERM, exit after {took:.2f} s")
    assert run.proc.returncode == 75, run.stderr()
    assert took < EXIT_BOUND_S, f"{took:.2f} s: {run.stderr()}"
    assert not list(checkpoints.glob(".*.tmp"))  # no temporary file left
    state = files.load_checkpoint(checkpoints / "last.pt")["state"]  # whole
    assert state["global_step"] == read_summary(project / "run")["steps"] > 0


def test_a_signal_during_the_export_leaves_no_model_onnx(project):
    train_in_process(project / "run", *QUIET, "trainer.max_steps=2")
    ckpt = project / "run" / "checkpoints" / "best.pt"
    run = Run("infer.py", ["mode=export", f"ckpt={ckpt}"], project)
    exported = ckpt.with_name(".model.onnx.tmp.onnx")  # written, then checked for parity
    run.wait_for(exported.exists)
    took = run.stop(signal.SIGTERM)
    print(f"export: SIGTERM, exit after {took:.2f} s")
    assert run.proc.returncode == 75, run.stderr()
    assert took < EXIT_BOUND_S, f"{took:.2f} s: {run.stderr()}"
    (line,) = run.stderr().splitlines()
    assert line.startswith("infer.py mode=export preempted: no file was left half-written; run")
    assert not ckpt.with_name("model.onnx").exists()
    assert not ckpt.with_name("model.onnx.json").exists()


# ---------------------------------------------------------------------------------------------
# The handlers themselves, in this process


def test_before_step_1_the_handler_raises_at_once_and_from_step_1_it_asks_the_loop():
    import torch

    from kiln.engine.distributed import DistInfo

    before = pytest.raises(PreemptedBeforeStart, match="preempted before step 1: nothing was")
    with PreemptionFlag(DistInfo(), torch.device("cpu")), before:
        signal.raise_signal(signal.SIGUSR1)
    flag = PreemptionFlag(DistInfo(), torch.device("cpu"))  # a new run starts afresh
    with flag:
        flag.defer()
        signal.raise_signal(signal.SIGTERM)  # asks the loop; raises nothing
        assert flag.requested and not flag.interrupted and flag.agreed()
        with pytest.raises(Preempted, match="at step 7, after the last step"):
            SIGNALS.trained(7)  # a stop asked after the last boundary: raised at once


def test_a_forked_child_leaves_the_signal_to_its_parent():
    import torch

    from kiln.engine.distributed import DistInfo

    with PreemptionFlag(DistInfo(), torch.device("cpu")):
        pid = os.fork()
        if pid == 0:  # a DataLoader worker, say
            signal.raise_signal(signal.SIGTERM)  # ignored here: the parent decides
            os._exit(0)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
