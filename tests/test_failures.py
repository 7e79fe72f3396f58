"""How a run dies: through train.py's main, a broken model is stopped by its rule with one
[FAIL] line of the contract's grammar, its detail, the run directory, failures.log and the
traceback in train.log; and a model a user registers joins the registry-wide tests unedited.
The runs are main() in the test's process: a failed run's [FAIL] line and exit status from a
real process are tested in test_resume.py (a non-finite loss) and test_printed_commands.py."""

from __future__ import annotations

import os
import re
import sys
import textwrap

import pytest

from kiln import registry
from kiln.cli.paths import REPO_ROOT
from kiln.findings import KINDS
from kiln.guards.rules import BATCH, DEAD, DETERMINISM, LEARN
from kiln.registry import MODELS

from .conftest import SUBPROCESS_ENV, read_summary, run_python, train_main_here

REGISTER_BROKEN = """
from tests.broken_models import BROKEN
from kiln.registry import MODELS
for broken in BROKEN:
    MODELS.register(broken.name, config=broken.config, inputs=broken.inputs)(broken.builder)
"""


# Issue 31's kinds through the plugin API and the real train.py: what a model computes, each
# stopped before step 1 by its own check, with the module in summary.json (model, <what>, module).
BEHAVIOUR_KINDS = [
    ("rnn_batch_first", "batch dependence", "rnn"),
    ("eval_dropout", "determinism", ""),  # the model's own forward: no submodule to name
    ("dead_units", "dead gradients", "body.0"),  # its first Linear: zero gradients
    ("tiny_logits", "cannot learn", ""),
]
RULES_BY_WHAT = {
    "batch dependence": BATCH,
    "determinism": DETERMINISM,
    "dead gradients": DEAD,
    "cannot learn": LEARN,
}


@pytest.fixture
def broken_project(tmp_path, monkeypatch):
    """A user's folder with a plugin module registering the broken models and their option
    YAMLs; the test's working directory and on its path, as the plugin's folder is for
    `python train.py` started there. What the plugin adds (its module, registry entries, search
    path) leaves with the test."""
    (tmp_path / "broken_parts.py").write_text(REGISTER_BROKEN)
    (tmp_path / "conf" / "model").mkdir(parents=True)
    for name in ("eval_only_crash", "layer_on_meta", *(kind[0] for kind in BEHAVIOUR_KINDS)):
        (tmp_path / "conf" / "model" / f"{name}.yaml").write_text("dropout: 0.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_CONFIG_DIRS", [])
    before = set(MODELS.names())
    yield tmp_path
    sys.modules.pop("broken_parts", None)
    for name in set(MODELS.names()) - before:
        del MODELS._entries[name]


@pytest.mark.parametrize(
    ("model", "what", "detail"),
    [
        ("eval_only_crash", "shapes", "rule 3 (train and eval must agree): the eval"),
        ("layer_on_meta", "device mismatch in head", "devices (one model, one device): device"),
    ],
)
def test_a_broken_model_dies_with_one_fail_line_its_detail_and_the_run_dir(
    broken_project, capfd, model, what, detail
):
    run_dir = broken_project / "run"
    code, stderr = train_main_here(
        capfd,
        "plugins=[broken_parts]",
        f"hydra.searchpath=[file://{broken_project}/conf]",
        f"model={model}",
        "hydra.run.dir=run",
        "env.progress_bar=false",
        "output_root=outs",
    )
    assert code == 1, stderr[-3000:]
    lines = stderr.strip().splitlines()
    fail = [i for i, line in enumerate(lines) if line.startswith("[FAIL]")]
    assert len(fail) == 1, stderr
    i = fail[0]
    assert lines[i] == f"[FAIL] digits-{model} | single | amp=False | {what} @ step 0"
    assert lines[i + 1].startswith(f"  {detail}")
    assert lines[i + 2] == "run directory: run"  # relative to the working directory
    logged = (broken_project / "outs" / "failures.log").read_text().splitlines()
    assert logged == lines[i : i + 2]
    train_log = (run_dir / "train.log").read_text()
    assert lines[i] in train_log and "Traceback" in train_log
    assert read_summary(run_dir)["status"] == "failed"


