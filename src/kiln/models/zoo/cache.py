"""Where a zoo model's pretrained weights are found: a local file, or the libraries' own caches
(torch.hub's checkpoints for torchvision, the Hugging Face hub cache for timm) -- never the
network. The file itself is read by kiln.models.weights.read_state_dict, the one reader."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from urllib.parse import urlparse

import torch

from kiln.config.base import ConfigError

log = logging.getLogger(__name__)

WEIGHT_FILE_SUFFIXES = (".pth", ".pt", ".safetensors", ".bin")
DEFAULT_WEIGHTS = "DEFAULT"


def is_weight_file(value: str) -> bool:
    return value.endswith(WEIGHT_FILE_SUFFIXES) or os.sep in value or "/" in value


def weight_file(value: str) -> Path:
    path = Path(value).expanduser()
    if not path.is_file():
        raise ConfigError(
            f"weights file {value} not found",
            "model.weights",
            f"pass an existing .pth, .pt or .safetensors file (looked in {Path.cwd()})",
        )
    return path.resolve()


def torch_hub_checkpoints() -> Path:
    """Where torch.hub (and so torchvision) caches weights: $TORCH_HOME/hub/checkpoints."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def hub_cache_dir() -> Path:
    """huggingface_hub's cache folder, read from the environment now (huggingface_hub reads it
    once, when imported): $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub."""
    home = os.getenv(
        "HF_HOME", os.path.join(os.getenv("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    )
    legacy = os.getenv("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub"))
    return Path(os.path.expandvars(os.path.expanduser(os.getenv("HF_HUB_CACHE", legacy))))


def url_file_name(url: str) -> str:
    return os.path.basename(urlparse(url).path)


def warn_on_hash_mismatch(path: Path) -> None:
    """torch.hub names its files <name>-<first hex digits of their sha256>.pth; a file that does
    not hash to its name is not the one published (kiln loads it all the same, and says so)."""
    found = re.search(r"-([a-f0-9]{6,})\.", path.name)
    if found is None:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    if not digest.hexdigest().startswith(found.group(1)):
        log.warning("%s: its sha256 does not start with %s, as its name says", path, found.group(1))
