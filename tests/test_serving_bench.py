"""scripts/loadtest.py and scripts/bench_infer.py run end to end on tiny checkpoints, and fail
when they should: a wrong answer from the server, a floor not met under --check, ONNX Runtime
disagreeing with torch. Speed is reported, never asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from .bench_tables import markdown_tables, number
from .conftest import SUBPROCESS_ENV
from .inference_helpers import digits_run, text_run

REPO = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(REPO / "scripts" / name), *args]
    return subprocess.run(
        cmd, cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def digits_ckpt(tmp_path_factory) -> Path:
    run_dir, _ = digits_run(tmp_path_factory)
    return run_dir / "checkpoints" / "best.pt"


@pytest.mark.slow  # 13 s: a server process and the load test against it
def test_loadtest_checks_every_answer_and_reports_the_floors(digits_ckpt, tmp_path):
    out = tmp_path / "load.json"
    done = run_script(
        "loadtest.py",
        "--ckpt",
        f"mlp={digits_ckpt}",
        "--modes",
        "batched,echo",
        "--concurrency",
        "1,4",
        "--requests",
        "16",
        "--rounds",
        "2",
        "--floor-concurrency",
        "4",
        "--out",
        str(out),
        "--check",
        "--min-ceiling-ratio",
        "1e9",  # a floor nobody meets
        "--markdown",
    )
    assert done.returncode == 1, done.stdout + done.stderr  # --check: the floor was not met
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) == 2 * 2 * 2  # modes x formats x concurrencies
    assert result["wrong_answers"] == 0
    assert all(r["errors"] == 0 and r["mismatches"] == 0 and r["requests"] == 16 for r in rows)
    assert all(r["requests_per_s"] > 0 and r["p50_ms"] <= r["p99_ms"] for r in rows)
    floors = {f["name"]: f for f in result["floors"]}
    ceiling = floors["mlp binary: batched / echo ceiling at concurrency 4"]
    by = {(r["mode"], r["format"], r["concurrency"]): r for r in rows}
    expected = (
        by["batched", "binary", 4]["requests_per_s"] / by["echo", "binary", 4]["requests_per_s"]
    )
    assert math.isclose(ceiling["value"], expected) and ceiling["met"] is False
    assert "mlp: binary / JSON throughput at concurrency 4" in floors
    assert "NOT met" in done.stdout
    # --markdown: the tables as docs/benchmarks.md holds them, their numbers the JSON's
    (header, table), (floor_header, floor_table) = markdown_tables(done.stdout)
    assert header == [
        "model",
        "mode",
        "format",
        "c",
        "req/s",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "model call ms",
        "inputs/call",
        "wrong",
    ]
    assert len(table) == len(rows)
    for line, row in zip(table, rows, strict=True):
        assert [line["model"], line["mode"], line["format"], int(line["c"])] == [
            row["model"],
            row["mode"],
            row["format"],
            row["concurrency"],
        ]
        assert number(line["req/s"]) == pytest.approx(row["requests_per_s"], abs=0.05)
        assert number(line["p99 ms"]) == pytest.approx(row["p99_ms"], abs=0.05)
        assert number(line["inputs/call"]) >= 1 and number(line["wrong"]) == 0
    assert floor_header == ["floor", "measured", "at least", "met", "from"]
    listed = {line["floor"]: line for line in floor_table}
    assert listed.keys() == floors.keys()
    assert listed[ceiling["name"]]["met"] == "NOT met"
    assert number(listed[ceiling["name"]]["measured"]) == pytest.approx(expected, abs=0.005)


@pytest.mark.slow  # a server process of its own; --check already shows the script can fail
def test_loadtest_fails_on_a_wrong_answer(digits_ckpt, tmp_path):
    """Answers are checked against offline predictions: served from one checkpoint and checked
    against another, every answer is wrong and the exit status says so."""
    checkpoint = torch.load(digits_ckpt, weights_only=True)
    checkpoint["model"] = {k: torch.randn_like(v) for k, v in checkpoint["model"].items()}
    other = tmp_path / "other.pt"
    torch.save(checkpoint, other)
    done = run_script(
        "loadtest.py",
        "--ckpt",
        f"mlp={digits_ckpt}",
        "--reference",
        str(other),
        "--modes",
        "batched",
        "--formats",
        "binary",
        "--concurrency",
        "2",
        "--requests",
        "8",
    )
    assert done.returncode == 1
    assert "differed from the offline predictions" in done.stdout


@pytest.mark.slow  # three server processes, both formats, four concurrencies
def test_loadtest_all_modes(digits_ckpt, tmp_path):
    out = tmp_path / "load.json"
    done = run_script(
        "loadtest.py", "--ckpt", f"mlp={digits_ckpt}", "--requests", "64", "--out", str(out)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert len(result["rows"]) == 3 * 2 * 4 and result["wrong_answers"] == 0


@pytest.mark.slow  # 7 s: the whole script, three backends
def test_bench_infer_compares_eager_fp32_and_int8(digits_ckpt, tmp_path_factory, tmp_path):
    text_dir, _ = text_run(tmp_path_factory)
    out = tmp_path / "bench.json"
    done = run_script(
        "bench_infer.py",
        "--ckpt",
        f"mlp={digits_ckpt}",
        "--ckpt",
        f"text_bow={text_dir / 'checkpoints' / 'best.pt'}",
        "--repeats",
        "3",
        "--out",
        str(out),
        "--markdown",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # --markdown: the table as docs/benchmarks.md holds it, with when, which commit, where
    assert "*Recorded " in done.stdout and "| mlp | eager | 1 |" in done.stdout
    report = json.loads(out.read_text())
    assert report["markdown"].startswith("*Recorded ")  # docs/benchmarks.md's figures block
    rows = report["rows"]
    assert {(r["model"], r["backend"], r["batch_size"]) for r in rows} == {
        (m, b, n)
        for m in ("mlp", "text_bow")
        for b in ("eager", "onnx_fp32", "onnx_int8")
        for n in (1, 32)
    }
    for r in rows:
        eager = next(
            e
            for e in rows
            if e["model"] == r["model"]
            and e["batch_size"] == r["batch_size"]
            and e["backend"] == "eager"
        )
        assert math.isclose(r["ratio_to_eager"], eager["median_ms"] / r["median_ms"])
        if r["backend"] == "onnx_fp32":
            assert r["agreement"] <= 1e-4
    impossible = run_script(
        "bench_infer.py",
        "--ckpt",
        f"mlp={digits_ckpt}",
        "--repeats",
        "2",
        "--check",
        "--min-ratio",
        "1e9",
    )
    assert impossible.returncode == 1 and "below 1e+09x eager" in impossible.stdout


def test_peer_ratios_are_per_round_and_against_kiln():
    """loadtest.py --peers: each round's ratio pairs kiln with the peer of the same round (the
    LitServe venv and wrk themselves are exercised by `make bench`, not here: they install)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from loadtest_peers import PeerRound, summary, table
    from provenance import stamp

    def round_(server, r, rps, p99):
        return PeerRound("mlp", server, 32, r, int(rps), rps, p99 / 2, p99, 0, 1.5)

    rounds = [round_("kiln", 0, 200, 10), round_("litserve", 0, 100, 20)]
    rounds += [round_("litserve", 1, 150, 15), round_("kiln", 1, 300, 30)]
    (row,) = summary(rounds)
    assert row["rps_ratios"] == [2.0, 2.0] and row["p99_ratios"] == [2.0, 0.5]
    assert row["kiln_requests_per_s"] == 250 and row["peer_requests_per_s"] == 125
    assert row["peer"] == "litserve" and row["load_avg_1m"] == [1.5] * 4
    # what --peers --markdown prints after the stamp
    ((header, (line,)),) = markdown_tables(stamp() + "\n\n" + table([row]))
    assert header[:5] == ["model", "c", "peer", "kiln req/s", "peer req/s"]
    assert [number(line["kiln req/s"]), number(line["peer req/s"])] == [250, 125]
    assert line["req/s kiln / peer, per round"] == "2.00 2.00"
    assert line["p99 peer / kiln, per round"] == "2.00 0.50" and line["load avg"] == "1.5-1.5"
