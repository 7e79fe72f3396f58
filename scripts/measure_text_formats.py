"""Two figures of docs/benchmarks.md's text sections, measured in fresh processes:

- `formats`: reading a large Parquet file through data=csv_text's reader (kiln.data.text_formats)
  row group by row group: rows/s, pyarrow's peak pool memory and the process's peak RSS, beside
  the RSS of the same imports alone;
- `baseline`: the linear baseline's cost (kiln.inference.baseline.compare: scikit-learn's
  import, TF-IDF + LinearSVC fit and predict) on N training and N validation texts of a generated
  corpus (long tickets, ~260 characters) and of a corpus of short one-line texts (~45), for
  each --rows.

Each prints its table under the provenance line (date, commit, machine) and, with --out, writes
it with the results as JSON (docs/benchmarks.md's are docs/figures/text_<what>.json):

    python scripts/measure_text_formats.py formats --rows 720000 --out text_formats.json
    python scripts/measure_text_formats.py baseline --rows 5000 10000 --out text_baseline.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from provenance import stamp, write_report  # noqa: E402

READ = """
import json, resource, sys, time
import pyarrow as pa
from kiln.data.csv_reader import CsvSettings, row_log
from kiln.data.text_formats import read_rows
start = time.perf_counter()
rows = 0
if sys.argv[2] == "read":
    for chunk in read_rows(sys.argv[1], CsvSettings("text", "label"), row_log("x"), "parquet"):
        rows += len(chunk.texts)
print(json.dumps({"rows": rows, "seconds": time.perf_counter() - start,
                  "pool_peak_mb": pa.default_memory_pool().max_memory() / 2**20,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""

FIT = """
import json, sys, time
start = time.perf_counter()
import numpy as np
from kiln.inference.baseline import compare
texts, labels = json.load(open(sys.argv[1]))
n = len(texts) // 2
names = sorted(set(labels))
y = np.array([names.index(x) for x in labels])
probs = np.eye(len(names))[y[n:]]
result = compare(texts[:n], y[:n], texts[n:], y[n:], probs, names)
print(json.dumps({"seconds": time.perf_counter() - start, "fit_predict_s": result["seconds"],
                  "accuracy": result["baseline"]["accuracy"], "train": n, "eval": len(texts) - n}))
"""


def child(code: str, *args: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-c", code, *args]
    done = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_parquet(path: Path, rows: int, row_group: int) -> int:
    """The file of `rows` texts of ~900 characters in row groups of `row_group`; returns the
    characters of text it holds."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    words = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor"
    words = words.split()
    rng = random.Random(0)
    characters = 0
    schema = pa.schema([("text", pa.string()), ("label", pa.int64())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, row_group):
            count = min(row_group, rows - start)
            texts = [" ".join(rng.choices(words, k=150)) + f" {start + i}" for i in range(count)]
            characters += sum(map(len, texts))
            table = pa.table({"text": texts, "label": [i % 4 for i in range(count)]})
            writer.write_table(table, row_group_size=row_group)
    return characters


def formats(args) -> dict:
    (rows,) = args.rows
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.parquet"
        characters = write_parquet(path, rows, args.row_group)
        read = child(READ, str(path), "read")
        imports = child(READ, str(path), "imports")
        return {
            "file_mb": path.stat().st_size / 2**20,
            "row_group": args.row_group,
            "text_mb": characters / 2**20,  # the texts are ASCII: a character is a byte
            **read,
            "rows_per_s": read["rows"] / read["seconds"],
            "imports_peak_rss_mb": imports["peak_rss_mb"],
        }


def baseline(args) -> dict:
    import random

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the corpora
    from kiln.data.text_corpus import ticket_rows
    from tests.package_text import corpus_rows

    out = []
    most = max(args.rows)
    corpora = {
        "errors (one-line messages)": list(corpus_rows("errors")),
        "tickets (generated, 2-5 lines)": list(ticket_rows(2 * most)),
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name, every in corpora.items():
            random.Random(0).shuffle(every)  # the corpus comes class by class
            done = set()
            for count in sorted(args.rows):
                rows = every[: 2 * count]
                if len(rows) in done:
                    continue  # a corpus smaller than this count: measured already
                done.add(len(rows))
                path = Path(tmp) / "texts.json"
                path.write_text(json.dumps([[t for t, _ in rows], [y for _, y in rows]]))
                result = child(FIT, str(path))
                characters = sum(len(t) for t, _ in rows) / len(rows)
                classes = len({y for _, y in rows})
                out.append({"corpus": name, "characters": characters, "classes": classes, **result})
    return out


def markdown(what: str, result, load: tuple[float, ...]) -> str:
    """The table of docs/benchmarks.md's "Text: other formats" or "Text: the linear baseline"."""
    lines = [stamp(load), ""]
    if what == "formats":
        r = result
        groups = -(-r["rows"] // r["row_group"])
        lines += [
            f"A {r['file_mb']:.0f} MiB Parquet file written by pyarrow ({r['rows']:,} rows, "
            f"{r['text_mb']:.0f} MiB of text, {groups} row groups of {r['row_group']:,} rows, "
            "snappy):",
            "",
            "| | figure |",
            "|---|---:|",
            f"| rows read, checked and cleaned | {r['rows']:,} in {r['seconds']:.1f} s "
            f"({r['rows_per_s']:,.0f} rows/s) |",
            f"| pyarrow's memory pool at its peak | {r['pool_peak_mb']:,.0f} MiB |",
            f"| the process's peak RSS | {r['peak_rss_mb']:,.0f} MiB |",
            "| the same process's imports alone (torch, pyarrow, kiln) | "
            f"{r['imports_peak_rss_mb']:,.0f} MiB |",
        ]
        return "\n".join(lines)
    lines += [
        "| corpus | training / scored texts | fit + predict | whole process (imports included) "
        "| baseline accuracy |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in result:
        corpus = f"{r['corpus']}, ~{r['characters']:.0f} characters, {r['classes']} classes"
        lines.append(
            f"| {corpus} | {r['train']:,} / {r['eval']:,} | {r['fit_predict_s']:.1f} s "
            f"| {r['seconds']:.1f} s | {r['accuracy']:.4f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("formats", "baseline"))
    parser.add_argument(
        "--rows",
        type=int,
        nargs="+",
        default=[10_000],
        help="formats: the file's rows; baseline: training texts, one run per value",
    )
    parser.add_argument("--row-group", type=int, default=60_000)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.what == "formats" and len(args.rows) != 1:
        parser.error("formats reads one file: give --rows one value")
    result = formats(args) if args.what == "formats" else baseline(args)
    load = os.getloadavg()
    report = {"what": args.what, "rows": args.rows, "result": result, "load_average": load}
    print(write_report(report, markdown(args.what, result, load), args.out), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
