"""Benchmark kiln's text path on a CSV (default: generated issue-tracker tickets), in one run:

1. data path: rows/s for read + clean + tokenize, with the Rust tokenizer's batch encoding and
   with the plain-Python reference of the same BPE over the same vocabulary (their ids are
   checked identical), and their ratio;
2. padded share of the tokens in training batches: padding every batch to data.max_length, to
   the longest text of a random batch (dynamic), and of a length-bucketed batch;
3. quality on one split: validation accuracy and wall time of text_bow, text_transformer and a
   TF-IDF (word 1-2 grams) + logistic regression baseline (scikit-learn);
4. throughput: training samples/s of both text models;
5. optionally (--prepare-rows N): a generated N-row CSV prepared twice in fresh processes --
   peak memory against the file's size, and the first (read, clean, tokenize, cache) against
   the second (cache hit) preparation time.

Speed is reported as ratios measured in the same run, never asserted, unless --check (exit 1
when a floor is missed). Floors: Rust >= 10x Python; bucketed padding < 10%; text_bow at least
the baseline's accuracy in less wall time.

    python scripts/bench_text.py                               # 30,000 generated tickets
    python scripts/bench_text.py --csv my.csv --epochs 5 data.text_column=body
    python scripts/bench_text.py --rows 2000 --skip-models --prepare-rows 1000000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kiln.config import load_config
from kiln.data.bpe_reference import ReferenceBPE
from kiln.data.csv_reader import BadRowLog, read_labelled_rows
from kiln.data.csv_text import csv_settings, prepare
from kiln.data.loaders import BucketedSampler, ResumableSampler
from kiln.data.text_corpus import write_ticket_csv
from kiln.engine.run import train
from kiln.preprocessing.text import encode_ids

FLOORS = {"rust_over_python": 10.0, "bucketed_padding": 0.10}


def progress(message: str) -> None:
    print(f"[bench_text] {message}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", help="a CSV with text and label columns (default: generated)")
    parser.add_argument("--rows", type=int, default=30_000, help="rows of the generated CSV")
    parser.add_argument("--epochs", type=int, default=3, help="training epochs of each model")
    # One thread, as bench_engine: on a shared 2-core machine two intra-op threads wait on each
    # other and the timings swing by 5x.
    parser.add_argument(
        "--seeds", type=int, default=3, help="text_bow runs (seeds 0..N-1): mean accuracy"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's)")
    parser.add_argument("--skip-models", action="store_true", help="only the data sections")
    parser.add_argument("--prepare-rows", type=int, default=0, help="1M-row style memory test")
    parser.add_argument("--workdir", help="where CSVs, caches and runs go (default: a temp dir)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--check", action="store_true", help="exit 1 when a floor is missed")
    parser.add_argument(
        "overrides", nargs="*", help="extra Hydra overrides of both models' runs (data.*, ...)"
    )
    args = parser.parse_args(argv)
    if min(args.rows - 9, args.epochs, args.seeds, args.threads + 1, args.prepare_rows + 1) < 1:
        parser.error(
            "--rows >= 10, --epochs >= 1, --seeds >= 1, --threads >= 0, --prepare-rows >= 0"
        )
    return args


# ---------------------------------------------------------------------------------------------
# 1. The data path


def data_path(cfg, tokenizer_json: str) -> dict:
    """Rows/s for read + clean + tokenize, Rust batch encoding vs the Python reference."""
    from tokenizers import Tokenizer

    settings = csv_settings(cfg)
    tokenizer = Tokenizer.from_str(tokenizer_json)

    def run(tokenize) -> tuple[float, int, list]:
        start, ids = time.perf_counter(), []
        log = BadRowLog(cfg.train_path)
        for chunk in read_labelled_rows(cfg.train_path, settings, log):
            ids += tokenize(chunk.texts)
        return time.perf_counter() - start, log.rows_read, ids

    read_clean_s, rows, _ = run(lambda texts: [])
    rust_s, _, rust_ids = run(lambda texts: encode_ids(tokenizer, texts))
    reference = ReferenceBPE.from_tokenizer_json(tokenizer_json, cfg.max_length)
    python_s, _, python_ids = run(reference.encode_batch)
    uncached = ReferenceBPE.from_tokenizer_json(tokenizer_json, cfg.max_length)
    uncached.cache = _NoCache()
    python_nocache_s, _, _ = run(uncached.encode_batch)
    return {
        "rows": rows,
        "read_clean_rows_per_s": rows / read_clean_s,
        "rust_rows_per_s": rows / rust_s,
        "python_rows_per_s": rows / python_s,
        "python_nocache_rows_per_s": rows / python_nocache_s,
        "rust_over_python": python_s / rust_s,
        "rust_over_python_nocache": python_nocache_s / rust_s,
        "identical_ids": rust_ids == python_ids,
        "tokenizer_threads": os.environ.get("RAYON_NUM_THREADS", f"{os.cpu_count()} (all)"),
    }


class _NoCache(dict):
    """A word cache that never keeps anything: the reference without its one optimisation."""

    def __setitem__(self, key, value):
        pass


# ---------------------------------------------------------------------------------------------
# 2. Padding


def padding(lengths: np.ndarray, batch_size: int, max_length: int, seed: int = 0) -> dict:
    def frac(order: list[int], pad_to=None) -> float:
        real = padded = 0
        for start in range(0, len(order), batch_size):
            batch = lengths[order[start : start + batch_size]]
            real += int(batch.sum())
            padded += len(batch) * (pad_to or int(batch.max()))
        return 1 - real / padded

    shuffled = list(
        ResumableSampler(range(len(lengths)), num_replicas=1, rank=0, shuffle=True, seed=seed)
    )
    bucketed = list(
        BucketedSampler(lengths, batch_size=batch_size, num_replicas=1, rank=0, seed=seed)
    )
    return {
        "pad_to_max": frac(shuffled, pad_to=max_length),
        "dynamic": frac(shuffled),
        "bucketed": frac(bucketed),
        "batch_size": batch_size,
        "max_length": max_length,
    }


# ---------------------------------------------------------------------------------------------
# 3-4. Quality and throughput


def kiln_model(name: str, overrides: list[str], run_dir: Path, seeds: int = 1) -> dict:
    """The model trained through kiln's train() (what train.py runs), once per seed: the mean
    validation accuracy, the median wall time and samples/s of a run."""
    runs = []
    for seed in range(seeds):
        cfg = load_config(["data=csv_text", f"model={name}", "logger=none", *overrides])
        cfg.seed = seed
        start = time.perf_counter()
        summary = train(cfg, run_dir / f"seed{seed}")
        runs.append({**summary, "wall_s": time.perf_counter() - start})
    return {
        "val_acc": float(np.mean([r["val_acc"] for r in runs])),
        "val_acc_runs": [r["val_acc"] for r in runs],
        "wall_s": float(np.median([r["wall_s"] for r in runs])),
        "samples_per_s": float(np.median([r["samples_per_s"] for r in runs])),
        "steps": runs[0]["steps"],
    }


def tfidf_baseline(cfg, train_rows: np.ndarray, val_rows: np.ndarray, labels: np.ndarray):
    """TF-IDF of word 1-2 grams + logistic regression on the same cleaned texts and split."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    texts = []
    for chunk in read_labelled_rows(cfg.train_path, csv_settings(cfg), BadRowLog("")):
        texts += chunk.texts  # the store's rows are the kept rows, in file order
    train_texts, val_texts = [texts[i] for i in train_rows], [texts[i] for i in val_rows]
    start = time.perf_counter()
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=2)
    classifier = LogisticRegression(max_iter=1000)
    classifier.fit(vectorizer.fit_transform(train_texts), labels[train_rows])
    accuracy = classifier.score(vectorizer.transform(val_texts), labels[val_rows])
    return {"val_acc": float(accuracy), "wall_s": time.perf_counter() - start}


