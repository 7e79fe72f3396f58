"""What a check before step 1 may not change: every RNG state, and the model's buffers, modes and
gradients. `untouched(model)` puts them back however the block ends, so the probes leave no
trace on the run and a resumed run stays bitwise equal to an uninterrupted one. A check that
must step the weights (the learn probe) does so in place inside `weights_kept(model)`, which keeps
them off the model's memory meanwhile: the model is never copied where it lives."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from kiln.rng import rng_state, set_rng_state


@dataclass
class Snapshot:
    rng: dict
    buffers: dict[str, torch.Tensor]
    modes: dict[str, bool]
    grads: dict[str, torch.Tensor | None]


def snapshot(model: nn.Module | None) -> Snapshot:
    """The state to put back. The model's gradients are taken off it meanwhile (a backward
    inside the block would add to them in place)."""
    if model is None:
        return Snapshot(rng_state(), {}, {}, {})
    saved = Snapshot(
        rng=rng_state(),
        buffers={name: b.detach().clone() for name, b in model.named_buffers()},
        modes={name: m.training for name, m in model.named_modules()},
        grads={name: p.grad for name, p in model.named_parameters()},
    )
    for param in model.parameters():
        param.grad = None
    return saved


def restore(model: nn.Module | None, saved: Snapshot) -> None:
    set_rng_state(saved.rng)
    if model is None:
        return
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in saved.buffers:
                buffer.copy_(saved.buffers[name])
    for name, module in model.named_modules():
        module.training = saved.modes.get(name, module.training)
    for name, param in model.named_parameters():
        param.grad = saved.grads.get(name)


@contextlib.contextmanager
def untouched(model: nn.Module | None = None) -> Iterator[Snapshot]:
    """RNG states (and `model`'s buffers, modes and gradients) as they were, after the block."""
    saved = snapshot(model)
    try:
        yield saved
    finally:
        restore(model, saved)


def changed_buffers(model: nn.Module, saved: Snapshot) -> list[str]:
    """The buffers that differ from the snapshot (an eval-mode forward that moved statistics)."""
    return [
        name
        for name, b in model.named_buffers()
        if name in saved.buffers and not torch.equal(b, saved.buffers[name])
    ]


class KeptWeights:
    """The model's parameters and buffers as they were (`restore()` puts them back, bitwise),
    kept off the model's own memory: a GPU model's on the host, a CPU model's in a temporary
    file (read back through a memory map), so a check that steps the weights in place costs
    no second copy where the model lives."""

    def __init__(self, model: nn.Module):
        self.model = model
        named = [*model.named_parameters(), *model.named_buffers()]
        on_cpu = {name: t.detach() for name, t in named if t.device.type == "cpu"}
        self.saved = {name: t.detach().to("cpu") for name, t in named if name not in on_cpu}
        self.file: str | None = None
        if on_cpu:
            handle, self.file = tempfile.mkstemp(prefix="kiln-weights-", suffix=".pt")
            os.close(handle)
            try:
                torch.save(on_cpu, self.file)
                self.saved.update(torch.load(self.file, mmap=True, weights_only=True))
            except OSError:  # no room in the temporary folder: kept in memory instead
                self.saved.update({name: t.clone() for name, t in on_cpu.items()})

    def restore(self) -> None:
        with torch.no_grad():
            for name, t in [*self.model.named_parameters(), *self.model.named_buffers()]:
                if name in self.saved:
                    t.copy_(self.saved[name])

    def close(self) -> None:
        self.saved = {}
        if self.file is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.file)


@contextlib.contextmanager
def weights_kept(model: nn.Module) -> Iterator[KeptWeights]:
    """The block may step `model`'s weights in place: they are as before after it."""
    kept = KeptWeights(model)
    try:
        yield kept
    finally:
        kept.restore()
        kept.close()
