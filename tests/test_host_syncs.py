"""The hot loop does not wait for the device: between two log lines a training step reads no
tensor on the host (no .item(), .tolist(), .cpu(), bool(), float(), ...), whatever the loss does.
Counted on CPU by patching every Tensor method that would synchronise with a GPU, with the
trainer keeping its numbers on the device as it does on a GPU (on the CPU it reads them at once:
free there, and fewer ops); both ways give the same log lines."""

from __future__ import annotations

import contextlib
import math
import sys

import pytest
import torch

from kiln.engine.distributed import DistInfo, GradientNorm
from kiln.engine.run import build_run
from kiln.guards.first_steps import READ_AFTER

from .conftest import compose_config

# Reads of host-made tensors, never of device tensors: the sampler's index lists, the RNG states.
HOST_DATA = ("torch.utils.data", "kiln.rng")
SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


class HostReads:
    """Counts calls of the syncing Tensor methods, separately inside and outside log lines."""

    def __init__(self):
        self.in_steps: list[str] = []
        self.in_log_lines: list[str] = []
        self.logging = False
        self.steps_with_reads: set[int] = set()
        self.step = 0  # the optimizer step the counted reads belong to

    @contextlib.contextmanager
    def counting(self):
        originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

        def counted(name):
            original = originals[name]

            def wrapper(tensor, *args, **kwargs):
                caller = sys._getframe(1).f_globals.get("__name__", "")
                if not caller.startswith(HOST_DATA):
                    (self.in_log_lines if self.logging else self.in_steps).append(name)
                    if not self.logging:
                        self.steps_with_reads.add(self.step)
                return original(tensor, *args, **kwargs)

            return wrapper

        for name in SYNCING:
            setattr(torch.Tensor, name, counted(name))
        try:
            yield self
        finally:
            for name, original in originals.items():
                setattr(torch.Tensor, name, original)

    def around(self, log_window):
        def wrapped(*args, **kwargs):
            self.logging = True
            try:
                return log_window(*args, **kwargs)
            finally:
                self.logging = False

        return wrapped


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        (
            "trainer.accumulate_grad_batches=3",
            "trainer.gradient_clip_val=1.0",
            "optimizer=sgd",
            "data.batch_size=16",
        ),
        ("trainer.nan_policy=skip", "trainer.max_skipped_steps=-1", "loss.force_all_branches=true"),
        ("data=csv_text", "model=text_transformer", "scheduler=cosine", "data.batch_size=16"),
    ],
    ids=["default", "accumulate-clip-sgd", "skip-branches", "text-cosine"],
)
def test_no_host_read_in_the_steps_between_log_lines(tmp_path, overrides):
    # Every check before step 1, however busy the machine: with no room for the learn probe its
    # readings move into the first steps (the test below), and these steps would read them.
    reads = twelve_steps_counted(tmp_path, overrides, "trainer.probe_budget.enforce=false")
    assert reads.in_steps == [], f"host reads inside training steps: {reads.in_steps}"
    assert reads.in_log_lines, "the log lines read the window: the count must see them"


def test_the_learn_probe_moved_into_the_first_steps_reads_only_at_its_readings(tmp_path):
    """No room for the learn probe before step 1: the probe batch's loss is read after step 5,
    and after 10 where it had not fallen yet (kiln.guards.first_steps.READ_AFTER), one host
    read each; no other step reads anything."""
    reads = twelve_steps_counted(
        tmp_path, (), "trainer.probe_budget.min_s=0", "trainer.probe_budget.max_s=0"
    )
    read_at = sorted(reads.steps_with_reads)
    assert read_at and read_at == [step for step in READ_AFTER if step <= 12][: len(read_at)]
    assert reads.in_steps == ["__float__"] * len(read_at)


def twelve_steps_counted(tmp_path, overrides, *budget) -> HostReads:
    """Twelve training steps of the config, logging every 5, the trainer keeping its numbers
    on the device (as on a GPU); the host reads they make, counted inside and outside the
    log lines."""
    cfg = compose_config(
        "trainer.log_every_n_steps=5",
        "trainer.max_steps=16",
        "env.progress_bar=false",
        "logger=none",
        *budget,
        *overrides,
    )
    trainer = build_run(cfg, tmp_path, DistInfo(), torch.device("cpu"), lambda m, s: None).trainer
    trainer.read_on_host(False)  # as on a GPU
    reads = HostReads()
    trainer.log_window = reads.around(trainer.log_window)
    loader = trainer.train_loader
    loader.sampler.set_epoch(0)
    batches = iter(loader)
    trainer.run_probes()
    window = cfg.trainer.accumulate_grad_batches
    with reads.counting():
        for _ in range(12):
            reads.step = trainer.state.global_step + 1
            result = trainer.train_step(batches, window)
            trainer.state.global_step += 1
            trainer.state.batch_in_epoch += window
            trainer.after_step(result, None)
    assert trainer.state.global_step == 12
    return reads


