"""Per-rank memory of parameters, gradients and AdamW state under DDP and under FSDP (kiln's
trainer=fsdp sharding), for a model of a few hundred MB, on CPU with gloo:

    python scripts/fsdp_memory.py                        # 2 ranks, 4 blocks of 4096x4096 (268 MB)
    python scripts/fsdp_memory.py --world-size 4 --width 2048 --blocks 8
    python scripts/fsdp_memory.py --out docs/figures/fsdp_memory.json   # docs/benchmarks.md's table

Counts the bytes of the tensors each rank holds after one optimizer step (DTensors by their local
shard), and the process's resident memory beside it. Under FSDP the share should be about
1/world_size of DDP's."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from kiln.config.run import FsdpConfig
from kiln.engine.fsdp import shard_model
from kiln.engine.precision import resolve_precision

sys.path.insert(0, str(Path(__file__).parent))
from provenance import stamp, write_report  # noqa: E402

MB = 2**20
NAMES = {"ddp": "DDP", "fsdp": "FSDP"}


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def build_model(width: int, blocks: int) -> nn.Sequential:
    layers = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def measure(strategy: str, width: int, blocks: int) -> dict[str, float]:
    """One AdamW step on this rank; the bytes it holds afterwards, in MB."""
    torch.manual_seed(0)
    model = build_model(width, blocks)
    if strategy == "fsdp":  # each Linear is a block: the size policy at width*width parameters
        cpu = torch.device("cpu")
        policy = FsdpConfig(min_block_params=width * width)
        wrapped = shard_model(model, policy, resolve_precision("fp32", cpu), cpu)
    else:
        wrapped = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = wrapped(torch.randn(8, width)).square().mean()
    loss.backward()
    optimizer.step()  # creates the AdamW state (exp_avg, exp_avg_sq)
    grads = local_bytes(p.grad for p in model.parameters() if p.grad is not None)
    state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
    params = local_bytes(model.parameters())
    optim = local_bytes(state)
    return {
        "params": params / MB,
        "grads": grads / MB,
        "optimizer": optim / MB,
        "params+optimizer": (params + optim) / MB,
        "rss": psutil.Process().memory_info().rss / MB,
    }


def worker(rank: int, world_size: int, port: int, args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        results[rank] = measure(args.strategy, args.width, args.blocks)
    finally:
        dist.destroy_process_group()


def run(strategy: str, args) -> list[dict[str, float]]:
    """Each strategy in fresh processes, so one's memory does not hide in the other's RSS."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        args.strategy = strategy
        mp.spawn(worker, args=(args.world_size, port, args, results), nprocs=args.world_size)
        return [dict(results[rank]) for rank in range(args.world_size)]


def markdown(report: dict) -> str:
    """The table of docs/benchmarks.md's "FSDP memory": one row per strategy and rank."""
    lines = [
        stamp(report["load_average"]),
        "",
        f"{report['model']}, after one step, per rank (MiB):",
        "",
        "| strategy | rank | parameters | gradients | AdamW state | parameters + optimizer "
        "| process RSS |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for strategy, rows in report["ranks"].items():
        for rank, row in enumerate(rows):
            cells = (row[c] for c in ("params", "grads", "optimizer", "params+optimizer", "rss"))
            lines.append(
                f"| {NAMES[strategy]} | {rank} | " + " | ".join(f"{c:.1f}" for c in cells) + " |"
            )
    lines += [
        "",
        f"FSDP's share of parameters + optimizer state per rank: {report['ratio']:.3f} of DDP's "
        f"(1/world_size = {1 / report['world_size']:.3f}).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="also write the result as JSON, with its table (docs/ reads it)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    numel = args.blocks * (args.width * args.width + args.width)
    model = (
        f"{args.blocks} x Linear({args.width}, {args.width}) = {numel / 1e6:.1f}M parameters, "
        f"{numel * 4 / MB:.0f} MiB in fp32; AdamW; {args.world_size} ranks (gloo, CPU)"
    )
    print(f"model: {model}")
    columns = ["params", "grads", "optimizer", "params+optimizer", "rss"]
    print(f"{'strategy':<8} {'rank':>4} " + " ".join(f"{c + ' MB':>20}" for c in columns))
    ranks = {}
    for strategy in ("ddp", "fsdp"):
        ranks[strategy] = run(strategy, args)
        for rank, row in enumerate(ranks[strategy]):
            print(f"{strategy:<8} {rank:>4} " + " ".join(f"{row[c]:>20.1f}" for c in columns))
    shares = {s: max(row["params+optimizer"] for row in rows) for s, rows in ranks.items()}
    ratio = shares["fsdp"] / shares["ddp"]
    print(
        f"FSDP / DDP per-rank params+optimizer: {ratio:.3f} "
        f"(1/world_size = {1 / args.world_size:.3f})"
    )
    report = {
        "model": model,
        "world_size": args.world_size,
        "ranks": ranks,
        "ratio": ratio,
        "load_average": os.getloadavg(),
    }
    write_report(report, markdown(report), args.out)


if __name__ == "__main__":
    main()
