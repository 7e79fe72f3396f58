"""An Optuna study kept in sqlite (hydra/sweeper=kiln_optuna): two workers fill one study, a
search killed with SIGKILL resumes and re-runs its interrupted trial, and the joblib launcher runs
a study's trials in parallel. A stand-in task replaces training (a made-up val_acc, best at
lr=3e-3, after `extra.trial_seconds` of "work") so that only the search is measured."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from .conftest import SUBPROCESS_ENV

REPO = Path(__file__).resolve().parents[1]
STUDY = "digits_optuna"

STAND_IN_APP = textwrap.dedent(
    """
    import math, sys, time
    import hydra
    from kiln.config import register_configs

    register_configs()

    @hydra.main(config_path=sys.argv.pop(1), config_name="config", version_base="1.3")
    def main(cfg) -> float:
        time.sleep(float(cfg.extra.get("trial_seconds", 0)))
        return 1.0 - abs(math.log10(cfg.optimizer.lr) - math.log10(3e-3)) / 10

    main()
    """
)


def search_command(tmp_path: Path, sweep_dir: Path, *overrides: str) -> list[str]:
    """What a user types, with the stand-in app in place of train.py."""
    app = tmp_path / "app.py"
    app.write_text(STAND_IN_APP)
    return [
        *(sys.executable, str(app), str(REPO / "conf")),
        "hparams_search=digits_optuna",
        f"hydra.sweeper.storage=sqlite:///{tmp_path / 'studies' / 'search.db'}",
        f"hydra.sweep.dir={sweep_dir}",
        *overrides,
    ]


def start(tmp_path: Path, sweep_dir: Path, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(
        search_command(tmp_path, sweep_dir, *overrides),
        cwd=tmp_path,
        env={**SUBPROCESS_ENV, "PYTHONPATH": str(REPO / "src")},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: int = 300) -> None:
    _, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, stderr[-3000:]


def load_study(tmp_path: Path):
    # optuna and sqlalchemy are imported where used: every xdist worker collecting the suite
    # paid their import (2-3 CPU-s) at the top of this file.
    import optuna

    return optuna.load_study(
        study_name=STUDY, storage=f"sqlite:///{tmp_path / 'studies' / 'search.db'}"
    )


def jobs_in(sweep_dir: Path) -> list[list[str]]:
    """The overrides of each job a worker launched."""
    return [yaml.safe_load(p.read_text()) for p in sweep_dir.glob("*/.hydra/overrides.yaml")]


def best_value(sweep_dir: Path) -> float:
    return yaml.safe_load((sweep_dir / "optimization_results.yaml").read_text())["best_value"]


def test_the_same_search_again_continues_its_study(tmp_path):
    """The study lives in sqlite (SQLAlchemy 1.4 under Optuna 2.10): a second run of the search
    joins it, and n_trials counts the whole study."""
    from optuna.trial import TrialState

    finish(start(tmp_path, tmp_path / "first", "hydra.sweeper.n_trials=2"))
    finish(start(tmp_path, tmp_path / "second", "hydra.sweeper.n_trials=3"))
    study = load_study(tmp_path)
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 3
    assert [len(jobs_in(tmp_path / run)) for run in ("first", "second")] == [2, 1]
    assert best_value(tmp_path / "second") == study.best_value


def wait_for_a_trial(proc: subprocess.Popen, tmp_path: Path, complete: int) -> None:
    """Until the study holds `complete` finished trials and a running one."""
    from optuna.trial import TrialState
    from sqlalchemy.exc import IntegrityError, OperationalError

    deadline = time.monotonic() + 240
    while True:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "the search did not get going"
        try:  # not before the worker made the file: opening a missing one would create it
            made = (tmp_path / "studies" / "search.db").is_file()
            states = [t.state for t in load_study(tmp_path).trials] if made else []
        except (KeyError, OperationalError, IntegrityError):  # half made, or no study yet
            states = []
        if states.count(TrialState.COMPLETE) == complete and TrialState.RUNNING in states:
            return
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_workers_fill_one_sqlite_study(tmp_path):
    from optuna.trial import TrialState

    workers = [tmp_path / "worker0", tmp_path / "worker1"]
    # Each worker its own sampler seed: with the same seed both would propose the same trials.
    settings = ("hydra.sweeper.n_trials=6", "+extra.trial_seconds=2")
    first = start(tmp_path, workers[0], *settings, "hydra.sweeper.sampler.seed=0")
    wait_for_a_trial(first, tmp_path, complete=0)  # it made the database; the second joins
    second = start(tmp_path, workers[1], *settings, "hydra.sweeper.sampler.seed=1")
    finish(first)
    finish(second)

    study = load_study(tmp_path)
    states = [t.state for t in study.trials]
    # n_trials=6 is the study's size; two workers asking at the same moment may add one more.
    assert 6 <= len(states) <= 7 and set(states) == {TrialState.COMPLETE}
    launched = [len(jobs_in(sweep_dir)) for sweep_dir in workers]
    assert min(launched) >= 1 and sum(launched) == len(states)  # both took part
    assert len({t.params["optimizer.lr"] for t in study.trials}) == len(states)
    assert max(best_value(sweep_dir) for sweep_dir in workers) == study.best_value


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_search_resumes_and_reruns_its_interrupted_trial(tmp_path):
    from optuna.trial import TrialState

    settings = (
        "hydra.sweeper.n_trials=4",
        "hydra.sweeper.heartbeat_interval=1",
        "hydra.sweeper.grace_period=2",
        "+extra.trial_seconds=1.5",
    )
    first = start(tmp_path, tmp_path / "first", *settings)
    wait_for_a_trial(first, tmp_path, complete=2)  # then kill the whole search
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=60)
    (interrupted,) = [t for t in load_study(tmp_path).trials if t.state == TrialState.RUNNING]
    time.sleep(3)  # past the grace period: its heartbeat has stopped

    finish(start(tmp_path, tmp_path / "resumed", *settings))

    study = load_study(tmp_path)
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 4  # the search's n_trials, not 4 more
    assert study.trials[interrupted.number].state == TrialState.FAIL
    assert interrupted.params in [t.params for t in complete[2:]]  # run again after the kill
    resumed_jobs = jobs_in(tmp_path / "resumed")
    assert len(resumed_jobs) == 2  # the interrupted trial and the one never started
    assert best_value(tmp_path / "resumed") == study.best_value


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_joblib_runs_trials_of_a_shared_study_in_parallel(tmp_path):
    from optuna.trial import TrialState

    sweep_dir = tmp_path / "sweep"
    proc = start(
        tmp_path,
        sweep_dir,
        "hydra/launcher=joblib_local",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.n_trials=4",
        "+extra.trial_seconds=3",
    )
    finish(proc, timeout=1400)
    trials = load_study(tmp_path).trials
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 4
    assert len(jobs_in(sweep_dir)) == 4
    # Two at a time: each batch's trials ran at the same time, in separate processes.
    first, second = trials[0], trials[1]
    assert first.datetime_start < second.datetime_complete
    assert second.datetime_start < first.datetime_complete
