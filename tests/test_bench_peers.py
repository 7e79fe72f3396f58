"""scripts/bench_peers.py on a tiny setting, without Lightning: its table and its loss check, not
its speed (speed is measured by the script, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "bench_peers.py"
sys.path.insert(0, str(SCRIPT.parent))

import bench_peers  # noqa: E402


@pytest.mark.slow  # 12 s: the whole script; the ratio and slowdown arithmetic below stays
def test_kiln_and_a_plain_loop_train_the_same_losses_and_the_table_says_so(tmp_path):
    out, table = tmp_path / "peers.json", tmp_path / "peers.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--tiny",
            "--works",
            "mlp",
            "--peers",
            "kiln,plain",
            "--rounds",
            "1",
            "--mlp-steps",
            "26",
            "--out",
            str(out),
            "--markdown",
            str(table),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["sides"] == ["kiln", "plain"] and report["not_run"] == ["lightning"]
    (round_,) = report["rounds"]
    kiln, plain = round_["mlp"]["kiln"], round_["mlp"]["plain"]
    # 26 steps of 64 cross an epoch end (22 full batches and a partial one per epoch): the
    # second epoch's shuffle and the evaluation between them are in the comparison too.
    assert kiln["num_steps"] == plain["num_steps"] == 26 and len(set(kiln["epochs"])) == 2
    assert kiln["losses"] == plain["losses"]  # bitwise: the same arithmetic in the same order
    check = round_["mlp"]["loss_check"]["plain"]
    assert check == {"steps": 26, "bitwise": True, "within": True, "max_abs_diff": 0.0}
    for side in (kiln, plain):
        assert side["steps_sps"] > 0 and side["steps_cpu_sps"] > 0 and side["run_sps"] > 0
        assert side["wall_s"] > side["run_s"] > side["to_first_step_s"] > 0
    text = table.read_text()
    assert text in proc.stdout
    stamp, blank, header, rule, *rows = text.splitlines()[:8]
    # as docs/benchmarks.md holds a table: when, at which commit, on what machine
    assert stamp.startswith("*Recorded ") and " commit " in stamp and blank == ""
    assert header == "| work | measure | kiln | plain | kiln / plain |"
    assert [row.split(" | ")[1] for row in rows] == [
        "samples/s, training steps",
        "samples per CPU-s, training steps",
        "samples/s, whole run",
        "wall s, whole process",
    ]
    assert "loss check, mlp, plain vs kiln: bitwise equal over 26 steps x 1 rounds" in text
    assert "not run: lightning (--peers)" in text and "load average" in text
    # The plain loop stepped torch's own AdamW, as its users write it: the same losses.
    assert report["peer_optimizer"] == "torch" and "the peers' optimizer: torch's class" in text
    assert kiln["probes_s"] > 0 and kiln["flops_s"] > 0  # timed by the trainer itself
    assert "kiln's start-up checks, mlp (rule 1 and 3 probes, FLOP count): " in text


def fake_round(kiln_sps: float, plain_sps: float, plain_losses: list[float]) -> dict:
    def side(sps: float, losses: list[float]) -> dict:
        return {
            "steps_sps": sps,
            "steps_cpu_sps": sps,
            "run_sps": sps / 2,
            "wall_s": 1000 / sps,
            "run_s": 10.0,
            "probes_s": 0.1,
            "flops_s": 0.1,
            "losses": losses,
        }

    losses = [2.0, 1.5, 1.0]
    return {
        "mlp": {
            "kiln": side(kiln_sps, losses),
            "plain": side(plain_sps, plain_losses),
            "loss_check": {"plain": bench_peers.loss_check(losses, plain_losses, 1e-6)},
        }
    }


def test_ratios_are_per_round_and_a_loss_difference_fails_the_check():
    rounds = [fake_round(100, 200, [2.0, 1.5, 1.0]), fake_round(300, 200, [2.0, 1.5, 1.01])]
    table = bench_peers.summarize(rounds, ["kiln", "plain"], ["mlp"])
    ratio = table["mlp"]["metrics"]["steps_sps"]["kiln/plain"]
    assert ratio["values"] == [0.5, 1.5]  # within each round, not the ratio of the medians
    assert (ratio["min"], ratio["median"], ratio["max"]) == (0.5, 1.0, 1.5)
    checks = table["mlp"]["loss_check"]["plain"]
    assert [c["bitwise"] for c in checks] == [True, False]
    assert [c["within"] for c in checks] == [True, False]
    text = bench_peers.markdown(
        table, {"mlp": bench_peers.works(True, 4, 30)["mlp"]}, ["kiln", "plain"], "a note"
    )
    assert "max |diff| 0.01" in text and "OUTSIDE the tolerance" in text
    assert "FLOP count): 0.20 s, 2.0% of kiln's run" in text
    # Different step counts are a failed check, not an exception.
    assert bench_peers.loss_check([1.0, 2.0], [1.0], 1e-6)["within"] is False


def test_contention_slowdowns_are_loaded_over_quiet_within_each_round():
    def side(wall: float, sps: float, threads: int) -> dict:
        return {"wall_s": wall, "steps_sps": sps, "threads": threads}

    rounds = [
        {
            "mlp": {
                "kiln": side(2.0, 100, 1),
                "kiln+busy": side(2.2, 90, 1),
                "plain": side(2.0, 100, 2),
                "plain+busy": side(5.0, 40, 2),
            }
        },
        {
            "mlp": {
                "kiln": side(4.0, 50, 1),
                "kiln+busy": side(4.8, 45, 1),
                "plain": side(1.0, 200, 2),
                "plain+busy": side(1.1, 190, 2),
            }
        },
    ]
    table = bench_peers.contention_summary(rounds, ["kiln", "plain"], ["mlp"])
    kiln, plain = table["mlp"]["kiln"], table["mlp"]["plain"]
    assert kiln["slowdown_wall"]["values"] == [2.2 / 2.0, 4.8 / 4.0]  # never across rounds
    assert plain["slowdown_wall"]["values"] == [2.5, 1.1 / 1.0]
    assert kiln["slowdown_steps"]["values"] == [100 / 90, 50 / 45]
    assert kiln["threads"] == [1, 1] and plain["loaded_threads"] == [2, 2]
    floors = bench_peers.contention_floors(table)
    measured, met = floors["mlp: kiln's slowdown <= the plain loop's"]
    assert met == (kiln["slowdown_wall"]["median"] <= plain["slowdown_wall"]["median"])
    assert measured == f"{kiln['slowdown_wall']['median']:.2f}x vs 1.80x"
    works = {"mlp": bench_peers.works(True, 4, 30)["mlp"]}
    text = bench_peers.contention_markdown(table, works, ["kiln", "plain"], busy=1)
    assert "| digits MLP, batch 64 | kiln | 1 / 1 |" in text and "wall s beside 1 busy" in text
    assert "| mlp: kiln's slowdown <= the plain loop's |" in text
