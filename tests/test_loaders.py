"""kiln's loaders read an in-memory TensorDataset a batch at a time (one index per tensor) and
give exactly the batches the textbook per-sample DataLoader gives: same tensors, same order,
same resumed epoch, same last batch."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from kiln.data.loaders import GatheredTensors, ResumableSampler, build_dataloaders, gathered
from kiln.guards.tree import iter_tensors
from kiln.registry import DATASETS, dataset_provides

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
    textbook = DataLoader(
        dataset, batch_size=16, sampler=sampler_of(dataset, skip), drop_last=drop_last
    )
    kiln = DataLoader(
        gathered_set,
        batch_size=16,
        sampler=sampler_of(dataset, skip),
        collate_fn=collate,
        num_workers=workers,
        drop_last=drop_last,
    )
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


def changed_in_place(batch) -> None:
    """What a careless model does to its batch: every tensor in it changed, in place."""
    for _, tensor in iter_tensors(batch):
        if tensor.dtype == torch.bool:
            tensor.logical_not_()
        else:
            tensor.mul_(2).add_(1)


@pytest.mark.parametrize("data", DATASETS.names())
def test_a_batch_is_a_copy_of_the_datasets_items(data):
    """A model that changes its batch in place (rescales detection boxes, normalises its inputs)
    changes that batch only: every dataset's items are as they were, however it stores them
    (the shapes dataset keeps its images and targets in memory and used to hand them out as
    they were, so a model that rescaled boxes rescaled the dataset's, every time it saw them)."""
    from .test_antibodies import SMALL, bundle_for

    fits = {"image": "mlp", "tokens": "text_bow", "image_list": "detector"}
    cfg = compose_config(
        f"data={data}",
        f"model={fits[dataset_provides(data)]}",
        *SMALL.get(data, ()),
        "data.num_workers=0",  # in this process: where an item and its batch could share memory
    )
    bundle = bundle_for(data)
    items = [copy.deepcopy(bundle.train[i]) for i in range(len(bundle.train))]
    train, _ = build_dataloaders(bundle, cfg.data, seed=0, rank=0, world_size=1, cuda=False)
    for batch in itertools.islice(train, 2):
        changed_in_place(batch)
    for i, item in enumerate(items):
        now = list(iter_tensors(bundle.train[i]))
        for (path, was), (_, is_) in zip(iter_tensors(item), now, strict=True):
            assert torch.equal(was, is_), f"{data}: item {i}'s {path} changed with its batch"


def test_a_finished_run_leaves_no_loader_workers_to_the_garbage_collector(tmp_path):
    """Persistent workers stop when train() returns (kiln.data.loaders.stop_workers); left to a
    later garbage collection, each loader's workers sat out torch's 5 s join first."""
    import gc
    import multiprocessing

    from .conftest import FAST, PROBES_OFF, train_in_process

    gc.collect()  # what earlier tests left
    before = set(multiprocessing.active_children())
    overrides = ("data.num_workers=1", "data.persistent_workers=true", "logger=none")
    summary = train_in_process(tmp_path / "run", *FAST, *PROBES_OFF, *overrides)
    assert summary["status"] in ("ok", "at_chance")
    assert set(multiprocessing.active_children()) <= before
