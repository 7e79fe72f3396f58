"""scripts/bench_startup.py: a tiny run of the whole script (kiln and the plain loop, the
default run shortened, infer.py against the server on 100 texts), and its floor arithmetic on
made-up rounds. Speed is measured by the script, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_startup.py"
sys.path.insert(0, str(SCRIPT.parent))

import bench_startup  # noqa: E402
from bench_peers import Work  # noqa: E402

from kiln.startup import PHASES  # noqa: E402


@pytest.mark.slow  # 30-60 s: five processes and a server; the arithmetic below stays
def test_a_tiny_run_measures_every_side_and_reports_its_floors(tmp_path):
    out, table = tmp_path / "startup.json", tmp_path / "startup.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tiny",
            "--peers",
            "kiln,plain",
            "--works",
            "default,infer",
            "--rounds",
            "1",
            "--rows",
            "100",
            "--out",
            str(out),
            "--markdown",
            str(table),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr  # floors missed: only with --check
    report = json.loads(out.read_text())
    assert report["sides"] == ["kiln", "plain"] and report["not_run"] == ["lightning"]
    (kiln,) = report["training_rounds"]["default"]
    kiln, plain = kiln["kiln"], kiln["plain"]
    for side in (kiln, plain):
        assert 0 < side["launch_to_first_step_s"] < side["wall_s"]
    # kiln's own start-up line covers the same span as the launch-to-first-step clock
    assert list(kiln["startup_s"]) == [*PHASES, "total"]
    assert kiln["startup_s"]["total"] == pytest.approx(kiln["launch_to_first_step_s"], abs=0.5)
    assert kiln["checks_s"] >= kiln["probes_s"] > 0 and plain["checks_s"] == 0
    (infer,) = report["infer"]["rounds"]
    assert infer["same_labels"] == 100  # the same model, the same answers
    assert 0 < infer["infer"]["load_s"] < infer["infer"]["first_call_s"] < infer["infer"]["wall_s"]
    assert infer["server"]["answer_s"] > 0 and infer["import_torch_s"] > 0
    text = table.read_text()
    assert text.startswith("*Recorded ") and " commit " in text.splitlines()[0]
    assert "| floor | work | measured | met |" in text and "not run: lightning" in text
    assert {f["work"] for f in report["floors"]} == {"default", "infer"}


def fake_kiln(first_step: float, checks: float, step_s: float, per_epoch: int = 10) -> dict:
    ends = [first_step + i * step_s for i in range(per_epoch)]
    return {
        "launch_to_first_step_s": first_step,
        "checks_s": checks,
        "wall_s": first_step + 1,
        "ends": ends,
        "epochs": [0] * per_epoch,
        "batches_per_epoch": per_epoch,
        "startup_s": {**dict.fromkeys(PHASES, 0.5), "total": 3.0},
    }


def test_the_floors_take_each_round_s_ratio_and_the_first_epoch_at_kiln_s_step_time():
    work = Work("w", (), 10, 1)
    rounds = [
        {"kiln": fake_kiln(3.0, 0.1, 1.0), "lightning": fake_kiln(2.0, 0.5, 1.0)},
        {"kiln": fake_kiln(4.0, 0.3, 1.0), "lightning": fake_kiln(5.0, 0.5, 1.0)},
    ]
    row = bench_startup.summarize_work(rounds, ["kiln", "lightning"], work)
    assert row["kiln/lightning"]["first_step"]["values"] == [1.5, 0.8]  # within each round
    assert row["kiln"]["first_epoch_s"]["median"] == pytest.approx(10.0)  # 10 steps of 1 s
    floors = {f["floor"]: f for f in bench_startup.training_floors("w", row)}
    share = floors["pre-step phase <= 2% of the first epoch"]
    assert share["measured"] == "0.20 s = 2.0% of 10.00 s" and share["met"]
    assert floors["pre-step phase <= 15 s"]["met"]
    ratio = floors["kiln's first step <= 1.5x Lightning's"]
    assert ratio["measured"] == "1.15x (0.80-1.50)" and ratio["met"]
    for r in rounds:  # slow probes: both check floors missed
        r["kiln"]["checks_s"] = 20.0
    row = bench_startup.summarize_work(rounds, ["kiln", "lightning"], work)
    missed = [f["floor"] for f in bench_startup.training_floors("w", row) if not f["met"]]
    assert missed == ["pre-step phase <= 2% of the first epoch", "pre-step phase <= 15 s"]


def test_infer_floors_compare_its_start_with_torch_and_the_load_and_its_rate_with_the_server():
    def round_(first_call, predict, answer):
        return {
            "import_torch_s": 1.5,
            "infer": {
                "load_s": 0.5,
                "first_call_s": first_call,
                "predict_s": predict,
                "wall_s": first_call + predict + 0.2,
            },
            "server": {"ready_s": 3.0, "answer_s": answer},
        }

    table = bench_startup.summarize_infer([round_(3.0, 1.0, 1.0), round_(5.0, 3.0, 1.0)])
    assert table["start_ratio"]["values"] == [1.5, 2.5]
    met = {f["floor"].split(" <=")[0]: f["met"] for f in bench_startup.infer_floors(table)}
    assert met == {"infer.py's first model call": True, "infer.py's prediction": False}
