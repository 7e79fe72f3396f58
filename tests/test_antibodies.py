"""The three rules, each on every registered model and on a deliberately broken one."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from torch import nn

from kiln.data import build_data
from kiln.data.spec import DataSpec
from kiln.engine.trainer import NonFiniteLossError
from kiln.guards import ShapeContractError, check_train_eval_agreement
from kiln.guards.input_sizes import ShapeInferenceError, check_sizes_follow_inputs
from kiln.models import build_model
from kiln.models.detector import LOSS_KEYS as DETECTOR_LOSS_KEYS
from kiln.registry import MODELS

from .conftest import compose_config
from .test_engine import make_trainer, one_step

IMAGE_MODELS = ["mlp", "resnet18", "resnet50"]
TEXT_MODELS = ["text_bow", "text_transformer"]


def image_spec(side: int, channels: int = 3) -> DataSpec:
    return DataSpec("classification", "image", 5, tuple("abcde"), channels, (side, side))


TEXT_SPEC = DataSpec("classification", "tokens", 4, tuple("abcd"), vocab_size=50, max_length=32)


def test_every_registered_model_is_covered_by_rule_one():
    assert set(MODELS.names()) == {*IMAGE_MODELS, *TEXT_MODELS, "detector"}


@pytest.mark.parametrize("name", IMAGE_MODELS)
@pytest.mark.parametrize(("side", "channels"), [(8, 1), (20, 3)])
def test_rule1_image_models_follow_size_channels_and_batch(name, side, channels):
    model_cfg = compose_config(f"model={name}").model
    spec = image_spec(side, channels)
    cases = [
        (f"batch {n} at {side}x{side}x{channels}", torch.randn(n, channels, side, side))
        for n in (1, 3)
    ]
    if name != "mlp":  # BatchNorm in train mode cannot normalise a single value per channel
        cases = [(label, x) for label, x in cases if x.shape[0] > 1 or side > 8]
    check_sizes_follow_inputs(lambda: build_model(spec, model_cfg), cases)


@pytest.mark.parametrize("name", TEXT_MODELS)
def test_rule1_text_models_follow_sequence_length_and_batch(name):
    model_cfg = compose_config(f"model={name}", "data=csv_text").model
    cases = [
        (f"batch {n} of length {length}", torch.randint(1, 50, (n, length)))
        for n in (1, 3)
        for length in (5, 29)
    ]
    check_sizes_follow_inputs(lambda: build_model(TEXT_SPEC, model_cfg), cases)


def test_rule1_detector_takes_mixed_image_sizes():
    cfg = compose_config("model=detector", "data=shapes_detection")
    spec = build_data(cfg.data).spec
    images = [torch.rand(3, 96, 128), torch.rand(3, 128, 100), torch.rand(3, 112, 112)]
    targets = [
        {"boxes": torch.tensor([[10.0, 12.0, 50.0, 60.0]]), "labels": torch.tensor([1])}
        for _ in images
    ]
    cases = [("batch 1 at 96x128", (images[:1], targets[:1])), ("batch 3 mixed", (images, targets))]
    check_sizes_follow_inputs(
        lambda: build_model(spec, cfg.model), cases, call=lambda model, batch: model(*batch)
    )


class LiteralShapeNet(nn.Module):
    """Broken on purpose: forward assumes 16x16 inputs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3 * 16 * 16, 5)

    def forward(self, x):
        h, w = 16, 16
        return self.fc(x.reshape(x.shape[0], 3 * h * w))


def test_rule1_catches_a_literal_shape_in_forward():
    cases = [
        ("batch 3 at 16x16", torch.randn(3, 3, 16, 16)),
        ("batch 3 at 24x24", torch.randn(3, 3, 24, 24)),
    ]
    with pytest.raises(ShapeInferenceError) as info:
        check_sizes_follow_inputs(LiteralShapeNet, cases)
    message = str(info.value)
    assert "LiteralShapeNet failed on batch 3 at 24x24" in message
    assert "(3, 3, 24, 24)" in message and "never written as literals" in message


BRANCH_CASES = {
    "mlp": ("data=digits",),
    "resnet18": ("data=synthetic_images", "data.image_size=12", "data.num_train=16"),
    "resnet50": ("data=synthetic_images", "data.image_size=12", "data.num_train=16"),
    "text_bow": ("data=csv_text",),
    "text_transformer": ("data=csv_text",),
    "detector": ("data=shapes_detection", "data.num_train=4", "data.num_val=2"),
}


@pytest.mark.parametrize("name", sorted(BRANCH_CASES))
def test_rule2_all_branches_on_give_finite_nonzero_terms_and_grads(tmp_path, name):
    trainer, _ = make_trainer(
        tmp_path,
        f"model={name}",
        *BRANCH_CASES[name],
        "loss.force_all_branches=true",
        "data.batch_size=4",
        *(() if name == "detector" else ("model.dropout=0.0",)),  # the detector has no dropout
    )
    grads = {}
    for pname, param in trainer.raw_model.named_parameters():
        param.register_hook(lambda g, pname=pname: grads.setdefault(pname, g.clone()))
    result = one_step(trainer, window=1)
    expected = (
        set(DETECTOR_LOSS_KEYS)
        if name == "detector"
        else {"main", "label_smoothing", "z_loss", "confidence_penalty", "aux_head"}
    )
    assert set(result.terms) == expected
    for term, value in result.terms.items():
        assert torch.isfinite(value) and float(value) != 0.0, f"{term} = {value}"
    assert grads and all(torch.isfinite(g).all() for g in grads.values())
    assert result.stepped and torch.isfinite(result.grad_norm)


