"""DataLoaders with seeded, resumable order: the shuffle of epoch e depends only on (seed, e), and a
resumed run can start inside an epoch at the next batch. Texts can be batched by length
(BucketedSampler), with the same guarantees."""

from __future__ import annotations

import logging
import math
import random
import signal
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    Sampler,
    Subset,
    TensorDataset,
)
from torch.utils.data._utils.collate import default_collate

from kiln.data.spec import DataBundle
from kiln.threads import Plan, cpu_budget, dataloader_workers

log = logging.getLogger(__name__)


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


class LengthOrderedSampler(ResumableSampler):
    """The items shortest first (ties in order), split over the replicas as ResumableSampler
    splits them: each validation batch is padded only to texts of about its own length (in file
    order, to the longest of 256 random ones). The evaluation's metrics are sums over every
    item, the same in any order."""

    def __init__(self, dataset, lengths: Sequence[int], *, num_replicas: int, rank: int, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, seed=seed)
        if len(lengths) != len(dataset):
            raise ValueError(f"{len(lengths)} lengths for {len(dataset)} items")
        self.order = np.argsort(np.asarray(lengths), kind="stable")

    def __iter__(self):
        return (int(self.order[position]) for position in super().__iter__())


class SeededItemSampler(ResumableSampler):
    """A ResumableSampler whose keys are (index, seed, epoch): for datasets that seed each
    item's randomness (augmentation) from these alone (`dataset.seeded_keys`), so an item comes
    out the same whichever worker loads it, and a resumed epoch equals an uninterrupted one."""

    def __iter__(self):
        return ((index, self.seed, self.epoch) for index in super().__iter__())


