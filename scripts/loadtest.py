"""Load test of kiln's server: an async client at several concurrencies against the real server
(`python infer.py mode=serve`, one process per mode) in three modes on the same stack --
batching on, `server.max_batch_size=1`, and `backend=echo` (no model: the HTTP stack's ceiling)
-- over the Open Inference Protocol v2 in JSON and over its binary tensor data extension. Every
answer is checked against offline predictions of the same checkpoint (echo: against its fixed
answer); a wrong or failed answer makes the exit status 1.

Reported per (model, mode, format, concurrency): requests/s (the median of rounds that take the
modes in turn, so a change in the machine's load hits them alike), p50/p95/p99 latency, the
server's mean batch compute; then the floors, each a ratio measured in this run:

    batched >= 3x unbatched throughput at concurrency 32      (image models, e.g. resnet18 32x32)
    a tiny model >= 0.8 of the echo ceiling                    (e.g. the digits mlp)
    p99 <= max_delay_ms + 3 batch computes                     (batched; also p99 above echo's)
    binary >= 3x JSON throughput                               (batched, concurrency 32)

Speed is reported, never asserted, unless --check asks (then a floor not met exits 1).

    python scripts/loadtest.py                      # trains tiny digits-mlp and resnet18 32x32
    python scripts/loadtest.py --ckpt mlp=outputs/<run>/checkpoints/best.pt --requests 400
    python scripts/loadtest.py --peers litserve     # kiln vs LitServe under wrk, per-round ratios

`--peers litserve` measures instead kiln beside LitServe on the same checkpoints, driven by wrk
(scripts/loadtest_peers.py says how; LitServe lives in a bench-only venv the script makes).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import loadtest_peers as peers
import numpy as np
from provenance import stamp
from tiny_checkpoints import REPO, checkpoints

sys.path.insert(0, str(REPO / "src"))

MODES = {
    "batched": [],
    "unbatched": ["server.max_batch_size=1"],
    "echo": ["backend=echo"],
}
FORMATS = ("json", "binary")
READY_TIMEOUT_S = 180
PROBS_TOLERANCE = 1e-4
POOL_SIZE = 64  # distinct inputs cycled through; each answer is checked against its own
# Quick checkpoints when none is given: what `python train.py` makes with these overrides.
TINY_RUNS = {
    "mlp": ["data=digits", "model=mlp", "trainer.max_epochs=1"],
    "resnet18": [
        "data=synthetic_images",
        "data.image_size=32",
        "data.num_train=64",
        "data.num_val=64",
        "model=resnet18",
        "trainer.max_steps=2",
    ],
}


@dataclass
class Row:
    model: str
    mode: str
    format: str
    concurrency: int
    requests: int
    seconds: float
    requests_per_s: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    errors: int  # answers other than 200
    mismatches: int  # 200s whose prediction differs from the offline one
    batch_ms: float  # the server's mean model call during this measurement
    mean_batch_size: float


@dataclass
class Floor:
    name: str
    value: float
    threshold: float
    detail: str

    @property
    def met(self) -> bool:
        return self.value >= self.threshold


# ---------------------------------------------------------------------------------------------
# Checkpoints, inputs, offline predictions


def input_pool(predictor, count: int, seed: int = 0) -> np.ndarray:
    """Valid raw images (N, C, H, W) spread over the training data's value range."""
    preprocess = predictor.preprocess
    low, high = preprocess.value_range or (0.0, 1.0)
    rng = np.random.default_rng(seed)
    return (low + (high - low) * rng.random((count, *preprocess.shape))).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# Requests and answers (Open Inference Protocol v2)


def encode(pixels: np.ndarray, fmt: str) -> tuple[bytes, dict[str, str]]:
    """One input per request; the answer's probs asked for in the same format."""
    tensor = {"name": "input", "shape": [1, *pixels.shape], "datatype": "FP32"}
    outputs = [{"name": "probs", "parameters": {"binary_data": fmt == "binary"}}]
    if fmt == "json":
        body = {"inputs": [{**tensor, "data": pixels.ravel().tolist()}], "outputs": outputs}
        return json.dumps(body).encode(), {"content-type": "application/json"}
    raw = pixels.astype("<f4").tobytes()
    tensor["parameters"] = {"binary_data_size": len(raw)}
    head = json.dumps({"inputs": [tensor], "outputs": outputs}).encode()
    return head + raw, {"Inference-Header-Content-Length": str(len(head))}


def decode_probs(body: bytes, headers, num_classes: int) -> np.ndarray:
    length = headers.get("Inference-Header-Content-Length")
    if length is None:
        (output,) = json.loads(body)["outputs"]
        return np.asarray(output["data"], dtype=np.float32)
    return np.frombuffer(body[int(length) :], dtype="<f4", count=num_classes)


