"""`--help` and user errors answer at once: they must not import the heavy stacks. Timing a
command would measure the neighbours on a shared machine, so this checks the cause instead: the
modules each command imports (`python -X importtime`), as a user types it, from a fresh process.

The regression this guards against was real: Hydra's plugin scan imports every public module
under `hydra_plugins/`, and one `import optuna` at the top of a sweeper cost every `train.py`
call 6 s."""

from __future__ import annotations

import importlib.util
import os
import py_compile
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.cli.paths import REPO_ROOT
from kiln.startup import StartupClock

from .conftest import SUBPROCESS_ENV, install_inputs, stale_install

HEAVY = ("torch", "optuna", "pandas", "sklearn", "onnxruntime", "wandb", "tensorboard", "fastapi")

COMMANDS = {
    "train --help": (["train.py", "--help"], 0),
    "train --help GROUP=OPTION": (["train.py", "--help", "model=resnet18"], 0),
    "train --help model=timm": (["train.py", "--help", "model=timm"], 0),  # a zoo entry
    "train unknown option": (["train.py", "model=resnet19"], 2),
    "train key of another option": (["train.py", "data=digits", "data.vocab_size=3"], 2),
    "train value out of range": (["train.py", "trainer.max_steps=0"], 2),
    "infer --help": (["infer.py", "--help"], 0),
    "infer unknown mode": (["infer.py", "mode=bogus"], 2),
    "infer missing checkpoint": (["infer.py", "ckpt=missing.pt", "input=examples/digits.npy"], 2),
}


def imported_modules(importtime_log: str) -> set[str]:
    modules = set()
    for line in importtime_log.splitlines():
        if line.startswith("import time:") and "|" in line:
            modules.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return modules


@pytest.mark.parametrize("name", COMMANDS)
def test_help_and_user_errors_do_not_import_the_heavy_stacks(name, tmp_path):
    args, expected_rc = COMMANDS[name]
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *args, f"hydra.run.dir={tmp_path}"]
        if args[0] == "train.py" and "--help" not in args
        else [sys.executable, "-X", "importtime", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=120,
    )
    assert result.returncode == expected_rc, result.stderr[-2000:]
    loaded = imported_modules(result.stderr)
    assert "kiln" in loaded  # the log is read correctly
    assert not loaded & set(HEAVY), f"{name} imported {sorted(loaded & set(HEAVY))}"
    if expected_rc == 2:
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, result.stderr[-2000:]


EXIT_PROBE = """
import atexit, gc, sys
from kiln.cli.script import run_script
def report():  # registered before run_script: atexit runs it after the script's own handlers
    print(f"frozen={gc.get_freeze_count() > 0}")
atexit.register(report)
def main():
    out = open(sys.argv[1], "w")  # left open on purpose: exit must still flush it
    out.write("every byte")
    {end}
run_script(main)
"""


@pytest.mark.parametrize(
    ("end", "code"),
    [("return", 0), ("raise SystemExit(3)", 3), ("raise ValueError('boom')", 1)],
    ids=["returns", "exits 3", "raises"],
)
def test_the_scripts_exit_skips_the_final_collection_and_nothing_else(end, code, tmp_path):
    """train.py and infer.py end through run_script: their objects are frozen (the collector's
    passes at shutdown cost a torch process up to a second), while exit codes, atexit handlers
    and files left open behave as Python's own exit."""
    target = tmp_path / "out.txt"
    done = subprocess.run(
        [sys.executable, "-c", EXIT_PROBE.replace("{end}", end), str(target)],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=60,
    )
    assert done.returncode == code, done.stderr
    assert "frozen=True" in done.stdout
    assert target.read_text() == "every byte"
    if code == 1:
        assert "ValueError: boom" in done.stderr
    for script in ("train.py", "infer.py"):
        assert "run_script(main" in (REPO_ROOT / script).read_text()


