"""Deliberately broken models, each breaking one rule the way real models do. The suite must
catch every one with that rule's message, through the same contract checks it runs on every
registered model, and train.py must stop each before it trains."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.config.model import DetectorConfig, MlpConfig, TextBowConfig
from kiln.guards.rules import (
    BATCH,
    COVERAGE,
    DEAD,
    DETERMINISM,
    DEVICES,
    LAYOUT,
    LEARN,
    LOGITS,
    NUMERICS,
    PADDING,
    PURITY,
    RULE_1,
    RULE_2,
    RULE_3,
)


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
            }
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

    uses_batch_statistics = True  # BatchNorm-like in train mode, as declared to the probes

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


@dataclass(frozen=True, kw_only=True)
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


@dataclass(frozen=True, kw_only=True)
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
            {
                "boxes": torch.zeros(0, 4),
                "labels": torch.zeros(0, dtype=torch.long),
                "scores": torch.zeros(0),
            }
            for _ in images
        ]

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


# ---------------------------------------------------------------------------------------------
# Issue 31: bugs that check what a model computes, not its shapes. Each kind has a correct twin
# (TWINS below) that must pass the same check and train as before.


def rows_as_sequence(x):
    """An image batch (N, C, H, W) as sequences (N, H, C*W): each image row a token."""
    n, c, h, w = x.shape
    return x.permute(0, 2, 1, 3).reshape(n, h, c * w)


class RowAttention(nn.Module):
    """Self-attention over an image's rows, nn.MultiheadAttention in its default (L, N, D)."""

    def __init__(self, spec, cfg, *, aux_head=False, transpose=False):
        super().__init__()
        self.transpose = transpose
        width = spec.channels * spec.image_size[1]
        self.embed = nn.Linear(width, 16)
        self.attend = nn.MultiheadAttention(16, 2)
        self.head = nn.Linear(16, spec.num_classes)

    def forward(self, x):
        h = self.embed(rows_as_sequence(x))  # (N, L, D)
        n, length, d = h.shape
        # The bug: a .view where a transpose was meant: the rows of different images mix.
        seq = h.transpose(0, 1) if self.transpose else h.view(length, n, d)
        mixed, _ = self.attend(seq, seq, seq, need_weights=False)
        back = mixed.transpose(0, 1) if self.transpose else mixed.view(n, length, d)
        return self.head(back.mean(dim=1))


class RowAttentionTransposed(RowAttention):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, transpose=True)


class RowRNN(nn.Module):
    """A GRU over an image's rows, fed (N, L, D) while it expects (L, N, D) (batch_first left at
    its default): it runs along the batch, each image's state carried into the next image's."""

    def __init__(self, spec, cfg, *, aux_head=False, batch_first=False):
        super().__init__()
        width = spec.channels * spec.image_size[1]
        self.embed = nn.Linear(width, 16)
        self.rnn = nn.GRU(16, 16, batch_first=batch_first)
        self.head = nn.Linear(16, spec.num_classes)

    def forward(self, x):
        out, _ = self.rnn(self.embed(rows_as_sequence(x)))  # (N, L, 16)
        return self.head(out[:, -1])


class RowRNNBatchFirst(RowRNN):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, batch_first=True)


