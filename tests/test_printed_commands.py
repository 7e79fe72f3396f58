"""Every command kiln prints works as printed, and every path it prints exists. Each test runs a
real `train.py` the way a user does (a folder of their own, `python ../train.py`, the venv's
`python` and `kiln` on PATH), reads what it printed after `next:` (and in a sweep's summary.md),
runs each of those commands exactly as printed -- the server with one addition, a free
`server.port` -- and checks every path the output names. Plugins (plugins=[...] with
hydra.searchpath, and an installed entry point that declares its config folder), resumed runs
(resume=auto, resume=<path>), a finished run, a failed run and a sweep."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kiln.checkpoint import load_checkpoint
from kiln.cli.paths import REPO_ROOT

from .conftest import SUBPROCESS_ENV, compose_config, shell_env, train_in_process
from .inference_helpers import free_port

SMALL = ("trainer.max_steps=3", "trainer.limit_val_batches=2", "env.progress_bar=false")
PROGRAMS = ("python ", "kiln ", "torchrun ")
PATH_PATTERNS = (
    r"run directory: (\S+)",
    r"curves: (\S+)",
    r"state is in (\S+)",
    r"batch statistics: (\S+)",
    r"kiln triage (\S+)",
    r"\b(?:ckpt|input|init_from|resume)=(?!auto\b)([^\s']+)",
    r"file://([^\]\s,']+)",
    r"Best \w+: \S+ in (\S+?):?$",
)

PLUGIN = '''
"""A user's model, outside src/kiln. Its option YAML is in ./conf (hydra.searchpath)."""
import math
from dataclasses import dataclass

from torch import nn

from kiln.config.model import ClassifierConfig
from kiln.registry import register_model


@dataclass(frozen=True, kw_only=True)
class PlainConfig(ClassifierConfig):
    """Flatten -> Linear -> ReLU -> Linear."""

    width: int = 32  # hidden width


@register_model("plain", config=PlainConfig, inputs=("image",))
def build_plain(spec, cfg, *, aux_head=False):
    features = spec.channels * math.prod(spec.image_size)
    return nn.Sequential(nn.Flatten(), nn.Linear(features, cfg.width), nn.ReLU(),
                         nn.Linear(cfg.width, spec.num_classes))
