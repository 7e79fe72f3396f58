"""Serving throughput and latency with dynamic batching on, against max_batch_size=1, measured in
the same run on the same checkpoint.

Each side starts the real server (`python infer.py mode=serve ...`) in its own process on a free
loopback port, waits for /readyz, then `--concurrency` client threads send `--requests` single-input
/v1/predict requests in total. Reported per side: requests/s, p50 and p95 latency; then the
throughput ratio batched / unbatched. Speed is reported, never asserted.

    python scripts/bench_serving.py --ckpt outputs/<run>/checkpoints/best.pt
    python scripts/bench_serving.py --ckpt ... --concurrency 64 --requests 4000 --backend onnx
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, max_batch_size: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, str(REPO_ROOT / "infer.py"), "mode=serve", f"ckpt={args.ckpt}"]
    cmd += [f"backend={args.backend}", f"device={args.device}", f"server.port={port}"]
    cmd += [f"server.max_batch_size={max_batch_size}", f"server.max_delay_ms={args.max_delay_ms}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"server not ready after {READY_TIMEOUT_S} s")


def example_input(url: str) -> list:
    """A valid input built from the model's v2 metadata (zeros image, or a short text)."""
    meta = httpx.get(f"{url}/v2/models/kiln").json()["inputs"][0]
    if meta["datatype"] == "BYTES":
        return "the home team won the match"
    _, channels, height, width = meta["shape"]
    return [[[0.0] * width for _ in range(height)] for _ in range(channels)]


def load(url: str, concurrency: int, num_requests: int) -> dict:
    payload = json.dumps({"inputs": [example_input(url)]})
    latencies: list[float] = []
    lock = threading.Lock()
    per_thread = num_requests // concurrency

    def client() -> None:
        mine = []
        with httpx.Client(base_url=url, timeout=60) as c:
            for _ in range(per_thread):
                started = time.perf_counter()
                response = c.post(
                    "/v1/predict", content=payload, headers={"content-type": "application/json"}
                )
                response.raise_for_status()
                mine.append(time.perf_counter() - started)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - started
    quantiles = statistics.quantiles(latencies, n=100)
    return {
        "requests": len(latencies),
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": quantiles[49] * 1000,
        "p95_ms": quantiles[94] * 1000,
    }


def measure(args, max_batch_size: int) -> dict:
    proc, url = start_server(args, max_batch_size)
    try:
        load(url, args.concurrency, min(args.requests, 4 * args.concurrency))  # warm-up
        return {"max_batch_size": max_batch_size, **load(url, args.concurrency, args.requests)}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="a kiln checkpoint (.pt)")
    parser.add_argument("--backend", default="torch", choices=("torch", "onnx"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-delay-ms", type=float, default=5.0)
    args = parser.parse_args()

    batched = measure(args, args.max_batch_size)
    unbatched = measure(args, 1)
    for row in (batched, unbatched):
        print(
            f"max_batch_size={row['max_batch_size']:>3}: {row['requests_per_s']:8.1f} req/s  "
            f"p50 {row['p50_ms']:6.1f} ms  p95 {row['p95_ms']:6.1f} ms  (n={row['requests']})"
        )
    ratio = batched["requests_per_s"] / unbatched["requests_per_s"]
    print(f"throughput ratio batched / unbatched: {ratio:.2f}x")
    print(json.dumps({"batched": batched, "unbatched": unbatched, "ratio": ratio}))


if __name__ == "__main__":
    main()