class Standardise(nn.Module):
    """Standardises features: over the batch (dim 0, the bug) or over each sample's features."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, h):
        return (h - h.mean(self.dim, keepdim=True)) / (h.std(self.dim, keepdim=True) + 1e-5)


class BatchStatistics(nn.Module):
    """A hand-written normalisation over the batch dimension, in both modes: each sample's
    output depends on whatever else is in its batch (evaluation included)."""

    def __init__(self, spec, cfg, *, aux_head=False, dim=0):
        super().__init__()
        self.body = nn.Linear(features(spec), 32)
        self.norm = Standardise(dim)
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        return self.head(self.norm(self.body(x.flatten(1))).relu())


class SampleStatistics(BatchStatistics):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, dim=1)


class RunningCentre(nn.Module):
    """Centres features by a running mean kept on self as a plain tensor (not a buffer) and
    updated in every call, evaluation included."""

    def __init__(self, width, keep_state=True):
        super().__init__()
        self.keep_state = keep_state
        self.centre = torch.zeros(width)
        self.register_buffer("running", torch.zeros(width))

    def forward(self, h):
        if not self.keep_state:  # the twin: a buffer, updated in train mode only
            if self.training:
                self.running.mul_(0.9).add_(0.1 * h.detach().mean(0))
            return h - self.running
        self.centre = 0.9 * self.centre + 0.1 * h.detach().mean(0)
        return h - self.centre


class StateOnSelf(nn.Module):
    def __init__(self, spec, cfg, *, aux_head=False, keep_state=True):
        super().__init__()
        self.body = nn.Linear(features(spec), 32)
        self.centre = RunningCentre(32, keep_state)
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        return self.head(self.centre(self.body(x.flatten(1))).relu())


class StateInABuffer(StateOnSelf):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, keep_state=False)


class FunctionalDropout(nn.Module):
    """F.dropout without training=self.training: dropout in evaluation too."""

    def __init__(self, spec, cfg, *, aux_head=False, follow_mode=False):
        super().__init__()
        self.follow_mode = follow_mode
        self.body = nn.Linear(features(spec), 64)
        self.head = nn.Linear(64, spec.num_classes)

    def forward(self, x):
        h = self.body(x.flatten(1)).relu()
        h = F.dropout(h, 0.3, training=self.training) if self.follow_mode else F.dropout(h, 0.3)
        return self.head(h)


class FunctionalDropoutFollowsMode(FunctionalDropout):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, follow_mode=True)


class GaussianNoise(nn.Module):
    """Noise injection for robustness, left on in eval (the twin checks self.training)."""

    def __init__(self, std, train_only=False):
        super().__init__()
        self.std, self.train_only = std, train_only

    def forward(self, h):
        if self.train_only and not self.training:
            return h
        return h + self.std * torch.randn_like(h)


class NoiseInEval(nn.Module):
    def __init__(self, spec, cfg, *, aux_head=False, train_only=False):
        super().__init__()
        self.body = nn.Linear(features(spec), 32)
        self.noise = GaussianNoise(0.3, train_only)
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        return self.head(self.noise(self.body(x.flatten(1)).relu()))


class NoiseInTrainingOnly(NoiseInEval):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, train_only=True)


class ScalesInputsInPlace(nn.Module):
    """Rescales the pixel batch in place (x /= 16): the batch the loss, the metrics and the
    probes see is no longer what was loaded."""

    def __init__(self, spec, cfg, *, aux_head=False, in_place=True):
        super().__init__()
        self.in_place = in_place
        self.body = nn.Linear(features(spec), 32)
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        if self.in_place:
            x /= 16.0
        else:
            x = x / 16.0
        return self.head(self.body(x.flatten(1)).relu())


class ScalesInputsOnACopy(ScalesInputsInPlace):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, in_place=False)


def build_kiln_detector(cls, spec, cfg):
    from kiln.models.detector import input_side

    return cls(spec.num_classes, input_side(spec), cfg)


class _BoxStatistics:
    """Logs the mean box size relative to each image (the twin on copies, the bug in place)."""

    in_place = True

    def forward(self, images, targets=None):
        if self.training and targets is not None:
            for image, target in zip(images, targets, strict=True):
                if self.in_place:  # the bug: the dataset's own boxes shrink every time
                    target["boxes"] /= image.shape[-1]
                    relative = target["boxes"]
                else:
                    relative = target["boxes"] / image.shape[-1]
                self.last_box_size = (
                    float(relative[:, 2:].sub(relative[:, :2]).mean()) if len(relative) else 0.0
                )
        return super().forward(images, targets)


def _detector_classes():
    from kiln.models.detector import KilnDetector

    class RescalesTargetsInPlace(_BoxStatistics, KilnDetector):
        in_place = True

    class RescalesTargetsOnCopies(_BoxStatistics, KilnDetector):
        in_place = False

    return RescalesTargetsInPlace, RescalesTargetsOnCopies


def rescales_targets_in_place(spec, cfg, *, aux_head=False):
    return build_kiln_detector(_detector_classes()[0], spec, cfg)


def rescales_targets_on_copies(spec, cfg, *, aux_head=False):
    return build_kiln_detector(_detector_classes()[1], spec, cfg)


class DeadUnits(nn.Module):
    """Every layer's bias initialised to -30, an initialisation copied from one layer to all:
    with standardised inputs and small weights, no ReLU ever fires."""

    def __init__(self, spec, cfg, *, aux_head=False, bias=-30.0):
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(features(spec), 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU()
        )
        self.head = nn.Linear(32, spec.num_classes)
        with torch.no_grad():
            for layer in (self.body[0], self.body[2]):
                layer.bias.fill_(bias)

    def forward(self, x):
        return self.head(self.body(x.flatten(1)))


class LiveUnits(DeadUnits):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, bias=0.0)


class DetachedOutput(nn.Module):
    """Returns its logits detached (a .detach() meant for a logged copy): nothing trains."""

    def __init__(self, spec, cfg, *, aux_head=False, detach=True):
        super().__init__()
        self.detach = detach
        self.body = nn.Linear(features(spec), 32)
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        logits = self.head(self.body(x.flatten(1)).relu())
        return logits.detach() if self.detach else logits


class AttachedOutput(DetachedOutput):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, detach=False)


class ZeroGate(nn.Module):
    """A learned layer behind a gate buffer initialised to zeros where ones were meant."""

    def __init__(self, width, opened=False):
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.register_buffer("gate", torch.ones(width) if opened else torch.zeros(width))

    def forward(self, h):
        return h + self.gate * self.fc(h)


class ZeroGradients(nn.Module):
    """Its residual branch is multiplied by a zero gate: the branch's gradients are exactly zero
    (not None), so rule 2's check of missing gradients passes it."""

    def __init__(self, spec, cfg, *, aux_head=False, opened=False):
        super().__init__()
        self.body = nn.Linear(features(spec), 32)
        self.branch = ZeroGate(32, opened)
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        return self.head(self.branch(self.body(x.flatten(1)).relu()))


