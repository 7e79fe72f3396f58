"""Shared helpers: the real config, composed and shrunk; training in-process through the same
`train(cfg, run_dir)` the CLI calls; the real train.py in a subprocess where the process itself
(exit codes, signals, stderr, torchrun) is what a test checks: forked from a Python that has
imported torch (`python_process`, tests/preloaded_python.py) unless its start is checked too."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from kiln.cli.paths import REPO_ROOT, has_override
from kiln.config import load_config
from kiln.registry import load_plugins

from .preloaded_python import server as preloaded_python
from .preloaded_python import takes

# Your own modules join the registry-wide tests: KILN_PLUGINS=my_parts make test
load_plugins([m for m in os.environ.get("KILN_PLUGINS", "").split(",") if m])

# No curves.png where a test does not look at it: its painter process (matplotlib's import and
# a draw, 0.9 CPU-s) cost a fifth of every short run the suite makes. KILN_OVERRIDES is appended
# to every train.py command line and never printed (kiln.commands); a test of the picture, or of
# a command exactly as a user types it, empties KILN_OVERRIDES or takes it out of its environment.
CURVES_OFF = "logger.curves=false"
os.environ["KILN_OVERRIDES"] = CURVES_OFF

# What make hands its recipes: under `make test-all ARGS=-x`, MAKEFLAGS carries ARGS=-x, and each
# `make sweep` or `make bench` a docs page runs as typed read pytest's options as its own. The
# suite's processes, and what they start, have the environment of a user's shell instead.
MAKE_VARIABLES = (
    "MAKEFLAGS",
    "MFLAGS",
    "MAKELEVEL",
    "MAKEOVERRIDES",
    "MAKE_TERMOUT",
    "MAKE_TERMERR",
)
for _name in MAKE_VARIABLES:
    os.environ.pop(_name, None)

# Keep CPU work predictable on the 2-core machines tests run on.
SUBPROCESS_ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "WANDB_MODE": "offline",
    "WANDB_SILENT": "true",
    "PYTHONUNBUFFERED": "1",
}


# Every check before step 1 off (rule 2's loss terms stay: a forward without backward).
PROBES_OFF = (
    "trainer.probe_sizes=false",
    "trainer.shape_check=false",
    "trainer.learn_probe=false",
    "trainer.skip_checks=[batch_dependence,determinism,purity,numerics,dead_gradients,device]",
)


# --dist loadscope keeps each test file on one worker, for its module fixtures. These files have
# none that cost much, and many independent cases (test-all's 1,626 zoo architectures in
# test_antibodies.py, hours on one worker; nine detectors trained with every check on, 30 min;
# each docs page's commands, the benchmarks page alone most of an hour; the whole failure
# matrix): each test is its own unit, spread over every worker, when slow tests run (make
# test-all). In make test they stay by file: spread there, .ci/run was no faster (833 s of
# pytest, 830 s not).
SPREAD_FILES = (
    "tests/test_antibodies.py",
    "tests/test_torchvision_detection.py",
    "tests/test_docs_commands.py",
    "tests/test_matrix.py",
)


def slow_tests_run(config) -> bool:
    """Whether `slow` tests are selected (make test-all), from the -m expression."""
    return "not slow" not in (config.option.markexpr or "")


def makefile_rule(makefile: Path, target: str) -> tuple[list[str], list[str]]:
    """A Makefile rule as written: its prerequisites and its recipe lines (stripped)."""
    lines = makefile.read_text().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(f"{target}:")]
    if not starts:
        raise ValueError(f"the {makefile.name} has no target {target!r} ({makefile})")
    head = lines[starts[0]].split(":", 1)[1].split("##")[0].split()
    body = itertools.takewhile(lambda line: line.startswith("\t"), lines[starts[0] + 1 :])
    return head, [line.strip() for line in body]


def install_inputs(makefile: Path) -> list[str]:
    """What `make install` re-installs on: the prerequisites of the Makefile's `$(STAMP):`."""
    return makefile_rule(makefile, "$(STAMP)")[0]


def stale_install(venv: Path, repo: Path) -> list[str]:
    """The files `make install` reads that are newer than the venv's install stamp."""
    stamp = venv / ".installed"
    if not stamp.exists():
        return []
    inputs = install_inputs(repo / "Makefile")
    return [n for n in inputs if (repo / n).stat().st_mtime > stamp.stat().st_mtime]


