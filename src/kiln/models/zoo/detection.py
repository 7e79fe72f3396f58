"""`model=torchvision_detection`: any box detector of torchvision.models.detection (Faster R-CNN,
RetinaNet, FCOS, SSD, SSDlite), sized from the data, with named weights (DEFAULT, COCO_V1) from
torch.hub's cache or a file.

    python train.py data=coco model=torchvision_detection \\
        model.arch=fasterrcnn_mobilenet_v3_large_320_fpn model.weights=DEFAULT ...

- the class head is built for the data's classes + the background (label 0), so labels 1..C
  are the data's; COCO weights load into everything else and their 91-class head is
  re-initialised (the log says which tensors);
- min_size and max_size (the side torchvision resizes each image to) are the data's image side
  (data.image_size, or the largest side in the data when smaller); SSD and SSDlite keep their
  fixed 300 / 320;
- BatchNorm layers are torchvision's FrozenBatchNorm2d (model.frozen_batchnorm=true), as its
  pretrained detectors train, whatever the weights: a checkpoint rebuilds into the same network.

The network is built without weights and the file read by kiln's one weights reader
(kiln.models.weights.read_state_dict); nothing is downloaded. Train mode returns torchvision's
loss dict, eval mode its boxes: the detection contract (kiln.models.detection_contract)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor, nn

from kiln.config.base import ConfigError
from kiln.config.model import TorchvisionDetectionConfig
from kiln.models.detection_contract import DetectionContract
from kiln.models.weights import read_state_dict
from kiln.models.zoo.archs import check_arch
from kiln.models.zoo.cache import is_weight_file, warn_on_hash_mismatch, weight_file
from kiln.models.zoo.surgery import load_weights
from kiln.models.zoo.torchvision import (
    torchvision_cached_file,
    torchvision_model_class,
    torchvision_weights,
)

DETECTION_LISTING = (
    'python -c "import torchvision.models as m; print(*m.list_models(module=m.detection), '
    "sep='\\n')\""
)
# Builders of torchvision.models.detection that return more than boxes: not box detectors.
NOT_BOX_DETECTORS = (
    "keypointrcnn_resnet50_fpn",
    "maskrcnn_resnet50_fpn",
    "maskrcnn_resnet50_fpn_v2",
)
# Loss names per family (what train mode returns) and where its class head is.
FAMILIES = {
    "FasterRCNN": (
        ("loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg"),
        "roi_heads.box_predictor",
    ),
    "RetinaNet": (("classification", "bbox_regression"), "head.classification_head.cls_logits"),
    "FCOS": (
        ("classification", "bbox_regression", "bbox_ctrness"),
        "head.classification_head.cls_logits",
    ),
    "SSD": (("bbox_regression", "classification"), "head.classification_head"),
}
FIXED_SIZE_FAMILIES = ("SSD",)  # SSD300 / SSDlite320 resize to their own fixed size
# Architectures whose traced ONNX graph does not agree with torch (kiln.inference.export checks
# every export against torch box by box; tests/test_torchvision_detection_export.py's slow sweep
# tries them all): export refuses them at once, with the reason.
NOT_ONNX_EXPORTABLE = {
    "ssdlite320_mobilenet_v3_large": "ONNX Runtime's run of its traced graph keeps another "
    "number of boxes than torch does (136 against 128 on the same image)",
}


@lru_cache(maxsize=1)
def detection_archs() -> tuple[str, ...]:
    import torchvision.models

    names = torchvision.models.list_models(module=torchvision.models.detection)
    return tuple(n for n in names if n not in NOT_BOX_DETECTORS)


def check_detection_arch(arch: str) -> str:
    return check_arch(arch, detection_archs(), "torchvision.models.detection", DETECTION_LISTING)


def is_detection_arch(arch: str) -> bool:
    """For model=torchvision's refusal: the name is a detector's (model=torchvision_detection)."""
    return arch in detection_archs() or arch in NOT_BOX_DETECTORS


def family_of(net: nn.Module) -> str:
    for klass in type(net).__mro__:
        if klass.__name__ in FAMILIES:
            return klass.__name__
    raise AssertionError(f"no detection family for {type(net).__name__}")


def freeze_batchnorm(net: nn.Module) -> None:
    """Every BatchNorm2d -> torchvision's FrozenBatchNorm2d holding the same statistics."""
    from torchvision.ops.misc import FrozenBatchNorm2d

    for name, module in list(net.named_modules()):
        if not isinstance(module, nn.BatchNorm2d):
            continue
        frozen = FrozenBatchNorm2d(module.num_features, eps=module.eps)
        with torch.no_grad():
            frozen.weight.copy_(module.weight)
            frozen.bias.copy_(module.bias)
            frozen.running_mean.copy_(module.running_mean)
            frozen.running_var.copy_(module.running_var)
        parent, _, attr = name.rpartition(".")
        setattr(net.get_submodule(parent) if parent else net, attr, frozen)


