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


@dataclass
class TinyConfig(ClassifierConfig):
    """Flatten -> Linear -> ReLU -> Linear."""

    width: int = 32  # hidden width (the comment is the key's meaning in --help)


@register_model("tiny", config=TinyConfig, inputs=("image",))
def build_tiny(spec, cfg, *, aux_head=False):
    features = spec.channels * math.prod(spec.image_size)  # from the data, never a literal
    hidden = nn.Linear(features, cfg.width)
    return nn.Sequential(nn.Flatten(), hidden, nn.ReLU(), nn.Linear(cfg.width, spec.num_classes))