def pytest_sessionstart(session):
    """The README's and docs' commands run `make install` in a folder that links this .venv: on
    an install older than what it reads, that would re-install into it from the test's
    temporary folder, and its entry points (`kiln`) would name a folder that goes with the test."""
    venv = REPO_ROOT / ".venv"
    if Path(sys.prefix).resolve() != venv.resolve() or hasattr(session.config, "workerinput"):
        return
    stale = stale_install(venv, REPO_ROOT)
    if stale:
        pytest.exit(
            f"{venv} is older than {' and '.join(stale)}: run `make install` (or `make test`)",
            returncode=2,
        )


def pytest_collection_modifyitems(config, items):
    """Under test-all, the longest tests first: a test's timeout mark is what it may take, and
    a 40-minute test handed out last would run alone at the end while the other workers idle
    (the scheduler below keeps this order). Each xdist worker collects, and sorts alike.
    Otherwise the registry-wide tests of one model/data case run one after another."""
    if slow_tests_run(config):
        items.sort(key=lambda item: -timeout_of(item))
    else:
        case_by_case(items)


CASE_PARAMS = ("model", "data", "model_overrides")


def case_of(item) -> tuple | None:
    """A registry-wide test's (model, data, overrides) case, as reprs; None for other tests."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    in_file = item.nodeid.startswith("tests/test_antibodies.py::")
    if not in_file or not all(name in params for name in CASE_PARAMS):
        return None
    return tuple(repr(params[name]) for name in CASE_PARAMS)


def case_by_case(items) -> None:
    """test_antibodies.py's tests of a (model, data, overrides) case, one after another in the
    slots those tests held (every rule for the first case, then the next): its seeded network is
    built once for them, not once per rule (test_antibodies.SeededBuild)."""
    slots = [i for i, item in enumerate(items) if case_of(item) is not None]
    order: dict[tuple, int] = {}
    for i in slots:
        order.setdefault(case_of(items[i]), len(order))
    cases = sorted((items[i] for i in slots), key=lambda item: order[case_of(item)])
    for i, item in zip(slots, cases, strict=True):
        items[i] = item


def timeout_of(item) -> float:
    mark = item.get_closest_marker("timeout")
    if mark is None:
        return 0.0
    return float(mark.args[0] if mark.args else mark.kwargs.get("timeout", 0))


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadscope" or not slow_tests_run(config):
        return None  # xdist's own scheduler: make test's (its cases are short) or the one asked for
    from .xdist_scheduling import SpreadSomeFiles

    config.option.loadscopereorder = False  # the order of collection: longest first
    return SpreadSomeFiles(config, log, SPREAD_FILES)


def compose_config(*overrides: str):
    """The typed config `python train.py <overrides>` would run (kiln.config.load_config).
    A Hydra composition costs 0.3 s and the default suite asks for a thousand, four in ten of
    them again: each test process composes the same overrides once while what the composition
    read stays the same (the YAML files, and the registry entries of the options it chose:
    tests register models of their own), and each caller gets its own copy (lists and dicts in
    a config are not frozen) and the warnings the composition gave. Under the suite's
    KILN_OVERRIDES: no curves.png unless `logger.curves=true` is among the overrides."""
    overrides = (CURVES_OFF, *overrides)
    if any(has_override([o], key) for o in overrides for key in UNCACHED_KEYS):
        return load_config(list(overrides))  # these import plugins or read folders of their own
    key = (overrides, config_files())
    found = [
        (cfg, said) for chosen, cfg, said in _composed.get(key, ()) if chosen == chosen_entries(cfg)
    ]
    if found:
        cfg, said = found[0]
    else:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            cfg = load_config(list(overrides))
        _composed.setdefault(key, []).append((chosen_entries(cfg), cfg, said))
    for warning in said:
        warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    return copy.deepcopy(cfg)


UNCACHED_KEYS = ("plugins", "hydra.searchpath")
_composed: dict[tuple, list[tuple]] = {}


def config_files() -> tuple:
    """Every option YAML a composition may read now (kiln's conf/ and the folders plugins
    added), with its mtime and size, and HOME (`~` in paths)."""
    import kiln.config
    from kiln.registry import config_dirs

    folders = [Path(kiln.config.CONF_DIR)]
    folders += [Path(d.removeprefix("file://")) for d in config_dirs() if d.startswith("file://")]
    files = []
    for folder in folders:
        for path in sorted(folder.rglob("*.yaml")):
            stat = path.stat()
            files.append((str(path), stat.st_mtime_ns, stat.st_size))
    return tuple(files), os.environ.get("HOME")


def chosen_entries(cfg) -> tuple | None:
    """The registry entry (and schema) each group's chosen option has now; None where one is no
    longer registered."""
    from kiln.registry import GROUP_REGISTRIES

    chosen = []
    for group, registry in GROUP_REGISTRIES.items():
        name = getattr(getattr(cfg, group), "name", None)
        if name not in registry.names():
            return None
        entry = registry.entry(name)
        chosen.append((group, name, id(entry), id(entry.config), entry.config.__qualname__))
    return tuple(chosen)


def train_in_process(run_dir: Path, *overrides: str) -> dict:
    """Train as train.py does, in this process; returns the summary."""
    from kiln.engine.run import train

    return train(compose_config(*overrides), run_dir)


def train_main_here(capture, *args: str) -> tuple[int, str]:
    """`python train.py <args>` as its main() runs it, in this process: the exit status (0 when
    it returned) and what it wrote to stderr (`capture`: the test's capfd or capsys). For what a
    run says and leaves; what only a process shows (signals, the interpreter's exit, output
    order across processes) needs run_train."""
    code, _, stderr = train_main_output(capture, *args)
    return code, stderr


def train_main_output(capture, *args: str) -> tuple[int, str, str]:
    """train_main_here with what the run printed too: (exit status, stdout, stderr)."""
    from kiln.cli.train import main

    argv = sys.argv[:]
    capture.readouterr()  # only this run's output
    try:
        main(list(args))
        code = 0
    except SystemExit as stop:
        code = stop.code
    finally:
        sys.argv = argv  # main hands its arguments to Hydra through sys.argv
    said = capture.readouterr()
    return code, said.out, said.err


@pytest.fixture(autouse=True)
def _own_probe_cache(tmp_path_factory, monkeypatch):
    """Each test its own probe cache (kiln.guards.probe_cache), in this process and in the
    subprocesses it starts: a model another test probed is probed again."""
    directory = str(tmp_path_factory.mktemp("probe-cache"))
    monkeypatch.setenv("KILN_PROBE_CACHE", directory)
    monkeypatch.setitem(SUBPROCESS_ENV, "KILN_PROBE_CACHE", directory)


@pytest.fixture(autouse=True)
def _quiet_threads():
    """One intra-op thread per test, as the subprocess runs have (OMP_NUM_THREADS=1)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _own_log_handlers():
    """A CLI main() called in this process (Hydra's job logging, infer's basicConfig) leaves a
    handler on the stream pytest captured for that test, closed when the test ends: a later
    test's log line would hit it ('--- Logging error ---' in that test's output). As separate
    processes the CLIs never share handlers, so each test's new handlers leave with it
    (pytest's own capture handlers come and go with each phase; they are its business)."""
    import logging

    loggers = [logging.getLogger(), logging.getLogger("kiln")]
    before = {logger.name: (set(logger.handlers), logger.level) for logger in loggers}
    yield
    for logger in loggers:
        handlers, level = before[logger.name]
        for handler in list(logger.handlers):
            if handler not in handlers and not type(handler).__module__.startswith("_pytest"):
                logger.removeHandler(handler)
                handler.close()
        logger.setLevel(level)


def run_train(
    run_dir: Path,
    *overrides: str,
    cwd: Path | None = None,
    timeout: int = 300,
    launcher=None,
    explicit_run_dir: bool = True,
    env_overrides: dict | None = None,
    fresh: bool = False,
):
    """Run the real `python train.py` with hydra.run.dir=run_dir; returns CompletedProcess.
    `fresh`: in a fresh interpreter, where its start is checked too (`python_process`)."""
    cmd = [*(launcher or [sys.executable]), str(REPO_ROOT / "train.py")]
    cmd += [f"hydra.run.dir={run_dir}"] if explicit_run_dir else []
    cmd += overrides
    env = {**SUBPROCESS_ENV, **(env_overrides or {})}
    return run_python(cmd, cwd=cwd or run_dir.parent, env=env, timeout=timeout, fresh=fresh)


# KILN_TESTS_FRESH_PYTHON=1 make test: every command in a fresh interpreter, none preloaded.
FRESH_PYTHON = os.environ.get("KILN_TESTS_FRESH_PYTHON") == "1"


def python_process(
    cmd: list,
    cwd: Path | None = None,
    env: dict | None = None,
    stdin=None,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    start_new_session: bool = False,
    fresh: bool = False,
) -> subprocess.Popen:
    """`[sys.executable, script.py | -m module, args...]` as a process, its output as text: a
    child of this worker's preloaded Python (tests/preloaded_python.py: torch, torchvision and
    Hydra imported once, not by each command) where its environment allows, else a fresh one. For
    commands whose own start (imports, start-up time, memory) is not what the test checks;
    `fresh=True` for one whose start is."""
    env = SUBPROCESS_ENV if env is None else env
    preloadable = cmd[0] == sys.executable and takes([str(part) for part in cmd])
    if preloadable and not (FRESH_PYTHON or fresh):
        preloaded = preloaded_python(SUBPROCESS_ENV)
        if preloaded.imported_with(env):
            streams = {"stdin": stdin, "stdout": stdout, "stderr": stderr}
            return preloaded.popen(cmd[1:], cwd, env, **streams, new_session=start_new_session)
    return subprocess.Popen(
        [str(part) for part in cmd],
        cwd=cwd,
        env=env,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        text=True,
        start_new_session=start_new_session,
    )


def shell_env(env: dict) -> dict:
    """`env` for a shell running commands as typed: its `python` (a script or `-m module`) is
    a child of the preloaded Python, as `python_process` gives, through a `python` first on
    PATH (tests/preloaded_python.shim); KILN_TESTS_FRESH_PYTHON=1 leaves PATH as it is."""
    if FRESH_PYTHON:
        return env
    preloaded = preloaded_python(SUBPROCESS_ENV)
    return {**preloaded.for_ranks(env), "PATH": preloaded.shell_path(env)}


def run_python(
    cmd: list,
    cwd: Path | None = None,
    env: dict | None = None,
    timeout: float = 300,
    input=None,
    fresh: bool = False,
) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True) through `python_process`."""
    stdin = subprocess.PIPE if input is not None else None
    with python_process(cmd, cwd, env, stdin=stdin, fresh=fresh) as process:
        try:
            out, err = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            raise
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def resident_mb() -> float:
    """This process's resident memory (Linux's /proc), in MiB."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def read_summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def read_wandb_records(run_dir: Path) -> tuple[Path, list[dict]]:
    """The offline W&B run under run_dir, read by wandb's own reader (`wandb leet inspect`)."""
    (run_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return run_file, [json.loads(line) for line in out.splitlines() if line.strip()]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# A learning rate that drives the digits MLP to a non-finite loss within a few steps. The learn
# probe would stop such a run before step 1 (cannot learn): these runs are made to reach the
# loop's own non-finite handling, so it is off for them.
DIVERGING = ("optimizer=sgd", "optimizer.lr=1e12", "scheduler=none", "trainer.learn_probe=false")

# Settings that make a real training run take seconds: tiny data, few steps, no progress bar.
FAST = (
    "trainer.max_epochs=1",
    "trainer.log_every_n_steps=1",
    "env.progress_bar=false",
)


@pytest.fixture
def temporary_model():
    """Register a model builder for one test: `temporary_model("name", Builder)`; returns the
    config of the default run with model.name switched to it (schema: the mlp's)."""

    from kiln.config.model import MlpConfig
    from kiln.registry import MODELS

    added = []

    def register(name, builder, *overrides):
        MODELS.register(name, config=MlpConfig)(builder)
        added.append(name)
        cfg = compose_config(*overrides)
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name=name))

    yield register
    for name in added:
        del MODELS._entries[name]


def start_process(cmd: list[str], cwd: Path) -> subprocess.Popen:
    """A process the test will signal or kill, its output captured (`python_process`)."""
    return python_process(cmd, cwd)
