"""What a detector declares about its outputs (rule 3), as torchvision's detection models behave:

    train mode, model(images, targets) -> {loss name: 0-d float tensor}   (summed by the engine)
    eval mode,  model(images)          -> one {"boxes" (K, 4), "labels" (K,), "scores" (K,)}
                                          per image, K per image, labels in 1..num_classes

A model gets this contract by inheriting `DetectionContract` and setting `loss_keys` (the loss
names it returns) and `num_classes` (object classes, background excluded): the engine then
calls it with targets in train mode and sums its losses (`computes_own_loss`), rule 3 checks
each mode's output against the contract instead of comparing the two modes' structures, and
the evaluators read its boxes. kiln's detector (model=detector), torchvision's
(model=torchvision_detection) and a plugin's detector declare it the same way."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor

DETECTION_SHAPES = {"boxes": ("K", 4), "labels": ("K",), "scores": ("K",)}


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


class DetectionContract:
    """Mixin for an nn.Module detector: set `loss_keys` and `num_classes`."""

    computes_own_loss: ClassVar[bool] = True  # the engine sums the train-mode loss dict
    loss_keys: tuple[str, ...] = ()
    num_classes: int

    def output_contract(self, mode: str) -> dict[str, Any]:
        """What forward returns in `mode` ("train" or "eval"), as plain data."""
        if mode == "train":
            return {"type": "dict", "keys": {key: () for key in self.loss_keys}}
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