class OpenGate(ZeroGradients):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, opened=True)


class ConditionalRefine(nn.Module):
    """Refines the features only when some image in the batch is bright (`if cond.any()`): a
    batch of dim digits skips `refine`, and under DDP the ranks' gradient reductions mismatch."""

    def __init__(self, spec, cfg, *, aux_head=False, always=False):
        super().__init__()
        self.always = always
        self.body = nn.Linear(features(spec), 32)
        self.refine = nn.Linear(32, 32)
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        h = self.body(x.flatten(1)).relu()
        bright = x.flatten(1).mean(dim=1) > BRIGHT
        if self.always:
            h = h + bright.to(h.dtype)[:, None] * self.refine(h)  # every step: weighted, no branch
        elif bright.any():
            h = h + self.refine(h)
        return self.head(h)


BRIGHT = 0.04  # a standardised digit's mean pixel: some of the first digits are above, some not


class RefineEveryStep(ConditionalRefine):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, always=True)


class PositionBias(nn.Module):
    def __init__(self, width, on_device=False):
        super().__init__()
        self.on_device = on_device
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, h):
        positions = (
            torch.arange(h.shape[-1], device=h.device)
            if self.on_device
            else torch.arange(h.shape[-1])
        )  # the bug: made on the CPU whatever the device
        return h * self.scale + positions / h.shape[-1]


class TensorWithoutDevice(nn.Module):
    """Creates a tensor in forward without device=: fine on a CPU run, a device mismatch at the
    first step of a GPU run."""

    def __init__(self, spec, cfg, *, aux_head=False, on_device=False):
        super().__init__()
        self.body = nn.Linear(features(spec), 16)
        self.position = PositionBias(16, on_device)
        self.head = nn.Linear(16, spec.num_classes)

    def forward(self, x):
        return self.head(self.position(self.body(x.flatten(1))).relu())


class TensorOnTheInputsDevice(TensorWithoutDevice):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, on_device=True)


class ListedOffsets(nn.Module):
    """Constant offsets kept in a list (as torchvision's DefaultBoxGenerator keeps its anchor
    shapes): .to(device) moves parameters and buffers, never a list attribute's tensors."""

    def __init__(self, width, moved=False):
        super().__init__()
        self.moved = moved
        self.scale = nn.Parameter(torch.ones(width))
        self._offsets = [torch.linspace(0, 1, width), torch.linspace(1, 0, width)]

    def forward(self, h):
        if not self.moved:  # the bug: the CPU tensors meet the run's own
            return h * self.scale + self._offsets[0]
        # DefaultBoxGenerator's way: computed on the CPU, then moved to the input's device
        steps = (torch.arange(h.shape[-1]) + 0.5) / h.shape[-1]
        offsets = torch.cat(
            [steps[:, None] * self._offsets[0][:, None], self._offsets[1][:, None]], 1
        )
        return h * self.scale + offsets.to(h.device).sum(1)


class OffsetsInAList(nn.Module):
    def __init__(self, spec, cfg, *, aux_head=False, moved=False):
        super().__init__()
        self.body = nn.Linear(features(spec), 16)
        self.offsets = ListedOffsets(16, moved)
        self.head = nn.Linear(16, spec.num_classes)

    def forward(self, x):
        return self.head(self.offsets(self.body(x.flatten(1))).relu())


class OffsetsMovedToTheInputsDevice(OffsetsInAList):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, moved=True)


