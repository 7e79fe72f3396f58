"""What reading a COCO-2017-sized annotation file costs kiln (data=coco's reader, element by
element: kiln.data.coco.read_coco_file) and pycocotools (`COCO(path)`: json.load and its
indexes), each in a fresh process: peak RSS (ru_maxrss) and wall time; and how fast kiln refuses
the hostile annotation inputs of issue 46 (tests/hostile_inputs.py builds them).

    python scripts/measure_annotation_memory.py --out docs/figures/annotation_memory.json
    python scripts/measure_annotation_memory.py --workdir annotations --only-refusals

The synthetic file has COCO 2017 train's shape: 118,287 images, 7 boxes each with a polygon of
26 points (COCO's own: 860,001 annotations, 448 MiB), written into --workdir (kept there for the
next run; a temporary folder by default). Prints the Markdown tables under the provenance line
(date, commit, machine) and writes them with the results as JSON (--out)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.hostile_inputs: the builders the tests use too
sys.path.insert(0, str(REPO / "scripts"))  # provenance: the stamp and the JSON report

from provenance import stamp, write_report  # noqa: E402

from tests.hostile_inputs import deep_json, write_coco_like, yaml_bomb  # noqa: E402

CHILD = """
import json, resource, sys, time
started = time.perf_counter()
kind, path = sys.argv[1], sys.argv[2]
if kind == "kiln":
    from kiln.data.coco import read_coco_file
    coco = read_coco_file(__import__("pathlib").Path(path), "train_json", 2**31)
    count = len(coco.annotation_ids)
else:
    from pycocotools.coco import COCO
    count = len(COCO(path).anns)
