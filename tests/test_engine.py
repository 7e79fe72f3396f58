"""The engine's mechanics on real configs: accumulation, clipping, schedules, checkpoints,
non-finite losses and device errors."""

from __future__ import annotations

import math
import pickle

import pytest
import torch

from kiln import checkpoint as ckpt
from kiln.engine.distributed import DistInfo
from kiln.engine.optim import total_optimizer_steps
from kiln.engine.run import build_run
from kiln.engine.trainer import NonFiniteLossError
from kiln.guards import DeviceMismatchError, NonFiniteInputError, assert_finite_inputs

from .conftest import compose_config

DETERMINISTIC_MLP = (
    "model=mlp",
    "model.dropout=0.0",
    "scheduler=none",
    "trainer.shape_check=false",
)


class Recorder(list):
    activations = None

    def __call__(self, metrics, step):
        self.append({"step": step, **metrics})


def make_trainer(tmp_path, *overrides, cfg=None):
    cfg = cfg or compose_config(*overrides)
    recorder = Recorder()
    trainer = build_run(cfg, tmp_path, DistInfo(), torch.device("cpu"), recorder).trainer
    return trainer, recorder


def one_step(trainer, window):
    trainer.train_loader.sampler.set_epoch(0)
    return trainer.train_step(iter(trainer.train_loader), window)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_accumulating_k_batches_equals_one_batch_of_k_times_b(tmp_path, optimizer):
    big, _ = make_trainer(
        tmp_path / "a", *DETERMINISTIC_MLP, f"optimizer={optimizer}", "data.batch_size=32"
    )
    small, _ = make_trainer(
        tmp_path / "b",
        *DETERMINISTIC_MLP,
        f"optimizer={optimizer}",
        "data.batch_size=8",
        "trainer.accumulate_grad_batches=4",
    )
    before = [p.detach().clone() for p in big.raw_model.parameters()]
    one_step(big, window=1)
    one_step(small, window=4)
    moved = False
    for p0, a, b in zip(
        before, big.raw_model.parameters(), small.raw_model.parameters(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        moved |= not torch.equal(p0, a)
    assert moved, "the step changed nothing: the comparison would be vacuous"


def test_partial_last_window_is_scaled_by_its_own_size(tmp_path):
    # A window of 1 micro-batch must give the same update as a plain step on that batch,
    # even though accumulate_grad_batches is 4 (the end of an epoch).
    plain, _ = make_trainer(tmp_path / "a", *DETERMINISTIC_MLP, "optimizer=sgd")
    partial, _ = make_trainer(
        tmp_path / "b", *DETERMINISTIC_MLP, "optimizer=sgd", "trainer.accumulate_grad_batches=4"
    )
    one_step(plain, window=1)
    one_step(partial, window=1)
    for a, b in zip(plain.raw_model.parameters(), partial.raw_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_optimizer_steps_per_epoch_include_the_partial_window(tmp_path):
    trainer, recorder = make_trainer(
        tmp_path,
        "data.batch_size=256",
        "trainer.accumulate_grad_batches=4",
        "trainer.max_epochs=2",
        "trainer.log_every_n_steps=1",
        "env.progress_bar=false",
    )
    assert trainer.batches_per_epoch == 6  # 1437 training digits / 256
    trainer.fit()
    assert trainer.state.global_step == 2 * math.ceil(6 / 4) == 4
    assert [m["step"] for m in recorder if "loss" in m] == [1, 2, 3, 4]


def lr_curve(tmp_path, *overrides):
    trainer, recorder = make_trainer(
        tmp_path,
        "data.batch_size=128",
        "trainer.log_every_n_steps=1",
        "env.progress_bar=false",
        *overrides,
    )
    trainer.fit()
    return trainer, [m["lr"] for m in recorder if "loss" in m]


def test_onecycle_curve_has_one_value_per_optimizer_step(tmp_path):
    trainer, lrs = lr_curve(
        tmp_path,
        "scheduler=onecycle",
        "trainer.max_epochs=3",
        "trainer.accumulate_grad_batches=3",
        "optimizer.lr=0.01",
    )
    expected = total_optimizer_steps(12, 3, 3, -1)
    assert len(lrs) == expected == trainer.state.global_step == 12
    peak = lrs.index(max(lrs))
    assert 0 < peak < len(lrs) - 1
    assert all(a <= b for a, b in zip(lrs[:peak], lrs[1 : peak + 1], strict=True))
    assert lrs[0] == pytest.approx(0.01 / 25)  # onecycle starts at lr / div_factor
    assert all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1 :], strict=False))
    assert max(lrs) == pytest.approx(0.01, rel=0.05)
    assert lrs[-1] < 0.01 / 1000


