"""The stock Optuna sweeper's loop (ask a batch of n_jobs trials, launch them through Hydra's
launcher, tell the results), changed where a study outgrows one process:

- n_trials is the size of the study, not of this process's share: every worker, and every run
  of the same command after a kill, asks for trials only while the study holds fewer (workers
  that ask at the same moment may overshoot by a batch);
- with a database storage (storage=sqlite:///..., postgresql://...) each running trial sends a
  heartbeat; a trial whose worker died goes silent, and the next worker to look fails it and
  queues its parameters again, so a resumed search re-runs the interrupted trial.

Built on hydra-optuna-sweeper's own parts (its config, parameter parsing and trial set-up), so
the search space and sampler keys are the same as hydra/sweeper=optuna."""

from __future__ import annotations

import logging
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides
from omegaconf import OmegaConf
from optuna.trial import FrozenTrial, Trial, TrialState
from sqlalchemy.exc import IntegrityError, OperationalError

if TYPE_CHECKING:
    from hydra_plugins.kiln_optuna_sweeper.sweeper import KilnOptunaSweeper

log = logging.getLogger(__name__)
# Heartbeats and fail_stale_trials are "experimental" in Optuna 2.10 (the version
# hydra-optuna-sweeper allows); kiln relies on them knowingly and tests them, so the warning at
# every search is noise on the console.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

INTERRUPTED = "kiln_interrupted_trials"  # study attribute: numbers of trials queued again
STORAGE_ATTEMPTS = 5


def run_search(sweeper: KilnOptunaSweeper, arguments: list[str]) -> None:
    """The search loop (the module docstring says what differs from the stock one)."""
    search = sweeper.sweeper  # the stock implementation: config, launcher, trial set-up
    search._process_searchspace_config()
    params = search._parse_sweeper_params_config() + list(arguments)
    distributions, fixed = create_params_from_overrides(params)
    distributions = {**(search.search_space_distributions or {}), **distributions}
    for name in fixed:
        distributions.pop(name, None)
    directions = search._get_directions()
    storage = open_storage(search.storage, sweeper)
    study = optuna.create_study(
        study_name=search.study_name,
        storage=storage,
        sampler=search.sampler,
        directions=directions,
        load_if_exists=True,  # a second worker, or the same command after a kill, joins it
    )
    log.info("Study %s in %s: %d trials so far", study.study_name, storage, counted(study))
    with Heartbeats(storage, sweeper.heartbeat_interval) as heartbeats:
        while True:
            if heartbeats.enabled:
                optuna.storages.fail_stale_trials(study)  # queued again by `requeue`
            batch = min(search.n_jobs, search.n_trials - counted(study))
            if batch <= 0:
                if not search.job_idx:
                    log.info(
                        "The study already holds hydra.sweeper.n_trials=%d trials: nothing to "
                        "run (raise n_trials to extend it)",
                        search.n_trials,
                    )
                break
            trials = [study.ask() for _ in range(batch)]
            heartbeats.watch(trials)
            overrides = search._configure_trials(trials, distributions, fixed)
            returns = search.launcher.launch(overrides, initial_job_idx=search.job_idx)
            search.job_idx += len(returns)
            results = zip(trials, returns, strict=True)
            failures = [tell(study, trial, job, len(directions)) for trial, job in results]
            heartbeats.forget(trials)
            failures = [f for f in failures if f is not None]
            if len(failures) / len(returns) > search.max_failure_rate:
                raise failures[0]
    write_results(study, Path(search.config.hydra.sweep.dir), len(directions))


def open_storage(url: Any, sweeper: KilnOptunaSweeper) -> Any:
    """An RDB storage with heartbeats for a database URL; None (in memory) stays None."""
    if not isinstance(url, str):
        return url
    if url.startswith("sqlite:///"):  # sqlite creates the file, not its directory
        Path(url.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(STORAGE_ATTEMPTS):
        try:
            return optuna.storages.RDBStorage(
                url,
                heartbeat_interval=sweeper.heartbeat_interval,
                grace_period=sweeper.grace_period,
                failed_trial_callback=requeue,
            )
        except (IntegrityError, OperationalError) as err:
            # Workers that start together on a new database all create its tables; all but
            # one fail, and find the tables there when they try again.
            if attempt == STORAGE_ATTEMPTS - 1:
                raise
            log.info("storage %s not ready (%s); trying again", url, type(err).__name__)
            time.sleep(1.0 + attempt)


def counted(study: optuna.Study) -> int:
    """Trials toward n_trials: finished, running or queued; not those interrupted and queued
    again (their copy counts)."""
    interrupted = set(study.system_attrs.get(INTERRUPTED, []))
    return sum(t.number not in interrupted for t in study.get_trials(deepcopy=False))


def requeue(study: optuna.Study, trial: FrozenTrial) -> None:
    """A trial failed for lack of heartbeats (its worker died): run its parameters again."""
    log.warning("trial %d was interrupted (no heartbeat); queued again", trial.number)
    study.set_system_attr(INTERRUPTED, [*study.system_attrs.get(INTERRUPTED, []), trial.number])
    study.enqueue_trial(trial.params)


def tell(study: optuna.Study, trial: Trial, job, num_directions: int) -> Exception | None:
    """Records a job's result; a failed job (or a return value that is not a number) fails its
    trial and is returned, without stopping the search."""
    try:
        returned = job.return_value  # re-raises the job's exception
        values = [float(returned)] if num_directions == 1 else [float(v) for v in returned]
        if len(values) != num_directions:
            raise ValueError(f"expected {num_directions} values, got {len(values)}")
    except Exception as err:  # the job's own error, whatever it is
        log.warning("Failed experiment: %s", err)
        study.tell(trial, state=TrialState.FAIL)
        return err
    study.tell(trial, values=values)
    return None


def write_results(study: optuna.Study, sweep_dir: Path, num_directions: int) -> None:
    """optimization_results.yaml in this worker's sweep directory, over the whole study."""
    if num_directions == 1:
        best = study.best_trial
        results = {"name": "optuna", "best_params": best.params, "best_value": best.value}
        log.info("Best parameters: %s, value %s", best.params, best.value)
    else:
        front = [{"params": t.params, "values": t.values} for t in study.best_trials]
        results = {"name": "optuna", "solutions": front}
    results["trials_in_study"] = len(study.get_trials(deepcopy=False))
    # A worker that found the study already full ran nothing, and Hydra made no directory.
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")


class Heartbeats:
    """Sends a heartbeat for each of this worker's running trials every `interval` seconds, from a
    thread, while Hydra's launcher runs them. Without a database storage it does nothing."""

    def __init__(self, storage: Any, interval: int):
        self.storage, self.interval = storage, interval
        self.enabled = isinstance(storage, optuna.storages.RDBStorage)
        self.trial_ids: set[int] = set()
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="optuna-heartbeats", daemon=True)

    def __enter__(self) -> Heartbeats:
        if self.enabled:
            self.thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()

    def watch(self, trials: list[Trial]) -> None:
        with self.lock:
            self.trial_ids |= {t._trial_id for t in trials}
        self._beat()  # at once: a trial without any heartbeat is never judged stale

    def forget(self, trials: list[Trial]) -> None:
        with self.lock:
            self.trial_ids -= {t._trial_id for t in trials}

    def _beat(self) -> None:
        if not self.enabled:
            return
        with self.lock:
            for trial_id in self.trial_ids:
                try:
                    self.storage.record_heartbeat(trial_id)
                except Exception as err:  # a busy database: the next beat will do
                    log.warning("heartbeat of trial id %d not recorded: %s", trial_id, err)

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            self._beat()