class OffsetsReplacedByMovedCopies(OffsetsInAList):
    """AnchorGenerator's way: each forward replaces the list by its tensors moved to the
    input's device, then uses them (the first tensors are let go: their ids come back)."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg)

    def forward(self, x):
        h = self.body(x.flatten(1))
        listed = self.offsets
        listed._offsets = [o.to(dtype=h.dtype, device=h.device) for o in listed._offsets]
        shifts = torch.arange(h.shape[-1], device=h.device)[:, None] + listed._offsets[1][:, None]
        h = h * listed.scale + listed._offsets[0] + shifts.sum(1)
        return self.head(h.relu())


class MaskedScores(nn.Module):
    """Attention-style scores masked with -1e9 (float16 holds +-65504) or with the dtype's
    own minimum (the twin)."""

    def __init__(self, width, from_dtype=False):
        super().__init__()
        self.from_dtype = from_dtype
        self.score = nn.Linear(width, width)

    def forward(self, h):
        scores = self.score(h)
        mask = torch.zeros_like(scores, dtype=torch.bool)
        mask[:, -1] = True  # the last feature is padding
        fill = torch.finfo(scores.dtype).min if self.from_dtype else -1e9
        return scores.masked_fill(mask, fill).softmax(dim=-1) * h


class MaskFillMinus1e9(nn.Module):
    def __init__(self, spec, cfg, *, aux_head=False, from_dtype=False):
        super().__init__()
        self.body = nn.Linear(features(spec), 32)
        self.mask = MaskedScores(32, from_dtype)
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        return self.head(self.mask(self.body(x.flatten(1))))


class MaskFillFromDtype(MaskFillMinus1e9):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, from_dtype=True)


class HandSoftmax(nn.Module):
    """A softmax written by hand, exp(scores) / sum: exp of a float16 score above 11 is Inf
    (the twin subtracts the row's maximum first)."""

    def __init__(self, width, stable=False):
        super().__init__()
        self.stable = stable
        self.score = nn.Linear(width, width)

    def forward(self, h):
        scores = self.score(h) * 16.0
        if self.stable:
            scores = scores - scores.amax(dim=-1, keepdim=True)
        weights = scores.exp()
        return weights / weights.sum(dim=-1, keepdim=True) * h


class ExpOfHalf(nn.Module):
    def __init__(self, spec, cfg, *, aux_head=False, stable=False):
        super().__init__()
        self.body = nn.Linear(features(spec), 32)
        self.attend = HandSoftmax(32, stable)
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        return self.head(self.attend(self.body(x.flatten(1))))


class ExpOfHalfStable(ExpOfHalf):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, stable=True)


class ViewOnPermuted(nn.Module):
    """Moves channels last with permute, then .view: the sizes are right but the memory is not
    contiguous (the twin uses .reshape)."""

    def __init__(self, spec, cfg, *, aux_head=False, reshape=False):
        super().__init__()
        self.reshape = reshape
        self.head = nn.Linear(features(spec), spec.num_classes)

    def forward(self, x):
        channels_last = x.permute(0, 2, 3, 1)
        flat = (
            channels_last.reshape(x.shape[0], -1)
            if self.reshape
            else channels_last.view(x.shape[0], -1)
        )
        return self.head(flat)


class ReshapeOnPermuted(ViewOnPermuted):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, reshape=True)


class TinyLogits(nn.Module):
    """A temperature multiplied where it should divide (logits * 1e-4, not / 1e-4 or / 1):
    gradients flow and the weights move, the loss stays at ln(classes)."""

    def __init__(self, spec, cfg, *, aux_head=False, temperature=1e-4, divide=False):
        super().__init__()
        self.temperature, self.divide = temperature, divide
        self.body = nn.Linear(features(spec), 32)
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        logits = self.head(self.body(x.flatten(1)).relu())
        return logits / self.temperature if self.divide else logits * self.temperature


class UnitTemperature(TinyLogits):
    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__(spec, cfg, temperature=1.0, divide=True)


