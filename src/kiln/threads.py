"""How many threads a process should run: the CPUs it may use and the size of its work.

`os.cpu_count()` is the machine's CPUs, not this process's: a container limited by a cgroup CPU
quota, a job pinned by `taskset`/a batch scheduler's affinity mask, or cores other jobs keep busy
all leave fewer. torch's intra-op pool takes every CPU by default, and its threads meet at the
end of every parallel region: where one of them waits for a core that another process holds,
the others spin and wait for it, so a small model pays for synchronisation it never needed (the
text_bow run of issue 36: 7.9 s quiet, 18.6 s beside one busy process with torch's default, 9.3 s
with one thread).

The rule, for training (kiln.engine.run), prediction and the server (kiln.inference, kiln.cli):

- usable CPUs: the affinity mask, capped by the cgroup's quota (v2 `cpu.max`, v1
  `cpu.cfs_quota_us / cpu.cfs_period_us`, the tightest along the cgroup's path);
- a step (or a model call) under SMALL_STEP_FLOPS runs on one intra-op thread; a larger one on
  the usable physical cores, less those other processes were seen keeping busy while the run
  started (`busy_elsewhere`; not for trainer.deterministic runs, whose thread count must not
  depend on a neighbour: a reduction split over another number of threads sums in another
  order);
- DataLoader workers: none for a dataset that gathers a whole batch in one step from memory
  (a worker would only add a copy), else a quarter of the physical cores, at least one and at
  most half of them (none on a single core); each worker runs single-threaded.

Stdlib only: a leaf that engine, data loaders, inference and serving all import."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

# A step of fewer model FLOPs than this runs on one thread. Such a step is a few milliseconds on
# one core, made of ops of well under a millisecond each; splitting an op over threads costs a
# wake-up and a barrier (tens of microseconds, far more when a thread has to wait for a core
# another process holds), which is about what it saves. resnet18 at 32 px, batch 64 (213 GFLOP
# a step) runs 2x faster on two cores; the digits MLP (17 MFLOP) no faster.
SMALL_STEP_FLOPS = 2e9
# A core counts as taken when other processes kept it busy for at least this share of the time.
TAKEN_SHARE = 0.6


# ---------------------------------------------------------------------------------------------
# The CPUs this process may use


@dataclass(frozen=True)
class CpuBudget:
    """What this process may use, and what it saw others use."""

    allowed: int  # CPUs in the affinity mask
    quota: float | None  # the cgroup CPU quota in CPUs (None: no quota)
    physical: int  # physical cores among the allowed CPUs
    busy_elsewhere: float = 0.0  # cores other processes kept busy (measured; 0: not measured)

    @property
    def usable(self) -> int:
        """Threads that can run at once: the allowed CPUs, capped by the quota (rounded down: a
        thread beyond it is throttled mid-region, and its region waits for it)."""
        cap = self.allowed if self.quota is None else min(self.allowed, math.floor(self.quota))
        return max(1, cap)

    @property
    def usable_physical(self) -> int:
        """Physical cores of the usable CPUs: a second hyper-thread of a core adds little to
        dense maths."""
        return max(1, min(self.physical, self.usable))

    @property
    def taken(self) -> int:
        """Usable cores other processes hold (each kept busy for TAKEN_SHARE of the time)."""
        return int(self.busy_elsewhere + 1 - TAKEN_SHARE)

    def describe(self) -> str:
        quota = "no cgroup quota" if self.quota is None else f"cgroup quota {self.quota:g} CPUs"
        text = (
            f"{self.usable} usable CPU(s) ({self.allowed} in the affinity mask, {quota}; "
            f"{self.usable_physical} physical core(s))"
        )
        if self.busy_elsewhere >= 0.05:
            text += f"; other processes kept {self.busy_elsewhere:.1f} core(s) busy"
        return text


def cpu_budget(root: Path = Path("/"), busy_elsewhere: float = 0.0) -> CpuBudget:
    """This process's CPUs: the affinity mask, the cgroup quota, the physical cores among them.
    `root` is the filesystem root where /proc and /sys are read (a test builds one)."""
    cpus = allowed_cpus()
    return CpuBudget(
        allowed=len(cpus),
        quota=cgroup_quota(root),
        physical=physical_cores(cpus, root / "sys/devices/system/cpu"),
        busy_elsewhere=busy_elsewhere,
    )


def allowed_cpus() -> set[int]:
    """The CPUs of this process's affinity mask (all CPUs where the OS has no such mask)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int], cpu_dir: Path) -> int:
    """Distinct (package, core) pairs among `cpus` from sysfs topology; len(cpus) when unknown."""
    cores = set()
    for cpu in cpus:
        topology = cpu_dir / f"cpu{cpu}" / "topology"
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            return len(cpus)
        cores.add((package, core))
    return len(cores) or len(cpus)


