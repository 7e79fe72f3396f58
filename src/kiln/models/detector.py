"""Object detection: a small anchor-free CenterNet ("Objects as Points", Zhou et al. 2019) made to
train from scratch on a CPU (weights=None: nothing pretrained, nothing downloaded).

Why not torchvision's Faster R-CNN: from scratch, its BatchNorm MobileNet backbone with a batch of
four images and two-stage sampling did not learn on shapes_detection in 12 CPU minutes (mAP@0.5
0.0025). This network is a few conv stages with GroupNorm (batch-size independent), one heatmap
peak per object, no anchors and no NMS, so it learns in minutes and exports to ONNX whole.

    images (3, H_i, W_i) raw pixels in [0, 1], any sizes
      -> each resized to (S, S), S = the data's largest side   (so any sizes share a batch)
      -> backbone (strides 2..16, GroupNorm) + top-down merge to stride 4
      -> heads at stride 4: class heatmap (C), box size (2), centre offset (2)
      -> peaks (3x3 max-pool), top K -> boxes in each image's own pixel coordinates

Calling convention (torchvision's): `model(images, targets)` in train mode returns the loss dict;
`model(images)` in eval mode returns one {"boxes" (K, 4), "labels" (K,), "scores" (K,)} per image,
scores >= score_threshold. Boxes are (x1, y1, x2, y2) pixels; labels are 1..num_classes (0 is the
background, as in torchvision). `detect(x)` is the same network on one (N, 3, H, W) tensor with a
fixed K per image and no threshold: the graph ONNX export and Triton serve."""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kiln.config.model import DetectorConfig
from kiln.models.detection_contract import DetectionContract

STRIDE = 4  # output cells per input pixel side
SIDE_MULTIPLE = 16  # the deepest stage has stride 16: S is rounded up to a multiple of it
PIXEL_MEAN, PIXEL_STD = 0.5, 0.25  # raw [0, 1] pixels -> roughly zero-mean, unit-scale inputs
HEATMAP_PRIOR = 0.1  # initial peak probability: the classic focal-loss bias initialisation
SIZE_LOSS_WEIGHT = 0.1  # box sizes are regressed in output cells (values ~2..20)
GAUSSIAN_SIGMA_PER_SIDE = 1 / 6  # target heatmap sigma as a share of the box side
MIN_SIGMA_CELLS = 0.5
LOSS_KEYS = ("loss_heatmap", "loss_size", "loss_offset")


# ---------------------------------------------------------------------------------------------
# The network


def conv_gn(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    groups = 8 if c_out % 8 == 0 else 1
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False),
        nn.GroupNorm(groups, c_out),
        nn.ReLU(inplace=True),
    )


class Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(conv_gn(channels, channels), conv_gn(channels, channels))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x)


def head(c_in: int, c_out: int, bias: float = 0.0) -> nn.Sequential:
    out = nn.Conv2d(c_in, c_out, 1)
    nn.init.constant_(out.bias, bias)
    return nn.Sequential(nn.Conv2d(c_in, c_in, 3, padding=1), nn.ReLU(inplace=True), out)


class CenterNetBody(nn.Module):
    """(N, 3, S, S) standardised -> heatmap logits (N, C, S/4, S/4), sizes and offsets
    (N, 2, S/4, S/4), both in output cells."""

    def __init__(self, num_classes: int, width: int):
        super().__init__()
        c1, c2, c3 = width, 2 * width, 4 * width
        self.stem = nn.Sequential(conv_gn(3, c1, 2), conv_gn(c1, c1))  # /2
        self.down4 = nn.Sequential(conv_gn(c1, c2, 2), Residual(c2))  # /4
        self.down8 = nn.Sequential(conv_gn(c2, c3, 2), Residual(c3))  # /8
        self.down16 = nn.Sequential(conv_gn(c3, c3, 2), Residual(c3))  # /16: sees whole objects
        self.merge8 = conv_gn(c3, c3)
        self.reduce8 = nn.Conv2d(c3, c2, 1)
        self.merge4 = conv_gn(c2, c2)
        prior_logit = float(torch.logit(torch.tensor(HEATMAP_PRIOR)))
        self.heatmap = head(c2, num_classes, bias=prior_logit)
        self.size = head(c2, 2)
        self.offset = head(c2, 2)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        f4 = self.down4(self.stem(x))
        f8 = self.down8(f4)
        f16 = self.down16(f8)
        p8 = self.merge8(f8 + F.interpolate(f16, scale_factor=2.0, mode="nearest"))
        p4 = self.merge4(f4 + F.interpolate(self.reduce8(p8), scale_factor=2.0, mode="nearest"))
        return self.heatmap(p4), self.size(p4), self.offset(p4)


