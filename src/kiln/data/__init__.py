"""Datasets: each registered builder turns its typed config (kiln.config.data) into a DataBundle.
Importing this package loads no dataset module; `build_data` imports the one asked for."""

from kiln.data.loaders import build_dataloaders, example_batch
from kiln.data.spec import DataBundle, DataSpec
from kiln.registry import DATASETS


def build_data(cfg) -> DataBundle:
    return DATASETS.get(cfg.name)(cfg)


__all__ = ["DataBundle", "DataSpec", "build_data", "build_dataloaders", "example_batch"]