# ---------------------------------------------------------------------------------------------
# The server


class Server:
    """`python infer.py mode=serve` on a free loopback port, until stopped (SIGTERM)."""

    def __init__(self, ckpt: Path, overrides: list[str]):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, str(REPO / "infer.py"), "mode=serve", f"ckpt={ckpt}"]
        cmd += [f"server.port={port}", *overrides]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"the server was not ready after {READY_TIMEOUT_S} s")

    def batch_stats(self) -> tuple[float, float, float]:
        """(model calls, their total seconds, inputs run) so far."""
        text = httpx.get(f"{self.url}/metrics").text
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            if name in (
                "kiln_inference_seconds_count",
                "kiln_inference_seconds_sum",
                "kiln_batch_size_sum",
            ):
                values[name] = float(value)
        return (
            values.get("kiln_inference_seconds_count", 0.0),
            values.get("kiln_inference_seconds_sum", 0.0),
            values.get("kiln_batch_size_sum", 0.0),
        )

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ---------------------------------------------------------------------------------------------
# The load


async def load(url: str, requests: list, expected: np.ndarray, concurrency: int, count: int):
    """`count` requests from `concurrency` workers; (latencies, seconds, errors, mismatches)."""
    import aiohttp

    latencies: list[float] = []
    errors = mismatches = 0
    next_index = itertools.count()
    num_classes = expected.shape[1]
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker():
            nonlocal errors, mismatches
            while (i := next(next_index)) < count:
                body, headers = requests[i % len(requests)]
                started = time.perf_counter()
                async with session.post(
                    f"{url}/v2/models/kiln/infer", data=body, headers=headers
                ) as response:
                    answer = await response.read()
                    latencies.append(time.perf_counter() - started)
                    if response.status != 200:
                        errors += 1
                        continue
                    probs = decode_probs(answer, response.headers, num_classes)
                if not np.allclose(probs, expected[i % len(requests)], atol=PROBS_TOLERANCE):
                    mismatches += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, time.perf_counter() - started, errors, mismatches


def quantile_ms(latencies: list[float], q: int) -> float:
    if len(latencies) < 2:
        return latencies[0] * 1000 if latencies else math.nan
    return statistics.quantiles(latencies, n=100)[q - 1] * 1000


@dataclass
class Round:
    """One measurement of one setting: throughput and the latencies behind it."""

    latencies: list[float]
    seconds: float
    errors: int
    mismatches: int
    model_calls: float
    model_seconds: float
    inputs: float


def measure_round(server, requests, expected, concurrency: int, count: int) -> Round:
    asyncio.run(load(server.url, requests, expected, concurrency, min(count, 2 * concurrency)))
    before = server.batch_stats()
    latencies, seconds, errors, mismatches = asyncio.run(
        load(server.url, requests, expected, concurrency, count)
    )
    calls, model_s, inputs = (a - b for a, b in zip(server.batch_stats(), before, strict=True))
    return Round(latencies, seconds, errors, mismatches, calls, model_s, inputs)


def summarise(model: str, mode: str, fmt: str, concurrency: int, rounds: list[Round]) -> Row:
    """Throughput: the median round's; latency quantiles: over every request of every round."""
    latencies = [t for r in rounds for t in r.latencies]
    calls = sum(r.model_calls for r in rounds)
    return Row(
        model=model,
        mode=mode,
        format=fmt,
        concurrency=concurrency,
        requests=len(latencies),
        seconds=sum(r.seconds for r in rounds),
        requests_per_s=statistics.median(len(r.latencies) / r.seconds for r in rounds),
        p50_ms=quantile_ms(latencies, 50),
        p95_ms=quantile_ms(latencies, 95),
        p99_ms=quantile_ms(latencies, 99),
        errors=sum(r.errors for r in rounds),
        mismatches=sum(r.mismatches for r in rounds),
        batch_ms=1000 * sum(r.model_seconds for r in rounds) / calls if calls else math.nan,
        mean_batch_size=sum(r.inputs for r in rounds) / calls if calls else math.nan,
    )


