"""The hot loop does not wait for the device: between two log lines a training step reads no
tensor on the host (no .item(), .tolist(), .cpu(), bool(), float(), ...), whatever the loss does.
Counted on CPU by patching every Tensor method that would synchronise with a GPU."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

from kiln.engine.distributed import DistInfo
from kiln.engine.run import build_trainer

from .conftest import compose_config

HOST_DATA = ("torch.utils.data",)  # reads of CPU-made index tensors, never of device tensors
SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")


class HostReads:
    """Counts calls of the syncing Tensor methods, separately inside and outside log lines."""

    def __init__(self):
        self.in_steps: list[str] = []
        self.in_log_lines: list[str] = []
        self.logging = False

    @contextlib.contextmanager
    def counting(self):
        originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

        def counted(name):
            original = originals[name]

            def wrapper(tensor, *args, **kwargs):
                caller = sys._getframe(1).f_globals.get("__name__", "")
                if not caller.startswith(HOST_DATA):  # the sampler's index lists are host data
                    (self.in_log_lines if self.logging else self.in_steps).append(name)
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
        ),  # fmt: skip
        ("trainer.nan_policy=skip", "trainer.max_skipped_steps=-1", "loss.force_all_branches=true"),
        ("data=csv_text", "model=text_transformer", "scheduler=cosine", "data.batch_size=16"),
    ],
    ids=["default", "accumulate-clip-sgd", "skip-branches", "text-cosine"],
)
def test_no_host_read_in_the_steps_between_log_lines(tmp_path, overrides):
    cfg = compose_config(
        "trainer.log_every_n_steps=5",
        "trainer.max_steps=16",
        "env.progress_bar=false",
        "logger=none",
        *overrides,
    )
    trainer = build_trainer(cfg, tmp_path, DistInfo(), torch.device("cpu"), lambda m, s: None)
    reads = HostReads()
    trainer.log_window = reads.around(trainer.log_window)
    loader = trainer.train_loader
    loader.sampler.set_epoch(0)
    batches = iter(loader)
    trainer.run_probes()
    window = cfg.trainer.accumulate_grad_batches
    with reads.counting():
        for _ in range(12):
            result = trainer.train_step(batches, window)
            trainer.state.global_step += 1
            trainer.state.batch_in_epoch += window
            trainer.after_step(result, None)
    assert reads.in_steps == [], f"host reads inside training steps: {reads.in_steps}"
    assert reads.in_log_lines, "the log lines read the window: the count must see them"
    assert trainer.state.global_step == 12