@dataclass(frozen=True)
class Broken:
    name: str
    builder: type
    data: str  # a dataset whose inputs it takes (where the breakage shows)
    rule: str  # the rule whose message must name it
    # which check catches it: rule1 | rule2 | rule3 (any forward) | logits | config (start-up)
    # | behaviour (the probe plan's behaviour checks and the learn probe) | fp16 (the same, with
    # the fp16 probe that precision=amp plans)
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
    ),
    Broken(
        "eval_extra_column",
        EvalExtraColumn,
        "digits",
        RULE_3,
        "rule3",
        "shape differs: train (4, 10) vs eval (4, 11) (what varied: the mode, train vs eval, no "
        "grad in both; the first module whose output differs: <model> (EvalExtraColumn)",
    ),
    Broken(
        "eval_structure",
        EvalReturnsAnotherStructure,
        "digits",
        RULE_3,
        "rule3",
        "structure differs",
    ),
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
    ),
    Broken("layer_on_meta", LayerLeftOnMeta, "digits", DEVICES, "rule3", "device mismatch in head"),
    Broken(
        "tensor_made_on_meta",
        TensorCreatedOnAnotherDevice,
        "digits",
        DEVICES,
        "rule3",
        "device mismatch in mix (Mixer)",
    ),
    Broken(
        "eval_only_nan", EvalOnlyNaN, "digits", NUMERICS, "rule3", "eval-mode output is non-fin"
    ),
    Broken("softmax_head", SoftmaxHead, "digits", LOGITS, "logits", "come from head.1 (Softmax)"),
    Broken(
        "aux_on_by_default",
        AuxOnByDefault,
        "digits",
        RULE_2,
        "config",
        "schema AuxOnConfig turns the branch aux_head on by default",
        AuxOnConfig,
    ),
    Broken(
        "unused_side_head",
        UnusedSideHead,
        "digits",
        RULE_2,
        "rule2",
        "got no gradient at step 1: side.weight, side.bias, in side (Linear)",
        SideHeadConfig,
    ),
    Broken(
        "position_table_32",
        PositionTable32,
        "csv_text",
        RULE_1,
        "rule1",
        "2 sequences of 256 tokens (spec.max_length",
        TextBowConfig,
        ("tokens",),
    ),
    Broken(
        "assumes_a_box",
        AssumesABox,
        "shapes_detection",
        RULE_1,
        "rule1",
        "failed on an image with no box and the image with the most boxes",
        DetectorConfig,
        ("image_list",),
    ),
    Broken(
        "batchnorm_head",
        BatchNormHead,
        "digits",
        RULE_1,
        "rule1",
        "set data.drop_last=true (that sample is left out of each epoch), or data.batch_size=5",
        overrides=("data.batch_size=4",),  # 1437 training digits: the last batch holds 1
    ),
    Broken(
        "grad_mode_width",
        GradModeWidth,
        "digits",
        RULE_1,
        "rule1",
        "What varied: grad mode: the same batch with grad, as training runs it, gives the right "
        "output; without grad, as evaluation and inference run, it does not; the first module "
        "whose output differs: head (GradModeHead): (1, 10) in the with-grad run vs (1, 11)",
    ),
]

# Issue 31's kinds: what a model computes. Each is stopped before step 1 by its own check, which
# names the module; conditional_refine only under DDP (one process trains on, warned).
BROKEN += [
    Broken(
        "view_for_transpose",
        RowAttention,
        "digits",
        BATCH,
        "behaviour",
        "<model> (RowAttention).forward, between embed (Linear)'s output and head (Linear)'s input",
    ),
    Broken(
        "rnn_batch_first",
        RowRNN,
        "digits",
        BATCH,
        "behaviour",
        "rnn (GRU): row i of its output depends on other rows of its input",
    ),
    Broken("batch_statistics", BatchStatistics, "digits", BATCH, "behaviour", "norm (Standardise)"),
    Broken(
        "state_on_self",
        StateOnSelf,
        "digits",
        DETERMINISM,
        "behaviour",
        "the model changes itself on every call: the first module call where they part: "
        "centre (RunningCentre)",
    ),
    Broken(
        "eval_dropout",
        FunctionalDropout,
        "digits",
        DETERMINISM,
        "behaviour",
        "randomness is left on in eval mode; the first module call where they part: <model> "
        "(FunctionalDropout).forward, before it calls head (Linear)",
    ),
    Broken(
        "eval_noise",
        NoiseInEval,
        "digits",
        DETERMINISM,
        "behaviour",
        "randomness is left on in eval mode; the first module call where they part: noise "
        "(GaussianNoise)",
    ),
    Broken(
        "inputs_in_place",
        ScalesInputsInPlace,
        "digits",
        PURITY,
        "behaviour",
        "changed the batch it was given: batch[0]: ",
    ),
    Broken(
        "targets_in_place",
        rescales_targets_in_place,
        "shapes_detection",
        PURITY,
        "behaviour",
        "changed the batch it was given: batch[1][1]['boxes']: 12 of 12 values changed",
        DetectorConfig,
        ("image_list",),
    ),
    Broken(
        "dead_units",
        DeadUnits,
        "digits",
        DEAD,
        "behaviour",
        "Layers with every unit off on the probe batch: body.1: 32 of 32 units off (ReLU)",
    ),
    Broken(
        "detached_output",
        DetachedOutput,
        "digits",
        DEAD,
        "behaviour",
        "output is detached from the graph",
    ),
    Broken(
        "zero_gradients",
        ZeroGradients,
        "digits",
        DEAD,
        "behaviour",
        "got a gradient that is exactly zero in the probe step before step 1, and again after "
        "one optimizer step: branch.fc.weight, branch.fc.bias, in branch.fc (Linear)",
    ),
    Broken(
        "conditional_refine",
        ConditionalRefine,
        "digits",
        DEAD,
        "behaviour",
        "parameters used only in some steps: refine.weight, refine.bias (in refine (Linear)) "
        "got a gradient from samples 5, 6, 7 (each alone), the whole batch of 8 and none from "
        "samples 0, 1, 2, 3, 4 (each alone)",
    ),
    Broken(
        "tensor_without_device",
        TensorWithoutDevice,
        "digits",
        DEVICES,
        "behaviour",
        "in position (PositionBias) combines a tensor of shape (16,) made by "
        "torch.arange(...) without device= in position (PositionBias)",
    ),
    Broken(
        "offsets_in_a_list",
        OffsetsInAList,
        "digits",
        DEVICES,
        "behaviour",
        "in offsets (ListedOffsets) combines a tensor of shape (16,) made by the plain "
        "attribute offsets._offsets[0] of ListedOffsets",
    ),
    Broken(
        "mask_fill_minus_1e9",
        MaskFillMinus1e9,
        "digits",
        NUMERICS,
        "fp16",
        "under fp16 autocast (precision=amp on CUDA) mask (MaskedScores) uses a value float16 "
        "cannot hold",
        overrides=("precision=amp",),
    ),
    Broken(
        "exp_of_half",
        ExpOfHalf,
        "digits",
        NUMERICS,
        "fp16",
        "in attend (HandSoftmax) makes Inf/NaN out of finite",
        overrides=("precision=amp",),
    ),
    Broken(
        "view_on_permuted", ViewOnPermuted, "synthetic_images", LAYOUT, "rule1", "use .reshape(...)"
    ),
    Broken(
        "tiny_logits",
        TinyLogits,
        "digits",
        LEARN,
        "behaviour",
        "5 steps on one fixed batch of 8 at lr 0.003: its loss",
    ),
]


