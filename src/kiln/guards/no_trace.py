"""What a check before step 1 may not change: every RNG state, and the model's buffers, modes and
gradients. `untouched(model)` puts them back however the block ends, so the probes leave no
trace on the run and a resumed run stays bitwise equal to an uninterrupted one. (A check that
must change weights or an optimizer's state, the learn probe, works on copies.)"""

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
    if model is None:
        return Snapshot(rng_state(), {}, {}, {})
    return Snapshot(
        rng=rng_state(),
        buffers={name: b.detach().clone() for name, b in model.named_buffers()},
        modes={name: m.training for name, m in model.named_modules()},
        grads={name: p.grad for name, p in model.named_parameters()},
    )


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
