"""Deliberately broken models, each breaking one rule the way real models do. The suite must
catch every one with that rule's message, through the same contract checks it runs on every
registered model, and train.py must stop each before it trains."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kiln.config.model import DetectorConfig, MlpConfig, TextBowConfig
from kiln.guards.rules import DEVICES, LOGITS, RULE_1, RULE_2, RULE_3


def features(spec) -> int:
    return spec.channels * math.prod(spec.image_size)


class ViewTo3x32x32(nn.Module):
    """Flattens with a literal image size: fine on 32x32x3 data, wrong anywhere else."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(3 * 32 * 32, spec.num_classes)

    def forward(self, x):
        return self.fc(x.view(-1, 3 * 32 * 32))


class LiteralBatchReshape(nn.Module):
    """Reshapes with the batch size it was debugged at (8)."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(features(spec), spec.num_classes)

    def forward(self, x):
        return self.fc(x.reshape(8, -1))


class LiteralNumClasses(nn.Module):
    """Ten output classes whatever the data has."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(features(spec), 10)

    def forward(self, x):
        return self.fc(x.flatten(1))


class LiteralSequenceLength(nn.Module):
    """Flattens token embeddings assuming every batch is max_length long."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.length = spec.max_length
        self.embed = nn.Embedding(spec.vocab_size, 8, padding_idx=spec.pad_id)
        self.fc = nn.Linear(8 * spec.max_length, spec.num_classes)

    def forward(self, ids):
        return self.fc(self.embed(ids).reshape(ids.shape[0], 8 * self.length))


class EvalExtraColumn(nn.Module):
    """Eval mode appends an 'unknown' class column."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(features(spec), spec.num_classes)

    def forward(self, x):
        logits = self.fc(x.flatten(1))
        if not self.training:
            logits = torch.cat([logits, logits.mean(dim=1, keepdim=True)], dim=1)
        return logits


class EvalReturnsAnotherStructure(nn.Module):
    """A dict in train mode, a bare tensor in eval mode."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(features(spec), spec.num_classes)

    def forward(self, x):
        logits = self.fc(x.flatten(1))
        return {"logits": logits} if self.training else logits


class EvalOnlyHead(nn.Module):
    def __init__(self, width, classes):
        super().__init__()
        self.fc = nn.Linear(width, classes)

    def forward(self, h):
        if not self.training:  # a code path only evaluation takes, with a shape bug
            h = h.reshape(h.shape[0] * 2, -1)
        return self.fc(h)


class EvalOnlyCrash(nn.Module):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.head = EvalOnlyHead(features(spec), spec.num_classes)

    def forward(self, x):
        return self.head(x.flatten(1))


class BatchNormForcedTrain(nn.Module):
    """Its BatchNorm is forced back into train mode, so evaluation moves its statistics."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(features(spec), spec.num_classes)
        self.norm = nn.BatchNorm1d(spec.num_classes)

    def forward(self, x):
        self.norm.train()
        return self.norm(self.fc(x.flatten(1)))


class EvalUpdatesBuffer(nn.Module):
    """Counts calls in a buffer, in every mode."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(features(spec), spec.num_classes)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        return self.fc(x.flatten(1))


class NaNAuxBranch(nn.Module):
    """The auxiliary head's logits are NaN."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(features(spec), spec.num_classes)
        self.aux = nn.Linear(features(spec), spec.num_classes) if aux_head else None

    def forward(self, x):
        logits = self.fc(x.flatten(1))
        if self.aux is None:
            return logits
        return {"logits": logits, "aux_logits": self.aux(x.flatten(1)) * float("nan")}