def test_cosine_curve_warms_up_then_decays(tmp_path):
    _, lrs = lr_curve(
        tmp_path,
        "scheduler=cosine",
        "scheduler.warmup_steps=3",
        "scheduler.min_lr_ratio=0.1",
        "trainer.max_epochs=2",
        "trainer.accumulate_grad_batches=2",
        "optimizer.lr=0.01",
    )
    assert len(lrs) == total_optimizer_steps(12, 2, 2, -1) == 12
    assert lrs[:3] == sorted(lrs[:3]) and lrs[0] == pytest.approx(0.01 / 3)
    assert lrs[2] == pytest.approx(0.01)
    decay = lrs[2:]
    assert all(a >= b for a, b in zip(decay, decay[1:], strict=False))
    assert lrs[-1] == pytest.approx(0.001, rel=1e-6)


def test_max_steps_caps_the_schedule(tmp_path):
    trainer, lrs = lr_curve(
        tmp_path, "scheduler=onecycle", "trainer.max_steps=5", "trainer.max_epochs=10"
    )
    assert trainer.state.global_step == 5 and len(lrs) == 5
    assert lrs[-1] < lrs[2]  # annealed over 5 steps, not over 10 epochs


def test_clipping_bounds_the_update_and_the_raw_norm_is_logged(tmp_path):
    clip = 1e-3
    trainer, _ = make_trainer(
        tmp_path,
        *DETERMINISTIC_MLP,
        "optimizer=sgd",
        "optimizer.lr=1.0",
        "optimizer.momentum=0.0",
        "optimizer.weight_decay=0.0",
        f"trainer.gradient_clip_val={clip}",
    )
    before = torch.cat([p.detach().flatten().clone() for p in trainer.raw_model.parameters()])
    result = one_step(trainer, window=1)
    after = torch.cat([p.detach().flatten() for p in trainer.raw_model.parameters()])
    assert float(result.grad_norm) > 100 * clip  # the norm before clipping
    assert float((after - before).norm()) == pytest.approx(clip, rel=1e-3)


def test_nan_policy_fail_raises_with_batch_statistics(tmp_path):
    trainer, _ = make_trainer(tmp_path, *DETERMINISTIC_MLP)
    with torch.no_grad():
        trainer.raw_model.head.bias.fill_(float("nan"))
    result = one_step(trainer, window=1)  # flags the step on the device, skips its update
    trainer.state.global_step += 1
    with pytest.raises(NonFiniteLossError) as info:
        trainer.after_step(result, None)  # the log line reads the flag
    assert info.value.kind == "NaN" and info.value.step == 1
    inputs = info.value.batch_stats["batch[0]"]
    assert inputs["shape"] == [64, 1, 8, 8] and inputs["nan"] == 0


@pytest.mark.parametrize("on_host", [True, False], ids=["host", "device-flag"])
def test_nan_policy_skip_counts_and_leaves_weights_untouched(tmp_path, on_host):
    trainer, _ = make_trainer(tmp_path, *DETERMINISTIC_MLP, "trainer.nan_policy=skip")
    trainer.read_on_host(on_host)  # the CPU's way, and the GPU's (the fused step skips it)
    with torch.no_grad():
        trainer.raw_model.head.bias.fill_(float("nan"))
    weight = trainer.raw_model.head.weight.detach().clone()
    result = one_step(trainer, window=2)
    assert bool(result.bad)
    trainer.state.global_step += 1
    trainer.window.add(result)
    trainer.log_window()
    assert trainer.state.nonfinite_skipped == 1
    assert torch.equal(weight, trainer.raw_model.head.weight)  # the update was skipped
    assert all(p.grad is None for p in trainer.raw_model.parameters())