# ---------------------------------------------------------------------------------------------
# Training targets and losses


def _object_targets(boxes: Tensor, scale_x: float, scale_y: float) -> tuple[Tensor, Tensor]:
    """Boxes (K, 4) in image pixels -> centres (K, 2) and sizes (K, 2) in output cells."""
    scale = torch.tensor([scale_x, scale_y, scale_x, scale_y], device=boxes.device) / STRIDE
    cells = boxes * scale
    centres = (cells[:, :2] + cells[:, 2:]) / 2
    sizes = cells[:, 2:] - cells[:, :2]
    return centres, sizes


def heatmap_target(centres: Tensor, sizes: Tensor, labels: Tensor, shape) -> Tensor:
    """(C, H, W): an elliptical Gaussian per object peaking at 1 on its centre cell."""
    num_classes, height, width = shape
    target = torch.zeros(shape, device=centres.device)
    ys = torch.arange(height, device=centres.device, dtype=torch.float32).view(-1, 1)
    xs = torch.arange(width, device=centres.device, dtype=torch.float32).view(1, -1)
    for (cx, cy), (w, h), label in zip(centres, sizes, labels, strict=True):
        ix, iy = cx.floor().clamp(0, width - 1), cy.floor().clamp(0, height - 1)
        sx = (w * GAUSSIAN_SIGMA_PER_SIDE).clamp(min=MIN_SIGMA_CELLS)
        sy = (h * GAUSSIAN_SIGMA_PER_SIDE).clamp(min=MIN_SIGMA_CELLS)
        blob = torch.exp(-((xs - ix) ** 2) / (2 * sx**2) - ((ys - iy) ** 2) / (2 * sy**2))
        target[label - 1] = torch.maximum(target[label - 1], blob)
    return target


def focal_loss(logits: Tensor, target: Tensor) -> Tensor:
    """CenterNet's penalty-reduced focal loss, summed and divided by the number of peaks."""
    prob = logits.sigmoid()
    peaks = target.eq(1.0).float()
    positive = F.logsigmoid(logits) * (1 - prob) ** 2 * peaks
    negative = F.logsigmoid(-logits) * prob**2 * (1 - target) ** 4 * (1 - peaks)
    return -(positive.sum() + negative.sum()) / peaks.sum().clamp(min=1.0)


# ---------------------------------------------------------------------------------------------
# The model


