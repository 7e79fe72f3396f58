"""What a check before step 1 may not change: every RNG state, and the model's buffers, modes and
gradients. `untouched(model)` puts them back however the block ends, so the probes leave no
trace on the run and a resumed run stays bitwise equal to an uninterrupted one. A check that
must step the weights (the learn probe) does so in place inside `weights_kept(model)`, which holds
them on the host meanwhile: the model is never copied on its device."""

from __future__ import annotations

import contextlib
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
    """The model's parameters and buffers as they were, on the host (`restore()` puts them
    back, bitwise)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.saved = {
            name: t.detach().to("cpu", copy=True)
            for name, t in [*model.named_parameters(), *model.named_buffers()]
        }

    def restore(self) -> None:
        with torch.no_grad():
            for name, t in [*self.model.named_parameters(), *self.model.named_buffers()]:
                if name in self.saved:
                    t.copy_(self.saved[name])


@contextlib.contextmanager
def weights_kept(model: nn.Module) -> Iterator[KeptWeights]:
    """The block may step `model`'s weights in place: they are as before after it."""
    kept = KeptWeights(model)
    try:
        yield kept
    finally:
        kept.restore()
