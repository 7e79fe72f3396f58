"""DataLoaders with seeded, resumable order: the shuffle of epoch e depends only on (seed, e), and a
resumed run can start inside an epoch at the next batch."""

from __future__ import annotations

import random

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.data._utils.collate import default_collate

from kiln.data.spec import DataBundle


class ResumableSampler(DistributedSampler):
    """DistributedSampler (works with one replica too) that can skip the first samples of an
    epoch, so that resuming mid-epoch continues with the next batch, not the epoch's start."""

    def __init__(self, dataset, *, num_replicas: int, rank: int, shuffle: bool, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.skip = 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        super().set_epoch(epoch)
        self.skip = skip

    def __iter__(self):
        indices = list(super().__iter__())
        return iter(indices[self.skip :])

    def __len__(self) -> int:
        return self.num_samples - self.skip


def seed_worker(worker_id: int) -> None:
    # torch gives each worker initial_seed = base_seed + worker_id, where base_seed comes from the
    # loader's generator; python and numpy are seeded from it so augmentations repeat too.
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def _loader(dataset, sampler, cfg, *, collate_fn, pin_memory: bool, seed: int) -> DataLoader:
    workers = cfg.num_workers
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=workers,
        collate_fn=collate_fn,
        pin_memory=pin_memory,
        persistent_workers=cfg.persistent_workers and workers > 0,
        prefetch_factor=cfg.prefetch_factor if workers > 0 else None,
        worker_init_fn=seed_worker,
        generator=torch.Generator().manual_seed(seed),
        drop_last=False,
    )


def build_dataloaders(
    bundle: DataBundle, cfg, *, seed: int, rank: int, world_size: int, cuda: bool
):
    """Returns (train_loader, val_loader). pin_memory is applied only when training on CUDA."""
    pin = bool(cfg.pin_memory and cuda)
    train_sampler = ResumableSampler(
        bundle.train, num_replicas=world_size, rank=rank, shuffle=True, seed=seed
    )
    val_sampler = ResumableSampler(
        bundle.val, num_replicas=world_size, rank=rank, shuffle=False, seed=seed
    )
    collate = bundle.collate_fn
    train = _loader(bundle.train, train_sampler, cfg, collate_fn=collate, pin_memory=pin, seed=seed)
    val = _loader(bundle.val, val_sampler, cfg, collate_fn=collate, pin_memory=pin, seed=seed)
    return train, val


def example_batch(bundle: DataBundle, batch_size: int, seed: int = 0):
    """One collated training batch, chosen with a fixed seed: what the shape check feeds the
    model, so Tensor, List[Tensor] and dict inputs all come out exactly as in training."""
    gen = torch.Generator().manual_seed(seed)
    n = min(batch_size, len(bundle.train))
    indices = torch.randperm(len(bundle.train), generator=gen)[:n].tolist()
    collate = bundle.collate_fn or default_collate
    return collate([bundle.train[i] for i in indices])
