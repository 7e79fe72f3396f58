"""kiln.threads: the CPUs a process may use (affinity mask, cgroup quota read from a /proc and
/sys tree the test builds), the thread and worker decisions on given budgets and FLOPs, what
other processes keep busy, and a training run's own decision, logged once with its reason."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kiln.threads import (
    SMALL_STEP_FLOPS,
    BusyElsewhere,
    CpuBudget,
    cgroup_quota,
    dataloader_workers,
    intra_op_threads,
    physical_cores,
    training_threads,
)

from .conftest import train_in_process


def write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# ------------------------------------------------------------------------- the cgroup quota


def test_cgroup_v2_quota_is_the_tightest_along_the_path(tmp_path):
    write(tmp_path, "proc/self/cgroup", "0::/jobs/run7\n")
    write(tmp_path, "sys/fs/cgroup/cpu.max", "max 100000\n")
    write(tmp_path, "sys/fs/cgroup/jobs/cpu.max", "150000 100000\n")  # 1.5 CPUs for all jobs
    write(tmp_path, "sys/fs/cgroup/jobs/run7/cpu.max", "300000 100000\n")  # 3: the parent wins
    assert cgroup_quota(tmp_path) == 1.5
    write(tmp_path, "sys/fs/cgroup/jobs/cpu.max", "max 100000\n")
    assert cgroup_quota(tmp_path) == 3.0


def test_cgroup_v2_without_a_quota_and_a_container_that_sees_its_own_cgroup_as_root(tmp_path):
    write(tmp_path, "proc/self/cgroup", "0::/\n")
    write(tmp_path, "sys/fs/cgroup/cpu.max", "max 100000\n")
    assert cgroup_quota(tmp_path) is None
    # Inside a container the path names the host's cgroup, absent from the container's mount:
    # the mount itself is the container's cgroup.
    write(tmp_path, "proc/self/cgroup", "0::/kubepods/pod1/abc\n")
    write(tmp_path, "sys/fs/cgroup/cpu.max", "50000 100000\n")
    assert cgroup_quota(tmp_path) == 0.5


def test_cgroup_v1_quota_and_its_no_limit(tmp_path):
    cgroups = "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n1:name=systemd:/\n"
    write(tmp_path, "proc/self/cgroup", cgroups)
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "200000\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cgroup_quota(tmp_path) == 2.0
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    assert cgroup_quota(tmp_path) is None


def test_no_cgroup_file_means_no_quota(tmp_path):
    assert cgroup_quota(tmp_path) is None


def test_available_memory_is_capped_by_the_room_under_a_cgroup_limit(tmp_path):
    """A container sees the machine's memory in /proc/meminfo: its cgroup's limit less what it
    uses is the tighter figure (v2, and v1 with its "no limit" of ~2**63)."""
    import psutil

    from kiln.threads import available_memory

    machine = psutil.virtual_memory().available
    assert available_memory(tmp_path) == pytest.approx(machine, rel=0.2)  # no cgroup file
    write(tmp_path, "proc/self/cgroup", "0::/jobs/run7\n")
    write(tmp_path, "sys/fs/cgroup/memory.max", "max\n")
    write(tmp_path, "sys/fs/cgroup/memory.current", "100\n")
    write(tmp_path, "sys/fs/cgroup/jobs/run7/memory.max", f"{3 * 2**20}\n")
    write(tmp_path, "sys/fs/cgroup/jobs/run7/memory.current", f"{2**20}\n")
    assert available_memory(tmp_path) == 2 * 2**20
    write(tmp_path, "proc/self/cgroup", "4:memory:/docker/abc\n")
    write(tmp_path, "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", f"{2**62}\n")
    write(tmp_path, "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes", "5\n")
    assert available_memory(tmp_path) == pytest.approx(machine, rel=0.2)  # no limit
    write(tmp_path, "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", f"{2**30}\n")
    assert available_memory(tmp_path) == 2**30 - 5


def test_this_machines_quota_is_read_without_error():
    quota = cgroup_quota()
    assert quota is None or quota > 0


def test_physical_cores_count_each_core_once(tmp_path):
    cpu_dir = tmp_path / "cpu"
    for cpu, core in enumerate([0, 1, 0, 1]):  # two cores, two hyper-threads each
        write(cpu_dir, f"cpu{cpu}/topology/core_id", f"{core}\n")
        write(cpu_dir, f"cpu{cpu}/topology/physical_package_id", "0\n")
    assert physical_cores({0, 1, 2, 3}, cpu_dir) == 2
    assert physical_cores({0, 2}, cpu_dir) == 1  # pinned to one core's two threads
    assert physical_cores({0, 1, 7}, cpu_dir) == 3  # cpu7 has no topology: counted as CPUs


def test_usable_cpus_are_the_mask_capped_by_the_quota():
    assert CpuBudget(allowed=8, quota=None, physical=4).usable == 8
    assert CpuBudget(allowed=8, quota=2.5, physical=4).usable == 2  # a third thread is throttled
    assert CpuBudget(allowed=8, quota=0.5, physical=4).usable == 1
    assert CpuBudget(allowed=8, quota=2.5, physical=4).usable_physical == 2
    assert CpuBudget(allowed=8, quota=None, physical=4).usable_physical == 4
    assert CpuBudget(allowed=2, quota=None, physical=2, busy_elsewhere=0.55).taken == 0
    assert CpuBudget(allowed=2, quota=None, physical=2, busy_elsewhere=0.65).taken == 1
    assert CpuBudget(allowed=4, quota=None, physical=4, busy_elsewhere=1.7).taken == 2


# ----------------------------------------------------------------------------- the decisions


@pytest.fixture
def no_omp_cap(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


def test_a_small_step_runs_on_one_thread_a_large_one_on_the_usable_cores(no_omp_cap):
    eight = CpuBudget(allowed=16, quota=None, physical=8)
    small = intra_op_threads("auto", eight, SMALL_STEP_FLOPS / 2)
    assert small.count == 1 and "one thread" in small.reason and "16 usable CPU(s)" in small.reason
    large = intra_op_threads("auto", eight, SMALL_STEP_FLOPS * 100)
    assert large.count == 8 and "usable physical cores" in large.reason
    quota = CpuBudget(allowed=16, quota=3.0, physical=8)
    assert intra_op_threads("auto", quota, SMALL_STEP_FLOPS * 100).count == 3
    assert "cgroup quota 3 CPUs" in intra_op_threads("auto", quota, 1e12).reason


def test_cores_other_processes_hold_are_left_to_them(no_omp_cap):
    busy = CpuBudget(allowed=2, quota=None, physical=2, busy_elsewhere=1.0)
    plan = intra_op_threads("auto", busy, 1e12)
    assert plan.count == 1 and "less 1 that other processes hold" in plan.reason
    full = CpuBudget(allowed=2, quota=None, physical=2, busy_elsewhere=5.0)
    assert intra_op_threads("auto", full, 1e12).count == 1  # never fewer than one


def test_pinned_shared_reserved_and_uncounted(no_omp_cap, monkeypatch):
    eight = CpuBudget(allowed=8, quota=None, physical=8)
    assert intra_op_threads(3, eight, 1.0).count == 3
    assert intra_op_threads(3, eight, 1.0).reason == "pinned (3)"
    assert intra_op_threads("auto", eight, 1e12, share=4).count == 2  # 4 DDP ranks here
    assert intra_op_threads("auto", eight, 1e12, reserve=1).count == 7  # a core for HTTP
    uncounted = intra_op_threads("auto", eight, None)
    assert uncounted.count == 8 and "not counted" in uncounted.reason
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    capped = intra_op_threads("auto", eight, 1e12)
    assert capped.count == 2 and capped.reason.startswith("OMP_NUM_THREADS=2 caps 8")
    assert intra_op_threads("auto", eight, 1.0).count == 1  # under the cap already


def test_deterministic_runs_do_not_follow_the_load(no_omp_cap):
    class Busy:  # what BusyElsewhere measured: every core taken
        def cores(self) -> float:
            return 64.0

    free = training_threads("auto", 1e15, watch=None, deterministic=False, share=1)
    loaded = training_threads("auto", 1e15, watch=Busy(), deterministic=False, share=1)
    assert loaded.count == 1
    fixed = training_threads("auto", 1e15, watch=Busy(), deterministic=True, share=1)
    assert fixed.count == free.count  # the machine's usable cores, whatever the load


@pytest.mark.parametrize(
    ("physical", "workers"), [(1, 0), (2, 1), (4, 1), (8, 2), (16, 4), (64, 16)]
)
def test_workers_are_a_quarter_to_a_half_of_the_physical_cores(physical, workers):
    budget = CpuBudget(allowed=2 * physical, quota=None, physical=physical)
    plan = dataloader_workers(budget, in_memory=False)
    assert plan.count == workers
    assert physical < 2 or physical / 4 <= plan.count * 1.5 and plan.count <= physical / 2


def test_an_in_memory_dataset_gets_no_worker():
    plan = dataloader_workers(CpuBudget(allowed=64, quota=None, physical=32), in_memory=True)
    assert plan.count == 0 and "in memory" in plan.reason


# ------------------------------------------------------------------ what others keep busy


def test_a_busy_process_elsewhere_is_seen_and_one_of_our_own_is_not(tmp_path):
    marker = tmp_path / "pid"
    # A grandchild (its parent exits at once), so not one of this process's children.
    code = (
        "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', "
        "'import time\\nend = time.time() + 20\\nwhile time.time() < end: pass']); "
        f"open({str(marker)!r}, 'w').write(str(p.pid))"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    pid = int(marker.read_text())
    try:
        time.sleep(0.3)
        watch = BusyElsewhere()
        time.sleep(1.0)
        assert watch.cores() >= 0.6  # the busy loop (and whatever else runs here)
    finally:
        os.kill(pid, signal.SIGKILL)
    # Our own child's CPU is ours: the same loop as a child adds nothing to what others use.
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        watch = BusyElsewhere()
        start = watch._children_s()
        deadline = time.monotonic() + 30  # a loaded machine gives the child its CPU slowly
        while watch._children_s() - start < 0.3 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert watch._children_s() - start >= 0.3  # the child's CPU is counted as our own
    finally:
        child.kill()
        child.wait()


def test_a_short_window_says_nothing():
    assert BusyElsewhere().cores() == 0.0


# ------------------------------------------------------------------- a run's own decision


def test_a_run_logs_its_threads_and_workers_once_with_the_reason(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        summary = train_in_process(run_dir, "trainer.max_epochs=1", "logger=none")
    lines = [line for line in caplog.messages if "threads: " in line]
    assert len(lines) == 1, lines
    # The digits MLP: a few MFLOP a step, an in-memory dataset.
    assert "threads: 1 intra-op (a step is " in lines[0] and "under 2: one thread" in lines[0]
    assert "DataLoader workers: 0 (the dataset is in memory" in lines[0]
    assert summary["threads"] == 1 and summary["num_workers"] == 0
    assert torch.get_num_threads() == 1
    saved = json.loads((run_dir / "summary.json").read_text())
    assert saved["threads"] == 1


def test_pinned_threads_and_workers_are_what_the_run_uses(tmp_path, caplog):
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        summary = train_in_process(
            run_dir,
            "trainer.max_epochs=1",
            "logger=none",
            "trainer.threads=2",
            "data.num_workers=1",
        )
    log = caplog.text
    assert "threads: 2 intra-op (pinned (2)); DataLoader workers: 1 (data.num_workers=1)" in log
    assert summary["threads"] == 2 and summary["num_workers"] == 1


def test_a_loader_worker_runs_one_thread():
    from torch.utils.data import DataLoader, Dataset

    from kiln.data.loaders import seed_worker

    class Threads(Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, index):
            return torch.get_num_threads()

    torch.set_num_threads(2)
    loader = DataLoader(Threads(), batch_size=1, num_workers=1, worker_init_fn=seed_worker)
    assert [int(batch) for batch in loader] == [1, 1]


@pytest.mark.parametrize("value", ["many", -1, 0, 1.5, True])
def test_bad_thread_settings_are_config_errors(value):
    from kiln.config import ConfigError

    from .conftest import compose_config

    with pytest.raises(ConfigError, match="trainer.threads"):
        compose_config(f"trainer.threads={value}")


def test_prediction_and_serving_take_the_same_rule(tmp_path_factory, caplog, monkeypatch):
    """infer.py sizes a model call of its batch by the checkpoint's own forward FLOPs, counted
    on the model it then runs (built once: a second build cost a BERT-sized infer.py 3-4 s);
    the server (server.model_threads=0) does the same for server.max_batch_size, a core kept."""
    from kiln.config.infer import model_threads
    from kiln.inference import predictor as predictor_module
    from kiln.inference.predictor import Predictor, auto_threads, forward_flops

    from .inference_helpers import digits_run

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run_dir, _ = digits_run(tmp_path_factory)
    ckpt = run_dir / "checkpoints" / "best.pt"
    builds = []
    rebuild = predictor_module.rebuild_model  # the real one, counted
    monkeypatch.setattr(
        predictor_module, "rebuild_model", lambda *a: builds.append(1) or rebuild(*a)
    )
    torch.set_num_threads(2)
    with caplog.at_level(logging.INFO):
        predictor = Predictor.from_checkpoint(ckpt, threads="auto", batch_size=256)
    assert len(builds) == 1
    assert torch.get_num_threads() == 1  # the digits MLP: a few MFLOP a call
    assert "threads: 1 intra-op (a model call of 256 input(s) is " in caplog.text
    assert model_threads(0) == "auto" and model_threads(3) == 3
    flops = forward_flops(predictor.record, predictor.backend.net.model)
    assert 1e3 < flops < 1e7
    assert auto_threads(flops, 32, reserve=1) == 1
    # An ONNX file alone has no model to count: the usable cores, less the reserve.
    assert auto_threads(None, 32, reserve=0) >= 1
