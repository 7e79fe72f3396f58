"""kiln.inference.box_agreement: two runs of a detector matched box for box -- twins by label,
score and place; near-tied scores that NMS or the top-k decide by numeric noise as ties; a
comparison over no box refused; a box moved on one side a mismatch, also among ties."""

from __future__ import annotations

import numpy as np

from kiln.inference.box_agreement import match_image, match_images


def found(*boxes):
    """(x1, y1, x2, y2, score, label) rows -> a detections dict."""
    rows = np.asarray(boxes, dtype=np.float64).reshape(-1, 6)
    return {"boxes": rows[:, :4], "scores": rows[:, 4], "labels": rows[:, 5].astype(int)}


TRAINED = found((10, 10, 50, 60, 0.91, 1), (60, 5, 90, 40, 0.72, 2), (0, 0, 20, 20, 0.40, 1))


def test_the_same_boxes_in_another_order_all_match_and_are_counted():
    shuffled = {k: v[::-1] for k, v in TRAINED.items()}
    agreement = match_images([TRAINED, found()], [shuffled, found()])
    assert agreement.problem() is None
    assert (agreement.matched, agreement.boxes, agreement.images_with_boxes) == (3, 3, 1)
    assert agreement.summary().startswith("3 of 3 torch boxes matched on 1 of 2 images")


def test_a_comparison_over_no_box_is_refused():
    agreement = match_images([found(), found()], [found(), found()])
    assert agreement.problem().startswith("compared no box")


def test_a_moved_box_is_a_mismatch_named_with_its_image():
    moved = found((10, 10, 50, 60, 0.91, 1), (62, 5, 92, 40, 0.72, 2), (0, 0, 20, 20, 0.40, 1))
    agreement = match_images([TRAINED, TRAINED], [TRAINED, moved])
    assert agreement.mismatched == 2  # the box on each side without its twin
    assert "image 1: torch's box (60.0, 5.0, 90.0, 40.0) of label 2" in agreement.problem()


def test_near_tied_scores_kept_in_another_order_are_a_tie():
    """An untrained model's crowded scores: the top-k keeps the last box of one run and a
    box scoring 2e-6 less in the other (and NMS then keeps a box the first one suppressed)."""
    common = [(i * 10, 0, i * 10 + 8, 8, 0.153 - i * 1e-3, 1) for i in range(4)]
    first = found(*common, (50, 50, 70, 70, 0.1500020, 2), (52, 50, 72, 70, 0.1200, 2))
    second = found(*common, (0, 50, 20, 70, 0.1500000, 1), (55, 52, 75, 72, 0.1100, 2))
    agreement = match_image(first, second)
    assert agreement.problem() is None, agreement.problem()
    assert (agreement.matched, agreement.tied, agreement.mismatched) == (4, 4, 0)
    assert "4 near-tied left out" in agreement.summary()


def test_every_box_of_an_image_moved_is_no_tie_even_when_scores_are_close():
    """A graph that sizes one image a pixel off moves all its boxes: twins' scores stay within
    the tolerance of each other, which alone would read as ties."""
    boxes = [(i * 10, 0, i * 10 + 8, 8, 0.5 + i * 1e-5, 1) for i in range(4)]
    shifted = [(x1 + 0.4, y1, x2 + 0.4, y2, s, c) for x1, y1, x2, y2, s, c in boxes]
    problem = match_image(found(*boxes), found(*shifted)).problem()
    assert problem is not None and "image 0: 8 of its 8 boxes near-tied" in problem
