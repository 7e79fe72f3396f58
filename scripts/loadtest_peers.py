"""kiln side by side with another server of the same checkpoint (`loadtest.py --peers litserve`).

Both answer the same request -- kiln's /v1/predict body, one input -- and are driven by the same
compiled load generator (wrk, installed from the system's packages when missing), in rounds
that take the two servers in turn (which goes first alternates), so a change in the machine's
load hits both alike. Before any load, every input of a pool is sent to both and the answers
checked against each other and against offline predictions: a difference exits 1.

Reported per (model, concurrency): each server's req/s, p50 and p99 (medians over the rounds),
the per-round ratios kiln / peer in req/s and peer / kiln in p99 (>= 1: kiln at least as fast,
its p99 no higher), wrk's errors, and the load average at each round.

LitServe is a bench-only dependency: it lives in its own venv (.bench/litserve), made here on
first use, which sees kiln's environment (torch, kiln itself) through a site directory, so both
servers run the very same code and weights; kiln's own install never needs it."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
from bench_venv import bench_python

REPO = Path(__file__).resolve().parents[1]
LITSERVE_PACKAGES = ("litserve==0.2.19", "pyzmq==27.3.0")  # --no-deps: the rest is kiln's
READY_TIMEOUT_S = 180
PROBS_TOLERANCE = 1e-4
WRK_TIMEOUT_S = 10  # wrk's per-request timeout: an answer later than this counts as an error

# wrk's report, one JSON line (latencies in microseconds); the body is substituted in.
WRK_SCRIPT = """
wrk.method = "POST"
wrk.path = "{path}"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[{body}]==]
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "errors": %d}}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.status + e.timeout))
end
"""


@dataclass
class PeerRound:
    model: str
    server: str
    concurrency: int
    round: int
    requests: int
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int  # wrk: connect/read/write errors, non-2xx answers, timeouts
    load_avg_1m: float  # the machine's load average as the round started


# ---------------------------------------------------------------------------------------------
# Tools: wrk and the LitServe venv


def ensure_wrk() -> str:
    found = shutil.which("wrk")
    if found:
        return found
    if os.geteuid() != 0:
        raise SystemExit("error: wrk is not installed; run `sudo apt-get install -y wrk`")
    print("installing wrk from the system's packages (apt-get)", flush=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], check=True)
    return shutil.which("wrk") or "wrk"


def litserve_python() -> Path:
    """The LitServe venv's python (.bench/litserve), made on first use."""
    return bench_python("litserve", LITSERVE_PACKAGES)


