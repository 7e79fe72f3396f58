"""The fine-tuning recipe the field uses for pretrained encoders: no weight decay on biases and
norm scales, layer-wise learning-rate decay (optimizer.layer_decay), freezing the embeddings or
the bottom layers (model.freeze=embeddings | layers:K), told by what the optimizer does to the
weights, not by the groups' labels alone; and a run with all of them (bf16 autocast, warm-up)
that trains and resumes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kiln.config.base import ConfigError
from kiln.data.spec import DataSpec
from kiln.engine.finetune import frozen_parameter_names, layer_depths, parameter_groups
from kiln.engine.optim import apply_hyperparameters, build_optimizer
from kiln.models import build_model

from .conftest import compose_config, train_in_process

SPEC = DataSpec(
    "classification", "tokens", 3, ("a", "b", "c"), vocab_size=50, max_length=12, pad_id=0
)
BERT = ("data=csv_text", "model=hf", "model.arch=bert")  # a small BERT built from its type


def small_bert(*overrides: str):
    cfg = compose_config(*BERT, *overrides)
    torch.manual_seed(0)
    return build_model(SPEC, cfg.model), cfg


def test_biases_and_norm_scales_take_no_weight_decay_unless_asked():
    """With zero gradients AdamW's whole update is the decay: 2-D weights shrink, every 1-D
    parameter (biases, LayerNorm scales) stays exactly as it was."""
    for decay_all in (False, True):
        model, cfg = small_bert(
            f"optimizer.decay_bias_and_norm={decay_all}", "optimizer.weight_decay=0.1"
        )
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = build_optimizer(parameter_groups(model, cfg.optimizer), cfg.optimizer)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        optimizer.step()
        for name, p in model.named_parameters():
            moved = not torch.equal(p, before[name])
            if p.ndim > 1 or decay_all:
                assert moved or not before[name].any(), name
            else:
                assert not moved, name


def test_layer_decay_scales_each_layers_lr_from_the_top_down():
    model, cfg = small_bert("optimizer.layer_decay=0.5", "optimizer.head_lr_mult=4")
    depths, layers = layer_depths(model, "optimizer.layer_decay", "hf")
    assert layers == 2  # kiln's small default: 2 layers
    optimizer = build_optimizer(parameter_groups(model, cfg.optimizer), cfg.optimizer)
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    lr = cfg.optimizer.lr
    expected = {
        "net.bert.embeddings.word_embeddings.weight": lr * 0.5**3,
        "net.bert.encoder.layer.0.attention.self.query.weight": lr * 0.5**2,
        "net.bert.encoder.layer.1.output.dense.weight": lr * 0.5,
        "net.bert.pooler.dense.weight": lr,  # after the last layer: the top
        "net.classifier.weight": lr * 4,  # the head: head_lr_mult on top
    }
    for name, want in expected.items():
        assert lr_of[id(named[name])] == pytest.approx(want), name
    # A resume that changes lr (and head_lr_mult) keeps each group's layer scale.
    changed = dataclasses.replace(cfg.optimizer, lr=lr * 10, head_lr_mult=1.0)
    apply_hyperparameters(optimizer, changed)
    lr_of = {id(p): g["lr"] for g in optimizer.param_groups for p in g["params"]}
    assert lr_of[id(named["net.bert.encoder.layer.0.attention.self.query.weight"])] == (
        pytest.approx(lr * 10 * 0.25)
    )
    assert lr_of[id(named["net.classifier.weight"])] == pytest.approx(lr * 10)
    nodecay = [g for g in optimizer.param_groups if not g["decay"]]
    assert nodecay and all(g["weight_decay"] == 0.0 for g in nodecay)


def test_freeze_embeddings_and_bottom_layers_by_depth():
    model, _ = small_bert()
    embeddings = frozen_parameter_names(model, "embeddings", "hf")
    assert embeddings and all(n.startswith("net.bert.embeddings.") for n in embeddings)
    bottom = frozen_parameter_names(model, "layers:1", "hf")
    assert bottom - embeddings and all(
        n.startswith(("net.bert.embeddings.", "net.bert.encoder.layer.0.")) for n in bottom
    )
    with pytest.raises(ConfigError, match="has 2 layers"):
        frozen_parameter_names(model, "layers:3", "hf")


def test_a_model_without_numbered_layers_is_refused_naming_the_option():
    model = build_model(SPEC, compose_config("data=csv_text", "model=text_bow").model)
    with pytest.raises(ConfigError, match="no numbered layers") as caught:
        parameter_groups(model, compose_config("optimizer.layer_decay=0.8").optimizer, "text_bow")
    assert caught.value.key == "optimizer.layer_decay"


def test_bad_freeze_and_layer_decay_values_fail_at_start_up():
    with pytest.raises(ConfigError, match="layers:K"):
        compose_config(*BERT, "model.freeze=layers")
    with pytest.raises(ConfigError, match="layer_decay"):
        compose_config("optimizer.layer_decay=1.5")


def test_a_run_with_the_whole_recipe_trains_frozen_embeddings_stay_and_resume_continues(
    tmp_path,
):
    """bf16 autocast, linear warm-up, layer decay, frozen embeddings, no decay on biases and
    norms: the run trains; the embeddings in its checkpoint are the initial ones; a resume that
    changes layer_decay is refused (the saved moments belong to other groups)."""
    from kiln.data import build_data

    overrides = (
        *BERT,
        "data.max_length=24",
        "data.batch_size=16",
        "trainer.max_epochs=2",
        "precision=bf16",
        "scheduler=linear_warmup",
        "optimizer.lr=0.002",
        "optimizer.layer_decay=0.8",
        "model.freeze=embeddings",
    )
    cfg = compose_config(*overrides)
    torch.manual_seed(cfg.seed)  # build_run's order: seed, data, model
    initial = build_model(build_data(cfg.data).spec, cfg.model)
    run_dir = tmp_path / "run"
    summary = train_in_process(run_dir, *overrides)
    chance = summary["chance"]
    assert summary["val_acc"] > chance["value"] + chance["margin"], summary
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    for name, param in initial.named_parameters():
        if name.startswith("net.bert.embeddings."):
            assert torch.equal(saved[name], param), name
    layer = "net.bert.encoder.layer.0.output.dense.weight"
    assert not torch.equal(saved[layer], dict(initial.named_parameters())[layer])
    changed = (*overrides[:-2], "optimizer.layer_decay=0.5", "model.freeze=embeddings")
    with pytest.raises(Exception, match="layer_decay"):
        train_in_process(tmp_path / "again", *changed, f"resume={run_dir}/checkpoints/last.pt")
