"""kiln's optimizers and FLOP count run without importing torch._dynamo (1.0-1.3 s of every
run's start-up when they did), and compute what torch's own do, bitwise."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.flop_counter import FlopCounterMode

from kiln.config.optim import AdamWConfig, SGDConfig
from kiln.engine.flop_count import FlopCount
from kiln.engine.optim import build_adamw, build_sgd
from kiln.models.text import FastText


def test_a_run_s_optimizer_and_flop_count_leave_torch_dynamo_unimported():
    """In a fresh interpreter: kiln's adamw (a sparse table and dense layers) and sgd built,
    stepped, zeroed, saved and loaded, and a step's FLOPs counted. torch._dynamo is imported
    by torch's wrappers of these methods the first time one runs."""
    script = textwrap.dedent(
        """
        import sys
        import torch
        from kiln.config.optim import AdamWConfig, SGDConfig
        from kiln.engine.optim import build_adamw, build_sgd
        from kiln.engine.throughput import flops_per_sample

        table = torch.nn.EmbeddingBag(50, 8, mode="sum", sparse=True)
        head = torch.nn.Linear(8, 3)
        for optimizer in (
            build_adamw([*table.parameters(), *head.parameters()], AdamWConfig()),
            build_sgd(head.parameters(), SGDConfig()),
        ):
            for _ in range(2):
                head(table(torch.tensor([[1, 2], [3, 4]]))).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            optimizer.load_state_dict(optimizer.state_dict())
        model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
        flops = flops_per_sample(model, lambda m, x, train: m(x), torch.randn(3, 4), 3)
        # a sample: forward 2*(4*5 + 5*2); backward the weights' gradients as much again, and
        # the first layer's output gradient 2*5*2 (the input needs none)
        assert flops == 2 * 2 * (4 * 5 + 5 * 2) + 2 * 5 * 2, flops
        print("torch._dynamo" in sys.modules)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def _steps(optimizer_of, seed: int = 0) -> list[torch.Tensor]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    optimizer = optimizer_of(model.parameters())
    x, y = torch.randn(32, 6), torch.randint(0, 3, (32,))
    for _ in range(5):
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    # A state saved and loaded into a fresh optimizer continues the same way.
    state = optimizer.state_dict()
    optimizer = optimizer_of(model.parameters())
    optimizer.load_state_dict(state)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "kiln_of, torch_of",
    [
        (
            lambda ps: build_adamw(ps, AdamWConfig(lr=0.01, weight_decay=0.05)),
            lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.05, fused=True),
        ),
        (
            lambda ps: build_sgd(ps, SGDConfig(lr=0.1, weight_decay=1e-3)),
            lambda ps: torch.optim.SGD(
                ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3, fused=True
            ),
        ),
    ],
    ids=["adamw", "sgd"],
)
def test_kiln_s_optimizers_step_bitwise_as_torch_s(kiln_of, torch_of):
    for ours, theirs in zip(_steps(kiln_of), _steps(torch_of), strict=True):
        assert torch.equal(ours, theirs)


def _transformer() -> nn.Module:
    return nn.TransformerEncoder(
        nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0), num_layers=2
    )


@pytest.mark.parametrize(
    "build, inputs",
    [
        (
            lambda: nn.Sequential(nn.Linear(10, 7), nn.GELU(), nn.Linear(7, 3)),
            (torch.randn(5, 10),),
        ),
        (
            lambda: nn.Sequential(
                nn.Conv2d(3, 4, 3, padding=1),
                nn.BatchNorm2d(4),
                nn.ReLU(),
                nn.Conv2d(4, 2, 3, stride=2),
                nn.Flatten(),
            ),
            (torch.randn(2, 3, 9, 9),),
        ),
        (_transformer, (torch.randn(2, 6, 16),)),
        (
            lambda: FastText(
                40, 8, 4, ngrams=2, num_buckets=64, dropout=0.0, pad_id=0, aux_head=False
            ),
            (torch.randint(1, 40, (3, 7)),),
        ),
    ],
    ids=["mlp", "conv", "transformer", "text_bow"],
)
def test_the_flop_count_equals_torch_s_flop_counter(build, inputs):
    torch.manual_seed(0)
    model = build()
    with FlopCount() as ours:
        model(*inputs).float().sum().backward()
    with FlopCounterMode(display=False) as theirs:
        model(*inputs).float().sum().backward()
    assert ours.total > 0
    assert ours.total == theirs.get_total_flops()


def test_kiln_s_steps_are_seen_by_step_hooks_and_the_profiler_and_skip_its_ranges_unwatched(
    monkeypatch,
):
    """Nothing watching: no profiler range entered on a step or a zero_grad (torch's wrapper
    enters one on every step). Watched -- a hook of its own, a global hook, a profiler -- each
    sees the step as it would a torch optimizer's."""
    model = nn.Linear(4, 2)
    optimizer = build_adamw(model.parameters(), AdamWConfig())
    ranges = []
    enter = torch.autograd.profiler.record_function.__enter__

    def counted(self):
        ranges.append(self.name)
        return enter(self)

    monkeypatch.setattr(torch.autograd.profiler.record_function, "__enter__", counted)

    def step():
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    assert ranges == []
    assert model.weight.grad is None  # zero_grad set every gradient to None
    seen = []
    own = optimizer.register_step_post_hook(lambda opt, args, kwargs: seen.append("post"))
    everyone = register_optimizer_step_pre_hook(lambda opt, args, kwargs: seen.append("global pre"))
    step()
    own.remove()
    everyone.remove()
    assert seen == ["global pre", "post"]
    assert ranges == ["Optimizer.step#AdamW.step"]
    ranges.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
    names = {event.key for event in prof.key_averages()}
    assert {"Optimizer.step#AdamW.step", "Optimizer.zero_grad#AdamW.zero_grad"} <= names
    ranges.clear()
    step()  # the profiler gone: unwatched again
    assert ranges == []