@dataclass(frozen=True)
class Twin:
    """The correct twin of a broken model: the same model with the bug fixed."""

    name: str
    builder: type
    of: str  # the Broken entry it mends

    def broken(self) -> Broken:
        return next(b for b in BROKEN if b.name == self.of)


TWINS = [
    Twin("view_for_transpose_fixed", RowAttentionTransposed, "view_for_transpose"),
    Twin("rnn_batch_first_fixed", RowRNNBatchFirst, "rnn_batch_first"),
    Twin("sample_statistics", SampleStatistics, "batch_statistics"),
    Twin("state_in_a_buffer", StateInABuffer, "state_on_self"),
    Twin("dropout_follows_mode", FunctionalDropoutFollowsMode, "eval_dropout"),
    Twin("noise_in_training_only", NoiseInTrainingOnly, "eval_noise"),
    Twin("inputs_on_a_copy", ScalesInputsOnACopy, "inputs_in_place"),
    Twin("targets_on_copies", rescales_targets_on_copies, "targets_in_place"),
    Twin("live_units", LiveUnits, "dead_units"),
    Twin("attached_output", AttachedOutput, "detached_output"),
    Twin("open_gate", OpenGate, "zero_gradients"),
    Twin("refine_every_step", RefineEveryStep, "conditional_refine"),
    Twin("tensor_on_the_inputs_device", TensorOnTheInputsDevice, "tensor_without_device"),
    Twin("offsets_moved_to_the_inputs_device", OffsetsMovedToTheInputsDevice, "offsets_in_a_list"),
    Twin("offsets_replaced_by_moved_copies", OffsetsReplacedByMovedCopies, "offsets_in_a_list"),
    Twin("mask_fill_from_dtype", MaskFillFromDtype, "mask_fill_minus_1e9"),
    Twin("exp_of_half_stable", ExpOfHalfStable, "exp_of_half"),
    Twin("reshape_on_permuted", ReshapeOnPermuted, "view_on_permuted"),
    Twin("unit_temperature", UnitTemperature, "tiny_logits"),
]


# ---------------------------------------------------------------------------------------------
# Issue 48: bugs that still ended `ok` -- a model that reads its padding or its neighbours in
# attention pooling, a layer built in forward or a tie re-made there (the optimizer never sees
# either) -- each with its correct twin; and broken datasets (BROKEN_DATA below).


