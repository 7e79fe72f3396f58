"""What reading a COCO-2017-sized annotation file costs kiln (data=coco's reader, element by
element: kiln.data.coco.read_coco_file) and pycocotools (`COCO(path)`: json.load and its
indexes), each in a fresh process: peak RSS (ru_maxrss) and wall time; and how fast kiln refuses
the hostile annotation inputs of issue 46 (tests/hostile_inputs.py builds them).

    python scripts/measure_annotation_memory.py --out /tmp/annotations [--images 118287]

The synthetic file has COCO 2017 train's shape: 118,287 images, 7 boxes each with a polygon of
26 points (COCO's own: 860,001 annotations, 448 MiB), written once into --out. Prints a
Markdown table and writes results.json beside the file."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

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
    build_data(load_config(sys.argv[1:]).data)
    outcome = "accepted"
except UserError as err:
    outcome = str(err)
print(json.dumps({"s": time.perf_counter() - started, "outcome": outcome[:160]}))
"""


def run(code: str, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def hostile_cases(out: Path) -> dict:
    """name -> overrides of a run whose data is one hostile input (built under `out`)."""
    from PIL import Image

    images = out / "images"
    images.mkdir(exist_ok=True)
    for name in "abcde":  # five: a validation split of one
        Image.new("RGB", (40, 30), (90, 120, 30)).save(images / f"{name}.png")
    cases = {}
    deep = out / "deep.json"
    deep.write_text(deep_json())
    cases["COCO JSON nested 100,000 deep"] = [f"data.train_json={deep}"]
    cases["COCO JSON over data.max_json_bytes (the 448 MiB file, limit 100 MiB)"] = [
        f"data.train_json={out / 'coco2017_like.json'}",
        f"data.max_json_bytes={100 * 2**20}",
    ]
    crowded = out / "crowded.json"
    boxes = [{"id": i, "image_id": 1, "category_id": 1, "bbox": [i % 30, i % 20, 5, 5]}
             for i in range(1_000_000)]  # fmt: skip
    others = [{"id": 2 + k, "file_name": f"{n}.png"} for k, n in enumerate("bcde")]
    crowded.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.png"}, *others],
                                   "annotations": boxes,
                                   "categories": [{"id": 1, "name": "x"}]}))  # fmt: skip
    cases["one image with 1,000,000 boxes (kept 1,000)"] = [f"data.train_json={crowded}"]
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
    yolo_run = ["data=yolo", "model=detector", f"data.train_dir={yolo / 'images' / 'train'}",
                f"data.cache_dir={out / 'cache'}"]  # fmt: skip
    cases["YOLO label file of 100 MB (sparse)"] = yolo_run
    bomb = out / "bomb"
    (bomb / "images" / "train").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 30)).save(bomb / "images" / "train" / "a.png")
    (bomb / "data.yaml").write_text(yaml_bomb())
    cases["data.yaml of YAML aliases (billion laughs)"] = [
        "data=yolo", "model=detector", f"data.train_dir={bomb / 'images' / 'train'}",
        f"data.cache_dir={out / 'cache'}"]  # fmt: skip
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--images", type=int, default=118_287)
    parser.add_argument("--skip-pycocotools", action="store_true")
    parser.add_argument("--only-refusals", action="store_true", help="the hostile inputs only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "coco2017_like.json"
    if not path.exists():
        print(f"writing {path}", file=sys.stderr)
        write_coco_like(path, args.images, 7, polygon_points=26)
    results = {"file_mib": path.stat().st_size / 2**20, "imports_only": run(IMPORTS)}
    if not args.only_refusals:
        results["kiln"] = run(CHILD, "kiln", str(path))
    if not args.skip_pycocotools and not args.only_refusals:
        results["pycocotools"] = run(CHILD, "pycocotools", str(path))
    results["refused"] = {name: run(REFUSE, *overrides)
                          for name, overrides in hostile_cases(args.out).items()}  # fmt: skip
    results["date"] = time.strftime("%Y-%m-%d")
    results["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                       capture_output=True, text=True).stdout.strip()  # fmt: skip
    name = "refusals.json" if args.only_refusals else "results.json"
    (args.out / name).write_text(json.dumps(results, indent=1))
    print(f"| reader | peak RSS | wall | ({results['file_mib']:.0f} MiB file) |")
    print("|---|---|---|---|")
    for name in ("kiln", "pycocotools"):
        if name in results:
            r = results[name]
            print(f"| {name} | {r['peak_rss_mb']:,.0f} MiB | {r['s']:.1f} s | "
                  f"{r['annotations']:,} annotations |")  # fmt: skip
    for name, r in results["refused"].items():
        print(f"| {name} | | {r['s']:.2f} s | {r['outcome'][:90]} |")


if __name__ == "__main__":
    main()