NAN_STEPS = (3, 4, 9)  # a run of two, and one alone


@pytest.mark.parametrize("window", [1, 2], ids=["one-batch", "accumulated"])
@pytest.mark.parametrize("policy", ["skip", "fail"])
def test_reading_on_the_host_gives_the_log_lines_of_the_device_way(tmp_path, policy, window):
    """Same config, same seed: the CPU's way (each number read as it comes) and the GPU's way
    (device sums read at the log line) log the same numbers, skip the same steps, and report
    the same first non-finite step with its terms."""

    def run(on_host: bool) -> tuple[list[dict], str | None]:
        cfg = compose_config(
            "trainer.log_every_n_steps=5",
            "trainer.max_steps=12",
            "env.progress_bar=false",
            "logger=none",
            "loss.force_all_branches=true",
            f"trainer.accumulate_grad_batches={window}",
            "data.batch_size=32",
            f"trainer.nan_policy={policy}",
            "trainer.max_skipped_steps=-1",
        )
        lines: list[dict] = []
        trainer = build_run(
            cfg,
            tmp_path / str(on_host),
            DistInfo(),
            torch.device("cpu"),
            lambda metrics, step: lines.append({"step": step, **metrics}),
        ).trainer
        trainer.read_on_host(on_host)
        criterion = trainer.criterion

        def poisoned(model, batch):  # NaN in one branch's term at the chosen steps
            loss, terms = criterion(model, batch)
            if trainer.state.global_step + 1 in NAN_STEPS:
                terms = {**terms, "z_loss": terms["z_loss"] * float("nan")}
                loss = loss + terms["z_loss"]
            return loss, terms

        trainer.criterion = poisoned
        trainer.criterion.forward = criterion.forward
        loader = trainer.train_loader
        loader.sampler.set_epoch(0)
        batches = iter(loader)
        failure = None
        try:
            for _ in range(12):
                result = trainer.train_step(batches, window)
                trainer.state.global_step += 1
                trainer.after_step(result, None)
        except Exception as err:  # noqa: BLE001 -- compared between the two ways
            failure = f"{type(err).__name__}: {err} {getattr(err, 'bad_terms', None)}"
        return lines, failure

    host_lines, host_failure = run(True)
    device_lines, device_failure = run(False)
    assert host_failure == device_failure
    if policy == "fail":
        assert host_failure is not None and "@ step 3" in host_failure and "z_loss" in host_failure
    else:
        assert host_failure is None and host_lines[-1]["nonfinite_skipped"] == len(NAN_STEPS)
    assert [line["step"] for line in host_lines] == [line["step"] for line in device_lines]
    timing = ("samples_per_s", "data_time_frac", "memory_mb", "model_tflops_per_s", "mfu")
    for host, device in zip(host_lines, device_lines, strict=True):
        assert host.keys() == device.keys()
        for key, value in host.items():
            if key in timing:
                continue
            assert value == pytest.approx(device[key], rel=1e-5, nan_ok=True), key


def test_the_gradient_norm_read_on_the_host_is_torch_s_total_norm():
    """Measured only and read at once (the CPU, one process), the norm comes back as a float
    combined on the host; clipping, or a norm kept on the device, is torch's tensor."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 33), torch.nn.ReLU(), torch.nn.Linear(33, 4))
    model(torch.randn(16, 9)).pow(2).sum().backward()
    grads = [p.grad for p in model.parameters()]
    expected = float(torch.nn.utils.get_total_norm(grads))
    norm = GradientNorm(list(model.parameters()))
    on_host = norm(math.inf, on_host=True)
    assert isinstance(on_host, float) and on_host == pytest.approx(expected, rel=1e-6)
    kept = norm(math.inf)
    assert isinstance(kept, torch.Tensor) and float(kept) == pytest.approx(expected, rel=1e-6)
    clipped = norm(expected / 2, on_host=True)  # clipping: torch's arithmetic, then the clip
    assert isinstance(clipped, torch.Tensor) and float(clipped) == pytest.approx(expected)
    after = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))
    assert after == pytest.approx(expected / 2, rel=1e-5)
    model[0].weight.grad[0, 0] = math.inf  # a non-finite gradient stays visible
    assert norm(math.inf, on_host=True) == math.inf
