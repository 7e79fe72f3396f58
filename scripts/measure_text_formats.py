"""Two figures of docs/benchmarks.md's text sections, measured in fresh processes:

- `formats`: reading a large Parquet file through data=csv_text's reader (kiln.data.text_formats)
  row group by row group: rows/s, pyarrow's peak pool memory and the process's peak RSS, beside
  the RSS of the same imports alone;
- `baseline`: the linear baseline's cost (kiln.inference.baseline.compare: scikit-learn's
  import, TF-IDF + LinearSVC fit and predict) on N training and N validation texts of a generated
  corpus (long tickets, ~260 characters) and of a corpus of short one-line texts (~45).

    python scripts/measure_text_formats.py formats --rows 720000 --row-group 60000
    python scripts/measure_text_formats.py baseline --rows 10000
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

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


def write_parquet(path: Path, rows: int, row_group: int) -> None:
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    words = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor"
    words = words.split()
    rng = random.Random(0)
    schema = pa.schema([("text", pa.string()), ("label", pa.int64())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, row_group):
            count = min(row_group, rows - start)
            texts = [" ".join(rng.choices(words, k=150)) + f" {start + i}" for i in range(count)]
            table = pa.table({"text": texts, "label": [i % 4 for i in range(count)]})
            writer.write_table(table, row_group_size=row_group)


def formats(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big.parquet"
        write_parquet(path, args.rows, args.row_group)
        read = child(READ, str(path), "read")
        imports = child(READ, str(path), "imports")
        return {
            "file_mb": path.stat().st_size / 2**20,
            "row_group": args.row_group,
            **read,
            "rows_per_s": read["rows"] / read["seconds"],
            "imports_peak_rss_mb": imports["peak_rss_mb"],
        }


def baseline(args) -> dict:
    import random

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the corpora
    from kiln.data.text_corpus import ticket_rows
    from tests.package_text import corpus_rows

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        corpora = {
            "tickets (~260 characters)": ticket_rows(2 * args.rows),
            "errors (~45 characters)": corpus_rows("errors"),
        }
        for name, rows in corpora.items():
            rows = list(rows)
            random.Random(0).shuffle(rows)  # the corpus comes class by class
            rows = rows[: 2 * args.rows]
            path = Path(tmp) / "texts.json"
            path.write_text(json.dumps([[t for t, _ in rows], [y for _, y in rows]]))
            out[name] = child(FIT, str(path))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("formats", "baseline"))
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--row-group", type=int, default=60_000)
    args = parser.parse_args(argv)
    result = formats(args) if args.what == "formats" else baseline(args)
    print(json.dumps({**result, "load": os.getloadavg()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