# ---------------------------------------------------------------------------------------------
# 5. Streaming a large CSV

CHILD = """
import json, resource, sys, time
from kiln.config import load_config
from kiln.data.csv_text import prepare
start = time.perf_counter()
entry, report = prepare(load_config(sys.argv[1:]).data)
print(json.dumps({"prepare_s": time.perf_counter() - start, "hit": report["cache"]["hit"],
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "rows": len(entry.store), "cache_dir": report["cache"]["dir"]}))
"""
# The same imports, nothing prepared: what the interpreter, torch and pandas cost by themselves.
IMPORTS_ONLY = (
    CHILD.split("start =")[0]
    + """
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""
)


def streaming(rows: int, workdir: Path, overrides: list[str]) -> dict:
    path = workdir / f"tickets-{rows}.csv"
    if not path.exists():
        progress(f"writing {rows} rows to {path}")
        write_ticket_csv(path, rows, seed=1)
    cache = workdir / "stream-cache"
    args = [
        "data=csv_text",
        "model=text_bow",
        f"data.train_path={path}",
        f"data.cache_dir={cache}",
        *overrides,
    ]
    runs = []
    for attempt in ("first", "second"):
        progress(f"preparing {path.name} in a fresh process ({attempt} run)")
        done = subprocess.run(
            [sys.executable, "-c", CHILD, *args], capture_output=True, text=True, check=True
        )
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    baseline = subprocess.run(
        [sys.executable, "-c", IMPORTS_ONLY],
        capture_output=True,
        text=True,
        check=True,
    )
    cache_mb = sum(f.stat().st_size for f in Path(runs[0]["cache_dir"]).iterdir()) / 2**20
    return {
        "rows": rows,
        "file_mb": path.stat().st_size / 2**20,
        "cache_mb": cache_mb,
        "first": runs[0],
        "second": runs[1],
        "import_only_peak_rss_mb": json.loads(baseline.stdout)["peak_rss_mb"],
    }


# ---------------------------------------------------------------------------------------------
# Report


def table(result: dict) -> str:
    lines = []
    data = result["data_path"]
    lines += [
        "| data path (read + clean + tokenize) | rows/s |",
        "|---|---:|",
        f"| read + clean only | {data['read_clean_rows_per_s']:,.0f} |",
        f"| + Rust BPE (batch encoding) | {data['rust_rows_per_s']:,.0f} |",
        f"| + Python BPE (same vocabulary, word cache) | {data['python_rows_per_s']:,.0f} |",
        f"| + Python BPE, no word cache | {data['python_nocache_rows_per_s']:,.0f} |",
        f"| ratio Rust / Python (no cache) | {data['rust_over_python']:.2f}x "
        f"({data['rust_over_python_nocache']:.2f}x) |",
        f"| identical ids | {data['identical_ids']} |",
        "",
    ]
    pad = result["padding"]
    lines += [
        f"| padded share of tokens (batch {pad['batch_size']}) | |",
        "|---|---:|",
        f"| pad to max_length ({pad['max_length']}) | {pad['pad_to_max']:.1%} |",
        f"| dynamic (longest in a random batch) | {pad['dynamic']:.1%} |",
        f"| bucketed by length | {pad['bucketed']:.1%} |",
        "",
    ]
    if "quality" in result:
        lines += [
            f"| model ({result['epochs']} epochs; same split) | val_acc | wall s | "
            "train samples/s |",
            "|---|---:|---:|---:|",
        ]
        for name, row in result["quality"].items():
            speed = f"{row['samples_per_s']:,.0f}" if "samples_per_s" in row else "-"
            runs = row.get("val_acc_runs", [])
            spread = (
                f" ({min(runs):.4f}-{max(runs):.4f}, {len(runs)} seeds)" if len(runs) > 1 else ""
            )
            lines.append(
                f"| {name} | {row['val_acc']:.4f}{spread} | {row['wall_s']:.1f} | {speed} |"
            )
        lines.append(
            f"(validation: {result['val_rows']} rows; a 95% interval is about "
            f"+-{1.96 * (0.25 / result['val_rows']) ** 0.5:.3f} at accuracy 0.5, less near 1)"
        )
        lines.append("")
    if "streaming" in result:
        s = result["streaming"]
        lines += [
            f"| {s['rows']:,} rows, {s['file_mb']:.0f} MB CSV | prepare s | peak RSS MB |",
            "|---|---:|---:|",
            f"| first run (read, clean, tokenize, cache) | {s['first']['prepare_s']:.1f} | "
            f"{s['first']['peak_rss_mb']:.0f} |",
            f"| second run (cache hit) | {s['second']['prepare_s']:.1f} | "
            f"{s['second']['peak_rss_mb']:.0f} |",
            f"| imports only | | {s['import_only_peak_rss_mb']:.0f} |",
            f"| token cache on disk | | {s['cache_mb']:.0f} MB |",
            "",
        ]
    lines += ["| floor | measured | met |", "|---|---:|---|"]
    for name, (measured, met) in result["floors"].items():
        lines.append(f"| {name} | {measured} | {'yes' if met else 'NO'} |")
    return "\n".join(lines)


def floors(result: dict) -> dict:
    data, pad = result["data_path"], result["padding"]
    out = {
        "Rust >= 10x Python": (
            f"{data['rust_over_python']:.2f}x",
            data["rust_over_python"] >= FLOORS["rust_over_python"],
        ),
        "bucketed padding < 10%": (
            f"{pad['bucketed']:.1%}",
            pad["bucketed"] < FLOORS["bucketed_padding"],
        ),
    }
    if "quality" in result:
        bow, tfidf = result["quality"]["text_bow"], result["quality"]["tfidf_logreg"]
        out["text_bow accuracy >= TF-IDF"] = (
            f"{bow['val_acc']:.4f} vs {tfidf['val_acc']:.4f}",
            bow["val_acc"] >= tfidf["val_acc"],
        )
        out["text_bow wall < TF-IDF"] = (
            f"{bow['wall_s']:.1f} s vs {tfidf['wall_s']:.1f} s",
            bow["wall_s"] < tfidf["wall_s"],
        )
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_text-"))
    workdir.mkdir(parents=True, exist_ok=True)
    csv_path = Path(args.csv) if args.csv else workdir / f"tickets-{args.rows}.csv"
    if not args.csv:
        progress(f"generating {args.rows} tickets in {csv_path}")
        write_ticket_csv(csv_path, args.rows)
    overrides = [
        f"data.train_path={csv_path}",
        f"data.cache_dir={workdir / 'cache'}",
        *args.overrides,
    ]
    cfg = load_config(["data=csv_text", "model=text_bow", *overrides]).data
    progress("preparing the token store (read, clean, train the tokenizer, encode, cache)")
    entry, report = prepare(cfg)
    result = {
        "csv": str(csv_path),
        "prepare_s": report["prepare_s"],
        "epochs": args.epochs,
        "val_rows": len(entry.val_rows),
    }
    progress("data path: Rust vs Python tokenization")
    result["data_path"] = data_path(cfg, entry.tokenizer_json)
    lengths = entry.store.lengths(entry.train_rows)
    result["padding"] = padding(lengths, cfg.batch_size, cfg.max_length)
    if not args.skip_models:
        train_args = [*overrides, f"trainer.max_epochs={args.epochs}", "env.progress_bar=false"]
        quality = {}
        for name, seeds in (("text_bow", args.seeds), ("text_transformer", 1)):
            progress(f"training {name} for {args.epochs} epochs ({seeds} seed(s))")
            quality[name] = kiln_model(name, train_args, workdir / "runs" / name, seeds)
        progress("TF-IDF + logistic regression")
        quality["tfidf_logreg"] = tfidf_baseline(
            cfg, entry.train_rows, entry.val_rows, entry.store.labels
        )
        result["quality"] = quality
    if args.prepare_rows:
        result["streaming"] = streaming(args.prepare_rows, workdir, args.overrides)
    result["floors"] = floors(result)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(table(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    missed = [name for name, (_, met) in result["floors"].items() if not met]
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
