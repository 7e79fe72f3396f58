"""Peak RSS of `python infer.py` predicting a folder of 1 large JPEG and of many (1,000 by
default): infer.py streams files (read, decode, predict, write one batch at a time), so its peak
must not grow with the number of files. Each count runs in a fresh process whose own peak RSS
(ru_maxrss from wait4) is reported as a Markdown table under the provenance line (date, commit,
machine), and with it as JSON (--out). This process stays small (training and the JPEGs are
made by children of their own): a child's ru_maxrss starts from its parent's resident size
(vfork), reported as measurer_rss_mib, a floor.

    python scripts/measure_infer_memory.py                      # 1 and 1,000 JPEGs of 4000x3000
    python scripts/measure_infer_memory.py --counts 1 40 1000 --out infer_memory.json
    python scripts/measure_infer_memory.py --out docs/figures/infer_memory.json   # docs/' table

The JPEGs are `--distinct` real files (noise over a gradient: ~12 MB each at quality 95, the size
issue 32 measured) and hard links to them for the rest, so 1,000 inputs take ~10 x 12 MB of
disk; each link is a file of its own to infer.py (read, decoded and predicted again). The
checkpoint is a small classifier trained here on image files (model=mlp, 32x32 inputs): the
decoding of the 12-megapixel files, not the model, is what the peak measures."""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from provenance import stamp, write_report  # noqa: E402


def progress(message: str) -> None:
    print(f"[measure_infer_memory] {message}", file=sys.stderr, flush=True)


def large_jpeg(path: Path, seed: int, size=(4000, 3000)) -> int:
    rng = np.random.default_rng(seed)
    width, height = size
    ramp = np.linspace(0, 200, width, dtype=np.float32)[None, :, None]
    noise = rng.normal(0, 40, (height, width, 3)).astype(np.float32)
    pixels = np.clip(ramp + noise + 28, 0, 255).astype(np.uint8)
    Image.fromarray(pixels).save(path, quality=95)
    return path.stat().st_size


def train_checkpoint(work: Path) -> Path:
    """Trained by train.py in a process of its own: this one stays small (a forked child's
    ru_maxrss starts from its parent's resident size)."""
    for offset, name in enumerate(("a", "b")):
        (work / "train" / name).mkdir(parents=True, exist_ok=True)
        for i in range(4):
            rng = np.random.default_rng(10 * offset + i)
            Image.fromarray(rng.integers(0, 256, (48, 48, 3), np.uint8)).save(
                work / "train" / name / f"{i}.png"
            )
    subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "train.py"),
            f"hydra.run.dir={work / 'run'}",
            "data=image_folder",
            f"data.train_dir={work / 'train'}",
            f"data.cache_dir={work / 'c'}",
            "data.image_size=32",
            "model=mlp",
            "trainer.max_steps=1",
            "data.batch_size=4",
            "env.progress_bar=false",
            "logger=none",
        ],
        check=True,
        capture_output=True,
        cwd=work,
    )
    return work / "run" / "checkpoints" / "best.pt"


def folder_of(count: int, originals: list[Path], work: Path) -> Path:
    folder = work / f"jpegs_{count}"
    folder.mkdir()
    for i in range(count):
        os.link(originals[i % len(originals)], folder / f"{i:05d}.jpg")
    return folder


