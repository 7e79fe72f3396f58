"""The optimizer sees every parameter: after the first step, every trainable parameter of the
model must be one the optimizer holds. A layer built in forward on its first call (a
projection sized from the first batch), a parameter replaced after the optimizer was built, a
tie re-made as a new Parameter: each trains nothing (0.85 where the control reached 0.95), and
under DDP it is never reduced either (0.65). The check compares identities, once, after step 1
(by then a lazily built layer exists), before anything is saved."""

from __future__ import annotations

import torch
from torch import nn

from kiln.errors import first_few
from kiln.guards.rules import COVERAGE, ProbeFailure


class OutsideTheOptimizerError(ProbeFailure):
    """Trainable parameters the optimizer does not hold."""

    what = "optimizer coverage"


def parameters_outside(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the model's trainable parameters the optimizer does not hold."""
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]


def check_optimizer_coverage(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, distributed: bool = False
) -> None:
    """OutsideTheOptimizerError naming the parameters the optimizer does not hold."""
    outside = parameters_outside(model, optimizer)
    if not outside:
        return
    modules = list(dict.fromkeys(name.rpartition(".")[0] for name in outside))
    kinds = [
        f"{path or '<model>'} ({type(model.get_submodule(path)).__name__})" for path in modules
    ]
    ddp = "; under DDP they are not reduced either, so the ranks drift apart" if distributed else ""
    raise OutsideTheOptimizerError(
        f"{COVERAGE}: {first_few(outside, 4)} (in {first_few(kinds, 3)}) are trainable "
        f"parameters of the model after step {step} that the optimizer does not hold: they "
        f"were created or replaced after it was built (a layer built in forward on its first "
        f"call?) and never train{ddp}. Create every layer in __init__ (nn.LazyLinear where a "
        "size is known only at the first call), and never replace a parameter afterwards",
        module=modules[0],
    )
