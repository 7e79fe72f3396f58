"""The server under decompression bombs: /healthz p99 and a good request's latency while bomb
clients hammer it, against good-only load measured in the same run.

    python scripts/loadtest_bombs.py                    # trains a tiny image-folder model first
    python scripts/loadtest_bombs.py --ckpt run/checkpoints/best.pt --seconds 20 --rounds 5
    python scripts/loadtest_bombs.py --out docs/figures/serving_bombs.json   # (make bench): docs/

One server, `python infer.py mode=serve` as a user starts it (its defaults: one model thread and
`server.decode_threads` = max(2, cores) decode threads on this machine's cores). Each round runs
every phase for `--seconds`, the phases in turn (the order rotates from round to round, so a
change in the machine's load hits them alike):

    quiet   --good-clients (10) each send one good photo per request, back to back (v1, base64:
            the example photos, real JPEGs)
    bombs   the same, plus --bomb-clients (10) sending decompression bombs back to back
            (scripts/image_bombs.py: the 1.4 KB GIF of 90 frames at 4000x4000 and the 110 KB
            1-bit PNG of 30000x30000, in turn)
    huge    the bombs phase, plus --huge-clients (2) sending a legal but slow image (an 8-bit
            greyscale PNG of --huge-side (8000) x the same: 64 M pixels, within the limit, a
            second or more to decode)

and all the while one separate process polls /healthz (a kept-alive connection, every
--health-interval-ms). Every process starts up (imports, bodies) before the phase's clock
starts. All clients run at the server's priority (--attacker-nice N puts the bomb and huge
clients under `nice -n N`, standing in for attackers on other machines).

Every good answer is checked against the offline prediction of the same checkpoint, every bomb
must be answered 422 naming "image too large", every huge image 200 (or 504: its deadline
passed while it waited for the large-image slot; counted apart); anything else exits 1.

Reported per phase: good requests' p50 / p99 and requests/s, /healthz p50 / p99 / max, the
ratios against quiet (over all rounds, and round by round), and the cores the server and the
clients used (CPU time over wall time: on a small machine the clients' share is the server's
loss). Floors, checked with --check:

    /healthz p99 < 50 ms in every phase
    good p50 and p99 under bombs <= --max-latency-ratio (1.5) x quiet

The client shares the machine's cores with the server; so does the machine's other load."""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from image_bombs import gif_bomb, grey_png, png_bomb
from loadtest import Server
from provenance import commit, stamp, write_report
from tiny_checkpoints import REPO, checkpoints

sys.path.insert(0, str(REPO / "src"))

PHOTOS = REPO / "examples" / "photos"
TINY_RUNS = {
    "photos_mlp": [
        "data=image_folder",
        f"data.train_dir={PHOTOS / 'train'}",
        "data.image_size=32",
        "model=mlp",
        "trainer.max_steps=2",
    ],
}
PHASES = ("quiet", "bombs", "huge")
PROBS_TOLERANCE = 1e-4
# The /healthz poller: its own process, so its timings are the server's, not this client's
# event loop's. Prints one JSON list of latencies (seconds) when its time is up.
PROCESS_STARTUP_S = 4.0  # a client process's imports and bodies, before the phase's clock starts
POLLER = """
import http.client, json, sys, time
host, port, seconds, interval, start_at = sys.argv[1], int(sys.argv[2]), *map(float, sys.argv[3:6])
connection = http.client.HTTPConnection(host, port, timeout=30)
time.sleep(max(0.0, start_at - time.time()))
latencies, failures, end = [], 0, time.monotonic() + seconds
while time.monotonic() < end:
    started = time.perf_counter()
    connection.request("GET", "/healthz")
    response = connection.getresponse()
    response.read()
    latencies.append(time.perf_counter() - started)
    failures += response.status != 200
    time.sleep(interval)
print(json.dumps({"latencies": latencies, "failures": failures}))
"""