class TokenPooling(nn.Module):
    """Embeds token ids and pools them over the sequence: `pool` says how."""

    pool = "masked_mean"

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.pad_id = spec.pad_id
        self.embed = nn.Embedding(spec.vocab_size, 16)  # padding embeds to a vector, not 0
        self.score = nn.Linear(16, 1) if self.pool.startswith("softmax") else None
        self.head = nn.Linear(16, spec.num_classes)

    def forward(self, ids):
        h = self.embed(ids)
        real = (ids != self.pad_id)[..., None]
        if self.pool == "mean_over_padding":  # the bug: padding counts in the mean
            pooled = h.mean(dim=1)
        elif self.pool == "masked_mean":  # the mean over each text's real tokens
            pooled = (h * real).sum(dim=1) / real.sum(dim=1).clamp(min=1)
        else:  # attention pooling
            scores = self.score(h).masked_fill(~real, -1e9)
            dim = 0 if self.pool == "softmax_over_batch" else 1  # the bug: dim 0, the batch
            pooled = (scores.softmax(dim=dim) * h * real).sum(dim=1)
        return self.head(pooled)


class MeanOverPadding(TokenPooling):
    pool = "mean_over_padding"


class MeanOverRealTokens(TokenPooling):
    pool = "masked_mean"


class SoftmaxOverBatch(TokenPooling):
    pool = "softmax_over_batch"


class SoftmaxOverSequence(TokenPooling):
    pool = "softmax_over_sequence"


class MaskedAttention(nn.Module):
    """Self-attention over the tokens, padding masked (key_padding_mask: True where a token is
    padding), then a mean over the real tokens; `inverted`: the mask handed over the other way
    round (True where a token is real), as an attention_mask convention would have it."""

    inverted = False

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.pad_id = spec.pad_id
        self.embed = nn.Embedding(spec.vocab_size, 16)
        self.attend = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, spec.num_classes)

    def forward(self, ids):
        h = self.embed(ids)
        padding = ids == self.pad_id
        mask = ~padding if self.inverted else padding
        out, _ = self.attend(h, h, h, key_padding_mask=mask, need_weights=False)
        real = (~padding)[..., None]
        return self.head((out * real).sum(dim=1) / real.sum(dim=1).clamp(min=1))


class InvertedAttentionMask(MaskedAttention):
    inverted = True


class BuiltInForward(nn.Module):
    """Builds its projection on the first call, sized from the first batch: the optimizer, built
    before any forward, never holds it."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.proj: nn.Module | None = None
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        h = x.flatten(1)
        if self.proj is None:
            self.proj = nn.Linear(h.shape[1], 32).to(h.device)
        return self.head(self.proj(h).relu())


class LazyProjection(nn.Module):
    """The same, with torch's own lazy layer: sized by a dry forward before the optimizer."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.proj = nn.LazyLinear(32)
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        return self.head(self.proj(x.flatten(1)).relu())


class TiedInForward(nn.Module):
    """Ties its decoder to its encoder on the first call, with a copy made a new Parameter
    (the tie meant was the Parameter itself): the optimizer holds the old one."""

    def __init__(self, spec, cfg, *, aux_head=False):
        super().__init__()
        self.tied = False
        self.encode = nn.Linear(features(spec), 32, bias=False)
        self.decode = nn.Linear(32, features(spec), bias=False)
        self.head = nn.Linear(32, spec.num_classes)

    def forward(self, x):
        if not self.tied:
            self.decode.weight = nn.Parameter(self.encode.weight.detach().t().clone())
            self.tied = True
        h = self.encode(x.flatten(1)).relu()
        return self.head(h + 0.1 * self.encode(self.decode(h)))


BROKEN += [
    Broken(
        "mean_over_padding",
        MeanOverPadding,
        "csv_text",
        PADDING,
        "behaviour",
        "the model reads its padding; first seen in <model> (MeanOverPadding).forward, "
        "before it calls head (Linear)",
        TextBowConfig,
        ("tokens",),
    ),
    Broken(
        "softmax_over_batch",
        SoftmaxOverBatch,
        "csv_text",
        BATCH,
        "behaviour",
        "its output depends on its neighbour",
        TextBowConfig,
        ("tokens",),
    ),
    Broken(
        "inverted_attention_mask",
        InvertedAttentionMask,
        "csv_text",
        PADDING,
        "behaviour",
        "the model reads its padding; first seen in attend (MultiheadAttention)",
        TextBowConfig,
        ("tokens",),
    ),
    Broken(
        "built_in_forward",
        BuiltInForward,
        "digits",
        COVERAGE,
        "coverage",
        "proj.weight, proj.bias (in proj (Linear)) are trainable parameters of the model "
        "after step 1 that the optimizer does not hold",
    ),
    Broken(
        "tied_in_forward",
        TiedInForward,
        "digits",
        COVERAGE,
        "coverage",
        "decode.weight (in decode (Linear))",
    ),
]
TWINS += [
    Twin("mean_over_real_tokens", MeanOverRealTokens, "mean_over_padding"),
    Twin("softmax_over_sequence", SoftmaxOverSequence, "softmax_over_batch"),
    Twin("masked_attention", MaskedAttention, "inverted_attention_mask"),
    Twin("lazy_projection", LazyProjection, "built_in_forward"),
]


