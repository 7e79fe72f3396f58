"""Every user error one line: Hydra's override grammar errors explained with the quoting that
works (exit 2, no traceback); every override kiln prints written so Hydra reads it back (paths
with spaces, commas, `=`, quotes, `~`); `~` expanded alike in every path key; `kiln triage` on a
damaged or foreign run directory is one `error:` line and exit 2."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.cli.main import main as kiln_main
from kiln.cli.paths import REPO_ROOT
from kiln.cli.train import main as train_main
from kiln.commands import RunCommand
from kiln.config.overrides import override, override_value

from .conftest import SUBPROCESS_ENV, compose_config, read_summary, run_python, train_main_here

GRAMMAR_ERRORS = {
    "init_from=~/w.pt": ("'~'", "'init_from=\"~/w.pt\"'"),
    "data.train_dir=é/x": ("'é'", "'data.train_dir=\"é/x\"'"),
    "init_from=a'b": ('"\'"', """'init_from="a'"'"'b"'"""),
    "init_from=a=b": ("'='", "'init_from=\"a=b\"'"),
}


@pytest.mark.parametrize("arg", GRAMMAR_ERRORS)
def test_an_override_hydra_cannot_parse_is_one_line_with_the_quoting_that_works(arg, capfd):
    culprit, quoted = GRAMMAR_ERRORS[arg]
    code, stderr = train_main_here(capfd, arg)
    assert code == 2
    err = stderr.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"error: Hydra's override grammar cannot read {arg} ({culprit} ")
    assert err[0].endswith(f"quote the value for Hydra, inside quotes for the shell: {quoted}")
    fixed = shlex.split(quoted)  # what the shell hands over when the user types the fix
    key, _, value = arg.partition("=")
    cfg = compose_config(*(["data=image_folder"] if key.startswith("data.") else []), *fixed)
    got = cfg.data.train_dir if key.startswith("data.") else cfg.init_from
    assert got == os.path.expanduser(value)


def test_the_grammar_error_of_a_real_train_py_process_is_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), "init_from=~/w.pt"],
        cwd=tmp_path,
        env=SUBPROCESS_ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert """'init_from="~/w.pt"'""" in done.stderr


def test_a_column_named_in_other_letters_reads_with_the_quoting_the_error_shows(tmp_path, capfd):
    """`data.text_column=Käse` is refused by Hydra's grammar (a letter outside ASCII); the
    one-line error's quoted override composes, and the data reads that column."""
    code, stderr = train_main_here(capfd, "data=csv_text", "data.text_column=Käse")
    assert code == 2
    (line,) = stderr.strip().splitlines()
    quoted = line.rsplit("inside quotes for the shell: ", 1)[1]
    assert quoted == "'data.text_column=\"Käse\"'"
    path = tmp_path / "käse.csv"
    rows = [("Käse", "label")] + [(f"text {i} {'ab'[i % 2]}", "ab"[i % 2]) for i in range(40)]
    path.write_text("".join(f"{a},{b}\n" for a, b in rows), encoding="utf-8")
    cfg = compose_config(
        "data=csv_text",
        *shlex.split(quoted),
        "model=text_bow",
        override("data.train_path", str(path)),
        f"data.cache_dir={tmp_path / 'cache'}",
    )
    assert cfg.data.text_column == "Käse"
    from kiln.data import build_data

    assert len(build_data(cfg.data).train) == 32


NASTY = [
    "/data/my photos/run 1/last.pt",
    "/data/a,b/last.pt",
    "/data/k=v/last.pt",
    "/data/it's/last.pt",
    '/data/say "hi"/last.pt',
    "/data/both ' and \"/last.pt",
    "/data/back\\slash/last.pt",
    "/data/ünï cödé/last.pt",
    "~/w.pt",
    "/data/[x]/{y}/last.pt",
]


@pytest.mark.parametrize("path", NASTY)
def test_printed_overrides_read_back_through_the_shell_and_hydra(path):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    line = RunCommand(("model=mlp",)).train(override("init_from", path))
    args = shlex.split(line)  # the shell's reading of the printed line
    assert args[:2] == ["python", str(Path(args[1]))] and args[2] == "model=mlp"
    (parsed,) = OverridesParser.create().parse_overrides([args[3]])
    assert parsed.key_or_group == "init_from" and parsed.value() == path
    assert override_value("plain/path.pt") == "plain/path.pt"  # plain paths stay as they are


def test_tilde_is_expanded_in_every_path_key(tmp_path, monkeypatch):
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    images = compose_config(
        "data=image_folder",
        'data.train_dir="~/photos/train"',
        'data.val_dir="~/v"',
        'data.test_dir="~/t"',
        'data.cache_dir="~/c"',
        'init_from="~/w.pt"',
        'resume="~/run/checkpoints/last.pt"',
        'output_root="~/outputs"',
    )
    assert images.data.train_dir == f"{home}/photos/train"
    assert (images.data.val_dir, images.data.test_dir) == (f"{home}/v", f"{home}/t")
    assert images.data.cache_dir == f"{home}/c" and images.init_from == f"{home}/w.pt"
    assert images.resume == f"{home}/run/checkpoints/last.pt"
    assert images.output_root == f"{home}/outputs"
    text = compose_config(
        "data=csv_text", "model=text_bow", 'data.train_path="~/a.csv"', 'data.val_path="~/b.csv"'
    )
    assert (text.data.train_path, text.data.val_path) == (f"{home}/a.csv", f"{home}/b.csv")
    zoo = compose_config("model=torchvision", 'model.weights="~/r18.pth"')
    assert zoo.model.weights == f"{home}/r18.pth"
    assert compose_config("model=torchvision", "model.weights=DEFAULT").model.weights == "DEFAULT"