@dataclass
class Phase:
    """One phase of one round."""

    name: str
    good: list[float] = field(default_factory=list)  # latencies of good requests, seconds
    health: list[float] = field(default_factory=list)
    seconds: float = 0.0
    wrong: int = 0  # good answers not 200 or not the offline prediction
    health_failures: int = 0
    bombs: int = 0
    bombs_refused: int = 0  # 422 naming "image too large"
    huge: int = 0
    huge_ok: int = 0  # 200, or 504: past the deadline while the one large slot was busy
    huge_late: int = 0  # of those, 504
    other: list[str] = field(default_factory=list)  # unexpected answers, a few kept
    server_cpu_s: float = 0.0  # the server process's CPU time during the phase
    clients_cpu_s: float = 0.0  # the client processes' (this machine's cores are shared)


def quantile_ms(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    return float(np.quantile(np.asarray(values), q)) * 1000


# ---------------------------------------------------------------------------------------------
# The clients: each kind in its own process (`--worker KIND`), so one kind's client-side work
# (the bombs' 146 KB bodies) does not sit in another kind's measured latency.


def b64_body(data: bytes) -> bytes:
    return json.dumps({"inputs": [base64.b64encode(data).decode()]}).encode()


async def worker(
    kind: str,
    url: str,
    clients: int,
    seconds: float,
    expected: Path | None,
    huge_side: int,
    start_at: float,
):
    """`clients` clients of one kind sending back to back for `seconds` from `start_at` (a
    time.time()); returns what they saw."""
    import aiohttp

    seen = {"latencies": [], "sent": 0, "ok": 0, "other": []}
    if kind == "good":
        goods = [b64_body(p.read_bytes()) for p in good_photos()]
        probs = np.asarray(json.loads(expected.read_text()))
        bodies = goods
    elif kind == "bombs":
        bodies = [b64_body(gif_bomb()), b64_body(png_bomb())]
    else:
        bodies = [b64_body(grey_png(huge_side))]
    await asyncio.sleep(max(0.0, start_at - time.time()))  # every process ready, then all go
    end = time.monotonic() + seconds
    headers = {"content-type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as s:

        async def client(offset: int):
            i = offset
            while time.monotonic() < end:
                k = i % len(bodies)
                started = time.perf_counter()
                async with s.post(f"{url}/v1/predict", data=bodies[k], headers=headers) as answer:
                    status, body = answer.status, await answer.read()
                seen["latencies"].append(time.perf_counter() - started)
                seen["sent"] += 1
                if kind == "good":
                    ok = status == 200 and np.allclose(
                        json.loads(body)["predictions"][0]["probs"], probs[k], atol=PROBS_TOLERANCE
                    )
                elif kind == "bombs":
                    ok = status == 422 and b"image too large" in body
                else:  # answered, or past its deadline (504) when the large slot is busy
                    ok = status in (200, 504)
                    seen["late"] = seen.get("late", 0) + (status == 504)
                seen["ok"] += ok
                if not ok and len(seen["other"]) < 5:
                    seen["other"].append(f"{kind} {status}: {body[:200]!r}")
                i += 1

        await asyncio.gather(*(client(i) for i in range(clients)))
    return seen


def good_photos() -> list[Path]:
    return sorted((PHOTOS / "test").rglob("*.jpg"))


def start_worker(
    kind: str,
    url: str,
    clients: int,
    seconds: float,
    expected: Path,
    huge_side: int,
    nice: int,
    start_at: float,
):
    cmd = [sys.executable, __file__, "--worker", kind, "--url", url, "--clients", str(clients)]
    if kind != "good" and nice:  # the attackers: elsewhere in life, lower priority here
        cmd = ["nice", "-n", str(nice), *cmd]
    cmd += ["--seconds", str(seconds), "--expected", str(expected)]
    cmd += ["--huge-side", str(huge_side), "--start-at", repr(start_at)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def _sent_ok(seen: dict | None) -> tuple[int, int]:
    return (seen["sent"], seen["ok"]) if seen else (0, 0)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_phase(name: str, server: Server, args, expected: Path, seconds: float) -> Phase:
    """`seconds` of this phase's load, each kind of client and the health poller in its own
    process, started together and sending from the same moment, once each has started up and
    built its bodies (a process's start-up is no load the server should see); the server's and
    the clients' CPU time meanwhile."""
    url = server.url
    start_at = time.time() + PROCESS_STARTUP_S
    server_cpu = cpu_seconds(server.proc.pid)
    clients_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    host, port = url.removeprefix("http://").split(":")
    interval = str(args.health_interval_ms / 1e3)
    poller = subprocess.Popen(
        [sys.executable, "-c", POLLER, host, port, str(seconds), interval, repr(start_at)],
        stdout=subprocess.PIPE,
        text=True,
    )
    kinds = {"good": args.good_clients}
    if name in ("bombs", "huge"):
        kinds["bombs"] = args.bomb_clients
    if name == "huge":
        kinds["huge"] = args.huge_clients
    workers = {
        k: start_worker(k, url, n, seconds, expected, args.huge_side, args.attacker_nice, start_at)
        for k, n in kinds.items()
        if n
    }
    seen = {k: json.loads(w.communicate(timeout=seconds + 300)[0]) for k, w in workers.items()}
    polled = json.loads(poller.communicate(timeout=seconds + 60)[0])
    good = seen["good"]
    phase = Phase(name, good=good["latencies"], health=polled["latencies"], seconds=seconds)
    phase.wrong = good["sent"] - good["ok"]
    phase.health_failures = polled["failures"]
    phase.bombs, phase.bombs_refused = _sent_ok(seen.get("bombs"))
    phase.huge, phase.huge_ok = _sent_ok(seen.get("huge"))
    phase.huge_late = seen.get("huge", {}).get("late", 0)
    phase.other = [line for s in seen.values() for line in s["other"]][:5]
    phase.server_cpu_s = cpu_seconds(server.proc.pid) - server_cpu
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    phase.clients_cpu_s = (after.ru_utime + after.ru_stime) - (
        clients_cpu.ru_utime + clients_cpu.ru_stime
    )
    return phase


@dataclass
class Summary:
    phase: str
    good_requests: int
    good_per_s: float
    good_p50_ms: float
    good_p99_ms: float
    health_polls: int
    health_p50_ms: float
    health_p99_ms: float
    health_max_ms: float
    bombs: int
    huge: int
    huge_late: int  # huge images answered 504
    server_cores: float  # the server's CPU time over the phase's time (median round)
    clients_cores: float
    p50_ratio: float  # against quiet, over every round's requests
    p99_ratio: float
    p50_ratios_per_round: list[float]
    p99_ratios_per_round: list[float]


def summarise(rounds: list[dict[str, Phase]], phases: list[str]) -> list[Summary]:
    out = []
    quiet = [r["quiet"] for r in rounds] if "quiet" in phases else None
    for name in phases:
        runs = [r[name] for r in rounds]
        good = [t for p in runs for t in p.good]
        health = [t for p in runs for t in p.health]
        p50, p99 = quantile_ms(good, 0.5), quantile_ms(good, 0.99)
        base = [t for p in quiet for t in p.good] if quiet else []
        out.append(
            Summary(
                phase=name,
                good_requests=len(good),
                good_per_s=statistics.median(len(p.good) / p.seconds for p in runs),
                good_p50_ms=p50,
                good_p99_ms=p99,
                health_polls=len(health),
                health_p50_ms=quantile_ms(health, 0.5),
                health_p99_ms=quantile_ms(health, 0.99),
                health_max_ms=max(health, default=math.nan) * 1000,
                bombs=sum(p.bombs for p in runs),
                huge=sum(p.huge for p in runs),
                huge_late=sum(p.huge_late for p in runs),
                server_cores=statistics.median(p.server_cpu_s / p.seconds for p in runs),
                clients_cores=statistics.median(p.clients_cpu_s / p.seconds for p in runs),
                p50_ratio=p50 / quantile_ms(base, 0.5) if base else math.nan,
                p99_ratio=p99 / quantile_ms(base, 0.99) if base else math.nan,
                p50_ratios_per_round=[
                    round(quantile_ms(p.good, 0.5) / quantile_ms(q.good, 0.5), 2)
                    for p, q in zip(runs, quiet or runs, strict=True)
                ],
                p99_ratios_per_round=[
                    round(quantile_ms(p.good, 0.99) / quantile_ms(q.good, 0.99), 2)
                    for p, q in zip(runs, quiet or runs, strict=True)
                ],
            )
        )
    return out


def table(rows: list[Summary], checked: list[tuple[str, bool]], args) -> str:
    """Per phase the good requests' and /healthz's latencies, the ratios against quiet (over
    every round, then round by round) and the cores used; then the floors: the tables of
    docs/benchmarks.md's "Serving under decompression bombs"."""
    lines = [
        f"{args.rounds} round(s) x {args.seconds:g} s per phase; {args.good_clients} good, "
        f"{args.bomb_clients} bomb and {args.huge_clients} huge clients (attackers at nice "
        f"{args.attacker_nice}):",
        "",
        "| phase | good requests | good/s | good p50 ms | good p99 ms | p50 x quiet "
        "| p99 x quiet | p50 x quiet, per round | p99 x quiet, per round | /healthz polls "
        "| /healthz p50 ms | /healthz p99 ms | /healthz max ms | bombs | huge | huge 504 "
        "| server cores | client cores |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        per_round = [
            " ".join(f"{x:.2f}" for x in ratios)
            for ratios in (r.p50_ratios_per_round, r.p99_ratios_per_round)
        ]
        lines.append(
            f"| {r.phase} | {r.good_requests} | {r.good_per_s:.1f} | {r.good_p50_ms:.1f} "
            f"| {r.good_p99_ms:.1f} | {r.p50_ratio:.2f} | {r.p99_ratio:.2f} | {per_round[0]} "
            f"| {per_round[1]} | {r.health_polls} | {r.health_p50_ms:.2f} "
            f"| {r.health_p99_ms:.2f} | {r.health_max_ms:.1f} | {r.bombs} | {r.huge} "
            f"| {r.huge_late} | {r.server_cores:.2f} | {r.clients_cores:.2f} |"
        )
    lines += ["", "| floor | met |", "|---|---|"]
    lines += [f"| {name} | {'met' if met else 'NOT met'} |" for name, met in checked]
    return "\n".join(lines)


def floors(rows: list[Summary], args) -> list[tuple[str, bool]]:
    checked = []
    for r in rows:
        checked.append(
            (f"{r.phase}: /healthz p99 {r.health_p99_ms:.1f} ms < 50 ms", r.health_p99_ms < 50)
        )
        if r.phase == "bombs":
            for which, ratio in (("p50", r.p50_ratio), ("p99", r.p99_ratio)):
                checked.append(
                    (
                        f"bombs: good {which} {ratio:.2f} x quiet <= {args.max_latency_ratio:g}",
                        ratio <= args.max_latency_ratio,
                    )
                )
    return checked


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", default=None, help="a checkpoint trained on image files")
    parser.add_argument("--seconds", type=float, default=10.0, help="one phase of one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--good-clients", type=int, default=10)
    parser.add_argument("--bomb-clients", type=int, default=10)
    parser.add_argument("--huge-clients", type=int, default=2)
    parser.add_argument("--huge-side", type=int, default=8000, help="the huge PNG's side")
    parser.add_argument(
        "--attacker-nice",
        type=int,
        default=0,
        help="niceness of the bomb and huge clients (0: none); the good ones and the poller run "
        "at the server's priority",
    )
    parser.add_argument("--health-interval-ms", type=float, default=10.0)
    parser.add_argument("--max-latency-ratio", type=float, default=1.5)
    parser.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an infer.py setting (repeatable), e.g. server.decode_threads=4",
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a floor is not met")
    parser.add_argument("--worker", choices=["good", "bombs", "huge"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--clients", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--expected", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    parser.add_argument(
        "--markdown",
        action="store_true",
        help="print the tables as docs/benchmarks.md holds them (date, commit, machine) at the end",
    )
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:  # one kind of client, in its own process (run_phase starts it)
        seen = asyncio.run(
            worker(
                args.worker,
                args.url,
                args.clients,
                args.seconds,
                args.expected,
                args.huge_side,
                args.start_at,
            )
        )
        print(json.dumps(seen))
        return 0
    if os.environ.get("KILN_SMOKE") == "1":  # the README's own test: proves the path, quickly
        args.rounds, args.seconds = 1, 3.0
    phases = args.phases.split(",")
    load = os.getloadavg()
    from kiln.inference import Predictor

    with tempfile.TemporaryDirectory() as tmp:
        specs = [f"model={args.ckpt}"] if args.ckpt else []
        runs = {k: [*v, f"data.cache_dir={tmp}/cache"] for k, v in TINY_RUNS.items()}
        (ckpt,) = checkpoints(specs, runs, Path(tmp)).values()
        offline = Predictor.from_checkpoint(ckpt).predict_probs(
            [p.read_bytes() for p in good_photos()]
        )
        expected = Path(tmp) / "expected.json"
        expected.write_text(json.dumps(offline.tolist()))
        server = Server(ckpt, args.server)
        rounds: list[dict[str, Phase]] = []
        try:
            run_phase("quiet", server, args, expected, 2.0)  # warm the path and the client
            for k in range(args.rounds):
                order = phases[k % len(phases) :] + phases[: k % len(phases)]
                results = {}
                for name in order:
                    results[name] = p = run_phase(name, server, args, expected, args.seconds)
                    print(
                        f"round {k + 1} {name}: {len(p.good)} good (p50 "
                        f"{quantile_ms(p.good, 0.5):.1f} ms, p99 "
                        f"{quantile_ms(p.good, 0.99):.1f} ms), "
                        f"{p.bombs} bombs, {p.huge} huge, /healthz p99 "
                        f"{quantile_ms(p.health, 0.99):.2f} ms over {len(p.health)}",
                        flush=True,
                    )
                rounds.append(results)
            metrics = httpx.get(f"{server.url}/metrics").text
        finally:
            server.stop()
    rows = summarise(rounds, phases)
    checked = floors(rows, args)
    print("\n" + table(rows, checked, args), flush=True)
    decode_lines = [
        line
        for line in metrics.splitlines()
        if line.startswith(
            ("kiln_decode_seconds_count", "kiln_decode_seconds_sum", "kiln_bad_image_files_total")
        )
    ]
    print("server:", "; ".join(decode_lines))
    text = stamp(load) + "\n\n" + table(rows, checked, args)
    if args.markdown:
        print("\n" + text, flush=True)
    bad = [(n, p) for r in rounds for n, p in r.items()]
    wrong = sum(
        p.wrong + p.health_failures + (p.bombs - p.bombs_refused) + (p.huge - p.huge_ok)
        for _, p in bad
    )
    for name, p in bad:
        for line in p.other:
            print(f"  unexpected in {name}: {line}")
    if args.out:
        report = {
            "date": str(datetime.date.today()),
            "commit": commit(),
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "summary": [asdict(r) for r in rows],
            "floors": [{"floor": n, "met": m} for n, m in checked],
            "wrong_answers": wrong,
        }
        write_report(report, text, args.out)  # report["markdown"]: docs/benchmarks.md's figures
    if wrong:
        print(f"\n{wrong} wrong answers (a good image failed or mispredicted, a bomb not refused)")
        return 1
    if args.check and not all(met for _, met in checked):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