def measure_model(name: str, ckpt: Path, args, modes, formats, concurrencies) -> list[Row]:
    """Every mode's server up at once; each (format, concurrency) measured in rounds that take
    the modes in turn, so a change in the machine's load hits every mode alike."""
    from kiln.inference import Predictor

    reference = Predictor.from_checkpoint(args.reference or ckpt)
    pool = input_pool(reference, POOL_SIZE)
    offline = reference.predict_probs(pool)
    expected = {
        m: np.full_like(offline, 1 / offline.shape[1]) if m == "echo" else offline for m in modes
    }
    servers = {}
    try:
        for mode in modes:
            settings = [f"server.max_batch_size={args.max_batch_size}"]
            settings += [f"server.max_delay_ms={args.max_delay_ms}", *MODES[mode]]
            servers[mode] = Server(ckpt, settings)
        rows = []
        for fmt in formats:
            requests = [encode(pixels, fmt) for pixels in pool]
            for c in concurrencies:
                count = max(1, args.requests // args.rounds)
                rounds = {mode: [] for mode in modes}
                for _ in range(args.rounds):
                    for mode in modes:
                        rounds[mode].append(
                            measure_round(servers[mode], requests, expected[mode], c, count)
                        )
                for mode in modes:
                    rows.append(summarise(name, mode, fmt, c, rounds[mode]))
                    r = rows[-1]
                    print(
                        f"  {name} {mode} {fmt} c={c}: {r.requests_per_s:.1f} req/s, p99 "
                        f"{r.p99_ms:.1f} ms, {r.errors + r.mismatches} wrong",
                        flush=True,
                    )
        return rows
    finally:
        for server in servers.values():
            server.stop()


# ---------------------------------------------------------------------------------------------
# Floors


def find(rows: list[Row], **match) -> Row | None:
    return next((r for r in rows if all(getattr(r, k) == v for k, v in match.items())), None)


def floors(rows: list[Row], args) -> list[Floor]:
    out = []
    c = args.floor_concurrency
    for model in dict.fromkeys(r.model for r in rows):
        for fmt in FORMATS:
            batched = find(rows, model=model, mode="batched", format=fmt, concurrency=c)
            unbatched = find(rows, model=model, mode="unbatched", format=fmt, concurrency=c)
            echo = find(rows, model=model, mode="echo", format=fmt, concurrency=c)
            if batched and unbatched:
                out.append(
                    Floor(
                        f"{model} {fmt}: batched / unbatched at concurrency {c}",
                        batched.requests_per_s / unbatched.requests_per_s,
                        args.min_batching_gain,
                        f"{batched.requests_per_s:.0f} vs {unbatched.requests_per_s:.0f} req/s",
                    )
                )
            if batched and echo:
                out.append(
                    Floor(
                        f"{model} {fmt}: batched / echo ceiling at concurrency {c}",
                        batched.requests_per_s / echo.requests_per_s,
                        args.min_ceiling_ratio,
                        f"{batched.requests_per_s:.0f} vs {echo.requests_per_s:.0f} req/s",
                    )
                )
        for row in rows:
            if row.model == model and row.mode == "batched" and row.format == "binary":
                bound = args.max_delay_ms + 3 * row.batch_ms
                out.append(
                    Floor(
                        f"{model} binary c={row.concurrency}: (delay + 3 batches) / p99",
                        bound / row.p99_ms,
                        1.0,
                        f"p99 {row.p99_ms:.1f} ms, bound {bound:.1f} ms "
                        f"({args.max_delay_ms:g} + 3 x {row.batch_ms:.1f})",
                    )
                )
                # The same bound on what batching adds: p99 above the echo ceiling's own p99
                # (HTTP, parsing and the client, which share these cores).
                echo = find(
                    rows, model=model, mode="echo", format="binary", concurrency=row.concurrency
                )
                if echo:
                    added = max(row.p99_ms - echo.p99_ms, 1e-3)
                    out.append(
                        Floor(
                            f"{model} binary c={row.concurrency}: (delay + 3 batches) / "
                            "(p99 - echo p99)",
                            bound / added,
                            1.0,
                            f"p99 {row.p99_ms:.1f} - echo {echo.p99_ms:.1f} ms, "
                            f"bound {bound:.1f} ms",
                        )
                    )
        json_row = find(rows, model=model, mode="batched", format="json", concurrency=c)
        binary_row = find(rows, model=model, mode="batched", format="binary", concurrency=c)
        if json_row and binary_row:
            out.append(
                Floor(
                    f"{model}: binary / JSON throughput at concurrency {c}",
                    binary_row.requests_per_s / json_row.requests_per_s,
                    args.min_binary_gain,
                    f"{binary_row.requests_per_s:.0f} vs {json_row.requests_per_s:.0f} req/s",
                )
            )
    return out


# ---------------------------------------------------------------------------------------------


def table(rows: list[Row], checked: list[Floor], args) -> str:
    """Per (model, mode, format, concurrency) the measured row, then the floors: the tables of
    docs/benchmarks.md's "Serving: batching, unbatched and the HTTP ceiling"."""
    lines = [
        f"{args.requests} requests per setting in {args.rounds} round(s) that take the modes in "
        f"turn, max_batch_size={args.max_batch_size}, max_delay_ms={args.max_delay_ms:g}:",
        "",
        "| model | mode | format | c | req/s | p50 ms | p95 ms | p99 ms | model call ms "
        "| inputs/call | wrong |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.mode} | {r.format} | {r.concurrency} | {r.requests_per_s:.1f} "
            f"| {r.p50_ms:.1f} | {r.p95_ms:.1f} | {r.p99_ms:.1f} | {r.batch_ms:.2f} "
            f"| {r.mean_batch_size:.1f} | {r.errors + r.mismatches} |"
        )
    lines += ["", "Floors, ratios measured in this run:", ""]
    lines += ["| floor | measured | at least | met | from |", "|---|---:|---:|---|---|"]
    for f in checked:
        lines.append(
            f"| {f.name} | {f.value:.2f} | {f.threshold:g} | {'met' if f.met else 'NOT met'} "
            f"| {f.detail} |"
        )
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ckpt",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a checkpoint to serve (repeatable); default: train tiny mlp and resnet18 ones",
    )
    parser.add_argument("--reference", default=None, help="check answers against this .pt")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--requests", type=int, default=400, help="per setting, all rounds")
    parser.add_argument("--rounds", type=int, default=3, help="modes measured in turn, R times")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--max-delay-ms", type=float, default=5.0)
    parser.add_argument("--floor-concurrency", type=int, default=32)
    parser.add_argument("--min-batching-gain", type=float, default=3.0)
    parser.add_argument("--min-ceiling-ratio", type=float, default=0.8)
    parser.add_argument("--min-binary-gain", type=float, default=3.0)
    parser.add_argument("--check", action="store_true", help="exit 1 when a floor is not met")
    parser.add_argument(
        "--peers", default="", help="compare with these servers instead (litserve), under wrk"
    )
    parser.add_argument("--peer-concurrency", default="1,32")
    parser.add_argument("--peer-rounds", type=int, default=5, help="the servers in turn, R times")
    parser.add_argument("--peer-seconds", type=float, default=5.0, help="one wrk run")
    parser.add_argument("--litserve-max-batch-size", type=int, default=1)
    parser.add_argument("--litserve-batch-timeout-s", type=float, default=0.0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the tables as docs/benchmarks.md holds them (date, commit, machine) at the end",
    )
    return parser.parse_args(argv)


