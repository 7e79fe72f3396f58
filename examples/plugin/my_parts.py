"""A model of your own, outside src/kiln: one file (and conf/model/tiny.yaml for its values).

cd examples/plugin
python ../../train.py plugins=[my_parts] model=tiny
"""

import math
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from kiln.config.model import ClassifierConfig
from kiln.registry import register_config_dir, register_model

register_config_dir(Path(__file__).parent / "conf")  # where model=tiny's YAML is


@dataclass(frozen=True, kw_only=True)
class TinyConfig(ClassifierConfig):
    """Flatten -> Linear -> ReLU -> Linear."""

    width: int = 32  # hidden width (the comment is the key's meaning in --help)


class Tiny(nn.Module):
    def __init__(self, features: int, width: int, classes: int, aux_head: bool):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(features, width), nn.ReLU())
        self.head = nn.Linear(width, classes)
        # loss.aux_head=true (or loss.force_all_branches=true, as the tests run) asks for an
        # auxiliary head, trained by its own loss term: build it only when asked (rule 2).
        self.aux = nn.Linear(width, classes) if aux_head else None

    def forward(self, x):
        h = self.body(x)
        if self.aux is None:
            return self.head(h)
        return {"logits": self.head(h), "aux_logits": self.aux(h)}


@register_model("tiny", config=TinyConfig, inputs=("image",))
def build_tiny(spec, cfg, *, aux_head=False):
    features = spec.channels * math.prod(spec.image_size)  # from the data, never a literal
    return Tiny(features, cfg.width, spec.num_classes, aux_head)