class TorchvisionDetector(DetectionContract, nn.Module):
    """A torchvision detector under kiln's detection contract: model(images, targets) in train
    mode -> its loss dict; model(images) in eval mode -> one boxes/labels/scores dict per image.
    Images are (3, H_i, W_i) in [0, 1]; torchvision's own transform resizes and normalises."""

    def __init__(self, net: nn.Module, num_classes: int, arch: str):
        super().__init__()
        self.net = net
        self.num_classes = num_classes
        self.arch = arch
        self.loss_keys = FAMILIES[family_of(net)][0]
        self.onnx_refusal = NOT_ONNX_EXPORTABLE.get(arch)  # kiln.inference.export
        from kiln.models.zoo.traced_resize import traced_resize_as_eager

        traced_resize_as_eager(net.transform)  # ONNX export: sized as eager torch sizes

    def forward(self, images: list[Tensor], targets: list[dict[str, Tensor]] | None = None):
        if self.training:
            if targets is None:
                raise ValueError(f"{self.arch} in train mode needs targets: model(images, targets)")
            return self.net(images, targets)
        return self.net(images)

    def unreached_by_batch(self, names: list[str], batch) -> tuple[list[str], str]:
        """Of `names` (parameters whose gradient was exactly zero in a training step on
        `batch`), those this batch's loss cannot reach by SSD's design, and why: a level's head
        (and the extra layers that feed only coarser levels) learns from the anchors matched to
        an object at that level, and from the negatives mined there; a level whose anchors match
        no object of the batch may get neither (kiln.guards.live_gradients does not judge them
        on this batch). Other families share their heads across levels: nothing."""
        if family_of(self.net) != "SSD":
            return [], ""
        levels = {name: levels_fed(self.net, name) for name in names}
        matched, grids, side = self.matched_levels(batch)
        unmatched = set(range(len(grids))) - matched
        excused = [n for n, fed in levels.items() if fed and fed <= unmatched]
        if not excused:
            return [], ""
        shown = sorted(set().union(*(levels[n] for n in excused)))
        cells = ", ".join(f"{grids[k][0]}x{grids[k][1]}" for k in shown)
        why = (
            f"{self.arch}'s anchor level(s) {', '.join(map(str, shown))} ({cells} cells of its "
            f"{side} px input) matched no object in the batch, so its loss reaches their heads "
            "(and the extra layers feeding only them) only through mined negatives, none of "
            "which were there; they learn from objects those anchors match"
        )
        return excused, why

    @torch.no_grad()
    def matched_levels(self, batch) -> tuple[set[int], list[tuple[int, int]], int]:
        """The SSD levels with an anchor matched to an object of `batch` (images, targets), each
        level's grid, and the side images are resized to: SSD's own transform, backbone,
        anchors and matcher, as its training forward runs them (in eval mode: the matching
        depends on sizes only, and no statistics move)."""
        from torchvision.ops import box_iou

        images, targets = batch
        net, was_training = self.net, self.net.training
        net.eval()
        try:
            image_list, targets = net.transform(list(images), [dict(t) for t in targets])
            features = list(net.backbone(image_list.tensors).values())
            anchors = net.anchor_generator(image_list, features)
        finally:
            net.train(was_training)
        grids = [tuple(f.shape[-2:]) for f in features]
        per_cell = net.anchor_generator.num_anchors_per_location()
        per_level = [h * w * n for (h, w), n in zip(grids, per_cell, strict=True)]
        bounds = torch.tensor(per_level).cumsum(0)
        matched: set[int] = set()
        for anchors_per_image, target in zip(anchors, targets, strict=True):
            if target["boxes"].numel():
                found = net.proposal_matcher(box_iou(target["boxes"], anchors_per_image))
                hit = torch.where(found >= 0)[0].cpu()
                matched |= set(torch.bucketize(hit, bounds, right=True).tolist())
        return matched, grids, int(image_list.tensors.shape[-1])


def build_torchvision_detection(
    spec, cfg: TorchvisionDetectionConfig, *, aux_head: bool = False
) -> TorchvisionDetector:
    import torchvision.models

    if spec.task != "detection" or spec.input_kind != "image_list":
        raise ValueError(
            f"model {cfg.name} needs detection data (input_kind image_list), got task="
            f"{spec.task}, input_kind={spec.input_kind}; use data=coco, data=yolo or "
            "data=shapes_detection"
        )
    arch = check_detection_arch(cfg.arch)
    side = max(spec.image_size)
    kwargs = {"weights": None, "weights_backbone": None, "num_classes": spec.num_classes + 1}
    family = next(
        k.__name__ for k in torchvision_model_class(arch).__mro__ if k.__name__ in FAMILIES
    )
    if family not in FIXED_SIZE_FAMILIES:
        kwargs.update(min_size=side, max_size=side)
    net = torchvision.models.get_model(arch, **kwargs)
    if cfg.frozen_batchnorm:
        freeze_batchnorm(net)
    if cfg.weights is not None:
        if is_weight_file(cfg.weights):
            path = weight_file(cfg.weights)
            label = f"file {path.name}"
        else:
            named = torchvision_weights(arch, cfg.weights)
            path = torchvision_cached_file(named)
            warn_on_hash_mismatch(path)
            label = f"torchvision {named!r}"
        head = FAMILIES[family][1]
        state = read_state_dict(path, "model.weights")
        if not cfg.frozen_batchnorm:  # BatchNorm2d counts its updates; a frozen one does not
            for key, value in net.state_dict().items():
                if key.endswith("num_batches_tracked"):
                    state.setdefault(key, value)
        load_weights(
            net,
            state,
            label=label,
            head=head,
            first_conv=None,
            channels=3,
            num_classes=spec.num_classes + 1,
        )
    if cfg.weights_backbone is not None:
        load_backbone(net, arch, cfg.weights_backbone)
    if cfg.trainable_layers is not None:
        freeze_backbone(net, arch, cfg.trainable_layers)
    return TorchvisionDetector(net, spec.num_classes, arch)