class DetachedAuxBranch(nn.Module):
    """The auxiliary 'head' is computed from detached logits: its loss reaches no weight."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.aux_head = aux_head
        self.fc = nn.Linear(features(spec), spec.num_classes)

    def forward(self, x):
        logits = self.fc(x.flatten(1))
        if not self.aux_head:
            return logits
        return {"logits": logits, "aux_logits": logits.detach().flip(-1)}


class StackingDetector(nn.Module):
    """A 'detector' that stacks its List[Tensor] input: fine while every image has one size."""

    computes_own_loss = True

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, images, targets=None):
        x = torch.stack(images)
        score = self.conv(x).mean(dim=(1, 2, 3))
        if self.training:
            return {"loss_objectness": score.mean()}
        return [
            {
                "boxes": torch.zeros(0, 4),
                "labels": torch.zeros(0, dtype=torch.long),
                "scores": s.reshape(0),
            }  # fmt: skip
            for s in score
        ]


class LayerLeftOnMeta(nn.Module):
    """model.to(device) leaves its head behind (on `meta`, standing in for another device)."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.body = nn.Linear(features(spec), 16)
        self.head = nn.Linear(16, spec.num_classes)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        self.head.to("meta")
        return self

    def forward(self, x):
        return self.head(self.body(x.flatten(1)).relu())


class Mixer(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, h):
        bias = torch.zeros(h.shape[-1], device="meta")  # created on the wrong device
        return h * self.scale + bias


class TensorCreatedOnAnotherDevice(nn.Module):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.body = nn.Linear(features(spec), 16)
        self.mix = Mixer(16)
        self.head = nn.Linear(16, spec.num_classes)

    def forward(self, x):
        return self.head(self.mix(self.body(x.flatten(1))))


# ---------------------------------------------------------------------------------------------
# Issue 20: bugs that used to train silently, or to be caught only by a lucky sample


class UnsetRunningScale(nn.Module):
    """Scales by the batch's spread in training and by a running spread in eval mode, but never
    updates the running one (left at its initial 0): evaluation divides by zero."""

    def __init__(self, width):
        super().__init__()
        self.register_buffer("running_std", torch.zeros(width))

    def forward(self, h):
        std = h.std(dim=0, correction=0) + 1e-5 if self.training else self.running_std
        return h / std


class EvalOnlyNaN(nn.Module):
    """Finite in training, NaN in eval mode: val_loss NaN."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.body = nn.Linear(features(spec), 32)
        self.norm = UnsetRunningScale(32)
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        return self.head(self.norm(self.body(x.flatten(1))))


class SoftmaxHead(nn.Module):
    """An MLP ending in nn.Softmax: probabilities where the cross-entropy expects logits."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features(spec), 32), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(32, spec.num_classes), nn.Softmax(dim=1))

    def forward(self, x):
        return self.head(self.body(x.flatten(1)))


@dataclass
class AuxOnConfig(MlpConfig):
    """A plugin's schema that turns its auxiliary head on by default."""

    aux_head: bool = True


class AuxOnByDefault(nn.Module):
    """Builds `aux` whenever asked: with its schema's default, always, and no loss trains it."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(features(spec), spec.num_classes)
        self.aux = nn.Linear(features(spec), spec.num_classes) if aux_head else None

    def forward(self, x):
        h = x.flatten(1)
        return self.fc(h) if self.aux is None else {"logits": self.fc(h), "aux_logits": self.aux(h)}


@dataclass
class SideHeadConfig(MlpConfig):
    side_head: bool = True  # a second head whose logits are returned for monitoring


class UnusedSideHead(nn.Module):
    """An option of its own builds a head whose output no loss term reads: no gradient ever."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(features(spec), spec.num_classes)
        self.side = nn.Linear(features(spec), spec.num_classes) if cfg.side_head else None

    def forward(self, x):
        logits = self.fc(x.flatten(1))
        if self.side is None:
            return logits
        return {"logits": logits, "side_logits": self.side(x.flatten(1))}