def compare_peers(args, load: tuple[float, ...]) -> int:
    """kiln against other servers of the same checkpoints (scripts/loadtest_peers.py)."""
    from kiln.inference import Predictor

    rounds, wrong = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for name, ckpt in checkpoints(args.ckpt, TINY_RUNS, Path(tmp)).items():
            reference = Predictor.from_checkpoint(args.reference or ckpt)
            pool = input_pool(reference, POOL_SIZE)
            offline = reference.predict_probs(pool)
            model_rounds, model_wrong = peers.measure_peers(name, ckpt, args, pool, offline)
            rounds += model_rounds
            wrong += model_wrong
    rows = peers.summary(rounds)
    print("\n" + peers.table(rows), flush=True)
    if args.markdown:
        print("\n" + stamp(load) + "\n\n" + peers.table(rows), flush=True)
    errors = sum(r.errors for r in rounds)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "peer_rounds": [asdict(r) for r in rounds],
                    "peers": rows,
                    "wrong_answers": wrong,
                    "errors": errors,
                },
                indent=1,
            )
        )
    if wrong or errors:
        print(f"\n{wrong} inputs answered differently, {errors} load errors")
        return 1
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()
    if os.environ.get("KILN_SMOKE") == "1":  # the README's own test: proves the path, quickly
        args.concurrency, args.requests, args.rounds, args.formats = "1,8", 24, 1, "json,binary"
    if args.peers:
        return compare_peers(args, load)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    modes, formats = args.modes.split(","), args.formats.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        ckpts = checkpoints(args.ckpt, TINY_RUNS, Path(tmp))
        rows: list[Row] = []
        for name, ckpt in ckpts.items():
            rows += measure_model(name, ckpt, args, modes, formats, concurrencies)
    checked = floors(rows, args)
    print("\n" + table(rows, checked, args), flush=True)
    if args.markdown:
        print("\n" + stamp(load) + "\n\n" + table(rows, checked, args), flush=True)
    wrong = sum(r.errors + r.mismatches for r in rows)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "rows": [asdict(r) for r in rows],
                    "floors": [{**asdict(f), "met": f.met} for f in checked],
                    "wrong_answers": wrong,
                },
                indent=1,
            )
        )
    if wrong:
        print(f"\n{wrong} answers were errors or differed from the offline predictions")
        return 1
    if args.check and not all(f.met for f in checked):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