'''


@dataclass
class Output:
    rc: int
    text: str  # stdout and stderr together

    @property
    def commands(self) -> list[str]:
        return printed_commands(self.text)


def printed_commands(text: str) -> list[str]:
    """`next: <command>` lines and the indented commands of a `next:` block, comments dropped."""
    found, in_block = [], False
    for line in text.splitlines():
        if line.startswith("next:"):
            rest = line[len("next:") :].strip()
            in_block = not rest
            if rest:
                found.append(without_comment(rest))
        elif in_block and line.startswith("  ") and line.strip().startswith(PROGRAMS):
            found.append(without_comment(line.strip()))
        else:
            in_block = False
    return found


def without_comment(command: str) -> str:
    return re.split(r"\s+# ", command)[0].strip()


def printed_paths(text: str) -> list[str]:
    paths = []
    for line in text.splitlines():
        for pattern in PATH_PATTERNS:  # in what the line says, not in its comment
            paths += re.findall(pattern, without_comment(line))
    return paths


def assert_printed_paths_exist(output: Output, cwd: Path, *, some: bool = True) -> None:
    paths = printed_paths(output.text)
    assert paths or not some, output.text[-3000:]
    missing = [p for p in paths if not (cwd / p).exists()]
    assert not missing, f"printed but missing (cwd {cwd}): {missing}\n{output.text[-3000:]}"


def environment(extra_pythonpath: Path | None = None) -> dict[str, str]:
    venv = Path(sys.executable).parent  # what `source .venv/bin/activate` puts first
    env = {**SUBPROCESS_ENV, "PATH": f"{venv}{os.pathsep}{os.environ['PATH']}"}
    env.pop("KILN_OVERRIDES", None)
    if extra_pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(extra_pythonpath), env.get("PYTHONPATH")])
        )
    return shell_env(env)


def shell(command: str, cwd: Path, env: dict, timeout: int = 600) -> Output:
    done = subprocess.run(
        ["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    return Output(done.returncode, done.stdout + done.stderr)


def serve_as_printed(command: str, cwd: Path, env: dict) -> None:
    """The printed server command plus a free port; its GET /v1/example body, POSTed to both
    APIs, is answered 200."""
    port = free_port()
    proc = subprocess.Popen(
        ["bash", "-c", f"exec {command} server.port={port}"],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"{command} exited:\n{proc.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, f"{command} was never ready"
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.3)
        for api, route in (("v1", "/v1/predict"), ("v2", "/v2/models/kiln/infer")):
            body = httpx.get(f"{url}/v1/example", params={"api": api}, timeout=30).json()
            answer = httpx.post(f"{url}{route}", json=body, timeout=60)
            assert answer.status_code == 200, (api, answer.text[:500])
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)


def run_as_printed(command: str, cwd: Path, env: dict, ok=(0,)) -> Output | None:
    """One printed command, exactly as printed (a server: see serve_as_printed)."""
    if "mode=serve" in command:
        serve_as_printed(command, cwd, env)
        return None
    output = shell(command, cwd, env)
    assert output.rc in ok, f"{command}\n{output.text[-4000:]}"
    assert not any(line.startswith("error: ") for line in output.text.splitlines()), output.text
    assert_printed_paths_exist(output, cwd, some=False)
    return output


def run_every_printed_command(output: Output, cwd: Path, env: dict) -> list[Output]:
    assert output.commands, output.text[-3000:]
    ran = [run_as_printed(command, cwd, env) for command in output.commands]
    return [o for o in ran if o is not None]


def user_folder(tmp_path: Path) -> Path:
    """A folder laid out like a clone (train.py, infer.py), with a plugin folder in it."""
    home = tmp_path / "kiln"
    home.mkdir()
    for name in ("train.py", "infer.py"):
        (home / name).symlink_to(REPO_ROOT / name)
    return home


def run_dirs(outputs: Path) -> list[Path]:
    return sorted(p.parent.parent for p in outputs.glob("*/*/.hydra/config.yaml"))


def plugin_project(tmp_path: Path) -> tuple[Path, str]:
    """A user's folder `mine/` beside train.py: a plugin module and its option YAML, found by
    hydra.searchpath (the module does not declare its folder)."""
    project = user_folder(tmp_path) / "mine"
    (project / "conf" / "model").mkdir(parents=True)
    (project / "my_parts.py").write_text(PLUGIN)
    (project / "conf" / "model" / "plain.yaml").write_text("width: 24\n")
    return project, f"hydra.searchpath=[file://{project}/conf]"


def plugin_run(project: Path, searchpath: str, env: dict) -> Output:
    first = shell(
        f"python ../train.py 'plugins=[my_parts]' '{searchpath}' model=plain {' '.join(SMALL)}",
        project,
        env,
    )
    assert first.rc == 0, first.text[-4000:]
    assert_printed_paths_exist(first, project)
    return first


def test_a_plugin_run_carries_its_plugins_into_the_commands_it_prints(tmp_path):
    """plugins=[...] hydra.searchpath=[...]: the printed train command carries both and runs;
    --help takes them; the printed infer.py commands carry plugins=[...] (a checkpoint never
    makes infer.py import a module: from another folder, it is named and its folder said)."""
    project, searchpath = plugin_project(tmp_path)
    env = environment()
    first = plugin_run(project, searchpath, env)
    (longer,) = [c for c in first.commands if "train.py" in c]
    assert "init_from=" in longer and "resume=" not in longer
    assert "plugins=[my_parts]" in longer and searchpath in longer
    run_as_printed(longer, project, env)
    described = shell(
        f"python ../train.py --help 'plugins=[my_parts]' '{searchpath}' model=plain", project, env
    )
    assert described.rc == 0 and "width" in described.text and "24" in described.text, described
    predicts = [c for c in first.commands if "infer.py" in c]
    assert predicts and all("'plugins=[my_parts]'" in c for c in predicts), predicts
    best = next(project.glob("outputs/*/*/checkpoints/best.pt")).resolve()
    example = best.parent.parent / "example_input.npy"
    elsewhere = shell(f"python {REPO_ROOT}/infer.py ckpt={best} input={example}", tmp_path, env)
    assert elsewhere.rc == 2, elsewhere.text[-3000:]
    assert "add 'plugins=[my_parts]' to the command" in elsewhere.text
    assert f"my_parts was imported from {project.resolve()}" in elsewhere.text
    named = shell(
        f"PYTHONPATH={project} python {REPO_ROOT}/infer.py ckpt={best} input={example} "
        "'plugins=[my_parts]'",
        tmp_path,
        env,
    )
    assert named.rc == 0, named.text[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_plugin_runs_printed_commands_all_run_as_printed(tmp_path):
    """Predict, export, serve and train longer, each as printed, from the user's folder; the
    printed command with resume=auto instead of init_from= continues the plugin's run."""
    project, searchpath = plugin_project(tmp_path)
    env = environment()
    first = plugin_run(project, searchpath, env)
    run_every_printed_command(first, project, env)
    (longer,) = [c for c in first.commands if "train.py" in c]
    resumed = run_as_printed(re.sub(r"init_from=\S+", "resume=auto", longer), project, env)
    run_every_printed_command(resumed, project, env)


ENTRY_POINT_PLUGIN = '''
"""An installed plugin: registers a model and declares its option YAMLs' folder."""
from pathlib import Path

