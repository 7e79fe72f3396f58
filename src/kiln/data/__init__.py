"""Datasets: each registered builder turns its typed config (kiln.config.data) into a DataBundle.
Importing this package loads no dataset module; `build_data` imports the one asked for."""

from kiln.data.loaders import build_dataloaders, example_batch
from kiln.data.spec import DataBundle, DataSpec
from kiln.registry import DATASETS


def build_data(cfg, pretrained=None) -> DataBundle:
    """`pretrained`: the model's weights' own preprocessing (a PretrainedInput), passed to the
    datasets that declare uses_pretrained (data.normalize=auto, the default input size)."""
    entry = DATASETS.entry(cfg.name)
    if entry.meta.get("uses_pretrained"):
        return entry.load()(cfg, pretrained=pretrained)
    return entry.load()(cfg)


__all__ = ["DataBundle", "DataSpec", "build_data", "build_dataloaders", "example_batch"]