# ---------------------------------------------------------------------------------------------
# Servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A server process on a free loopback port, ready once `health` answers 200."""

    def __init__(self, name: str, cmd: list[str], port: int, path: str, health: str):
        self.name, self.path = name, path
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in stop())
        # A session of its own: stop() ends its worker processes too (LitServe's outlive it).
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{name} exited during start-up:\n{self.output()[-3000:]}")
            try:
                if httpx.get(f"{self.url}{health}", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{name} was not ready after {READY_TIMEOUT_S} s")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
        time.sleep(0.5)  # its workers' own shutdown
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the group is left
        self.log.close()


def kiln_server(ckpt: Path, settings: list[str]) -> Process:
    port = free_port()
    cmd = [sys.executable, str(REPO / "infer.py"), "mode=serve", f"ckpt={ckpt}"]
    return Process("kiln", [*cmd, f"server.port={port}", *settings], port, "/v1/predict", "/readyz")


def litserve_server(ckpt: Path, max_batch_size: int, batch_timeout_s: float) -> Process:
    """LitServe with kiln's default model threads (every core but one), so the two run the
    model alike: with torch's default (every core) its worker's threads fought the HTTP side
    and the load generator, and resnet18 fell below 1 req/s on a loaded machine."""
    port = free_port()
    threads = max(1, (os.cpu_count() or 2) - 1)
    cmd = [str(litserve_python()), str(REPO / "scripts" / "litserve_app.py"), "--ckpt", str(ckpt)]
    cmd += ["--port", str(port), "--max-batch-size", str(max_batch_size)]
    cmd += ["--batch-timeout-s", str(batch_timeout_s), "--threads", str(threads)]
    return Process("litserve", cmd, port, "/predict", "/health")


# ---------------------------------------------------------------------------------------------
# Identical answers, then the load


def check_answers(servers: list[Process], pool: np.ndarray, offline: np.ndarray) -> int:
    """Every input of the pool to every server: the number of inputs whose answers are not
    identical -- the same label from every server, every probability within PROBS_TOLERANCE of
    the offline prediction -- or that failed."""
    answers = []
    for server in servers:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            replies = [client.post(server.path, json={"inputs": [x.tolist()]}) for x in pool]
        answers.append(
            [r.json()["predictions"][0] if r.status_code == 200 else None for r in replies]
        )
    return sum(
        not _identical([a[i] for a in answers], expected) for i, expected in enumerate(offline)
    )


def _identical(answers: list, expected: np.ndarray) -> bool:
    if any(a is None for a in answers) or len({a["label"] for a in answers}) != 1:
        return False
    return all(np.allclose(a["probs"], expected, atol=PROBS_TOLERANCE) for a in answers)


def run_wrk(wrk: str, server: Process, body: str, concurrency: int, seconds: float) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(WRK_SCRIPT.format(path=server.path, body=body))
    try:
        threads = min(concurrency, 2)
        cmd = [wrk, f"-t{threads}", f"-c{concurrency}", f"-d{seconds:g}s"]
        cmd += [f"--timeout={WRK_TIMEOUT_S}s", "-s", script.name, server.url]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    finally:
        os.unlink(script.name)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_peers(name: str, ckpt: Path, args, pool: np.ndarray, offline: np.ndarray):
    """(rounds, wrong answers) for kiln and each peer on one checkpoint."""
    wrk = ensure_wrk()
    kiln_settings = [f"server.max_batch_size={args.max_batch_size}"]
    kiln_settings += [f"server.max_delay_ms={args.max_delay_ms}"]
    servers = [kiln_server(ckpt, kiln_settings)]
    try:
        for peer in args.peers.split(","):
            if peer != "litserve":
                raise SystemExit(f"error: unknown peer {peer!r} (--peers): known: litserve")
            servers.append(
                litserve_server(ckpt, args.litserve_max_batch_size, args.litserve_batch_timeout_s)
            )
        wrong = check_answers(servers, pool, offline)
        body = json.dumps({"inputs": [pool[0].tolist()]})
        for server in servers:  # warm-up: the first calls pay for lazy set-up
            run_wrk(wrk, server, body, 4, 1)
        rounds = []
        for c in [int(c) for c in args.peer_concurrency.split(",")]:
            for r in range(args.peer_rounds):
                order = servers if r % 2 == 0 else servers[::-1]
                for server in order:
                    load = os.getloadavg()[0]
                    report = run_wrk(wrk, server, body, c, args.peer_seconds)
                    rounds.append(peer_round(name, server.name, c, r, report, load))
                    print_round(rounds[-1])
        return rounds, wrong
    finally:
        for server in servers:
            server.stop()


def peer_round(model, server, c, r, report, load) -> PeerRound:
    seconds = report["duration_us"] / 1e6
    return PeerRound(
        model=model,
        server=server,
        concurrency=c,
        round=r,
        requests=report["requests"],
        requests_per_s=report["requests"] / seconds,
        p50_ms=report["p50_us"] / 1000,
        p99_ms=report["p99_us"] / 1000,
        errors=report["errors"],
        load_avg_1m=load,
    )


# ---------------------------------------------------------------------------------------------
# The table


def print_round(r: PeerRound) -> None:
    print(
        f"  {r.model:<9} {r.server:<9} c={r.concurrency:<3} round {r.round}: "
        f"{r.requests_per_s:8.1f} req/s  p50 {r.p50_ms:7.2f} ms  p99 {r.p99_ms:7.2f} ms  "
        f"errors {r.errors}  load {r.load_avg_1m:.2f}",
        flush=True,
    )


def summary(rounds: list[PeerRound]) -> list[dict]:
    """Per (model, concurrency, peer): medians and the per-round ratios against kiln."""
    out = []
    keys = dict.fromkeys((r.model, r.concurrency) for r in rounds)
    for model, c in keys:
        mine = [r for r in rounds if (r.model, r.concurrency, r.server) == (model, c, "kiln")]
        for peer in dict.fromkeys(r.server for r in rounds if r.server != "kiln"):
            theirs = [r for r in rounds if (r.model, r.concurrency, r.server) == (model, c, peer)]
            pairs = list(
                zip(
                    sorted(mine, key=lambda r: r.round),
                    sorted(theirs, key=lambda r: r.round),
                    strict=True,
                )
            )
            out.append(
                {
                    "model": model,
                    "concurrency": c,
                    "peer": peer,
                    "kiln_requests_per_s": statistics.median(r.requests_per_s for r in mine),
                    "peer_requests_per_s": statistics.median(r.requests_per_s for r in theirs),
                    "kiln_p50_ms": statistics.median(r.p50_ms for r in mine),
                    "peer_p50_ms": statistics.median(r.p50_ms for r in theirs),
                    "kiln_p99_ms": statistics.median(r.p99_ms for r in mine),
                    "peer_p99_ms": statistics.median(r.p99_ms for r in theirs),
                    "rps_ratios": [_ratio(k.requests_per_s, p.requests_per_s) for k, p in pairs],
                    "p99_ratios": [_ratio(p.p99_ms, k.p99_ms) for k, p in pairs],
                    "errors": sum(r.errors for r in mine + theirs),
                    "load_avg_1m": [round(r.load_avg_1m, 2) for r in mine + theirs],
                }
            )
    return out


def _ratio(a: float, b: float) -> float:
    """a / b; a peer that answered nothing in a round (0 req/s) is infinitely slower."""
    return a / b if b else math.inf


def table(rows: list[dict]) -> str:
    """Medians over the rounds, then every round's ratio: the table of docs/benchmarks.md's
    "Serving: kiln and LitServe"."""
    lines = [
        "| model | c | peer | kiln req/s | peer req/s | kiln p50 ms | peer p50 ms | kiln p99 ms "
        "| peer p99 ms | req/s kiln / peer, per round | p99 peer / kiln, per round | load avg |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for s in rows:
        rps = " ".join(f"{x:.2f}" for x in s["rps_ratios"])
        p99 = " ".join(f"{x:.2f}" for x in s["p99_ratios"])
        load = f"{min(s['load_avg_1m']):.1f}-{max(s['load_avg_1m']):.1f}"
        lines.append(
            f"| {s['model']} | {s['concurrency']} | {s['peer']} "
            f"| {s['kiln_requests_per_s']:.1f} | {s['peer_requests_per_s']:.1f} "
            f"| {s['kiln_p50_ms']:.2f} | {s['peer_p50_ms']:.2f} "
            f"| {s['kiln_p99_ms']:.2f} | {s['peer_p99_ms']:.2f} | {rps} | {p99} | {load} |"
        )
    return "\n".join(lines)
