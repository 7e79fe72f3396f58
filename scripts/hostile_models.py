"""Hostile model=hf folders (issue 46): how fast, and in how little memory, kiln refuses each.

Each case is a copy of a tiny BERT folder (tests/hf_helpers.py builds them) with one size made
hostile: config.json asking for hidden_size 10^6, vocab_size 10^9, max_position_embeddings 10^9
or 10^4 layers of BERT-base width, a 200 MB tokenizer.json, a 100 MB config.json, a weights file
larger than this machine's memory (the files are sparse: large by their size, no disk). Each is
checked in a fresh process by what `train.py` runs at start-up
(kiln.models.zoo.transformers.hf_preprocessing), one after another in one fresh process that
has imported torch and transformers and checked the good folder once (the floor): each check's
time, and how far its peak RSS (ru_maxrss) rose. With --train each case also runs
`python train.py` whole: its wall time, its peak RSS (wait4's ru_maxrss) and its exit status.

    python scripts/hostile_models.py                   # the table, as Markdown
    python scripts/hostile_models.py --train --out docs/figures/hostile_models.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # tests.hf_helpers: the builders the tests use too
sys.path.insert(0, str(REPO_ROOT / "scripts"))  # provenance: the stamp and the JSON report

from provenance import stamp, write_report  # noqa: E402

from tests.hf_helpers import sized_config, sparse_file, write_bert  # noqa: E402  (after the path)

CHILD = """
import json, resource, sys, time
from kiln.config import load_config
from kiln.config.base import ConfigError
from kiln.models.zoo.transformers import hf_preprocessing

def check(folder):
    cfg = load_config(["data=csv_text", "model=hf", f"model.arch={folder}"])
    started = time.perf_counter()
    try:
        hf_preprocessing(cfg.model)
        outcome = "accepted"
    except ConfigError as err:
        outcome = str(err)
    return time.perf_counter() - started, outcome

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

check(sys.argv[1])  # the good folder: every import and the first meta build are paid here
floor = peak()
results = {}
for folder in sys.argv[2:]:
    before = peak()
    seconds, outcome = check(folder)
    results[folder] = {"seconds": seconds, "floor_mib": floor, "outcome": outcome,
                       "above_floor_mib": peak() - before}
print(json.dumps(results))
"""
TEXTS = ["the ndarray broadcast along an axis", "a session cookie in the request header"] * 20


def cases(work: Path) -> dict[str, Path]:
    """name -> a hostile folder, written under `work` (and the good one, "good")."""
    from kiln.threads import available_memory

    good = write_bert(work / "good", TEXTS)
    folders = {"good": good}
    for key, value in (
        ("hidden_size", 10**6),
        ("vocab_size", 10**9),
        ("max_position_embeddings", 10**9),
    ):
        folders[f"{key}={value:.0e}"] = sized_config(good, work / key, **{key: value})
    folders["num_hidden_layers=1e+04 (BERT-base width)"] = sized_config(
        good,
        work / "layers",
        num_hidden_layers=10**4,
        hidden_size=768,
        intermediate_size=3072,
        num_attention_heads=12,
    )
    tokenizer = sized_config(good, work / "tokenizer")
    sparse_file(tokenizer / "tokenizer.json", 200 * 2**20)
    folders["tokenizer.json of 200 MB"] = tokenizer
    config = sized_config(good, work / "config")
    sparse_file(config / "config.json", 100 * 2**20)
    folders["config.json of 100 MB"] = config
    weights = sized_config(good, work / "weights")
    # twice what is free now, not just past it: memory freed before the check (another process
    # ending) must not bring the file back under it (a CI run saw this case accepted)
    sparse_file(weights / "model.safetensors", 2 * available_memory() + 2**30)
    folders["model.safetensors past the memory"] = weights
    return folders


def check_in_child(good: Path, folders: list[Path]) -> dict[str, dict]:
    """{folder: seconds, floor_mib, above_floor_mib, outcome}: each folder checked in turn by
    one fresh process, after it checked `good` (the floor). Peaks only grow, so a case's peak
    above the floor is the growth of ru_maxrss during its own check."""
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(good), *map(str, folders)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def train_whole(folder: Path, run_dir: Path) -> dict:
    """`python train.py` on the folder: wall time, peak RSS (wait4), exit status, last line."""
    command = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        "data=csv_text",
        "model=hf",
        f"model.arch={folder}",
        f"hydra.run.dir={run_dir}",
        "trainer.max_steps=1",
        "env.progress_bar=false",
    ]
    started = time.perf_counter()
    with open(os.devnull, "w") as sink, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stdout=sink, stderr=err, cwd=REPO_ROOT, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        last = (err.read().strip().splitlines() or [""])[-1]
    return {
        "train_seconds": time.perf_counter() - started,
        "train_peak_mib": usage.ru_maxrss / 1024,
        "exit": proc.returncode,
        "last_line": last,
    }


def measure(work: Path, *, train: bool, only: list[str] | None = None) -> dict[str, dict]:
    folders = cases(work)
    chosen = {
        name: folder
        for name, folder in folders.items()
        if name != "good" and (not only or any(o in name for o in only))
    }
    checked = check_in_child(folders["good"], list(chosen.values()))
    results = {name: checked[str(folder)] for name, folder in chosen.items()}
    if train:
        for name, folder in chosen.items():
            results[name].update(train_whole(folder, work / "runs" / folder.name))
    return results


def markdown(results: dict[str, dict]) -> str:
    header = "| folder | refused in | peak RSS above the floor | train.py: wall, peak RSS, exit |"
    lines = [stamp(), "", header, "|---|---:|---:|---|"]
    for name, r in results.items():
        whole = (
            f"{r['train_seconds']:.1f} s, {r['train_peak_mib']:.0f} MiB, {r['exit']}"
            if "exit" in r
            else ""
        )
        lines.append(
            f"| {name} | {r['seconds'] * 1000:.0f} ms | {r['above_floor_mib']:.1f} MiB | {whole} |"
        )
    floor = max(r["floor_mib"] for r in results.values())
    lines += ["", f"The floor (torch, transformers and one good folder's check): {floor:.0f} MiB."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train", action="store_true", help="also run train.py on each folder")
    parser.add_argument("--only", nargs="*", help="cases whose name holds one of these")
    parser.add_argument(
        "--out",
        type=Path,
        help="write the results as JSON here: each case's, and the table (docs/ reads it)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        results = measure(Path(work), train=args.train, only=args.only)
    report = {"train": args.train, "cases": results}
    print(write_report(report, markdown(results), args.out), end="")


if __name__ == "__main__":
    main()
