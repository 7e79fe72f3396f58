"""What inference needs from a checkpoint -- the data spec, the preprocessing recipe, the model
name and config -- read from a training checkpoint (.pt) or from the JSON written beside an ONNX
export, plus the env profile's rule on which checkpoint files may be used."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from kiln.checkpoint import load_checkpoint
from kiln.config import option_from_dict
from kiln.data.spec import DataSpec
from kiln.inference.errors import CheckpointPolicyError, UnsupportedCheckpointError
from kiln.models import build_model, without_weights
from kiln.preprocessing import Recipe, recipe_from_dict
from kiln.registry import load_plugins

BEST_CHECKPOINT = "best.pt"


@dataclass(frozen=True)
class ModelRecord:
    spec: DataSpec
    recipe: Recipe  # the training preprocessing, repeated exactly
    config: dict[str, Any]  # the training run's resolved config
    model_name: str
    checkpoint_name: str  # file name of the .pt it came from (the env policy checks it)
    checkpoint_sha256: str  # ties an ONNX export to the exact .pt it was made from

    def to_json(self) -> dict[str, Any]:
        return {
            "data_spec": self.spec.to_dict(),
            "preprocessing": self.recipe.to_dict(),
            "config": self.config,
            "model_name": self.model_name,
            "checkpoint_name": self.checkpoint_name,
            "checkpoint_sha256": self.checkpoint_sha256,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelRecord:
        fields = dict(d)
        spec = DataSpec.from_dict(fields.pop("data_spec"))
        recipe = recipe_from_dict(fields.pop("preprocessing"))
        return cls(spec=spec, recipe=recipe, **fields)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


SUPPORTED_TASKS = ("classification", "detection")


def check_supported(record: ModelRecord, source: Path) -> None:
    if record.spec.task not in SUPPORTED_TASKS:
        raise UnsupportedCheckpointError(
            f"{source}: a {record.spec.task} checkpoint (model {record.model_name}); kiln "
            f"inference supports {' and '.join(SUPPORTED_TASKS)} only"
        )


def check_policy(record: ModelRecord, source: Path) -> None:
    """env.require_best_checkpoint (env=production) allows only best.pt to be used."""
    required = record.config.get("env", {}).get("require_best_checkpoint", False)
    if required and record.checkpoint_name != BEST_CHECKPOINT:
        raise CheckpointPolicyError(
            f"{source}: refused -- this run's env profile ({record.config['env'].get('name')}) "
            f"sets env.require_best_checkpoint=true, so only {BEST_CHECKPOINT} may be used for "
            f"inference, not {record.checkpoint_name}; pass ckpt=<run>/checkpoints/best.pt"
        )


def read_checkpoint(path: str | Path) -> tuple[ModelRecord, dict[str, Any]]:
    """(record, model state dict) from a training checkpoint, after the support/policy checks."""
    path = Path(path)
    ckpt = load_checkpoint(path)
    record = ModelRecord(
        spec=DataSpec.from_dict(ckpt["data_spec"]),
        recipe=recipe_from_dict(ckpt["preprocessing"]),
        config=ckpt["config"],
        model_name=ckpt["model_name"],
        checkpoint_name=path.name,
        checkpoint_sha256=file_sha256(path),
    )
    check_supported(record, path)
    check_policy(record, path)
    return record, ckpt["model"]


def read_sidecar(onnx_path: Path) -> ModelRecord:
    """The record saved beside an ONNX export (model.onnx -> model.onnx.json)."""
    sidecar = sidecar_path(onnx_path)
    if not sidecar.is_file():
        raise FileNotFoundError(
            f"{sidecar} is missing: it holds the preprocessing for {onnx_path.name}; re-run "
            "`python infer.py mode=export ckpt=<the .pt>`"
        )
    record = ModelRecord.from_json(json.loads(sidecar.read_text()))
    check_supported(record, onnx_path)
    check_policy(record, onnx_path)
    return record


def sidecar_path(onnx_path: Path) -> Path:
    return onnx_path.with_name(onnx_path.name + ".json")


def rebuild_model(record: ModelRecord, state_dict: dict[str, Any]) -> nn.Module:
    """The trained network in eval mode. A model trained with an auxiliary head (by
    model.aux_head or the loss branch) has `aux.*` weights, so it is rebuilt with one. Pretrained
    weights (a zoo model's model.weights) are not read again: the state dict holds them."""
    load_plugins(record.config.get("plugins", []))  # a user's model registers itself there
    aux_head = any(key.startswith("aux.") for key in state_dict)
    model_cfg = without_weights(option_from_dict("model", record.config["model"]))
    model = build_model(record.spec, model_cfg, aux_head=aux_head)
    model.load_state_dict(state_dict)
    return model.eval()