class PositionTable32(nn.Module):
    """Learned positions for 32 tokens (a table sized by a literal): fine on short texts, an
    IndexError on the first text longer than 32 tokens, whenever the shuffle brings it."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.embed = nn.Embedding(spec.vocab_size, 16, padding_idx=spec.pad_id)
        self.position = nn.Embedding(32, 16)
        self.head = nn.Linear(16, spec.num_classes)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        return self.head((self.embed(ids) + self.position(positions)).mean(dim=1))


class AssumesABox(nn.Module):
    """A detector whose loss reads every image's first box: an image with no box (background)
    is an IndexError, whenever the shuffle brings one."""

    computes_own_loss = True

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, images, targets=None):
        scores = torch.stack([self.conv(image[None]).mean() for image in images])
        if self.training:
            first = torch.stack([t["boxes"][0] for t in targets])  # (N, 4): one box assumed
            return {"loss_box": ((scores[:, None] - first / 100) ** 2).mean()}
        return [
            {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long),
             "scores": torch.zeros(0)}
            for _ in images
        ]  # fmt: skip

    def check_output(self, mode, output, batch_size=None):
        return []  # a loss dict in train mode, detections in eval mode, as detectors return


class BatchNormHead(nn.Module):
    """BatchNorm1d before the classifier: fine on full batches; an epoch whose last batch holds
    one sample fails there, in train mode, at the last step of the first epoch."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.body = nn.Linear(features(spec), 32)
        self.norm = nn.BatchNorm1d(32)
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        return self.head(self.norm(self.body(x.flatten(1))).relu())


class GradModeHead(nn.Module):
    def __init__(self, width, classes):
        super().__init__()
        self.fc = nn.Linear(width, classes)

    def forward(self, h):
        logits = self.fc(h)
        if not torch.is_grad_enabled():  # an "inference path" adding an 'unknown' column
            logits = torch.cat([logits, logits.new_zeros(len(logits), 1)], dim=1)
        return logits


class GradModeWidth(nn.Module):
    """Its output width changes with torch.is_grad_enabled(): evaluation sees another model."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.head = GradModeHead(features(spec), spec.num_classes)

    def forward(self, x):
        return self.head(x.flatten(1))


# Models that train into a non-finite loss (not a contract a probe can check): `kiln triage`
# must replay the failing step and name each one's cause first (tests/test_triage.py).


class LogOfSoftmaxLoss(nn.Module):
    """Computes its own cross-entropy as -log(softmax(logits)) with a temperature meant to be
    1e-3 written as 1e3: the probabilities underflow to 0, and log(0) is -inf."""

    computes_own_loss = True

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.fc = nn.Linear(features(spec), spec.num_classes)

    def forward(self, x, targets=None):
        logits = self.fc(x.flatten(1)) * 1e3
        if not self.training:
            return logits
        probs = logits.softmax(dim=1)
        return {"nll": -probs.gather(1, targets[:, None]).log().mean()}

    def check_output(self, mode, output, batch_size=None):
        return []  # a loss dict in train mode, logits in eval mode


class PerSampleStandardise(nn.Module):
    def forward(self, x):
        return (x - x.mean(dim=1, keepdim=True)) / x.std(dim=1, keepdim=True)  # 0/0 when blank


class StandardisesEachImage(nn.Module):
    """Standardises every image by its own spread: a blank image divides zero by zero."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.norm = PerSampleStandardise()
        self.head = nn.Linear(features(spec), spec.num_classes)

    def forward(self, x):
        return self.head(self.norm(x.flatten(1)))


class Energy(nn.Module):
    def forward(self, h):
        return h * h * 1e5  # fine in fp32; beyond 65504 (fp16's largest) under amp


