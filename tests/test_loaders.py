"""kiln's loaders read an in-memory TensorDataset a batch at a time (one index per tensor) and
give exactly the batches the textbook per-sample DataLoader gives: same tensors, same order,
same resumed epoch, same last batch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from kiln.data.loaders import GatheredTensors, ResumableSampler, build_dataloaders, gathered

from .conftest import compose_config


def sampler_of(dataset, skip: int = 0) -> ResumableSampler:
    sampler = ResumableSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=7)
    sampler.set_epoch(2, skip=skip)
    return sampler


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("skip, drop_last", [(0, False), (30, False), (0, True)])
def test_gathered_batches_equal_the_per_sample_ones(workers, skip, drop_last):
    x = torch.randn(101, 1, 8, 8)
    y = torch.randint(0, 10, (101,))
    dataset = TensorDataset(x, y)
    gathered_set, collate = gathered(dataset, None)
    assert isinstance(gathered_set, GatheredTensors)
    textbook = DataLoader(dataset, batch_size=16, sampler=sampler_of(dataset, skip),
                          drop_last=drop_last)  # fmt: skip
    kiln = DataLoader(gathered_set, batch_size=16, sampler=sampler_of(dataset, skip),
                      collate_fn=collate, num_workers=workers, drop_last=drop_last)  # fmt: skip
    expected, got = list(textbook), list(kiln)
    assert len(got) == len(expected) == len(kiln)
    for (ex, ey), (gx, gy) in zip(expected, got, strict=True):
        assert torch.equal(gx, ex) and torch.equal(gy, ey)
        assert gx.dtype == ex.dtype and gx.stride() == ex.stride() and gy.shape == ey.shape


def test_only_a_plain_tensor_dataset_with_default_collation_is_gathered():
    dataset = TensorDataset(torch.zeros(4, 2), torch.zeros(4))
    custom = lambda batch: batch  # noqa: E731 -- a collate of the dataset's own
    assert gathered(dataset, custom) == (dataset, custom)
    subset = Subset(dataset, [0, 1])  # trainer.overfit_batches' replacement
    assert gathered(subset, None) == (subset, None)


def test_the_digits_loaders_gather(tmp_path):
    from kiln.data import build_data

    cfg = compose_config("data=digits")
    bundle = build_data(cfg.data)
    train, val = build_dataloaders(bundle, cfg.data, seed=0, rank=0, world_size=1, cuda=False)
    assert isinstance(train.dataset, GatheredTensors) and isinstance(val.dataset, GatheredTensors)
    inputs, labels = next(iter(train))
    assert inputs.shape == (cfg.data.batch_size, 1, 8, 8) and labels.dtype == torch.int64