class KilnDetector(DetectionContract, nn.Module):
    """CenterNet that computes its own loss in train mode (the engine skips its criterion); its
    output contract (rule 3) is kiln.models.detection_contract's."""

    loss_keys = LOSS_KEYS

    def __init__(self, num_classes: int, side: int, cfg: DetectorConfig):
        super().__init__()
        self.num_classes = num_classes  # object classes, background excluded
        self.side = side  # every image is resized to (side, side)
        self.score_threshold = cfg.score_threshold
        self.max_detections = cfg.max_detections
        self.body = CenterNetBody(num_classes, cfg.width)

    # --- shared by training, eval and export ---------------------------------------------------

    def _resized(self, images: list[Tensor]) -> Tensor:
        """Raw images of any sizes -> one standardised (N, 3, S, S) batch."""
        resized = [
            F.interpolate(image[None], size=(self.side, self.side), mode="bilinear")
            for image in images
        ]
        return (torch.cat(resized) - PIXEL_MEAN) / PIXEL_STD

    def _decode(
        self, heatmap: Tensor, size: Tensor, offset: Tensor, heights: Tensor, widths: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Top-K peaks -> boxes (N, K, 4) in each image's pixels, scores (N, K), labels (N, K)."""
        n, classes, height, width = heatmap.shape
        prob = heatmap.sigmoid()
        # A peak is a cell no neighbour outscores: CenterNet's replacement for NMS.
        peaks = prob * (F.max_pool2d(prob, 3, stride=1, padding=1) == prob).float()
        k = self.detections_per_image
        scores, index = peaks.reshape(n, -1).topk(k, dim=1)
        labels = torch.div(index, height * width, rounding_mode="floor") + 1
        cell = index % (height * width)
        ys = torch.div(cell, width, rounding_mode="floor").float()
        xs = (cell % width).float()
        gather = cell.unsqueeze(1).expand(n, 2, k)
        box_w, box_h = size.reshape(n, 2, -1).gather(2, gather).unbind(1)
        off_x, off_y = offset.reshape(n, 2, -1).gather(2, gather).unbind(1)
        cx, cy = xs + off_x, ys + off_y
        # Output cells -> resized pixels -> each image's own pixels.
        scale_x = (STRIDE * widths / self.side).view(n, 1)
        scale_y = (STRIDE * heights / self.side).view(n, 1)
        max_x, max_y = widths.view(n, 1), heights.view(n, 1)
        boxes = torch.stack(
            [
                torch.minimum(((cx - box_w / 2) * scale_x).clamp(min=0), max_x),
                torch.minimum(((cy - box_h / 2) * scale_y).clamp(min=0), max_y),
                torch.minimum(((cx + box_w / 2) * scale_x).clamp(min=0), max_x),
                torch.minimum(((cy + box_h / 2) * scale_y).clamp(min=0), max_y),
            ],
            dim=2,
        )
        return boxes, scores, labels

    def detect(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(N, 3, H, W) raw pixels, one size -> boxes (N, K, 4), scores (N, K), labels (N, K),
        highest score first, K = max_detections, no threshold. What ONNX export runs."""
        n, _, height, width = x.shape
        resized = F.interpolate(x, size=(self.side, self.side), mode="bilinear")
        heatmap, size, offset = self.body((resized - PIXEL_MEAN) / PIXEL_STD)
        heights = torch.full((n,), height, dtype=torch.float32, device=x.device)
        widths = torch.full((n,), width, dtype=torch.float32, device=x.device)
        return self._decode(heatmap, size, offset, heights, widths)

    @property
    def detections_per_image(self) -> int:
        """K of `detect`: from the fixed side, not a map's shape, so an exported graph keeps it
        constant."""
        return min(self.max_detections, self.num_classes * (self.side // STRIDE) ** 2)

    # --- the engine's calling convention --------------------------------------------------------

    def forward(self, images: list[Tensor], targets: list[dict[str, Tensor]] | None = None):
        """Train mode: dict of three 0-d losses. Eval mode: list of {"boxes", "labels",
        "scores"}; targets are not used in eval mode."""
        if self.training:
            if targets is None:
                raise ValueError("KilnDetector in train mode needs targets: model(images, targets)")
            return self._losses(images, targets)
        return self._detections(images)

    def _losses(self, images: list[Tensor], targets: list[dict[str, Tensor]]) -> dict:
        heatmap, size, offset = self.body(self._resized(images))
        n, classes, height, width = heatmap.shape
        wanted = torch.zeros_like(heatmap)
        rows, cells, size_wanted, offset_wanted = [], [], [], []
        for i, (image, target) in enumerate(zip(images, targets, strict=True)):
            scale_x, scale_y = self.side / image.shape[2], self.side / image.shape[1]
            centres, sizes = _object_targets(target["boxes"], scale_x, scale_y)
            wanted[i] = heatmap_target(centres, sizes, target["labels"], (classes, height, width))
            ix = centres[:, 0].floor().clamp(0, width - 1)
            iy = centres[:, 1].floor().clamp(0, height - 1)
            rows.append(torch.full_like(ix, i, dtype=torch.long))
            cells.append((iy * width + ix).long())
            size_wanted.append(sizes)
            offset_wanted.append(centres - torch.stack([ix, iy], dim=1))
        row, cell = torch.cat(rows), torch.cat(cells)
        num_objects = max(len(row), 1)

        def at_centres(map_: Tensor) -> Tensor:  # (N, 2, H, W) -> (objects, 2)
            return map_.reshape(n, 2, -1)[row, :, cell]

        size_error = (at_centres(size) - torch.cat(size_wanted)).abs().sum() / num_objects
        offset_error = (at_centres(offset) - torch.cat(offset_wanted)).abs().sum() / num_objects
        return {
            "loss_heatmap": focal_loss(heatmap, wanted),
            "loss_size": SIZE_LOSS_WEIGHT * size_error,
            "loss_offset": offset_error,
        }

    def _detections(self, images: list[Tensor]) -> list[dict[str, Tensor]]:
        if not images:
            return []
        heatmap, size, offset = self.body(self._resized(images))
        heights = torch.tensor([float(im.shape[1]) for im in images], device=heatmap.device)
        widths = torch.tensor([float(im.shape[2]) for im in images], device=heatmap.device)
        boxes, scores, labels = self._decode(heatmap, size, offset, heights, widths)
        keep = scores >= self.score_threshold
        return [
            {"boxes": boxes[i][keep[i]], "labels": labels[i][keep[i]], "scores": scores[i][keep[i]]}
            for i in range(len(images))
        ]


def input_side(spec) -> int:
    """The side every image is resized to: the data's largest side, a multiple of 16."""
    largest = max(spec.image_size)
    return max(SIDE_MULTIPLE, -(-largest // SIDE_MULTIPLE) * SIDE_MULTIPLE)


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
    return KilnDetector(spec.num_classes, input_side(spec), cfg)