class LoudActivations(nn.Module):
    """Squared activations with a large gain: finite in fp32, an overflow under fp16 autocast."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.body = nn.Linear(features(spec), 32)
        self.energy = Energy()
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        return self.head(self.energy(self.body(x.flatten(1))) * 1e-5)


@dataclass(frozen=True)
class Broken:
    name: str
    builder: type
    data: str  # a dataset whose inputs it takes (where the breakage shows)
    rule: str  # the rule whose message must name it
    # which check catches it: rule1 | rule2 | rule3 (any forward) | logits | config (start-up)
    check: str
    needle: str  # a fragment the message must hold
    config: type = MlpConfig
    inputs: tuple[str, ...] = ("image",)
    overrides: tuple[str, ...] = ()  # what the data must be for the bug to show


BROKEN = [
    Broken("view_3x32x32", ViewTo3x32x32, "synthetic_images", RULE_1, "rule1", "failed on"),
    Broken("literal_batch", LiteralBatchReshape, "digits", RULE_1, "rule1", "failed on batch"),
    Broken("literal_classes", LiteralNumClasses, "synthetic_images", RULE_1, "rule1", "expected"),
    Broken(
        "literal_length",
        LiteralSequenceLength,
        "csv_text",
        RULE_1,
        "rule1",
        "failed on",
        TextBowConfig,
        ("tokens",),
    ),  # fmt: skip
    Broken(
        "eval_extra_column",
        EvalExtraColumn,
        "digits",
        RULE_3,
        "rule3",
        "shape differs: train (4, 10) vs eval (4, 11) (what varied: the mode, train vs eval, no "
        "grad in both; the first module whose output differs: <model> (EvalExtraColumn)",
    ),  # fmt: skip
    Broken(
        "eval_structure",
        EvalReturnsAnotherStructure,
        "digits",
        RULE_3,
        "rule3",
        "structure differs",
    ),  # fmt: skip
    Broken("eval_only_crash", EvalOnlyCrash, "digits", RULE_3, "rule3", "eval-mode forward raised"),
    Broken("bn_forced_train", BatchNormForcedTrain, "digits", RULE_3, "rule3", "changed buffers"),
    Broken("eval_buffer", EvalUpdatesBuffer, "digits", RULE_3, "rule3", "changed buffers calls"),
    Broken("nan_aux", NaNAuxBranch, "digits", RULE_2, "rule2", "'aux_head' term is nan"),
    Broken("detached_aux", DetachedAuxBranch, "digits", RULE_2, "rule2", "reaches no parameter"),
    Broken(
        "stacking_detector",
        StackingDetector,
        "shapes_detection",
        RULE_1,
        "rule1",
        "stack expects each tensor to be equal size",
        DetectorConfig,
        ("image_list",),
    ),  # fmt: skip
    Broken("layer_on_meta", LayerLeftOnMeta, "digits", DEVICES, "rule3", "device mismatch in head"),
    Broken(
        "tensor_made_on_meta",
        TensorCreatedOnAnotherDevice,
        "digits",
        DEVICES,
        "rule3",
        "device mismatch in mix (Mixer)",
    ),  # fmt: skip
    Broken("eval_only_nan", EvalOnlyNaN, "digits", RULE_3, "rule3", "eval-mode output is non-fin"),
    Broken("softmax_head", SoftmaxHead, "digits", LOGITS, "logits", "come from head.1 (Softmax)"),
    Broken(
        "aux_on_by_default",
        AuxOnByDefault,
        "digits",
        RULE_2,
        "config",
        "schema AuxOnConfig turns the branch aux_head on by default",
        AuxOnConfig,
    ),  # fmt: skip
    Broken(
        "unused_side_head",
        UnusedSideHead,
        "digits",
        RULE_2,
        "rule2",
        "got no gradient at step 1: side.weight, side.bias, in side (Linear)",
        SideHeadConfig,
    ),  # fmt: skip
    Broken(
        "position_table_32",
        PositionTable32,
        "csv_text",
        RULE_1,
        "rule1",
        "2 sequences of 256 tokens (spec.max_length",
        TextBowConfig,
        ("tokens",),
    ),  # fmt: skip
    Broken(
        "assumes_a_box",
        AssumesABox,
        "shapes_detection",
        RULE_1,
        "rule1",
        "failed on an image with no box and the image with the most boxes",
        DetectorConfig,
        ("image_list",),
    ),  # fmt: skip
    Broken(
        "batchnorm_head",
        BatchNormHead,
        "digits",
        RULE_1,
        "rule1",
        "set data.drop_last=true (that sample is left out of each epoch), or data.batch_size=5",
        overrides=("data.batch_size=4",),  # 1437 training digits: the last batch holds 1
    ),  # fmt: skip
    Broken(
        "grad_mode_width",
        GradModeWidth,
        "digits",
        RULE_1,
        "rule1",
        "What varied: grad mode: the same batch with grad, as training runs it, gives the right "
        "output; without grad, as evaluation and inference run, it does not; the first module "
        "whose output differs: head (GradModeHead): (1, 10) in the with-grad run vs (1, 11)",
    ),  # fmt: skip
]