print(json.dumps({"s": time.perf_counter() - started, "annotations": count,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""
IMPORTS = """
import json, resource
from kiln.data.coco import read_coco_file
from pycocotools.coco import COCO
print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""
REFUSE = """
import json, sys, time
from pathlib import Path
from kiln.config import load_config
from kiln.data import build_data
from kiln.errors import UserError
started = time.perf_counter()
try:
    bundle = build_data(load_config(sys.argv[1:]).data)
    dropped = [line for line in (bundle.report or {}).get("summary", []) if "dropped (" in line]
    outcome = "accepted" + (": " + "; ".join(dropped) if dropped else "")
except UserError as err:
    outcome = str(err)
print(json.dumps({"s": time.perf_counter() - started, "outcome": outcome}))
"""


def run(code: str, *args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def hostile_cases(out: Path, big: Path) -> dict:
    """name -> overrides of a run whose data is one hostile input (built under `out`; `big`: the
    COCO-2017-sized file)."""
    from PIL import Image

    images = out / "images"
    images.mkdir(exist_ok=True)
    for name in "abcde":  # five: a validation split of one
        Image.new("RGB", (40, 30), (90, 120, 30)).save(images / f"{name}.png")
    cases = {}
    deep = out / "deep.json"
    deep.write_text(deep_json())
    cases["COCO JSON nested 100,000 deep"] = [f"data.train_json={deep}"]
    cases[f"the {big.stat().st_size / 2**20:.0f} MiB file with `data.max_json_bytes=100 MiB`"] = [
        f"data.train_json={big}",
        f"data.max_json_bytes={100 * 2**20}",
    ]
    crowded = out / "crowded.json"
    boxes = [
        {"id": i, "image_id": 1, "category_id": 1, "bbox": [i % 30, i % 20, 5, 5]}
        for i in range(1_000_000)
    ]
    others = [{"id": 2 + k, "file_name": f"{n}.png"} for k, n in enumerate("bcde")]
    crowded.write_text(
        json.dumps(
            {
                "images": [{"id": 1, "file_name": "a.png"}, *others],
                "annotations": boxes,
                "categories": [{"id": 1, "name": "x"}],
            }
        )
    )
    crowded_mb = crowded.stat().st_size / 1e6
    cases[f"one image with 1,000,000 boxes ({crowded_mb:.0f} MB JSON)"] = [
        f"data.train_json={crowded}"
    ]
    coco = [f"data.train_images={images}", f"data.cache_dir={out / 'cache'}", "data=coco"]
    cases = {name: ["model=detector", *coco, *args] for name, args in cases.items()}
    yolo = out / "yolo"
    (yolo / "images" / "train").mkdir(parents=True, exist_ok=True)
    (yolo / "labels" / "train").mkdir(parents=True, exist_ok=True)
    for name in "abcde":
        Image.new("RGB", (40, 30)).save(yolo / "images" / "train" / f"{name}.png")
    with (yolo / "labels" / "train" / "a.txt").open("wb") as f:
        f.truncate(100 * 2**20)
    (yolo / "data.yaml").write_text("names: [x]\n")
    yolo_run = [
        "data=yolo",
        "model=detector",
        f"data.train_dir={yolo / 'images' / 'train'}",
        f"data.cache_dir={out / 'cache'}",
    ]
    cases["a YOLO label file of 100 MB (sparse)"] = yolo_run
    bomb = out / "bomb"
    (bomb / "images" / "train").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 30)).save(bomb / "images" / "train" / "a.png")
    (bomb / "data.yaml").write_text(yaml_bomb())
    cases[f"a `data.yaml` of aliases (billion laughs, {len(yaml_bomb())} bytes)"] = [
        "data=yolo",
        "model=detector",
        f"data.train_dir={bomb / 'images' / 'train'}",
        f"data.cache_dir={out / 'cache'}",
    ]
    return cases


def markdown(results: dict, workdir: Path) -> str:
    """The tables of docs/benchmarks.md's "Annotation files: COCO 2017-sized and hostile"."""
    lines = [stamp(results["load_average"]), ""]
    readers = [name for name in ("kiln", "pycocotools") if name in results]
    if readers:
        counts = {results[name]["annotations"] for name in readers}
        lines += [
            f"The file: {results['images']:,} images, "
            + "/".join(f"{n:,}" for n in sorted(counts))
            + f" annotations with 26-point polygons, {results['file_mib']:.0f} MiB. Each reader "
            "in a fresh process:",
            "",
            "| reader | peak RSS | wall |",
            "|---|---:|---:|",
        ]
        label = {
            "kiln": "kiln, `data=coco`'s reader (`read_coco_file`: element by element, the boxes "
            "kept as columns)",
            "pycocotools": "pycocotools `COCO(path)` (json.load, then its indexes)",
        }
        for name in readers:
            r = results[name]
            lines.append(f"| {label[name]} | {r['peak_rss_mb']:,.0f} MiB | {r['s']:.1f} s |")
        imports = results["imports_only"]["peak_rss_mb"]
        lines += [
            "",
            f"The imports alone (torch, via kiln.data, and pycocotools): {imports:,.0f} MiB.",
            "",
        ]
    lines += [
        "Each hostile input, `build_data` in a fresh process (imports excluded):",
        "",
        "| input | handled in | outcome |",
        "|---|---:|---|",
    ]
    for name, r in results["refused"].items():
        outcome = r["outcome"].replace(str(workdir) + "/", "")  # no path of this machine
        for raw, shown in (("|", "\\|"), ("*", "\\*"), ("<", "&lt;")):  # Markdown's, literally
            outcome = outcome.replace(raw, shown)
        lines.append(f"| {name} | {r['s']:.2f} s | {outcome} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where the files are written, and kept (default: a temporary folder)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--images", type=int, default=118_287)
    parser.add_argument("--skip-pycocotools", action="store_true")
    parser.add_argument("--only-refusals", action="store_true", help="the hostile inputs only")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kiln-annotations-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        results = measure(workdir, args)
        text = markdown(results, workdir)
    print(write_report(results, text, args.out), end="")


def measure(workdir: Path, args) -> dict:
    path = workdir / f"coco2017_like_{args.images}.json"
    if not path.exists():
        print(f"writing {path.name} ({args.images:,} images)", file=sys.stderr, flush=True)
        write_coco_like(path, args.images, 7, polygon_points=26)
    results = {
        "images": args.images,
        "file_mib": path.stat().st_size / 2**20,
        "imports_only": run(IMPORTS),
    }
    if not args.only_refusals:
        results["kiln"] = run(CHILD, "kiln", str(path))
    if not args.skip_pycocotools and not args.only_refusals:
        results["pycocotools"] = run(CHILD, "pycocotools", str(path))
    results["refused"] = {
        name: run(REFUSE, *overrides) for name, overrides in hostile_cases(workdir, path).items()
    }
    results["load_average"] = os.getloadavg()
    return results


if __name__ == "__main__":
    main()
