"""The commands of README.md and docs/*.md, run as typed. Every command in a page's code blocks
is extracted and run, exactly as written, in a fresh folder laid out like a clone with the
virtual environment active; only KILN_OVERRIDES (appended to every train.py command line;
`smoke()` says what) and KILN_SMOKE (benchmarks and the matrix in their quick form) shorten
them, never an edit. A `$ command` followed by output lines must print that output. The few
commands that cannot run here are listed with the reason."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kiln.cli.paths import REPO_ROOT

from .conftest import SUBPROCESS_ENV, makefile_rule, shell_env

STARTS = ("python ", "make ", "torchrun ", "kiln ", "tensorboard ", "KILN_", "cd ")
# Not run, with the reason. Everything else in a code block is run.
NOT_RUN = {
    "make test": "runs this very suite (recursion)",
    "make test-all": "runs this very suite (recursion)",
    "make clean": "deletes the virtual environment the suite runs in",
    "make lock": "rewrites requirements.lock from the package index",
    "make format": "rewrites the source files",
    "--rdzv-endpoint=host0": "needs a second machine named host0",
    "scripts/slurm_torchrun.py": "needs a SLURM cluster",
    "hydra/launcher=slurm": "needs a SLURM cluster",
    "postgresql://": "needs a database server",
}
# Commands run as typed in full in one place: a page that lists them again (docs/development.md's
# make targets) skips them, naming where they run. make bench under KILN_SMOKE: 8 minutes.
RUN_ELSEWHERE = {
    "make bench": ("benchmarks.md", "docs/benchmarks.md runs it as typed"),
    "make matrix": (
        "tests/test_matrix.py",  # no page: the README's commands (page None) skip it too
        "tests/test_matrix.py runs the reduced matrix KILN_SMOKE makes of it and checks its cells",
    ),
}
SERVERS = {"mode=serve": 8000, "make serve": 8000, "tensorboard ": 6006}
# No curves.png either (logger.curves=false): its painter process is a second a run, and no
# command's output reads the picture (tests/test_background_writes.py tests it).
SMOKE = "trainer.max_steps=5 trainer.limit_val_batches=2 logger.curves=false"
# The default experiment (digits on an MLP, milliseconds a step) trains 40: its int8 export
# rightly refuses a 5-step model (logits still close together: argmax agreement 91.9% < 95%).
DEFAULT_RUN_SMOKE = "trainer.max_steps=40 trainer.limit_val_batches=2 logger.curves=false"
LINKED = (
    "train.py",
    "infer.py",
    "Makefile",
    "conf",
    "src",
    "scripts",
    "examples",
    "pyproject.toml",
    "requirements.in",
    "requirements.lock",
    "README.md",
    "docs",
    ".venv",
)


@dataclass
class Command:
    line: str
    expected: list[str] = field(default_factory=list)  # output lines a `$` example shows

    @property
    def skip_reason(self) -> str | None:
        return next((why for key, why in NOT_RUN.items() if key in self.line), None)

    @property
    def server_port(self) -> int | None:
        return next((port for key, port in SERVERS.items() if key in self.line), None)


def commands(text: str) -> list[Command]:
    """Shell commands in a page's indented and ```sh code blocks, in order."""
    found: list[Command] = []
    fenced = None
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            fenced = None if fenced is not None else line[3:].strip()
            i += 1
            continue
        if fenced not in (None, "sh", "bash", "shell") or not line.startswith("    "):
            i += 1
            continue
        body = line[4:]
        example = body.startswith("$ ")
        body = body[2:] if example else body
        while body.endswith("\\") and i + 1 < len(lines):  # a command over several lines
            i += 1
            body = body[:-1].rstrip() + " " + lines[i].strip()
        body = re.split(r"\s{2,}#", body)[0].strip()  # the explanatory comment
        if body.startswith(STARTS) or example:
            command = Command(body)
            while (
                example
                and i + 1 < len(lines)
                and lines[i + 1].startswith("    ")
                and not (lines[i + 1][4:].startswith("$ "))
            ):
                i += 1
                command.expected.append(lines[i][4:])
            found.append(command)
        i += 1
    return found


def placeholders(found: list[Command]) -> list[str]:
    """Commands that hold a `<...>` a user would have to fill in (and so cannot run)."""
    return [c.line for c in found if re.search(r"<[^>]*>", c.line) and not c.skip_reason]


def user_checkout(tmp_path: Path) -> Path:
    """A folder laid out like a clone, the repository's files linked in, and its .venv."""
    home = tmp_path / "kiln"
    home.mkdir()
    for name in LINKED:
        if (REPO_ROOT / name).exists():
            (home / name).symlink_to(REPO_ROOT / name)
    return home


