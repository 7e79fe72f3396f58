"""Object detection: torchvision's Faster R-CNN with a MobileNetV3-Large FPN backbone (weights=None,
nothing downloaded), sized from the data spec so it stays quick on a CPU.

Calling convention (torchvision's): `model(images, targets)` in train mode returns the loss dict;
`model(images)` in eval mode returns one detection dict per image. `images` is a list of
(3, H_i, W_i) tensors in [0, 1], sizes may differ; targets hold "boxes" (K, 4) as (x1, y1, x2, y2)
pixels and "labels" (K,) in 1..num_classes (0 is the background)."""

from __future__ import annotations

import warnings
from typing import Any

from torch import Tensor, nn
from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_320_fpn
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead

from kiln.config.model import DetectorConfig

# Images are resized to at least this side: below it MobileNet's stride-32 features shrink to
# 1x1, and BatchNorm cannot train on a batch of one image.
MIN_RESIZE_SIDE = 64
LOSS_KEYS = ("loss_classifier", "loss_box_reg", "loss_objectness", "loss_rpn_box_reg")
DETECTION_SHAPES = {"boxes": ("K", 4), "labels": ("K",), "scores": ("K",)}
ANCHOR_ASPECT_RATIOS = (0.5, 1.0, 2.0)
ANCHOR_SCALES = (1 / 8, 1 / 4, 1 / 2, 1, 2)  # anchor sides as a share of the image side
# CPU-sized training: torchvision's defaults (2000 proposals, 512 sampled RoIs per image, a
# 1024-wide box head) are made for COCO; a few objects per small image need far fewer, and a
# training step gets several times faster.
PROPOSALS_PER_IMAGE_TRAIN = 500
ROIS_PER_IMAGE_TRAIN = 128
BOX_HEAD_WIDTH = 256


def _format_shape(shape) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _shape_mismatch(path: str, value: Any, expected: tuple, bound: dict[str, int]) -> str | None:
    """Compares a tensor's shape with `expected`, whose str entries are symbolic sizes that must
    agree across calls sharing `bound` (e.g. K: the same number of boxes, labels and scores)."""
    if not isinstance(value, Tensor):
        wanted = _format_shape(expected)
        return f"{path}: expected a tensor of shape {wanted}, got {type(value).__name__}"
    got = tuple(value.shape)
    fits = len(got) == len(expected)
    for want, size in zip(expected, got, strict=False):
        if isinstance(want, str):
            fits = fits and bound.setdefault(want, size) == size
        else:
            fits = fits and want == size
    if fits:
        return None
    return f"{path}: expected {_format_shape(expected)}, got {_format_shape(got)}"


