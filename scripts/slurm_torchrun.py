"""Train on several SLURM nodes: submitit submits one job of `--nodes` tasks (one per node), and
each task runs torchrun, which meets the others through c10d rendezvous on the job's first node;
the engine reads the ranks torchrun sets. The job id names the rendezvous and the run directory
(outputs/slurm/<job id>), so when SLURM requeues the job (preemption, timeout) it continues from
its last checkpoint (resume=auto), and torchrun restarts a failed rank itself (--max-restarts).

    python scripts/slurm_torchrun.py --nodes 2 --procs-per-node 8 --partition gpu -- \\
        trainer=fsdp model=resnet50 data=synthetic_images
    python scripts/slurm_torchrun.py --cluster local --procs-per-node 2 -- trainer=ddp  # no SLURM

Everything after `--` is a train.py override. The run directory must be on a filesystem every
node sees."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import submitit

REPO_ROOT = Path(__file__).resolve().parents[1]
RENDEZVOUS_PORT = 29500


class Torchrun(submitit.helpers.Checkpointable):
    """What each node's task runs. Checkpointable: on preemption or timeout submitit requeues the
    job with this same callable (resume=auto then continues the run)."""

    def __init__(self, procs_per_node: int, max_restarts: int, overrides: list[str], workdir: Path):
        self.procs_per_node = procs_per_node
        self.max_restarts = max_restarts
        self.overrides = overrides
        self.workdir = workdir  # where outputs/ is, as for train.py: the submitting directory

    def __call__(self) -> str:
        job = submitit.JobEnvironment()
        run_dir = self.workdir / "outputs" / "slurm" / str(job.job_id)
        subprocess.run(torchrun_command(job, self, run_dir), check=True, cwd=self.workdir)
        return str(run_dir)


def torchrun_command(job, task: Torchrun, run_dir: Path) -> list[str]:
    return [
        *(sys.executable, "-m", "torch.distributed.run"),
        f"--nnodes={job.num_nodes}",
        f"--nproc_per_node={task.procs_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={job.hostnames[0]}:{RENDEZVOUS_PORT}",
        f"--rdzv-id={job.job_id}",
        f"--max-restarts={task.max_restarts}",
        str(REPO_ROOT / "train.py"),
        f"hydra.run.dir={run_dir}",
        "resume=auto",  # nothing to resume on the first attempt; the last checkpoint after that
        *task.overrides,
    ]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, overrides = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--procs-per-node", type=int, default=1, help="ranks per node (GPUs)")
    parser.add_argument("--partition", default=None)
    parser.add_argument("--account", default=None)
    parser.add_argument("--cpus-per-task", type=int, default=8)
    parser.add_argument("--mem-gb", type=int, default=64)
    parser.add_argument("--timeout-min", type=int, default=240)
    parser.add_argument("--max-restarts", type=int, default=3, help="torchrun group restarts")
    parser.add_argument("--cluster", default=None, help="slurm | local (default: what is here)")
    parser.add_argument("--folder", default="outputs/slurm/.submitit", help="submitit's logs")
    parser.add_argument("--wait", action="store_true", help="wait for the job and print its run")
    args = parser.parse_args(ours)

    executor = submitit.AutoExecutor(folder=args.folder, cluster=args.cluster)
    executor.update_parameters(nodes=args.nodes, tasks_per_node=1, timeout_min=args.timeout_min)
    if executor.cluster == "slurm":
        slurm = {"partition": args.partition, "account": args.account}
        executor.update_parameters(
            slurm_gpus_per_node=args.procs_per_node,
            cpus_per_task=args.cpus_per_task,
            mem_gb=args.mem_gb,
            **{f"slurm_{key}": value for key, value in slurm.items() if value},
        )
    task = Torchrun(args.procs_per_node, args.max_restarts, overrides, workdir=Path.cwd())
    job = executor.submit(task)
    print(f"submitted job {job.job_id}: run directory outputs/slurm/{job.job_id}", flush=True)
    if args.wait:
        print(f"finished: {job.result()}")


if __name__ == "__main__":
    main()