# ---------------------------------------------------------------------------------------------
# Broken datasets (issue 48): each is a dataset kiln builds, changed the way real data goes
# wrong; the data checks stop each before any model is built, naming it. The twin of each is
# the unchanged dataset (`mended`), which must pass the same check.


def _with_val(bundle, val):
    import dataclasses as dc

    return dc.replace(bundle, val=val, val_lengths=None, sources=None)


def val_is_train(bundle):
    """The validation split is the training split (a path copied into both keys)."""
    return _with_val(bundle, bundle.train)


def val_overlaps_train(bundle):
    """Half the validation split is training images (a split made twice, with two seeds)."""
    from torch.utils.data import ConcatDataset, Subset

    half = len(bundle.val) // 2
    return _with_val(
        bundle, ConcatDataset([Subset(bundle.train, range(half)), Subset(bundle.val, range(half))])
    )


class ClassMapped(torch.utils.data.Dataset):
    """A split that declares its class-to-index map, as torchvision's ImageFolder does."""

    def __init__(self, dataset, class_to_idx: dict[str, int]):
        self.dataset, self.class_to_idx = dataset, class_to_idx

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]


def class_maps(bundle, swap: bool):
    """Each split with its own class map; `swap`: the validation folder listed another way, so
    two classes trade indices (ImageFolder on a folder missing a class shifts them alike)."""
    import dataclasses as dc

    names = list(bundle.spec.class_names)
    train_map = {name: i for i, name in enumerate(names)}
    val_map = dict(train_map)
    if swap:
        val_map[names[0]], val_map[names[1]] = 1, 0
    return dc.replace(
        bundle, train=ClassMapped(bundle.train, train_map), val=ClassMapped(bundle.val, val_map)
    )


class Retargeted(torch.utils.data.Dataset):
    """Detection items whose targets a function rewrites."""

    def __init__(self, dataset, change):
        self.dataset, self.change = dataset, change

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        image, target = self.dataset[index]
        return image, self.change(dict(target))


def _retargeted(bundle, change):
    import dataclasses as dc

    return dc.replace(
        bundle, train=Retargeted(bundle.train, change), val=Retargeted(bundle.val, change)
    )


def labels_from_zero(bundle):
    """Labels 0..C-1, where the detectors reserve 0 for the background."""
    return _retargeted(bundle, lambda t: {**t, "labels": t["labels"] - 1})


def boxes_as_xywh(bundle):
    """Boxes written as COCO's (x, y, w, h) where kiln's items carry (x1, y1, x2, y2)."""
    from torchvision.ops import box_convert

    return _retargeted(bundle, lambda t: {**t, "boxes": box_convert(t["boxes"], "xyxy", "xywh")})


@dataclass(frozen=True)
class BrokenData:
    name: str
    change: object  # DataBundle -> DataBundle: the bug
    data: str  # the dataset it changes
    what: str  # the [FAIL] line's <what> (and the finding's kind)
    needle: str  # a fragment the message must hold
    mended: object = None  # DataBundle -> DataBundle: the twin (None: the dataset as it is)
    overrides: tuple[str, ...] = ()


BROKEN_DATA = [
    BrokenData(
        "val_is_train",
        val_is_train,
        "digits",
        "split leak",
        "1437 of 1437 val items (100.0%) are also in the train split",
    ),
    BrokenData(
        "val_overlaps_train",
        val_overlaps_train,
        "digits",
        "split leak",
        "180 of 360 val items (50.0%) are also in the train split",
    ),
    BrokenData(
        "class_map_swapped",
        lambda b: class_maps(b, swap=True),
        "digits",
        "class map",
        "2 class(es) at another index: '0' -> 1 in val, 0 in train, '1' -> 0 in val, 1 in train",
        mended=lambda b: class_maps(b, swap=False),
    ),
    BrokenData(
        "labels_from_zero",
        labels_from_zero,
        "shapes_detection",
        "box convention",
        "boxes are labelled 0 (labels 0..1), and kiln's detectors reserve 0 for the background",
        overrides=("model=detector",),
    ),
    BrokenData(
        "boxes_as_xywh",
        boxes_as_xywh,
        "shapes_detection",
        "box convention",
        "have x2 <= x1 or y2 <= y1",
        overrides=("model=detector",),
    ),
]