def test_the_printed_train_longer_command_works_for_a_run_dir_with_spaces_commas_and_equals(
    tmp_path,
):
    run_dir = tmp_path / "my runs, v=2" / "first run"
    settings = ["trainer.max_steps=2", "trainer.limit_val_batches=1", "env.progress_bar=false"]
    train = [sys.executable, str(REPO_ROOT / "train.py")]
    first = run_python([*train, override("hydra.run.dir", str(run_dir)), *settings], tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    (longer,) = [line for line in first.stdout.splitlines() if "init_from=" in line]
    command = shlex.split(longer.split("  # ")[0].strip())
    assert """'init_from="my runs, v=2/first run/checkpoints/last.pt"'""" in longer
    assert command[0] == "python" and any("my runs, v=2" in a for a in command)
    second = run_python(
        [sys.executable, *command[1:], f"hydra.run.dir={tmp_path / 'second'}"], tmp_path
    )
    assert second.returncode == 0, second.stderr[-2000:]
    assert read_summary(tmp_path / "second")["status"] == "ok"
    assert re.search(
        r"init_from=.*my runs, v=2", (tmp_path / "second" / ".hydra" / "overrides.yaml").read_text()
    )


def damaged_run(tmp_path, kind: str) -> Path:
    run = tmp_path / kind
    run.mkdir()
    summary = {"status": "failed", "error": "ValueError: x", "steps": 3}
    metrics = ['{"step": 1, "loss": 0.9}', '{"step": 2, "loss": 0.8}']
    if kind == "cut":
        metrics.append('{"step": 3, "lo')  # a killed run's last line
    elif kind == "no_step":
        metrics.append('{"epoch": 1, "loss": 0.7}')
    elif kind == "foreign_summary":
        summary = {"accuracy": 0.91, "status": 3, "error": {"code": 1}}
    elif kind == "summary_list":
        summary = [1, 2, 3]
    elif kind == "yaml":
        (run / ".hydra").mkdir()
        (run / ".hydra" / "config.yaml").write_text("model: [unclosed\n")
    (run / "metrics.jsonl").write_text("\n".join(metrics) + ("" if kind == "cut" else "\n"))
    (run / "summary.json").write_text(json.dumps(summary))
    return run


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("cut", r"metrics.jsonl: line 3 is not JSON .*cut off mid-record"),
        ("no_step", r"metrics.jsonl: record 3 has no integer 'step' \(epoch, loss\)"),
        ("foreign_summary", r"summary.json is not a kiln run summary \(status 3"),
        ("summary_list", r"summary.json holds a JSON list"),
        ("yaml", r"config.yaml cannot be read as YAML"),
    ],
)
def test_triage_of_a_damaged_or_foreign_run_is_one_line_and_exit_2(tmp_path, capsys, kind, says):
    run = damaged_run(tmp_path, kind)
    assert kiln_main(["triage", str(run)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and captured.out == ""
    assert re.search(says, lines[0]), lines[0]


def test_a_resumed_run_reads_past_a_cut_last_metrics_line(tmp_path, caplog):
    from kiln.logging.jsonl import JsonlWriter, read_jsonl

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 0.9}\n{"step": 2, "lo')
    damaged: list[str] = []
    assert read_jsonl(path, damaged=damaged) == [{"step": 1, "loss": 0.9}]
    assert "line 2" in damaged[0] and "cut off" in damaged[0]
    writer = JsonlWriter(path)  # a resumed run appends: its first record on a line of its own
    writer.write({"step": 2, "loss": 0.8})
    writer.close()
    assert read_jsonl(path, damaged=[])[-1] == {"step": 2, "loss": 0.8}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_the_same_user_error_in_train_and_infer(
    tmp_path, monkeypatch, capfd
):
    from kiln.cli.infer import main as infer_main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.pt").write_bytes(b"")
    (tmp_path / "x.npy").write_bytes(b"")
    with pytest.raises(SystemExit) as infer_exit:
        infer_main(["ckpt=x.pt", "input=x.npy", "backend=echo", "device=cuda"])
    said_by_infer = capfd.readouterr().err.strip().splitlines()
    code, stderr = train_main_here(
        capfd, "device=cuda", f"hydra.run.dir={tmp_path / 'run'}", "logger=none"
    )
    said_by_train = stderr.strip().splitlines()
    assert infer_exit.value.code == code == 2
    expected = "error: device=cuda but torch.cuda.is_available() is False; run kiln-doctor"
    assert said_by_infer[-1] == said_by_train[-1] == expected


@pytest.mark.parametrize(
    ("body", "error"),
    [("from kiln import no_such_name\n", ImportError), ("{}['key']\n", KeyError)],
    ids=["ImportError", "KeyError"],
)
def test_a_bug_in_a_plugin_is_a_traceback_not_the_users_mistake(
    tmp_path, monkeypatch, capfd, body, error
):
    """Only kiln's UserError is exit 2: a plugin's own ImportError or KeyError propagates (a
    traceback and exit 1), where a plugin that is not there at all is one line."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"buggy_plugin_{error.__name__.lower()}"
    (tmp_path / f"{name}.py").write_text(body)
    with pytest.raises(error):
        train_main([f"plugins=[{name}]", "--help"])
    assert train_main_here(capfd, "plugins=[no_such_plugin_module]", "--help")[0] == 2