def test_rule2_branches_default_off():
    cfg = compose_config()
    assert cfg.loss.force_all_branches is False
    flags = ("label_smoothing", "z_loss", "confidence_penalty", "aux_head")
    assert not any(getattr(cfg.loss, flag) for flag in flags)


class NaNAuxHead(nn.Module):
    """Broken on purpose: the auxiliary head's logits are NaN."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(64, spec.num_classes)

    def forward(self, x):
        logits = self.fc(x.flatten(1))
        return {"logits": logits, "aux_logits": logits * float("nan")}


def test_rule2_a_nan_branch_is_named_in_the_error(tmp_path, temporary_model):
    cfg = temporary_model("nan_aux", NaNAuxHead, "loss.aux_head=true")
    trainer, _ = make_trainer(tmp_path, cfg=cfg)
    with pytest.raises(
        NonFiniteLossError, match=r"loss NaN @ step 1 \(non-finite terms: aux_head\)"
    ):
        one_step(trainer, window=1)


class ModeDependentHead(nn.Module):
    """Broken on purpose: eval mode adds an extra 'unknown' class column."""

    def __init__(self, spec=None, cfg=None, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        logits = self.fc(x.flatten(1))
        if not self.training:
            logits = torch.cat([logits, logits.mean(dim=1, keepdim=True)], dim=1)
        return {"logits": logits}


class ModeDependentStructure(ModeDependentHead):
    def forward(self, x):
        logits = self.fc(x.flatten(1))
        return {"logits": logits} if self.training else logits


def forward_inputs(model, batch, train_mode):
    return model(batch[0])


def test_rule3_shape_change_in_eval_names_the_path_and_both_shapes():
    batch = (torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ShapeContractError) as info:
        check_train_eval_agreement(ModeDependentHead(), batch, forward_inputs)
    message = str(info.value)
    assert "output['logits']: shape differs: train (4, 10) vs eval (4, 11)" in message


def test_rule3_structure_change_in_eval_is_reported():
    batch = (torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ShapeContractError, match="structure differs"):
        check_train_eval_agreement(ModeDependentStructure(), batch, forward_inputs)


def test_rule3_training_stops_before_the_first_step(tmp_path, temporary_model):
    cfg = temporary_model("mode_dependent", ModeDependentHead)
    trainer, recorder = make_trainer(tmp_path, cfg=cfg)
    with pytest.raises(ShapeContractError):
        trainer.fit()
    assert trainer.state.global_step == 0 and not recorder


def test_rule3_check_leaves_no_trace(tmp_path):
    trainer, _ = make_trainer(
        tmp_path,
        "model=resnet18",
        "data=synthetic_images",
        "data.image_size=12",
        "data.num_train=16",
        "model.dropout=0.3",
    )
    model = trainer.raw_model
    model.train()
    model.net.fc[1].weight.grad = torch.full_like(model.net.fc[1].weight, 0.5)
    buffers = {k: v.clone() for k, v in model.named_buffers()}

    # Without restoring, one train-mode no-grad forward moves the BN statistics:
    probe = copy.deepcopy(model)
    with torch.no_grad():
        probe(trainer.parts.probe_batch[0])
    assert not torch.equal(probe.net.bn1.running_mean, model.net.bn1.running_mean)

    rng = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    trainer.check_shapes()
    assert model.training and all(m.training for m in model.modules())
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), f"{name} changed"
    assert torch.equal(model.net.fc[1].weight.grad, torch.full_like(model.net.fc[1].weight, 0.5))
    assert all(p.grad is None for n, p in model.named_parameters() if "fc.1" not in n)
    assert random.getstate() == rng[0]
    assert np.array_equal(np.random.get_state()[1], rng[1])
    assert torch.equal(torch.get_rng_state(), rng[2])


class LeakyNorm(nn.Module):
    """Broken on purpose: its BatchNorm is forced into train mode, so evaluation moves the
    running statistics."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)
        self.norm = nn.BatchNorm1d(10)

    def forward(self, x):
        self.norm.train()
        return self.norm(self.fc(x.flatten(1)))


def test_rule3_bn_statistics_leaking_in_eval_mode_are_reported():
    batch = (torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    model = LeakyNorm()
    before = model.norm.running_mean.clone()
    with pytest.raises(ShapeContractError) as info:
        check_train_eval_agreement(model, batch, forward_inputs)
    assert "eval-mode forward changed buffers norm.running_mean, norm.running_var" in str(
        info.value
    )
    assert torch.equal(model.norm.running_mean, before)  # and the check itself left no trace


def test_rule3_detector_is_checked_against_its_per_mode_contract(tmp_path):
    trainer, _ = make_trainer(
        tmp_path,
        "model=detector",
        "data=shapes_detection",
        "data.num_train=4",
        "data.num_val=2",
        "data.batch_size=2",
    )
    trainer.check_shapes()  # train: a loss dict; eval: detections; both as declared

    class EvalDropsScores(type(trainer.raw_model)):
        def forward(self, images, targets=None):
            output = super().forward(images, targets)
            if not self.training:
                output = [{k: v for k, v in d.items() if k != "scores"} for d in output]
            return output

    trainer.raw_model.__class__ = EvalDropsScores
    with pytest.raises(ShapeContractError, match="eval mode: .*scores"):
        trainer.check_shapes()