def cgroup_quota(root: Path = Path("/")) -> float | None:
    """The CPU quota of this process's cgroup in CPUs (quota / period), the tightest along its
    path up to the hierarchy's root; None when there is none. cgroup v2 (`cpu.max`: "max 100000"
    or "150000 100000") and v1 (`cpu.cfs_quota_us`, -1 for none, over `cpu.cfs_period_us`)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":  # the v2 unified hierarchy
            quotas += _along(root / "sys/fs/cgroup", path, _v2_quota)
        elif "cpu" in controllers.split(","):
            for mount in _v1_mounts(root, controllers):
                quotas += _along(mount, path, _v1_quota)
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _along(mount: Path, path: str, read) -> list[float | None]:
    """`read` of the cgroup at `path` under `mount` and of each ancestor up to the mount. Inside
    a container the mount is often the container's own cgroup, so the path may not exist under
    it: the mount itself is read then."""
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    found = []
    for depth in range(len(parts), -1, -1):
        directory = mount.joinpath(*parts[:depth])
        if directory.is_dir():
            found.append(read(directory))
    return found


def _v1_mounts(root: Path, controllers: str) -> list[Path]:
    """Where the v1 hierarchy holding `controllers` (e.g. "cpu,cpuacct") is mounted."""
    base = root / "sys/fs/cgroup"
    for name in (controllers, "cpu", "cpu,cpuacct"):
        if (base / name).is_dir():
            return [base / name]
    return []


def _v2_quota(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


# ---------------------------------------------------------------------------------------------
# The memory this process may still take


def available_memory(root: Path = Path("/")) -> int:
    """Bytes this process may still allocate: the kernel's estimate of available memory
    (psutil's `available`, /proc/meminfo's MemAvailable on Linux), capped by the room left under
    its cgroup's memory limit (v2 `memory.max - memory.current`, v1 `memory.limit_in_bytes -
    memory.usage_in_bytes`, the tightest along the cgroup's path): a container sees the
    machine's memory in /proc/meminfo, not its own limit."""
    import psutil  # here: the CPU rules above stay stdlib-only

    room = [int(psutil.virtual_memory().available)]
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return room[0]
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and controllers == "":
            room += _along(root / "sys/fs/cgroup", path, _v2_room)
        elif "memory" in controllers.split(","):
            for mount in _v1_mounts(root, controllers):
                room += _along(mount, path, _v1_room)
    return max(0, min(r for r in room if r is not None))


def _v2_room(directory: Path) -> int | None:
    try:
        limit = (directory / "memory.max").read_text().strip()
        used = int((directory / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else int(limit) - used


def _v1_room(directory: Path) -> int | None:
    try:
        limit = int((directory / "memory.limit_in_bytes").read_text())
        used = int((directory / "memory.usage_in_bytes").read_text())
    except (OSError, ValueError):
        return None
    return None if limit >= 1 << 62 else limit - used  # v1 writes "no limit" as ~2**63


# ---------------------------------------------------------------------------------------------
# What other processes keep busy


class BusyElsewhere:
    """The cores other processes kept busy between `__init__` and `cores()`: the allowed CPUs'
    busy time (/proc/stat: user, nice, system, irq, softirq and steal, which is a neighbour's
    too) less this process's own and its children's (the painter, DataLoader workers), over the
    time between. Linux only; 0.0 elsewhere or when the window is too short to tell."""

    MIN_WINDOW_S = 0.2

    def __init__(self, proc: Path = Path("/proc")):
        self.proc, self.cpus = proc, allowed_cpus()
        self.ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.start = self._snapshot()

    def _snapshot(self) -> tuple[float, float, float] | None:
        try:
            busy = 0
            for line in (self.proc / "stat").read_text().splitlines():
                name, *fields = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in self.cpus:
                    values = [int(v) for v in fields[:8]]  # user nice system idle iowait irq ...
                    busy += sum(values) - values[3] - values[4]
            own = sum(os.times()[:2]) + self._children_s()
        except (OSError, ValueError, IndexError):
            return None
        return time.monotonic(), busy / self.ticks, own

    def _children_s(self) -> float:
        """CPU seconds of this process's live children (waited-for ones are in os.times)."""
        total = 0.0
        for tasks in (self.proc / "self/task").glob("*/children"):
            for pid in tasks.read_text().split():
                try:
                    stat = (self.proc / pid / "stat").read_text()
                except OSError:
                    continue  # ended meanwhile
                fields = stat.rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / self.ticks  # utime, stime
        return total

    def cores(self) -> float:
        end = self._snapshot()
        if self.start is None or end is None or end[0] - self.start[0] < self.MIN_WINDOW_S:
            return 0.0
        wall = end[0] - self.start[0]
        others = (end[1] - self.start[1]) - (end[2] - self.start[2])
        return round(max(0.0, others / wall), 2)


# ---------------------------------------------------------------------------------------------
# The decisions


@dataclass(frozen=True)
class Plan:
    """A count kiln chose (intra-op threads, DataLoader workers) and why, for the log."""

    count: int
    reason: str


def intra_op_threads(
    setting: int | str,
    budget: CpuBudget,
    step_flops: float | None,
    *,
    what: str = "a step",
    share: int = 1,
    reserve: int = 0,
) -> Plan:
    """torch's intra-op threads for work of `step_flops` model FLOPs per step (or per model
    call); `setting`: "auto" or a number that pins it; `share`: processes of this job that
    split the CPUs between them (DDP ranks on one machine); `reserve`: cores kept for other
    work of this process (a server's HTTP)."""
    if setting != "auto":
        return Plan(int(setting), f"pinned ({setting})")
    plan = _auto_threads(budget, step_flops, what, share, reserve)
    cap = os.environ.get("OMP_NUM_THREADS", "")  # the user's (or torchrun's) say: a ceiling
    if cap.isdigit() and 0 < int(cap) < plan.count:
        return Plan(int(cap), f"OMP_NUM_THREADS={cap} caps {plan.count}: {plan.reason}")
    return plan


def _auto_threads(
    budget: CpuBudget, step_flops: float | None, what: str, share: int, reserve: int
) -> Plan:
    cores = max(1, budget.usable_physical // share - reserve)
    split = f" / {share} processes" if share > 1 else ""
    split += f", less {reserve} kept for other work" if reserve else ""
    if step_flops is None:
        return Plan(
            cores,
            f"the usable physical cores{split}: the model's FLOPs were not counted; "
            f"{budget.describe()}",
        )
    size = f"{what} is {step_flops / 1e9:.3g} GFLOP"
    if step_flops < SMALL_STEP_FLOPS:
        return Plan(
            1,
            f"{size}, under {SMALL_STEP_FLOPS / 1e9:g}: one thread (splitting ops this small "
            f"costs about what it saves, and far more beside a busy process); {budget.describe()}",
        )
    held = f", less {budget.taken} that other processes hold" if budget.taken else ""
    return Plan(
        max(1, cores - budget.taken),
        f"{size}: the usable physical cores{split}{held}; {budget.describe()}",
    )


def training_threads(
    setting: int | str,
    step_flops: float | None,
    *,
    watch: BusyElsewhere | None,
    deterministic: bool,
    share: int,
) -> Plan:
    """The training step's threads. What other processes keep busy counts only where the run's
    result may depend on it: not under trainer.deterministic (a reduction split over another
    number of threads sums in another order), and not for DDP ranks (the other ranks on the
    machine are this job's own processes, already counted by `share`)."""
    load_aware = watch is not None and not deterministic and share == 1
    budget = cpu_budget(busy_elsewhere=watch.cores() if load_aware else 0.0)
    plan = intra_op_threads(setting, budget, step_flops, share=share)
    if deterministic and setting == "auto" and plan.count > 1:
        return Plan(plan.count, plan.reason + "; trainer.deterministic: not load-dependent")
    return plan


def dataloader_workers(budget: CpuBudget, in_memory: bool) -> Plan:
    """DataLoader worker processes for data.num_workers=auto."""
    if in_memory:
        return Plan(0, "the dataset is in memory, a batch a lookup: a worker would only add a copy")
    cores = budget.usable_physical
    if cores < 2:
        return Plan(0, "one usable core: a worker would take it from the step")
    workers = min(max(1, round(cores / 4)), cores // 2)
    return Plan(
        workers,
        f"a quarter of the {cores} usable physical core(s), at least 1, at most half; each "
        "runs one thread",
    )
