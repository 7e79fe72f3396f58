"""A detector of your own: one box per image, from pooled features. Inheriting DetectionContract
and setting `loss_keys` and `num_classes` is the whole declaration: the engine calls it with
targets in train mode and sums its losses, the checks before step 1 hold it to the contract
(rule 3: eval-mode outputs with and without grad; rule 1 on the data's extreme images), the
evaluator scores its boxes with COCO's mAP, and `infer.py mode=export` exports its eval forward
to ONNX (one image of any size per call) when it traces.

cd examples/detection_plugin
python ../../train.py 'plugins=[box_csv,tiny_detector]' data=box_csv model=tiny_detector
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from kiln.config.model import ModelConfig
from kiln.models.detection_contract import DetectionContract
from kiln.registry import register_config_dir, register_model

register_config_dir(Path(__file__).parent / "conf")  # where model=tiny_detector's YAML is


@dataclass(frozen=True, kw_only=True)
class TinyDetectorConfig(ModelConfig):
    width: int = 16  # channels of the convolutions


class TinyDetector(DetectionContract, nn.Module):
    loss_keys = ("loss_box", "loss_class")

    def __init__(self, num_classes: int, width: int):
        super().__init__()
        self.num_classes = num_classes  # object classes; labels 1..num_classes
        self.body = nn.Sequential(
            nn.Conv2d(3, width, 3, stride=2, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, stride=2, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )  # fmt: skip
        self.box = nn.Linear(width, 4)  # (cx, cy, w, h) as shares of the image's sides
        self.classes = nn.Linear(width, num_classes + 1)  # 0: no object

    def heads(self, image):  # (3, H, W) in [0, 1] -> box shares (4,), class logits (C + 1,)
        features = self.body(image[None])[0]
        return self.box(features).sigmoid(), self.classes(features)

    def forward(self, images, targets=None):
        if self.training:
            box_losses, class_losses = [], []
            for image, target in zip(images, targets, strict=True):
                shares, logits = self.heads(image)
                height, width = image.shape[1:]
                scale = image.new_tensor([width, height, width, height])
                if len(target["boxes"]):  # learn the image's first box and its class
                    x1, y1, x2, y2 = target["boxes"][0] / scale
                    wanted = torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1])
                    box_losses.append((shares - wanted).abs().sum())
                    label = target["labels"][0]
                else:  # no box: nothing to place, and no object
                    box_losses.append(shares.sum() * 0)
                    label = torch.zeros((), dtype=torch.long, device=image.device)
                class_losses.append(nn.functional.cross_entropy(logits, label))
            return {"loss_box": torch.stack(box_losses).mean(),
                    "loss_class": torch.stack(class_losses).mean()}  # fmt: skip
        found = []
        for image in images:
            shares, logits = self.heads(image)
            height, width = image.shape[1:]
            cx, cy, w, h = shares
            box = torch.stack([(cx - w / 2) * width, (cy - h / 2) * height,
                               (cx + w / 2) * width, (cy + h / 2) * height])  # fmt: skip
            score, label = logits.softmax(-1)[1:].max(-1)  # the best object class
            found.append({"boxes": box[None], "labels": (label + 1)[None], "scores": score[None]})
        return found


@register_model("tiny_detector", config=TinyDetectorConfig, inputs=("image_list",))
def build_tiny_detector(spec, cfg, *, aux_head=False):
    return TinyDetector(spec.num_classes, cfg.width)