def environment(home: Path) -> dict[str, str]:
    venv = REPO_ROOT / ".venv" / "bin"
    env = {
        **SUBPROCESS_ENV,
        "PATH": f"{venv}{os.pathsep}{os.environ['PATH']}",  # what `source .venv/bin/activate` does
        "VIRTUAL_ENV": str(REPO_ROOT / ".venv"),
        "KILN_OVERRIDES": SMOKE,
        "KILN_SMOKE": "1",
        "TORCH_HOME": str(home / "torch-cache"),
    }
    return shell_env(env)


def cache_detector_weights(command: Command, env: dict) -> None:
    """The file a user downloads once for `model=torchvision_detection model.weights=DEFAULT`,
    written into $TORCH_HOME under its URL's file name (kiln downloads nothing). It is a fresh
    build with COCO's 91 classes and frozen batch norms, laid out as torchvision publishes it."""
    found = dict(re.findall(r"\b(model|model\.arch|model\.weights)=(\S+)", command.line))
    if found.get("model") != "torchvision_detection" or found.get("model.weights") != "DEFAULT":
        return
    import torch
    import torchvision.models

    from kiln.models.zoo.cache import url_file_name
    from kiln.models.zoo.detection import freeze_batchnorm

    arch = found["model.arch"]
    file = Path(env["TORCH_HOME"]) / "hub" / "checkpoints"
    file /= url_file_name(torchvision.models.get_model_weights(arch).DEFAULT.url)
    if not file.is_file():
        net = torchvision.models.get_model(
            arch, weights=None, weights_backbone=None, num_classes=91
        )
        freeze_batchnorm(net)
        file.parent.mkdir(parents=True, exist_ok=True)
        torch.save(net.state_dict(), file)


def run_server(command: Command, home: Path, env: dict) -> None:
    """Start it, wait until it answers on its port, stop it with SIGTERM."""
    process = subprocess.Popen(
        ["bash", "-c", command.line],
        cwd=home,
        env=env,
        start_new_session=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None, f"{command.line} exited: {process.stdout.read()[-3000:]}"
            assert time.monotonic() < deadline, f"{command.line} never answered"
            try:
                httpx.get(f"http://127.0.0.1:{command.server_port}/", timeout=2)
                return
            except httpx.HTTPError:
                time.sleep(0.5)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


def smoke(line: str) -> str:
    """KILN_OVERRIDES for a command line: the default experiment's, where it names no data,
    model or experiment, else SMOKE."""
    trains = "train.py" in line or "make train" in line
    if trains and not re.search(r"\b(data|model|experiment)=", line):
        return DEFAULT_RUN_SMOKE
    return SMOKE


def run(command: Command, home: Path, env: dict) -> None:
    env = {**env, "KILN_OVERRIDES": smoke(command.line)} if "KILN_OVERRIDES" in env else env
    if command.server_port:
        run_server(command, home, env)
        return
    done = subprocess.run(
        ["bash", "-c", command.line],
        cwd=home,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    output = (done.stdout + done.stderr).strip().splitlines()
    if command.expected:  # an example of a mistake: exactly the output it shows
        assert output == command.expected, f"{command.line}\n{done.stdout}\n{done.stderr}"
        return
    assert done.returncode == 0, f"{command.line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def run_elsewhere(command: Command, page: str | None) -> str | None:
    """Why `page` does not run `command` (run in full elsewhere), or None."""
    home, why = RUN_ELSEWHERE.get(command.line.strip(), (page, None))
    return None if home == page else why


def recipe(target: str) -> list[str]:
    """The commands `make <target>` runs, as a user types them: the Makefile's recipe lines,
    `$(PY)` as `python`, no `$(ARGS)`, one command per `&&`."""
    found = []
    for line in makefile_rule(REPO_ROOT / "Makefile", target)[1]:
        typed = line.replace("$(PY)", "python").replace("$(ARGS)", "")
        found += [" ".join(part.split()) for part in typed.split("&&")]
    return found


def to_run(found: list[Command], page: str | None = None) -> list[Command]:
    """The commands that run here, in order: not the ones that cannot (skip_reason), nor `$`
    examples (run by test_the_mistakes_the_docs_show_print_what_they_show), nor those run in
    full elsewhere (RUN_ELSEWHERE), nor a line a `make` target run before it on the page ran
    already, the same line in the same checkout (`make bench`'s bench_text.py and
    bench_startup.py lines, shown again on docs/benchmarks.md with what they measure)."""
    chosen, done = [], set()
    for command in found:
        if command.skip_reason or command.expected or run_elsewhere(command, page):
            continue
        if command.line not in done:
            chosen.append(command)
        if command.line.startswith("make "):
            done.update(recipe(command.line.split()[1]))
    return chosen


def run_all(
    found: list[Command], home: Path, env: dict, page: str | None = None
) -> list[tuple[str, int]]:
    """Every command that can run here (to_run), in order, in one checkout: (command, seconds).
    `page`: the docs page they come from (RUN_ELSEWHERE)."""
    ran = []
    for command in to_run(found, page):
        cache_detector_weights(command, env)
        started = time.monotonic()
        run(command, home, env)
        ran.append((command.line, round(time.monotonic() - started)))
    return ran