class BucketedSampler(Sampler[int]):
    """Batches of items of similar length, in shuffled order, so little of a padded batch is
    padding. Per epoch: shuffle every index (seeded by (seed, epoch) only), sort each pool of
    `pool_batches` global batches by length, cut the pools into global batches of
    batch_size x num_replicas, shuffle those, and give each rank one contiguous batch_size slice
    of each. The indices come out batch by batch, so the DataLoader's batching (batch_size,
    drop_last=False) reproduces the buckets. Like ResumableSampler: DistributedSampler's padding
    (num_samples per rank, every rank the same count), and `set_epoch(epoch, skip)` to resume
    after `skip` samples (a multiple of batch_size) inside an epoch. With `seeded_keys` the keys
    are (index, seed, epoch), as SeededItemSampler's (augmented items grouped by shape)."""

    def __init__(
        self,
        lengths: Sequence[int],
        *,
        batch_size: int,
        num_replicas: int,
        rank: int,
        seed: int,
        pool_batches: int = 50,
        seeded_keys: bool = False,
    ):
        self.lengths = np.asarray(lengths)
        self.seeded_keys = seeded_keys
        self.batch_size, self.num_replicas, self.rank = batch_size, num_replicas, rank
        self.seed, self.pool_batches = seed, pool_batches
        self.num_samples = math.ceil(len(self.lengths) / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.epoch, self.skip = 0, 0

    def set_epoch(self, epoch: int, skip: int = 0) -> None:
        self.epoch, self.skip = epoch, skip

    def rank_order(self) -> np.ndarray:
        """This rank's indices for the epoch, batch after batch."""
        rng = np.random.default_rng([self.seed % 2**32, self.epoch])
        order = rng.permutation(len(self.lengths))
        order = np.concatenate([order, order[: self.total_size - len(order)]])  # even shares
        global_batch = self.batch_size * self.num_replicas
        pool = global_batch * self.pool_batches
        # A stable sort keeps the shuffled order among equal lengths.
        order = np.concatenate(
            [
                order[start : start + pool][
                    np.argsort(self.lengths[order[start : start + pool]], kind="stable")
                ]
                for start in range(0, len(order), pool)
            ]
        )
        num_full = len(order) // global_batch
        full = order[: num_full * global_batch].reshape(
            num_full, self.num_replicas, self.batch_size
        )
        full = full[rng.permutation(num_full)]  # buckets in random order, not short to long
        tail = order[num_full * global_batch :]  # the last, smaller batch of each rank
        tail = tail.reshape(self.num_replicas, len(tail) // self.num_replicas)
        return np.concatenate([full[:, self.rank].reshape(-1), tail[self.rank]])

    def __iter__(self):
        order = self.rank_order()[self.skip :].tolist()
        if self.seeded_keys:
            return iter([(index, self.seed, self.epoch) for index in order])
        return iter(order)

    def __len__(self) -> int:
        return self.num_samples - self.skip


class GatheredBatch(list):
    """A batch `GatheredTensors` fetched whole: a list holding the collated batch, which
    `collate_gathered` hands on as it is."""


class GatheredTensors(Dataset):
    """A TensorDataset as kiln's loaders read it: a batch is gathered with one index per tensor
    (`__getitems__`, the DataLoader's batched fetch) instead of a select per sample and a stack
    of them -- the same tensors, a few ops instead of two per sample (digits' 64-sample batch:
    ~0.2 ms of a 1.2 ms step)."""

    in_memory = True  # a batch is a lookup: data.num_workers=auto gives it no worker

    def __init__(self, dataset: TensorDataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> GatheredBatch:
        rows = torch.as_tensor(indices)
        return GatheredBatch([tuple(tensor[rows] for tensor in self.dataset.tensors)])


def collate_gathered(batch):
    return batch[0] if isinstance(batch, GatheredBatch) else default_collate(batch)


def gathered(dataset, collate_fn):
    """(dataset, collate_fn) for a loader: a plain TensorDataset with the default collation
    is gathered batch by batch; anything else is read as it is."""
    if type(dataset) is TensorDataset and collate_fn is None:
        return GatheredTensors(dataset), collate_gathered
    return dataset, collate_fn


def seed_worker(worker_id: int) -> None:
    # Ctrl-C in a terminal reaches the whole process group: a worker leaves it to the training
    # process, which checkpoints at the step boundary and then shuts its workers down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # One thread: the workers share the cores with each other and with the step (torch's worker
    # loop does the same; said here, where kiln's rule is, in case it ever stops doing so).
    torch.set_num_threads(1)
    # torch gives each worker initial_seed = base_seed + worker_id, where base_seed comes from the
    # loader's generator; python and numpy are seeded from it so augmentations repeat too.
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


def in_memory(dataset) -> bool:
    """Whether the dataset's items are in memory, fetching a batch a lookup (its class says
    `in_memory = True`, or it is a TensorDataset; through a Subset too)."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return type(dataset) is TensorDataset or bool(getattr(dataset, "in_memory", False))


def worker_plan(cfg, dataset) -> Plan:
    """data.num_workers resolved: as set, or auto (kiln.threads.dataloader_workers)."""
    if cfg.num_workers != "auto":
        return Plan(int(cfg.num_workers), f"data.num_workers={cfg.num_workers}")
    return dataloader_workers(cpu_budget(), in_memory(dataset))


def _loader(
    dataset,
    sampler,
    cfg,
    *,
    collate_fn,
    pin_memory: bool,
    seed: int,
    workers: int,
    drop_last: bool = False,
) -> DataLoader:
    dataset, collate_fn = gathered(dataset, collate_fn)
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
        drop_last=drop_last,
    )


def stop_workers(*loaders) -> None:
    """Stop the loaders' persistent workers now. torch stops them when a loader's iterator is
    collected; collected in a reference cycle (a finished Trainer is one), whatever the iterator
    needs may be finalized first, and each worker then sits out torch's 5 s join before it is
    killed: 10 s of a later, unrelated moment per run in a process that goes on (a sweep's
    jobs, a notebook, the tests). `_iterator` is where DataLoader keeps a persistent one."""
    for loader in loaders:
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()
            loader._iterator = None


def train_sampler_for(bundle: DataBundle, batch_size: int, rank: int, world_size: int, seed: int):
    """BucketedSampler when the dataset gives lengths for its training items, else a shuffling
    ResumableSampler."""
    lengths = bundle.bucket_lengths
    if lengths is not None and len(lengths) != len(bundle.train):
        log.warning(
            "batches are not bucketed by length: the training set was replaced "
            "(trainer.overfit_batches)"
        )
        lengths = None
    if lengths is None:
        seeded = getattr(bundle.train, "seeded_keys", False)  # a Subset (overfit_batches) is not
        sampler = SeededItemSampler if seeded else ResumableSampler
        return sampler(bundle.train, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
    return BucketedSampler(
        lengths,
        batch_size=batch_size,
        num_replicas=world_size,
        rank=rank,
        seed=seed,
        seeded_keys=getattr(bundle.train, "seeded_keys", False),
    )


def val_sampler_for(bundle: DataBundle, rank: int, world_size: int, seed: int):
    """LengthOrderedSampler when the dataset gives lengths for its validation items (one per
    item: a wrong count is the sampler's error), else the items in order."""
    if bundle.val_lengths is not None:
        return LengthOrderedSampler(
            bundle.val, bundle.val_lengths, num_replicas=world_size, rank=rank, seed=seed
        )
    return ResumableSampler(
        bundle.val, num_replicas=world_size, rank=rank, shuffle=False, seed=seed
    )


def build_dataloaders(
    bundle: DataBundle, cfg, *, seed: int, rank: int, world_size: int, cuda: bool
):
    """Returns (train_loader, val_loader), each with `.worker_plan` (the workers and why).
    pin_memory is applied only when training on CUDA."""
    pin = bool(cfg.pin_memory and cuda)
    plan = worker_plan(cfg, bundle.train)
    train_sampler = train_sampler_for(bundle, cfg.batch_size, rank, world_size, seed)
    val_sampler = val_sampler_for(bundle, rank, world_size, seed)
    collate = bundle.collate_fn
    train = _loader(
        bundle.train,
        train_sampler,
        cfg,
        collate_fn=collate,
        pin_memory=pin,
        seed=seed,
        workers=plan.count,
        drop_last=cfg.drop_last,  # training only: every validation sample counts
    )
    val = _loader(
        bundle.val,
        val_sampler,
        cfg,
        collate_fn=collate,
        pin_memory=pin,
        seed=seed,
        workers=plan.count,
    )
    train.worker_plan = val.worker_plan = plan
    return train, val


def example_batch(bundle: DataBundle, batch_size: int, seed: int = 0):
    """One collated training batch, chosen with a fixed seed: what the shape check feeds the
    model, so Tensor, List[Tensor] and dict inputs all come out exactly as in training."""
    gen = torch.Generator().manual_seed(seed)
    n = min(batch_size, len(bundle.train))
    indices = torch.randperm(len(bundle.train), generator=gen)[:n].tolist()
    collate = bundle.collate_fn or default_collate
    return collate([bundle.train[i] for i in indices])
