"""The length-bucketed sampler: every item once per epoch, batches of similar length, order from
(seed, epoch) only, DDP shares, exact resume through the trainer; and padding_frac / tokens_per_s
in the training log."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from kiln.data.loaders import (
    BucketedSampler,
    LengthOrderedSampler,
    ResumableSampler,
    val_sampler_for,
)
from kiln.engine.distributed import DistInfo
from kiln.engine.preemption import Preempted
from kiln.engine.run import build_run, load_data

from .conftest import FAST, compose_config, read_metrics, train_in_process

LENGTHS = np.random.default_rng(0).integers(3, 120, size=1000)


def batches(sampler, batch_size):
    order = list(sampler)
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def padding_frac(lengths, batch_list):
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batch_list)
    return 1 - sum(lengths[i] for b in batch_list for i in b) / padded


def test_each_epoch_is_a_permutation_in_batches_of_similar_length():
    sampler = BucketedSampler(LENGTHS, batch_size=32, num_replicas=1, rank=0, seed=7)
    order = list(sampler)
    assert sorted(order) == list(range(len(LENGTHS))) and len(sampler) == len(LENGTHS)
    bucketed = padding_frac(LENGTHS, batches(sampler, 32))
    shuffled = ResumableSampler(range(len(LENGTHS)), num_replicas=1, rank=0, shuffle=True, seed=7)
    assert bucketed < 0.05 < 0.3 < padding_frac(LENGTHS, batches(shuffled, 32))
    # Buckets come in random order, not short to long.
    maxima = [max(LENGTHS[i] for i in b) for b in batches(sampler, 32)]
    assert maxima != sorted(maxima)


def test_the_order_depends_on_seed_and_epoch_only():
    def order(seed, epoch):
        sampler = BucketedSampler(LENGTHS, batch_size=16, num_replicas=1, rank=0, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(1, 0) == order(1, 0)
    assert order(1, 0) != order(1, 1) and order(1, 0) != order(2, 0)


def test_skip_resumes_inside_an_epoch_at_the_next_batch():
    sampler = BucketedSampler(LENGTHS, batch_size=16, num_replicas=1, rank=0, seed=3)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(2, skip=5 * 16)
    assert list(sampler) == full[5 * 16 :] and len(sampler) == len(full) - 80


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_get_equal_disjoint_shares_in_batches(world_size):
    lengths = LENGTHS[:997]  # not a multiple of anything: ranks are padded like DDP's sampler
    samplers = [
        BucketedSampler(lengths, batch_size=8, num_replicas=world_size, rank=r, seed=0)
        for r in range(world_size)
    ]
    orders = [list(s) for s in samplers]
    assert {len(o) for o in orders} == {math.ceil(997 / world_size)}
    assert {len(s) for s in samplers} == {samplers[0].num_samples}
    assert set().union(*orders) == set(range(997))
    padded = sum(len(o) for o in orders) - 997
    assert len(set().union(*orders)) == sum(len(o) for o in orders) - padded
    # Step k on every rank draws from one global bucket: similar lengths across ranks too.
    step_max = [[max(lengths[i] for i in b) for b in batches(s, 8)] for s in samplers]
    assert all(max(col) - min(col) <= 30 for col in zip(*step_max[:-1], strict=False))


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_validation_reads_shortest_first_every_item_once_per_rank_share(world_size):
    lengths = LENGTHS[:997]
    samplers = [
        LengthOrderedSampler(range(997), lengths, num_replicas=world_size, rank=r, seed=0)
        for r in range(world_size)
    ]
    orders = [list(s) for s in samplers]
    assert set().union(*orders) == set(range(997))  # DDP's padding repeats, never drops
    assert {len(o) for o in orders} == {math.ceil(997 / world_size)}
    for order in orders:  # DDP's padding (the shortest again) may end a rank's share
        real = [lengths[i] for i in order[: 997 // world_size]]
        assert real == sorted(real)
    in_file_order = ResumableSampler(range(997), num_replicas=1, rank=0, shuffle=False, seed=0)
    assert padding_frac(lengths, batches(samplers[0], 32)) < 0.1
    assert padding_frac(lengths, batches(in_file_order, 32)) > 0.3


def test_evaluation_in_length_order_gives_the_metrics_of_file_order(tmp_path):
    """The validation metrics are sums over every item: reading the items shortest first
    (data.bucket_by_length) changes the batches, not the numbers."""
    cfg = compose_config("data=csv_text", "model=text_bow", "data.batch_size=32", *FAST)
    trainer = build_run(cfg, tmp_path, DistInfo(), torch.device("cpu"), lambda *a: None).trainer
    assert type(trainer.val_loader.sampler) is LengthOrderedSampler
    ordered = trainer.evaluate()
    trainer.val_loader = torch.utils.data.DataLoader(
        trainer.val_loader.dataset, batch_size=32, collate_fn=trainer.val_loader.collate_fn
    )  # file order
    in_file_order = trainer.evaluate()
    assert ordered.keys() == in_file_order.keys()
    for key, value in ordered.items():
        assert value == pytest.approx(in_file_order[key], rel=1e-6, abs=1e-9), key


# --- through the trainer ---------------------------------------------------------------------

RESUMABLE = (
    "data=csv_text",
    "model=text_bow",
    "data.batch_size=16",
    "data.bucket_by_length=true",
    "model.dropout=0.3",  # dropout on: the RNG state must be restored too
    "trainer.deterministic=true",
    "trainer.max_epochs=2",
    "trainer.log_every_n_steps=1",
    "env.progress_bar=false",
)


def fit_until_preempted(run_dir, step: int):
    """Train in-process and stop at `step` the way SIGTERM does: the flag is seen at the step
    boundary, last.pt is saved, Preempted raised."""
    cfg = compose_config(*RESUMABLE)
    run_dir.mkdir(parents=True)
    trainer = None

    def on_metrics(metrics, at_step):
        if at_step == step and "loss" in metrics:
            trainer.preemption.requested = True

    trainer = build_run(cfg, run_dir, DistInfo(), torch.device("cpu"), on_metrics).trainer
    assert type(trainer.train_loader.sampler) is BucketedSampler
    with pytest.raises(Preempted):
        trainer.fit()
    return cfg


def test_resume_with_the_bucketed_sampler_equals_an_uninterrupted_run(tmp_path):
    reference = tmp_path / "reference"
    train_in_process(reference, *RESUMABLE)
    interrupted = tmp_path / "interrupted"
    cfg = fit_until_preempted(interrupted, step=7)
    cfg = dataclasses.replace(cfg, resume=str(interrupted / "checkpoints" / "last.pt"))
    trainer = build_run(cfg, interrupted, DistInfo(), torch.device("cpu"), lambda *a: None).trainer
    assert trainer.state.epoch == 0 and trainer.state.batch_in_epoch == 7  # mid-epoch
    trainer.fit()
    expected = torch.load(reference / "checkpoints" / "last.pt", weights_only=True)["model"]
    for name, value in trainer.raw_model.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_padding_frac_and_tokens_per_s_are_logged(tmp_path):
    def logged(bucket: bool):
        run = tmp_path / f"bucket-{bucket}"
        # Batches of 32: the demo corpus's 460 training texts make 15 buckets an epoch.
        train_in_process(
            run,
            "data=csv_text",
            "model=text_bow",
            "data.batch_size=32",
            f"data.bucket_by_length={bucket}",
            *FAST,
        )
        steps = [m for m in read_metrics(run) if "loss" in m]
        return np.mean([m["padding_frac"] for m in steps]), steps

    bucketed, steps = logged(True)
    shuffled, _ = logged(False)
    assert all(m["tokens_per_s"] > 0 and 0 <= m["padding_frac"] < 1 for m in steps)
    assert bucketed < 0.1 and shuffled > 2 * bucketed


def test_validation_lengths_of_the_wrong_count_are_an_error_not_file_order(tmp_path):
    """A dataset whose validation lengths miss items has a bug: the sampler names the counts
    (val_sampler_for no longer falls back to file order behind its back)."""
    cfg = compose_config("data=csv_text", "model=text_bow", f"data.cache_dir={tmp_path}")
    bundle = dataclasses.replace(load_data(cfg), val_lengths=[3, 1])
    with pytest.raises(ValueError, match=f"2 lengths for {len(bundle.val)} items"):
        val_sampler_for(bundle, rank=0, world_size=1, seed=0)
