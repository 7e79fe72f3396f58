"""Do kiln's image decoders let go of the GIL? The measurement behind the server's choice of
decode threads over processes (kiln.serving.decoding).

For each format, 1 and 2 threads decode a 3000x3000 photo-like image in a loop through kiln's
own decoder and eval transform (kiln.preprocessing.image_files.EncodedImageLoader), while the
main thread -- standing in for the event loop -- times a fixed piece of pure-Python work and
how late a 1 ms sleep wakes up. Two baselines run the same way in the same run: threads
hashing a buffer with sha256 (which releases the GIL: they cost the main thread only CPU) and
threads running pure Python (which hold it: the worst case). Reported: the work's time with
the threads running over its time alone, and over its time beside the sha256 threads (1.0: the
decoders cost the loop no more than any CPU-bound work that releases the GIL -- what is left
is the cores being shared, which processes would share too), and the wake-up lateness. One
intra-op torch thread, as the server runs (server.model_threads on 2 cores), and the server's
0.5 ms GIL switch interval.

    python scripts/measure_decode_gil.py [--seconds 1.5] [--side 3000]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import hashlib
import io
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
GIL_SWITCH_INTERVAL_S = 0.0005  # as kiln.serving.server sets it


def photo_like(side: int, fmt: str) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 200, side, dtype=np.uint8)
    pixels = (rng.random((side, side, 3)) * 40).astype(np.uint8) + ramp[None, :, None]
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, fmt)
    return buffer.getvalue()


def python_work() -> int:
    total = 0
    for i in range(20_000):
        total += i * i
    return total


def work_ms(repeats: int = 100) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        python_work()
    return (time.perf_counter() - started) / repeats * 1000


def lateness_ms(seconds: float) -> np.ndarray:
    late = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter()
        time.sleep(0.001)
        late.append(time.perf_counter() - started - 0.001)
    return np.asarray(late) * 1000


def measure(job, threads: int, seconds: float, alone_ms: float) -> dict:
    """The main thread's work and wake-ups while `threads` threads run `job()` in a loop."""
    stop = threading.Event()
    decoded = [0]

    def decode_forever():
        while not stop.is_set():
            job()
            decoded[0] += 1

    workers = [threading.Thread(target=decode_forever) for _ in range(threads)]
    for worker in workers:
        worker.start()
    time.sleep(0.2)
    busy_ms = work_ms()
    late = lateness_ms(seconds)
    stop.set()
    for worker in workers:
        worker.join()
    return {
        "work_ratio": busy_ms / alone_ms,
        "late_p50_ms": float(np.percentile(late, 50)),
        "late_p99_ms": float(np.percentile(late, 99)),
        "decodes": decoded[0],
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--side", type=int, default=3000)
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args(argv)
    import torch

    from kiln.preprocessing.image_files import EncodedImageLoader

    torch.set_num_threads(1)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    loader = EncodedImageLoader(3, 224, 256, "bilinear")
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(f"{datetime.date.today()}, commit {commit or 'unknown'}: {args.side}x{args.side} images")
    alone = work_ms()
    quiet = lateness_ms(args.seconds)
    print(
        f"alone: python work {alone:.2f} ms, wake-up lateness p50 {np.percentile(quiet, 50):.2f}"
        f" / p99 {np.percentile(quiet, 99):.2f} ms"
    )
    print(
        f"{'threads run':<12} {'MB':>5} {'one ms':>6} {'threads':>7} {'x alone':>7} "
        f"{'x sha256':>8} {'late p50':>8} {'late p99':>8}"
    )
    buffer = bytes(8 << 20)
    baselines = {
        "sha256": lambda: hashlib.sha256(buffer).digest(),  # releases the GIL
        "python": python_work,  # holds it
    }
    rows = [(name, job, 0) for name, job in baselines.items()]
    for fmt in args.formats.split(","):
        data = photo_like(args.side, fmt)
        rows.append((fmt, functools.partial(loader, data), len(data)))
    cpu_only = {}
    for name, job, size in rows:
        job()
        started = time.perf_counter()
        job()
        one_ms = (time.perf_counter() - started) * 1000
        for threads in (1, 2):
            got = measure(job, threads, args.seconds, alone)
            cpu_only.setdefault(threads, got["work_ratio"])  # sha256 runs first
            print(
                f"{name:<12} {size / 1e6:>5.1f} {one_ms:>6.0f} {threads:>7} "
                f"{got['work_ratio']:>7.2f} {got['work_ratio'] / cpu_only[threads]:>8.2f} "
                f"{got['late_p50_ms']:>8.2f} {got['late_p99_ms']:>8.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