def compiled(source: Path) -> bool:
    """Whether Python would load `source` from bytecode, as importlib judges a .pyc: the file
    cache_from_source names, this Python's magic number, and (for a timestamp .pyc) the
    source's mtime and size in its header; a hash .pyc is taken as it stands."""
    cached = Path(importlib.util.cache_from_source(str(source)))
    if not cached.is_file():
        return False
    header = cached.read_bytes()[:16]
    if header[:4] != importlib.util.MAGIC_NUMBER:
        return False
    if int.from_bytes(header[4:8], "little") & 1:  # hash-based
        return True
    stat = source.stat()
    mtime, size = int.from_bytes(header[8:12], "little"), int.from_bytes(header[12:16], "little")
    return (mtime, size) == (int(stat.st_mtime) & 0xFFFFFFFF, stat.st_size & 0xFFFFFFFF)


def test_the_installed_torch_is_byte_compiled():
    """`make install` byte-compiles the environment: with PYTHONDONTWRITEBYTECODE=1 (this
    machine, many images) nothing is written at import, and every process would compile torch's
    modules again (`import torch` 3.7 s instead of 1.6 s, and each test's subprocess with it).
    Checked on the venv these tests run in: torch's package and a spread sample of its tree,
    less its own test folders (never imported: the install leaves every package's out)."""
    import torch

    root = Path(torch.__file__).parent
    sources = sorted(
        p for p in root.rglob("*.py") if not {"test", "tests"} & set(p.relative_to(root).parts)
    )
    assert len(sources) > 1000  # the whole of torch is there to sample
    sample = sorted({*root.glob("*.py"), *sources[::50]})  # __init__.py among them
    missing = [str(s.relative_to(root)) for s in sample if not compiled(s)]
    assert not missing, (
        f"{len(missing)} of {len(sample)} sampled torch modules have no bytecode "
        f"(e.g. {missing[:3]}): run `make install` (it byte-compiles .venv)"
    )


def test_what_every_hf_run_imports_from_transformers_is_byte_compiled():
    """The install leaves out transformers' model families' own code (a run compiles the one
    family it imports, ~15 ms), never the package, its auto mappings or the configurations."""
    import transformers

    root = Path(transformers.__file__).parent
    needed = [root / "__init__.py", root / "modeling_utils.py", root / "configuration_utils.py"]
    needed += [*(root / "models" / "auto").glob("*.py"), root / "models" / "__init__.py"]
    needed += [*root.glob("models/*/configuration_*.py"), *root.glob("models/*/__init__.py")]
    missing = [str(s.relative_to(root)) for s in needed if not compiled(s)]
    assert len(needed) > 1000 and not missing, f"no bytecode: {missing[:5]} ({len(missing)})"


def links_libpython(executable: str) -> bool | None:
    """Whether `executable` calls its interpreter through libpython (ldd); None: not an ELF
    program ldd can read (a pyenv shim is a shell script)."""
    found = subprocess.run(["ldd", executable], capture_output=True, text=True)
    if found.returncode or "libc.so" not in found.stdout:
        return None
    return "libpython" in found.stdout


@pytest.mark.skipif(shutil.which("ldd") is None, reason="reads what programs link with ldd")
def test_the_venv_runs_on_a_python_that_holds_its_interpreter_where_path_has_one():
    """make install makes .venv from the first python3.11 on PATH whose executable is the
    interpreter itself (a distribution's build: PGO, LTO, no call through libpython3.11.so),
    else from the first python3.11: a build linked to libpython ran kiln 12-19% slower."""
    on_path = [p for p in os.get_exec_path() if os.access(Path(p) / "python3.11", os.X_OK)]
    kinds = [links_libpython(str(Path(p) / "python3.11")) for p in on_path]
    ours = links_libpython(str(Path(sys.executable).resolve()))
    assert ours is not None, sys.executable
    if False in kinds:  # PATH has one that holds its interpreter: .venv is made from one
        assert ours is False, f"{sys.executable} links libpython: make clean install"


