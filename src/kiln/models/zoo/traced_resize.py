"""A torchvision detector's resize, traced for ONNX, sized as eager torch sizes it.

Eager torchvision resizes an image by scale = min(min_size / short side, max_size / long side)
in Python floats, and F.interpolate (recompute_scale_factor) floors side * scale in float64.
Its traced path computes that product in float32, where 122 * (96 / 122) is 95.99999 -> 95: the
ONNX graph then resizes such an image a pixel shorter than torch does and every box of it moves
(IoU 0.94 on a 96-px detector). `ExactTracedResize.resize`, under tracing only, computes the
size in float64 as eager does and hands interpolate one scale whose float32 product with each
side floors to exactly that size. Eager calls run torchvision's own code.

Imported when a torchvision detector is built (it imports torchvision)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.onnx.operators import shape_as_tensor
from torchvision.models.detection.transform import GeneralizedRCNNTransform


class ExactTracedResize(GeneralizedRCNNTransform):
    def resize(self, image: Tensor, target=None):
        if not torch.jit.is_tracing() or target is not None or self.fixed_size is not None:
            return super().resize(image, target)
        # eager's min(min_size / short side, max_size / long side) in float64, on 1-d tensors
        # throughout (the exporter computes 0-d tensors and Python numbers in float32)
        sides = shape_as_tensor(image)[-2:].to(torch.float64)
        limits = torch.tensor([self.min_size[-1], self.max_size], dtype=torch.float64)
        short_long = torch.cat([sides.amin(0, keepdim=True), sides.amax(0, keepdim=True)])
        scale = (limits / short_long).amin(0, keepdim=True)
        size = torch.floor(sides * scale)
        # One scale whose float32 product with each side floors to that size: the larger
        # size/side ratio, nudged up past float32's rounding. The graph then resizes to those
        # sizes (recompute_scale_factor), sampling as eager torch does.
        landing = ((size / sides).amax(0, keepdim=True) * (1 + 1e-6)).to(torch.float32)[0]
        resized = nn.functional.interpolate(
            image[None],
            scale_factor=landing,  # a traced tensor, as torchvision's own traced path passes
            mode="bilinear",
            align_corners=False,
            recompute_scale_factor=True,
        )
        return resized[0], target


def traced_resize_as_eager(transform: nn.Module) -> None:
    """Give a torchvision detector's GeneralizedRCNNTransform the traced resize above: its class
    only (no state, no parameters change; a subclass of the same module keeps its pickling)."""
    if type(transform) is GeneralizedRCNNTransform:
        transform.__class__ = ExactTracedResize