@pytest.mark.parametrize(("model", "what", "module"), BEHAVIOUR_KINDS)
def test_a_model_that_computes_the_wrong_thing_stops_before_step_1_through_plugins(
    broken_project, capfd, model, what, module
):
    """`python train.py plugins=[...] model=<broken>`: the check's own [FAIL] line at step 0,
    its message starting with the check, and summary.json naming the check and the module."""
    run_dir = broken_project / "run"
    code, stderr = train_main_here(
        capfd,
        "plugins=[broken_parts]",
        f"hydra.searchpath=[file://{broken_project}/conf]",
        f"model={model}",
        "hydra.run.dir=run",
        "env.progress_bar=false",
        "output_root=outs",
    )
    assert code == 1, stderr[-3000:]
    lines = stderr.strip().splitlines()
    fail = [i for i, line in enumerate(lines) if line.startswith("[FAIL]")]
    assert len(fail) == 1, stderr[-3000:]
    assert lines[fail[0]] == f"[FAIL] digits-{model} | single | amp=False | {what} @ step 0"
    assert lines[fail[0] + 1].startswith(f"  {RULES_BY_WHAT[what]}: "), lines[fail[0] + 1]
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and summary["steps"] == 0
    check = summary["failed_check"]
    assert (check["what"], check["module"]) == (what, module), check
    assert check["kind"] in KINDS, check  # the finding's kind: what kiln triage reads


PLUGIN = """
import math
from torch import nn
from kiln.config.model import MlpConfig
from kiln.registry import register_model


@register_model("tiny_ok", config=MlpConfig)
def build_ok(spec, cfg, *, aux_head=False):
    return Classifier(spec, aux_head)


@register_model("tiny_view", config=MlpConfig)
def build_view(spec, cfg, *, aux_head=False):
    return Classifier(spec, aux_head, literal=True)


class Classifier(nn.Module):
    def __init__(self, spec, aux_head, literal=False):
        super().__init__()
        self.literal = literal
        self.fc = nn.Linear(spec.channels * math.prod(spec.image_size), spec.num_classes)
        self.aux = nn.Linear(spec.channels * math.prod(spec.image_size), spec.num_classes) \\
            if aux_head else None

    def forward(self, x):
        h = x.view(-1, 64) if self.literal else x.flatten(1)  # 64: digits' 1x8x8, a literal
        logits = self.fc(h)
        return logits if self.aux is None else {"logits": logits, "aux_logits": self.aux(h)}
"""


@pytest.mark.timeout(600)
def test_a_users_models_join_the_registry_wide_tests_without_any_test_edit(tmp_path):
    (tmp_path / "user_models.py").write_text(textwrap.dedent(PLUGIN))
    env = {
        **SUBPROCESS_ENV,
        "KILN_PLUGINS": "user_models",
        "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)]),
    }
    result = run_python(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-rA",
            "-m",
            "not slow",
            "-k",
            # the correct model through every check on one dataset; the literal view through
            # rule 1 where 64 is not the input size (not the zoo's *_tiny architectures)
            "tiny_ok-on-digits or (tiny_view-on-synthetic_images and rule1)",
            "tests/test_antibodies.py",
        ],
        REPO_ROOT,
        env,
        timeout=600,
    )
    out = result.stdout
    passed = re.findall(r"^PASSED tests/test_antibodies.py::(\S+)", out, flags=re.MULTILINE)
    failed = re.findall(r"^FAILED tests/test_antibodies.py::(\S+)", out, flags=re.MULTILINE)
    # The correct model: every registry-wide check (rules 1-3, rule 3 under bf16, logits,
    # the behaviour checks and the learn probe, devices), on digits.
    ok = {p for p in passed if "tiny_ok-on-digits" in p}
    assert not [f for f in failed if "tiny_ok-on-" in f], out[-3000:]
    assert len(ok) >= 7, out[-3000:]  # every registry-wide check
    # The literal view: rule 1 fails, on the data where 64 is not the input size.
    assert "test_rule1_sizes_follow_inputs[tiny_view-on-synthetic_images]" in failed, out[-3000:]
    assert "rule 1 (shapes come from inputs)" in out