def test_a_suite_on_an_install_older_than_its_inputs_stops_before_a_test(tmp_path):
    """tests/conftest.py stops the session (`make install` first): the README's `make install`
    would otherwise re-install into the linked .venv from a test's temporary folder. The
    inputs are the Makefile's own (its `$(STAMP):` rule), not a second list."""
    assert install_inputs(REPO_ROOT / "Makefile") == ["requirements.lock", "pyproject.toml"]
    shutil.copy(REPO_ROOT / "Makefile", tmp_path / "Makefile")
    for name in ("requirements.lock", "pyproject.toml"):
        (tmp_path / name).write_text("")
    venv = tmp_path / ".venv"
    venv.mkdir()
    assert stale_install(venv, tmp_path) == []  # no stamp: not made by make install
    (venv / ".installed").touch()
    os.utime(tmp_path / "pyproject.toml", (time.time() + 5,) * 2)
    assert stale_install(venv, tmp_path) == ["pyproject.toml"]


def test_the_bytecode_check_sees_a_missing_or_stale_pyc(tmp_path):
    module = tmp_path / "mod.py"
    module.write_text("x = 1\n")
    assert not compiled(module)
    py_compile.compile(str(module), cfile=importlib.util.cache_from_source(str(module)))
    assert compiled(module)
    module.write_text("x = 22\n")  # edited after compiling: Python would compile it again
    assert not compiled(module)


FLOPS_WITHOUT_TRITON = """
import sys, torch
from kiln.engine.flop_count import FlopCount
with FlopCount() as counted:
    torch.nn.Linear(10, 20)(torch.zeros(3, 10))
print(counted.total, sorted(m for m in sys.modules if m.split(".")[0] == "triton"))
import triton.runtime.jit  # still there for whoever needs it
"""


def test_counting_flops_loads_no_triton():
    """A run counts its step's FLOPs before step 1 with torch's formulas; their module imports
    triton at its top (0.1-0.3 s of every start-up) for kernels kiln never counts."""
    done = subprocess.run(
        [sys.executable, "-c", FLOPS_WITHOUT_TRITON],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1200", "[]"]  # 2 x 10 x 20 per row, 3 rows
    assert "triton" not in done.stderr  # torch's "triton not found" warning stays quiet


def test_the_start_up_clock_gives_each_lap_to_its_phase():
    clock = StartupClock(time.perf_counter() - 1.0)  # a process a second old
    clock.lap("imports")
    time.sleep(0.05)
    clock.lap("first step", within={"probes": 0.03, "build": 0.01})
    seconds = clock.as_dict()
    assert 1.0 <= seconds["imports"] < 1.05
    assert (seconds["probes"], seconds["build"]) == (0.03, 0.01)
    assert 0.01 <= seconds["first step"] < 0.1 and seconds["config"] == seconds["data"] == 0
    # each phase is rounded to the millisecond on its own: the sum may differ by one or two
    laps = seconds["imports"] + 0.04 + seconds["first step"]
    assert seconds["total"] == pytest.approx(laps, abs=0.0021)
    assert clock.line().startswith("start-up 1.1 s: imports 1.0, config 0.00, data 0.00, build")


def test_the_process_age_counts_from_the_process_start():
    """train.py's start-up line starts with the interpreter: the age is read from the kernel's
    record of the process, not from when kiln was imported."""
    code = "import time; time.sleep(0.5); from kiln.startup import process_age_s as a; print(a())"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=SUBPROCESS_ENV, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert 0.5 <= float(done.stdout) < 30


def test_train_py_collects_no_garbage_until_torch_and_the_engine_are_imported():
    """train.py pauses the garbage collector until its task has imported torch and the engine
    (run_script's collect_during_imports=False, then imports_done): what the imports made is
    frozen, so no full collection walks it again. Anywhere else imports_done changes nothing."""
    import gc

    from kiln.cli import script

    assert "collect_during_imports=False" in (REPO_ROOT / "train.py").read_text()
    seen = []

    def main():
        seen.append(gc.isenabled())
        script.imports_done()
        seen.append((gc.isenabled(), gc.get_freeze_count() > 0))
        script.imports_done()  # once per process: a sweep's next job changes nothing

    try:
        script.run_script(main, collect_during_imports=False)
        assert seen == [False, (True, True)]
        gc.unfreeze()
        script.imports_done()  # not paused (a test's process): nothing frozen
        assert gc.isenabled() and gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
        gc.enable()
