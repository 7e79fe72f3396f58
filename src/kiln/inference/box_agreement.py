"""Two runs of a detector on the same images, box for box: torch against its ONNX graph (the
export's parity check), `predict` against the server or another backend (the agreement tests).

Boxes are matched, never compared by rank. A box of one side and one of the other are twins
when they have the same label, scores within SCORE_TOLERANCE and an IoU of at least MIN_BOX_IOU
(a box of zero area, cut to the image's edge, has no IoU: the same corners within
BOX_TOLERANCE_PX match). A box left without a twin is a tie, not a mismatch, when its fate was
decided between near-equal scores: another box of its image, on its own side, scores within
SCORE_TOLERANCE of it -- which of such boxes NMS or the top-k keeps depends on numeric noise
(an untrained model's scores crowd 0.147-0.153) -- or it overlaps a tied box of its label enough
to have been suppressed by it (SUPPRESSION_IOU). Any other box without a twin is a mismatch: a
box moved on one side, whose twin scores the same on the other, is one (its own side has no
near-equal score), and an image most of whose boxes are tied is one too (MAX_TIED_SHARE). A
comparison over no box at all proves nothing, and is said to (`problem`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

SCORE_TOLERANCE = 1e-4  # twins' scores differ by at most this; closer scores are a tie
MIN_BOX_IOU = 0.99  # a box and its twin
BOX_TOLERANCE_PX = 1e-2  # the same corners (boxes of zero area, which have no IoU)
# Below the NMS IoU threshold of every detector kiln runs (torchvision's 0.45-0.7, kiln's 0.5):
# a box overlapping a tied one this much may have been suppressed by it on one side only.
SUPPRESSION_IOU = 0.4
# Ties are the exception: more boxes than this share left out as tied, over all images or in
# one image of at least MIN_BOXES_FOR_SHARE boxes, is a disagreement (a graph that moves every
# box of an image, or whose scores are all alike, would otherwise pass as one big tie).
MAX_TIED_SHARE = 0.5
MIN_BOXES_FOR_SHARE = 4


@dataclass
class BoxAgreement:
    """How the boxes of two runs (`first`: the reference, torch; `second`: the other) met."""

    first: str = "torch"
    second: str = "ONNX Runtime"
    images: int = 0
    images_with_boxes: int = 0  # images where either side found a box
    boxes: int = 0  # the first side's
    second_boxes: int = 0
    matched: int = 0  # pairs of twins
    tied: int = 0  # boxes (either side) without a twin, near-tied
    mismatched: int = 0  # boxes (either side) without a twin, not tied
    min_iou: float = 1.0  # over the twins
    max_score_diff: float = 0.0
    max_corner_px: float = 0.0
    example: str = ""  # the first mismatch: which image, which box
    most_tied: str = ""  # an image of MIN_BOXES_FOR_SHARE boxes or more, most of them tied

    def add(self, other: BoxAgreement) -> BoxAgreement:
        """Both comparisons as one (the images of one, then the other's)."""
        example = self.example or (
            other.example.replace("image 0", f"image {self.images}", 1) if other.example else ""
        )
        return BoxAgreement(
            self.first,
            self.second,
            self.images + other.images,
            self.images_with_boxes + other.images_with_boxes,
            self.boxes + other.boxes,
            self.second_boxes + other.second_boxes,
            self.matched + other.matched,
            self.tied + other.tied,
            self.mismatched + other.mismatched,
            min(self.min_iou, other.min_iou),
            max(self.max_score_diff, other.max_score_diff),
            max(self.max_corner_px, other.max_corner_px),
            example,
            self.most_tied or other.most_tied.replace("image 0", f"image {self.images}", 1),
        )

    def summary(self) -> str:
        """'12 of 12 boxes matched on 5 of 6 images (min IoU 0.9999, max |dscore| 2.1e-06)'."""
        tied = f"; {self.tied} near-tied left out" if self.tied else ""
        twins = (
            f" (min IoU {self.min_iou:.4f}, max |dscore| {self.max_score_diff:.1e})"
            if self.matched
            else ""
        )
        return (
            f"{self.matched} of {self.boxes} {self.first} boxes matched on "
            f"{self.images_with_boxes} of {self.images} images{twins}{tied}"
        )

    def problem(self, max_corner_px: float | None = None) -> str | None:
        """Why the two runs do not agree (None: they do)."""
        if not self.boxes and not self.second_boxes:
            return (
                f"compared no box: neither {self.first} nor {self.second} found one on the "
                f"{self.images} image(s) checked, so nothing was compared"
            )
        if self.mismatched:
            return (
                f"{self.mismatched} box(es) without a twin of their label, score (within "
                f"{SCORE_TOLERANCE:g}) and place (IoU >= {MIN_BOX_IOU:g}) on the other side "
                f"({self.summary()}), e.g. {self.example}"
            )
        if self.tied > MAX_TIED_SHARE * (self.boxes + self.second_boxes) or self.most_tied:
            where = f"{self.most_tied}; " if self.most_tied else ""
            return (
                f"{where}{self.tied} of {self.boxes + self.second_boxes} boxes have no twin and "
                f"are near-tied: more than {MAX_TIED_SHARE:.0%} are no ties ({self.summary()})"
            )
        if max_corner_px is not None and self.max_corner_px > max_corner_px:
            return (
                f"box corners differ by up to {self.max_corner_px:.3g} px > {max_corner_px:g} "
                f"({self.summary()})"
            )
        return None


Found = Mapping[str, np.ndarray]  # boxes (K, 4), scores (K,), labels (K,)


def _as_arrays(found: Found) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    boxes = np.asarray(found["boxes"], dtype=np.float64).reshape(-1, 4)
    scores = np.asarray(found["scores"], dtype=np.float64).reshape(-1)
    labels = np.asarray(found["labels"]).reshape(-1)
    return boxes, scores, labels


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(len(a), len(b)) IoU; boxes with the same corners (within BOX_TOLERANCE_PX) count 1."""
    top_left = np.maximum(a[:, None, :2], b[None, :, :2])
    bottom_right = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(bottom_right - top_left, 0, None).prod(axis=2)
    area_a = (a[:, 2:] - a[:, :2]).clip(0).prod(axis=1)
    area_b = (b[:, 2:] - b[:, :2]).clip(0).prod(axis=1)
    union = area_a[:, None] + area_b[None, :] - inter
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where(union > 0, inter / union, 0.0)
    same = np.abs(a[:, None, :] - b[None, :, :]).max(axis=2, initial=0.0) <= BOX_TOLERANCE_PX
    return np.where(same, 1.0, iou)


def match_image(first: Found, second: Found, names: tuple[str, str] = ("torch", "ONNX Runtime")):
    """One image's boxes, matched (module docstring)."""
    a_boxes, a_scores, a_labels = _as_arrays(first)
    b_boxes, b_scores, b_labels = _as_arrays(second)
    agreement = BoxAgreement(*names, images=1, boxes=len(a_boxes), second_boxes=len(b_boxes))
    agreement.images_with_boxes = int(bool(len(a_boxes) or len(b_boxes)))
    iou = box_iou(a_boxes, b_boxes)
    score_diff = np.abs(a_scores[:, None] - b_scores[None, :])
    twins = (a_labels[:, None] == b_labels[None, :]) & (score_diff <= SCORE_TOLERANCE)
    twins &= iou >= MIN_BOX_IOU
    a_free, b_free = np.ones(len(a_boxes), bool), np.ones(len(b_boxes), bool)
    for i, j in sorted(zip(*np.nonzero(twins), strict=True), key=lambda ij: -iou[ij]):
        if a_free[i] and b_free[j]:
            a_free[i] = b_free[j] = False
            agreement.matched += 1
            agreement.min_iou = min(agreement.min_iou, float(iou[i, j]))
            agreement.max_score_diff = max(agreement.max_score_diff, float(score_diff[i, j]))
            corners = float(np.abs(a_boxes[i] - b_boxes[j]).max())
            agreement.max_corner_px = max(agreement.max_corner_px, corners)
    # Every box of the image on one list, the first side's first
    boxes = np.concatenate([a_boxes, b_boxes])
    scores = np.concatenate([a_scores, b_scores])
    labels = np.concatenate([a_labels, b_labels])
    free = np.concatenate([a_free, b_free])
    side = np.arange(len(boxes)) < len(a_boxes)
    near = np.abs(scores[:, None] - scores[None, :]) <= SCORE_TOLERANCE
    near &= side[:, None] == side[None, :]  # on its own side: a moved twin is no tie
    np.fill_diagonal(near, False)
    tied = free & near.any(axis=1)
    overlaps = (box_iou(boxes, boxes) >= SUPPRESSION_IOU) & (labels[:, None] == labels[None, :])
    while True:  # a box a tied box may have suppressed on one side only is tied too
        more = free & ~tied & (overlaps & tied[None, :]).any(axis=1)
        if not more.any():
            break
        tied |= more
    agreement.tied = int(tied.sum())
    if len(boxes) >= MIN_BOXES_FOR_SHARE and agreement.tied > MAX_TIED_SHARE * len(boxes):
        agreement.most_tied = f"image 0: {agreement.tied} of its {len(boxes)} boxes near-tied"
    mismatched = free & ~tied
    agreement.mismatched = int(mismatched.sum())
    if agreement.mismatched:
        k = int(np.nonzero(mismatched)[0][0])
        side = names[0] if k < len(a_boxes) else names[1]
        box = ", ".join(f"{v:.1f}" for v in boxes[k])
        agreement.example = (
            f"image 0: {side}'s box ({box}) of label {labels[k]} scoring {scores[k]:.4f}"
        )
    return agreement


def match_images(
    first: Sequence[Found],
    second: Sequence[Found],
    names: tuple[str, str] = ("torch", "ONNX Runtime"),
) -> BoxAgreement:
    """Image by image (the same images, in the same order, on both sides)."""
    if len(first) != len(second):
        raise ValueError(f"{len(first)} images against {len(second)}")
    total = BoxAgreement(*names)
    for a, b in zip(first, second, strict=True):
        total = total.add(match_image(a, b, names))
    return total


__all__ = ["MIN_BOX_IOU", "SCORE_TOLERANCE", "BoxAgreement", "match_image", "match_images"]
