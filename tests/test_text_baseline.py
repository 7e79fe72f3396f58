"""The linear baseline inside every text report (kiln.inference.baseline): TF-IDF + LinearSVC
fitted on a bounded sample of the same training split, scored beside the model at the end of
training and by `infer.py mode=evaluate`, with the verdict and the override when the model is
below it; scikit-learn stays out of the server."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from kiln.cli.paths import REPO_ROOT
from kiln.inference.baseline import scores
from kiln.inference.evaluate import classification_metrics, evaluate_checkpoint

from .conftest import FAST, SUBPROCESS_ENV, train_in_process, train_main_output


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))


def test_the_baseline_scores_are_the_evaluation_reports_definitions():
    rng = np.random.default_rng(0)
    names = ["a", "b", "c", "d"]  # "d": in neither labels nor predictions (left out of macro)
    targets, predicted = rng.integers(0, 3, 200), rng.integers(0, 3, 200)
    predicted[:5] = 1
    mine = scores(predicted, targets, names)
    theirs = classification_metrics(np.eye(4, dtype=np.float32)[predicted], targets, names)
    assert mine["accuracy"] == pytest.approx(theirs["accuracy"])
    assert mine["macro_f1"] == pytest.approx(theirs["macro_f1"])
    for name in names:
        for key in ("precision", "recall", "f1", "support"):
            assert mine["per_class"][name][key] == pytest.approx(theirs["per_class"][name][key])


def test_a_run_below_the_baseline_says_so_with_the_override_to_try(tmp_path, capfd, monkeypatch):
    """One epoch of two steps on the demo corpus: text_bow is below TF-IDF + LinearSVC."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.chdir(REPO_ROOT)  # the printed commands name ./train.py
    code, stdout, stderr = train_main_output(
        capfd, "data=csv_text", "model=text_bow", *FAST, f"hydra.run.dir={run_dir}"
    )
    assert code == 0, stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["baseline_below"] is True
    assert summary["baseline_acc"] > summary["baseline_model_acc"] == summary["val_acc"]
    assert summary["baseline_override"] == "trainer.max_epochs=2"
    result = json.loads((run_dir / "baseline.json").read_text())
    assert (result["train_rows"], result["eval_rows"]) == (461, 115)  # the split's own rows
    assert set(result["baseline"]["per_class"]) == set(result["model"]["per_class"])
    out = stdout.splitlines()
    assert any(line.startswith("baseline (TF-IDF + LinearSVC") for line in out)
    assert "the model is below the linear baseline: train again with trainer.max_epochs=2" in stdout
    first = out[out.index("next:") + 1]
    kept = [key for key in FAST if not key.startswith("trainer.max_epochs")]
    expected = ["python", "train.py", "data=csv_text", "model=text_bow", *kept]
    assert first.split("#")[0].split() == [*expected, "trainer.max_epochs=2"]


def test_the_sample_is_bounded_and_the_baseline_can_be_switched_off(tmp_path):
    summary = train_in_process(
        tmp_path / "run", "data=csv_text", "model=text_bow", "data.baseline_rows=50", *FAST
    )
    result = json.loads((tmp_path / "run" / "baseline.json").read_text())
    assert (result["train_rows"], result["eval_rows"], result["val_total"]) == (50, 50, 115)
    assert "baseline_acc" in summary
    off = train_in_process(
        tmp_path / "off", "data=csv_text", "model=text_bow", "data.baseline_rows=0", *FAST
    )
    assert "baseline_acc" not in off and not (tmp_path / "off" / "baseline.json").exists()


def test_evaluate_reports_the_baseline_on_the_split_and_on_a_csv(tmp_path):
    train_in_process(tmp_path / "run", "data=csv_text", "model=text_bow", *FAST)
    best = tmp_path / "run" / "checkpoints" / "best.pt"
    report = evaluate_checkpoint(best, output=tmp_path / "eval")
    found = report.metrics["baseline"]
    assert found["what"] == "validation texts" and found["eval_rows"] == 115
    assert found["model"]["accuracy"] == pytest.approx(report.metrics["accuracy"])
    assert any(line.startswith("baseline: TF-IDF + LinearSVC") for line in report.lines())
    from kiln.data.text_corpus import demo_corpus

    texts, labels = demo_corpus()
    csv = tmp_path / "labelled.csv"
    import pandas as pd

    pd.DataFrame({"text": texts[:40], "label": labels[:40]}).to_csv(csv, index=False)
    on_file = evaluate_checkpoint(best, data=csv, output=tmp_path / "eval2").metrics["baseline"]
    assert on_file["what"] == "evaluated texts" and on_file["eval_rows"] == 40


def test_the_server_of_a_text_model_imports_no_scikit_learn(tmp_path):
    train_in_process(tmp_path / "run", "data=csv_text", "model=text_bow", *FAST)
    best = tmp_path / "run" / "checkpoints" / "best.pt"
    code = (
        "import sys\n"
        "import kiln.inference.evaluate, kiln.inference.baseline\n"
        "from kiln.inference import Predictor\n"
        "from kiln.serving import create_app\n"
        f"create_app(Predictor.from_checkpoint({str(best)!r}))\n"
        "print('sklearn' in sys.modules)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=SUBPROCESS_ENV,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