class KilnDetector(nn.Module):
    """Faster R-CNN that computes its own loss in train mode (the engine skips its criterion)."""

    computes_own_loss = True

    def __init__(self, net: nn.Module, num_classes: int):
        super().__init__()
        self.net = net
        self.num_classes = num_classes  # object classes, background excluded

    def forward(self, images: list[Tensor], targets: list[dict[str, Tensor]] | None = None):
        """Train mode: dict of four 0-d losses. Eval mode: list of {"boxes", "labels", "scores"};
        targets are not used in eval mode (torchvision computes no loss there)."""
        if self.training:
            if targets is None:
                raise ValueError("KilnDetector in train mode needs targets: model(images, targets)")
            return self.net(images, targets)
        return self.net(images)

    def output_contract(self, mode: str) -> dict[str, Any]:
        """What forward returns in `mode` ("train" or "eval"), as plain data."""
        if mode == "train":
            return {"type": "dict", "keys": {key: () for key in LOSS_KEYS}}
        if mode == "eval":
            return {"type": "list", "length": "batch", "item": dict(DETECTION_SHAPES)}
        raise ValueError(f"mode must be 'train' or 'eval', got {mode!r}")

    def check_output(self, mode: str, output: Any, batch_size: int | None = None) -> list[str]:
        """Mismatches between `output` and `output_contract(mode)`, one readable line each with
        its path inside the output; an empty list when the output is fine."""
        contract = self.output_contract(mode)
        if mode == "train":
            return self._check_losses(output, contract["keys"])
        return self._check_detections(output, contract["item"], batch_size)

    @staticmethod
    def _check_losses(output: Any, expected: dict[str, tuple]) -> list[str]:
        if not isinstance(output, dict):
            return [f"output: expected a dict of losses, got {type(output).__name__}"]
        problems = []
        missing = [key for key in expected if key not in output]
        unexpected = [key for key in output if key not in expected]
        if missing:
            problems.append(f"output: missing keys {missing}; got {sorted(output)}")
        if unexpected:
            problems.append(f"output: unexpected keys {unexpected}")
        for key in expected:
            if key in output:
                problem = _shape_mismatch(f"output[{key!r}]", output[key], expected[key], {})
                problems += [problem] if problem else []
                if problem is None and not output[key].is_floating_point():
                    problems.append(
                        f"output[{key!r}]: expected a float loss, got {output[key].dtype}"
                    )
        return problems

    def _check_detections(
        self, output: Any, expected: dict[str, tuple], batch_size: int | None
    ) -> list[str]:
        if not isinstance(output, list | tuple):
            return [f"output: expected a list of detection dicts, got {type(output).__name__}"]
        problems = []
        if batch_size is not None and len(output) != batch_size:
            problems.append(
                f"output: expected {batch_size} detection dicts (one per image), got {len(output)}"
            )
        for i, item in enumerate(output):
            if not isinstance(item, dict):
                problems.append(f"output[{i}]: expected a dict, got {type(item).__name__}")
                continue
            bound: dict[str, int] = {}  # K: boxes, labels and scores agree within one image
            for key, shape in expected.items():
                if key not in item:
                    problems.append(f"output[{i}]: missing key {key!r}; got {sorted(item)}")
                    continue
                problem = _shape_mismatch(f"output[{i}][{key!r}]", item[key], shape, bound)
                problems += [problem] if problem else []
            labels = item.get("labels")
            if (
                isinstance(labels, Tensor)
                and labels.numel()
                and (labels.min() < 1 or labels.max() > self.num_classes)
            ):
                problems.append(
                    f"output[{i}]['labels']: expected values in 1..{self.num_classes}, "
                    f"got {labels.min().item()}..{labels.max().item()}"
                )
        return problems


def _resize_side(spec) -> int:
    # Resize so the longer side is the data's largest side: images keep their own resolution.
    return max(max(spec.image_size), MIN_RESIZE_SIDE)


def build_detector(spec, cfg: DetectorConfig, *, aux_head: bool = False) -> KilnDetector:
    """aux_head is accepted for a uniform builder signature and ignored (no classifier head)."""
    if aux_head:
        warnings.warn(
            "model detector has no auxiliary head; aux_head=True is ignored", stacklevel=2
        )
    if spec.task != "detection" or spec.input_kind != "image_list":
        raise ValueError(
            f"model detector needs detection data (input_kind image_list), got task={spec.task}, "
            f"input_kind={spec.input_kind}; use data=shapes_detection"
        )
    if spec.channels != 3:
        raise ValueError(f"model detector needs 3-channel images, got channels={spec.channels}")
    side = _resize_side(spec)
    net = fasterrcnn_mobilenet_v3_large_320_fpn(
        weights=None,
        weights_backbone=None,
        num_classes=spec.num_classes + 1,  # + background
        min_size=side,
        max_size=side,
        rpn_pre_nms_top_n_train=PROPOSALS_PER_IMAGE_TRAIN,
        rpn_post_nms_top_n_train=PROPOSALS_PER_IMAGE_TRAIN,
        box_batch_size_per_image=ROIS_PER_IMAGE_TRAIN,
    )
    # torchvision's anchors (32..512 px) suit 320-800 px images; scale them to this data's images.
    # Same count per location (5 sizes x 3 ratios), so the RPN head still fits.
    num_levels = len(net.rpn.anchor_generator.sizes)
    sizes = tuple(max(1, round(side * s)) for s in ANCHOR_SCALES)
    net.rpn.anchor_generator = AnchorGenerator(
        (sizes,) * num_levels, (ANCHOR_ASPECT_RATIOS,) * num_levels
    )
    pooled = net.roi_heads.box_roi_pool.output_size  # e.g. [7, 7]
    head_inputs = net.backbone.out_channels * pooled[0] * pooled[1]
    net.roi_heads.box_head = TwoMLPHead(head_inputs, BOX_HEAD_WIDTH)
    net.roi_heads.box_predictor = FastRCNNPredictor(BOX_HEAD_WIDTH, spec.num_classes + 1)
    return KilnDetector(net, spec.num_classes)