def peak_rss(cmd: list[str]) -> tuple[int, float, int]:
    """(peak RSS in bytes, wall seconds, exit status) of one fresh process."""
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    stderr = process.stderr.read().decode(errors="replace")
    if process.returncode != 0:
        progress(f"exit {process.returncode}: {stderr[-2000:]}")
    return usage.ru_maxrss * 1024, time.perf_counter() - start, process.returncode


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(result: dict) -> str:
    """The table of docs/benchmarks.md's "Inference memory on image files"."""
    lines = [
        stamp(result["load_average"]),
        "",
        f"`python infer.py` on folders of JPEGs ({result['image']}, {result['jpeg_mib']:.1f} MiB "
        f"each: {result['distinct']} distinct files, the rest hard links to them), "
        f"batch_size={result['batch_size']}, each count in a fresh process:",
        "",
        "| files | input | peak RSS | wall | exit |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in result["runs"]:
        lines.append(
            f"| {row['files']:,} | {row['input_mib']:,.1f} MiB | {row['peak_rss_mib']:,.0f} MiB "
            f"| {row['wall_s']:.1f} s | {row['exit']} |"
        )
    first, last = result["runs"][0], result["runs"][-1]
    lines += [
        "",
        f"Peak RSS growth from {first['files']:,} to {last['files']:,} files: "
        f"{result['growth_mib']:,.1f} MiB (the measuring process's own, a floor of each "
        f"child's: {result['measurer_rss_mib']:.0f} MiB).",
    ]
    return "\n".join(lines)


def make_jpegs(argv: list[str]) -> None:
    folder, count, width, height = Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3])
    for i in range(count):
        large_jpeg(folder / f"{i}.jpg", i, (width, height))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", type=int, nargs="+", default=[1, 1000])
    parser.add_argument("--distinct", type=int, default=10, help="real JPEGs (the rest: links)")
    parser.add_argument("--side", type=int, nargs=2, default=[4000, 3000], metavar=("W", "H"))
    parser.add_argument("--batch-size", type=int, default=256, help="infer.py batch_size")
    parser.add_argument("--workdir", help="where files go (default: a temporary folder)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        work = Path(tmp)
        progress("training a small image-file classifier")
        ckpt = train_checkpoint(work)
        (work / "originals").mkdir()
        originals = [work / "originals" / f"{i}.jpg" for i in range(args.distinct)]
        # made by a child process: this one's resident size stays small (see train_checkpoint)
        maker = [sys.executable, __file__, "--make", str(work / "originals"), str(args.distinct)]
        subprocess.run([*maker, *map(str, args.side)], check=True)
        sizes = [p.stat().st_size for p in originals]
        progress(
            f"{args.distinct} JPEGs of {args.side[0]}x{args.side[1]}, "
            f"{np.mean(sizes) / 2**20:.1f} MiB each"
        )
        rows = []
        for count in args.counts:
            folder = folder_of(count, originals, work)
            cmd = [
                sys.executable,
                str(REPO_ROOT / "infer.py"),
                f"ckpt={ckpt}",
                f"input={folder}",
                f"output={work / f'preds_{count}.csv'}",
                f"batch_size={args.batch_size}",
            ]
            rss, wall, code = peak_rss(cmd)
            rows.append(
                {
                    "files": count,
                    "peak_rss_mib": round(rss / 2**20, 1),
                    "wall_s": round(wall, 1),
                    "exit": code,
                    "input_mib": round(count * np.mean(sizes) / 2**20, 1),
                }
            )
            progress(
                f"{count} files ({rows[-1]['input_mib']} MiB): peak RSS "
                f"{rows[-1]['peak_rss_mib']} MiB in {wall:.0f} s"
            )
    result = {
        "what": "peak RSS of python infer.py on a folder of large JPEGs",
        "measurer_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "date": datetime.date.today().isoformat(),
        "commit": commit(),
        "image": f"{args.side[0]}x{args.side[1]} JPEG, quality 95",
        "jpeg_mib": round(float(np.mean(sizes)) / 2**20, 2),
        "distinct": args.distinct,
        "batch_size": args.batch_size,
        "cpus": os.cpu_count(),
        "runs": rows,
        "growth_mib": round(rows[-1]["peak_rss_mib"] - rows[0]["peak_rss_mib"], 1),
        "load_average": os.getloadavg(),
    }
    print(write_report(result, markdown(result), args.out), end="")
    return result


if __name__ == "__main__":
    if sys.argv[1:2] == ["--make"]:
        make_jpegs(sys.argv[2:])
    else:
        main()
