"""Datasets: each registered builder turns a DataConfig into a DataBundle."""

from kiln.data import csv_text, digits, shapes_detection, synthetic  # noqa: F401  (registration side effects)
from kiln.data.loaders import build_dataloaders, example_batch
from kiln.data.spec import DataBundle, DataSpec
from kiln.registry import DATASETS


def build_data(cfg) -> DataBundle:
    return DATASETS.get(cfg.name)(cfg)


__all__ = ["DataBundle", "DataSpec", "build_data", "build_dataloaders", "example_batch"]