def levels_fed(net: nn.Module, name: str) -> set[int]:
    """The SSD feature levels the parameter `name` (of the wrapper: net.<...>) computes: a
    head's module_list.k feeds level k; the backbone's extra.j every level from its own on
    (extra layers run one after another); anything else (empty set) feeds every level."""
    parts = name.split(".")
    num_levels = len(net.head.classification_head.module_list)
    if parts[1:3] == ["head", "classification_head"] or parts[1:3] == ["head", "regression_head"]:
        return {int(parts[4])}
    if parts[1:3] == ["backbone", "extra"]:
        first = int(parts[3]) + num_levels - len(net.backbone.extra)
        return set(range(first, num_levels))
    return set()


def backbone_kind(net: nn.Module, arch: str) -> str:
    """resnet50 or mobilenet_v3_large: the classification arch of a detector's backbone body."""
    body = getattr(getattr(net, "backbone", None), "body", None)
    if body is not None and hasattr(body, "layer4"):
        return "resnet50"
    if body is not None and any(getattr(b, "_is_cn", False) for b in body.children()):
        return "mobilenet_v3_large"
    raise ConfigError(
        f"model.arch={arch} has no resnet50 or mobilenet_v3_large backbone body",
        "model.weights_backbone / model.trainable_layers",
        "use them with fasterrcnn_*, retinanet_* or fcos_* (or leave them null)",
    )


def load_backbone(net: nn.Module, arch: str, weights: str) -> None:
    """A classification state dict of the backbone's arch (its head dropped) into
    backbone.body: resnet keys as they are, mobilenet's features.N as N."""
    import logging

    kind = backbone_kind(net, arch)
    if is_weight_file(weights):
        path, label = weight_file(weights), f"file {Path(weights).name}"
    else:
        named = torchvision_weights(kind, weights)
        path, label = torchvision_cached_file(named), f"torchvision {named!r}"
    state = read_state_dict(path, "model.weights_backbone")
    own = net.backbone.body.state_dict()
    renamed = {}
    for key, value in state.items():
        inner = key.removeprefix("features.") if kind == "mobilenet_v3_large" else key
        if inner in own:
            renamed[inner] = value
    missing = [k for k in own if k not in renamed and not k.endswith("num_batches_tracked")]
    misshapen = [k for k, v in renamed.items() if v.shape != own[k].shape]
    if missing or misshapen:
        from kiln.models.weights import WeightsError

        shown = ", ".join((misshapen + missing)[:4])
        raise WeightsError(
            f"{label} does not fit the {kind} backbone of {arch} (model.weights_backbone): "
            f"{len(missing)} tensors missing, {len(misshapen)} of another shape, e.g. {shown}: "
            f"use {kind} ImageNet weights"
        )
    net.backbone.body.load_state_dict(renamed, strict=False)
    logging.getLogger(__name__).info(
        "model.weights_backbone: %d tensors of the %s backbone from %s; the rest of %s "
        "(FPN, heads) initialised fresh",
        len(renamed),
        kind,
        label,
        arch,
    )


def freeze_backbone(net: nn.Module, arch: str, trainable: int) -> None:
    """torchvision's trainable_backbone_layers: only the top `trainable` stages of the backbone
    body learn (resnet: layer4, layer3, layer2, layer1, conv1; mobilenet: its stages)."""
    kind = backbone_kind(net, arch)
    body = net.backbone.body
    if kind == "resnet50":
        if trainable > 5:
            raise ConfigError(
                f"resnet50 has 5 stages, got {trainable}", "model.trainable_layers", "choose 0..5"
            )
        learn = ["layer4", "layer3", "layer2", "layer1", "conv1"][:trainable]
        for name, parameter in body.named_parameters():
            if not any(name.startswith(stage) for stage in learn):
                parameter.requires_grad_(False)
        return
    blocks = list(body.children())
    stages = [0] + [i for i, b in enumerate(blocks) if getattr(b, "_is_cn", False)]
    stages.append(len(blocks) - 1)
    if trainable > len(stages):
        raise ConfigError(
            f"mobilenet_v3_large has {len(stages)} stages, got {trainable}",
            "model.trainable_layers",
            f"choose 0..{len(stages)}",
        )
    freeze_before = len(blocks) if trainable == 0 else stages[len(stages) - trainable]
    for block in blocks[:freeze_before]:
        block.requires_grad_(False)