def test_check_inputs_names_the_tensor():
    batch = (torch.zeros(2, 3), {"mask": torch.tensor([1.0, float("inf")])})
    with pytest.raises(
        NonFiniteInputError, match=r"batch\[1\]\['mask'\] \(shape \(2,\)\) has 0 NaN and 1 Inf"
    ):
        assert_finite_inputs(batch)
    assert_finite_inputs((torch.zeros(2), torch.tensor([1, 2])))


def test_a_device_mismatch_in_a_step_names_the_module(tmp_path):
    trainer, _ = make_trainer(tmp_path, *DETERMINISTIC_MLP)
    trainer.raw_model.head.to("meta")  # a layer left behind on another device
    with pytest.raises(DeviceMismatchError) as info:
        one_step(trainer, window=1)
    message = str(info.value)
    assert message.startswith("devices (one model, one device): device mismatch in head (Linear)")
    assert "parameters/buffers are on meta, its inputs on cpu" in message
    assert info.value.module == "head"


class NotPlainData:
    pass


def test_atomic_save_keeps_the_previous_file_when_writing_fails(tmp_path):
    path = tmp_path / "last.pt"
    ckpt.atomic_save({"model": {"w": torch.ones(2)}}, path)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        ckpt.atomic_save({"model": {"w": torch.zeros(2)}, "bad": lambda: 0}, path)
    assert torch.equal(ckpt.load_checkpoint(path)["model"]["w"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temp files left


def test_checkpoint_that_needs_unpickling_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"model": {}, "payload": NotPlainData()}, path)
    with pytest.raises(ckpt.CheckpointError, match="weights_only=True"):
        ckpt.load_checkpoint(path)


def test_corrupt_last_checkpoint_falls_back_to_the_newest_valid(tmp_path, caplog):
    ckpt.atomic_save({"model": {}, "which": "epoch"}, tmp_path / "epoch-3.pt")
    ckpt.atomic_save({"model": {}, "which": "last"}, tmp_path / "last.pt")
    data = (tmp_path / "last.pt").read_bytes()
    (tmp_path / "last.pt").write_bytes(data[: len(data) // 2])  # truncated by a crash
    path, checkpoint = ckpt.load_newest_valid(tmp_path)
    assert path.name == "epoch-3.pt" and checkpoint["which"] == "epoch"
    assert "last.pt is truncated or corrupt" in caplog.text


def test_epoch_checkpoints_are_pruned_to_the_last_k(tmp_path):
    for epoch in range(1, 6):
        ckpt.atomic_save({"model": {}}, tmp_path / f"epoch-{epoch}.pt")
    ckpt.prune_epoch_checkpoints(tmp_path, keep_last_k=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-4.pt", "epoch-5.pt"]


def test_slow_data_loading_is_reported_with_a_num_workers_hint(tmp_path, caplog):
    trainer, _ = make_trainer(tmp_path, *DETERMINISTIC_MLP)
    trainer.state.data_time_s, trainer.state.step_time_s = 4.0, 10.0
    trainer.report_data_time()
    assert "data loading took 40% of step time" in caplog.text
    assert "data.num_workers (now 0)" in caplog.text
    caplog.clear()
    trainer.state.data_time_s = 1.0
    trainer.report_data_time()
    assert "data loading took" not in caplog.text


def test_steps_gradscaler_skips_for_inf_gradients_are_counted(tmp_path):
    trainer, _ = make_trainer(tmp_path, *DETERMINISTIC_MLP)
    trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=True)
    head = trainer.raw_model.head
    weight = head.weight.detach().clone()
    handle = head.weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    result = one_step(trainer, window=1)
    handle.remove()
    assert not bool(result.bad) and not math.isfinite(float(result.grad_norm))
    trainer.window.add(result)
    trainer.log_window()
    assert trainer.state.scaler_skipped == 1 and trainer.state.nonfinite_skipped == 0
    assert torch.equal(weight, head.weight)  # the scaler skipped optimizer.step
    assert trainer.scaler.get_scale() == 2.0**7
    trainer.window.add(one_step(trainer, window=1))  # a clean step goes through, not counted
    trainer.log_window()
    assert trainer.state.scaler_skipped == 1 and not torch.equal(weight, head.weight)