from plainpkg_parts import build_plain  # noqa: F401  (registers "plain")
from kiln.registry import register_config_dir

register_config_dir(Path(__file__).parent / "conf")
'''


def test_an_entry_point_plugin_declares_its_config_folder(tmp_path):
    """A package advertising [kiln.plugins] (its .dist-info on the path, as pip installs it)
    whose module calls register_config_dir: model=<its option> needs neither plugins= nor
    hydra.searchpath, in training, --help and the printed commands."""
    site = tmp_path / "site"
    package = site / "plainpkg"
    (package / "conf" / "model").mkdir(parents=True)
    (site / "plainpkg_parts.py").write_text(PLUGIN)
    (package / "__init__.py").write_text(ENTRY_POINT_PLUGIN)
    (package / "conf" / "model" / "plain.yaml").write_text("width: 20\n")
    dist_info = site / "plainpkg-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: plainpkg\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[kiln.plugins]\nplain = plainpkg\n")
    home = user_folder(tmp_path)
    env = environment(extra_pythonpath=site)
    first = shell(f"python train.py model=plain {' '.join(SMALL)}", home, env)
    assert first.rc == 0, first.text[-4000:]
    assert "width: 20" in (home / "outputs" / "latest" / ".hydra" / "config.yaml").read_text()
    predict = next(c for c in first.commands if "input=" in c)
    run_as_printed(predict, home, env)
    described = shell("python train.py --help model=plain", home, env)
    assert described.rc == 0 and "20" in described.text, described.text


def test_a_failed_runs_printed_commands_run_as_printed(tmp_path):
    """[FAIL] prints `kiln triage <run>`; triage prints the run's command with the fix, which
    runs (the run itself may fail again: the command is what must work)."""
    home = user_folder(tmp_path)
    env = environment()
    failed = shell(
        "python train.py optimizer.lr=1e4 trainer.log_every_n_steps=1 "
        "trainer.max_steps=30 env.progress_bar=false",
        home,
        env,
    )
    assert failed.rc == 1 and "[FAIL]" in failed.text, failed.text[-3000:]
    assert_printed_paths_exist(failed, home)
    (triage,) = failed.commands
    assert triage.startswith("kiln triage ")
    triaged = run_as_printed(triage, home, env)
    (rerun,) = triaged.commands
    # The fix replaces the run's own optimizer.lr (the replayed first update sizes it).
    (lr,) = [float(w.split("=")[1]) for w in rerun.split() if w.startswith("optimizer.lr=")]
    assert lr < 1e4 and "optimizer.lr=1e4" not in rerun
    run_as_printed(rerun, home, env, ok=(0, 1))


def test_resume_path_carries_on_in_its_run_and_latest_keeps_what_commands_need(tmp_path):
    home = user_folder(tmp_path)
    env = environment()
    first = shell(f"python train.py {' '.join(SMALL)}", home, env)
    assert first.rc == 0, first.text[-3000:]
    (run_dir,) = run_dirs(home / "outputs")
    resumed = shell(
        f"python train.py {' '.join(SMALL)} resume=outputs/latest/checkpoints/last.pt", home, env
    )
    assert resumed.rc == 0, resumed.text[-3000:]
    assert run_dirs(home / "outputs") == [run_dir]  # no second folder holding only last.pt
    assert (home / "outputs" / "latest").resolve() == run_dir.resolve()
    assert_printed_paths_exist(resumed, home)
    assert "resumed from" in (run_dir / "train.log").read_text()


def test_a_run_resumed_into_a_new_folder_has_everything_a_run_has(tmp_path):
    """hydra.run.dir elsewhere (here: in-process): best.pt carried over, curves of the whole
    run, although a finished run resumed trains no further step."""
    first = tmp_path / "first"
    train_in_process(first, *SMALL, "logger=none")
    again = tmp_path / "again"
    resume = f"resume={first}/checkpoints/last.pt"
    train_in_process(again, *SMALL, "logger=none", "logger.curves=true", resume)
    copied = load_checkpoint(again / "checkpoints" / "best.pt")
    assert copied["state"] == load_checkpoint(first / "checkpoints" / "best.pt")["state"]
    assert (again / "checkpoints" / "last.pt").is_file()
    assert (again / "curves.png").is_file()  # drawn only from a history with training losses


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_resumed_runs_printed_commands_run_as_printed(tmp_path):
    """resume=auto and resume=<path>, in the run they resume and into a new folder: each
    resumed run's next commands run, and each path they print exists."""
    home = user_folder(tmp_path)
    env = environment()
    small = " ".join(SMALL)
    assert shell(f"python train.py {small}", home, env).rc == 0
    (run_dir,) = run_dirs(home / "outputs")
    for resume, where in (
        ("resume=auto", run_dir),
        (f"resume={run_dir}/checkpoints/last.pt", run_dir),
        (f"resume={run_dir}/checkpoints/last.pt hydra.run.dir=elsewhere", home / "elsewhere"),
    ):
        resumed = shell(f"python train.py {small} {resume}", home, env)
        assert resumed.rc == 0, resumed.text[-3000:]
        (printed,) = re.findall(r"^run directory: (\S+)", resumed.text, flags=re.MULTILINE)
        assert (home / printed).resolve() == where.resolve()  # carried on in the run it resumed
        assert_printed_paths_exist(resumed, home)
        run_every_printed_command(resumed, home, env)
    assert (home / "elsewhere" / "checkpoints" / "best.pt").is_file()


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_a_sweeps_summary_names_its_best_run_and_its_commands_run(tmp_path):
    home = user_folder(tmp_path)
    env = environment()
    sweep = shell(f"python train.py -m optimizer.lr=0.0003,0.01 {' '.join(SMALL)}", home, env)
    assert sweep.rc == 0, sweep.text[-3000:]
    (summary,) = home.glob("multirun/*/*/summary.md")
    text = summary.read_text()
    assert re.search(r"Best val_acc: \S+ in multirun/\S+/[01]:", text), text
    commands = [line.strip() for line in text.splitlines() if line.startswith("    python ")]
    assert len(commands) == 2, text
    assert_printed_paths_exist(Output(0, text), home)
    assert_printed_paths_exist(sweep, home)
    for command in commands:
        run_as_printed(without_comment(command), home, env)


def test_printed_commands_are_read_back_as_printed():
    """The reader above, on the output forms kiln prints (a test of the test's own parsing)."""
    text = textwrap.dedent(
        """\
        run ok: val_acc 0.9 (best 0.9), 3 steps
        next:
          python ../infer.py ckpt=outputs/latest/checkpoints/best.pt input=x.npy  # predict: a
          python ../train.py 'plugins=[a]' init_from=o/last.pt   # train longer
        [FAIL] digits-mlp | single | amp=False | loss NaN @ step 7
        next: kiln triage outputs/2026/09   # the likely causes
        """
    )
    assert printed_commands(text) == [
        "python ../infer.py ckpt=outputs/latest/checkpoints/best.pt input=x.npy",
        "python ../train.py 'plugins=[a]' init_from=o/last.pt",
        "kiln triage outputs/2026/09",
    ]
    assert set(printed_paths(text)) == {
        "outputs/latest/checkpoints/best.pt",
        "x.npy",
        "o/last.pt",
        "outputs/2026/09",
    }
    assert shlex.split(printed_commands(text)[1])[2] == "plugins=[a]"


@pytest.mark.parametrize(("best_step", "copied"), [(3, True), (6, False)])
def test_a_new_folder_takes_the_best_pt_of_its_past_only(tmp_path, best_step, copied):
    """Resumed from step 3: a best.pt of step 6 belongs to the original run's future."""
    from kiln import checkpoint as files
    from kiln.engine.checkpointer import Checkpointer
    from kiln.engine.trainer import TrainState

    source = tmp_path / "first" / "checkpoints"
    files.atomic_save({"model": {}, "state": {"global_step": best_step}}, source / "best.pt")
    state = TrainState(global_step=3, best_metric=0.9)
    cfg = compose_config().trainer
    target = Checkpointer(
        tmp_path / "again" / "checkpoints", cfg, monitor="val_acc", monitor_mode="max", is_main=True
    )
    target.adopt_best(source / "last.pt", state)
    assert (target.directory / "best.pt").is_file() is copied
    assert state.best_metric == (0.9 if copied else None)


def test_a_runs_command_is_read_back_from_its_hydra_folder(tmp_path, monkeypatch):
    """What triage and the sweep summary print: the run's overrides and search path, without
    its run directory, its resume or the KILN_OVERRIDES the environment appended."""
    import yaml

    from kiln.cli.report import preempted
    from kiln.commands import RunCommand

    monkeypatch.setenv("KILN_OVERRIDES", "trainer.max_steps=5")
    hydra_dir = tmp_path / "run" / ".hydra"
    hydra_dir.mkdir(parents=True)
    task = ["plugins=[my_parts]", "model=plain", "resume=auto", "trainer.max_steps=5"]
    hydra = ["hydra.run.dir=outputs/x", "hydra.searchpath=[file:///home/me/conf]"]
    (hydra_dir / "overrides.yaml").write_text(yaml.safe_dump(task))
    (hydra_dir / "hydra.yaml").write_text(
        yaml.safe_dump({"hydra": {"overrides": {"hydra": hydra}}})
    )
    command = RunCommand.of_run(tmp_path / "run")
    assert command.overrides == ("plugins=[my_parts]", "model=plain", hydra[1])
    line = command.train("model=plain2", "optimizer.lr=0.1")
    assert shlex.split(line)[2:] == [
        "plugins=[my_parts]",
        hydra[1],
        "model=plain2",
        "optimizer.lr=0.1",
    ]
    assert (
        preempted(tmp_path / "run", command)
        .splitlines()[1]
        .split("   #")[0]
        .endswith("'hydra.searchpath=[file:///home/me/conf]' resume=auto")
    )
