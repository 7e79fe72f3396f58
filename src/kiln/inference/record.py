"""What inference needs from a checkpoint -- the data spec, the preprocessing recipe, the model
name and config -- read from a training checkpoint (.pt) or from the JSON written beside an ONNX
export, plus the env profile's rule on which checkpoint files may be used."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.checkpoint import EMBEDDED_SHA256, check_embedded, embedded_hashes, load_checkpoint
from kiln.config import option_from_dict
from kiln.data.spec import DataSpec
from kiln.errors import MissingFileError
from kiln.inference.errors import (
    CheckpointMismatchError,
    CheckpointPolicyError,
    NonFiniteWeightsError,
    UnsupportedCheckpointError,
)
from kiln.models import (
    build_model,
    has_lazy_parameters,
    materialise,
    spec_example,
    without_weights,
)
from kiln.preprocessing import Recipe, recipe_from_dict
from kiln.preprocessing.pretrained import pretrained_from_dict
from kiln.registry import check_plugins

BEST_CHECKPOINT = "best.pt"


@dataclass(frozen=True)
class ModelRecord:
    spec: DataSpec
    recipe: Recipe  # the training preprocessing, repeated exactly
    config: dict[str, Any]  # the training run's resolved config
    model_name: str
    checkpoint_name: str  # file name of the .pt it came from (the env policy checks it)
    checkpoint_sha256: str  # ties an ONNX export to the exact .pt it was made from
    # {module: folder}: where the training run imported its plugins (kiln.registry)
    plugin_sources: dict[str, str] = field(default_factory=dict)
    # {module: {distribution, version, entry_point}}: the installed packages its plugins came from
    plugin_packages: dict[str, dict] = field(default_factory=dict)
    # {file: sha256} of the files `recipe.to_dict()` embeds (kiln.checkpoint.embedded_hashes):
    # an ONNX export's sidecar holds them, and is refused when its preprocessing was edited
    embedded_sha256: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "data_spec": self.spec.to_dict(),
            "preprocessing": self.recipe.to_dict(),
            "config": self.config,
            "model_name": self.model_name,
            "checkpoint_name": self.checkpoint_name,
            "checkpoint_sha256": self.checkpoint_sha256,
            "plugin_sources": self.plugin_sources,
            "plugin_packages": self.plugin_packages,
            EMBEDDED_SHA256: self.embedded_sha256,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelRecord:
        fields = dict(d)
        fields.pop("graph_input", None)  # for readers without kiln (export.graph_input)
        spec = DataSpec.from_dict(fields.pop("data_spec"))
        recipe = recipe_from_dict(fields.pop("preprocessing"))
        return cls(spec=spec, recipe=recipe, **fields)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


SUPPORTED_TASKS = ("classification", "multilabel", "detection")


def check_supported(record: ModelRecord, source: Path) -> None:
    if record.spec.task not in SUPPORTED_TASKS:
        raise UnsupportedCheckpointError(
            f"{source}: a {record.spec.task} checkpoint (model {record.model_name}); kiln "
            f"inference supports {', '.join(SUPPORTED_TASKS)} only"
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
    """(record, model state dict) from a training checkpoint, after the support/policy checks
    and the check of the files it embeds against their recorded hashes."""
    path = Path(path)
    ckpt = load_checkpoint(path)
    check_embedded(ckpt, path)
    recipe = recipe_from_dict(ckpt["preprocessing"])
    record = ModelRecord(
        spec=DataSpec.from_dict(ckpt["data_spec"]),
        recipe=recipe,
        config=ckpt["config"],
        model_name=ckpt["model_name"],
        checkpoint_name=path.name,
        checkpoint_sha256=file_sha256(path),
        plugin_sources=(ckpt.get("plugins") or {}).get("sources", {}),
        plugin_packages=(ckpt.get("plugins") or {}).get("packages", {}),
        embedded_sha256=embedded_hashes(recipe.to_dict()),  # of what a sidecar will hold
    )
    check_supported(record, path)
    check_policy(record, path)
    check_finite(ckpt["model"], path)
    return record, ckpt["model"]


def check_finite(state_dict: dict[str, Any], source: Path) -> None:
    """Refuse weights (or buffers) holding NaN or Inf, naming the first such tensor."""
    bad = [
        key
        for key, value in state_dict.items()
        if isinstance(value, torch.Tensor)
        and value.is_floating_point()
        and not bool(value.isfinite().all())
    ]
    if bad:
        first = state_dict[bad[0]]
        count = int((~first.isfinite()).sum())
        raise NonFiniteWeightsError(
            f"{source}: {len(bad)} weight tensor(s) hold NaN or Inf, first {bad[0]!r} "
            f"({count} of {first.numel()} values); the run that wrote it diverged -- use an "
            "earlier checkpoint, or retrain"
        )


MAX_KEYS_NAMED = 3  # mismatched keys named per kind in the error


def check_weights_fit(model: nn.Module, state_dict: dict[str, Any], source: str) -> None:
    """The checkpoint's weights against the model rebuilt from its config: the first keys
    missing, unexpected or of another shape are named (load_state_dict's own error is a
    multi-line dump that the CLI cannot show as one line)."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state_dict]
    unexpected = [k for k in state_dict if k not in expected]
    resized = [
        f"{k} (checkpoint {list(state_dict[k].shape)}, model {list(v.shape)})"
        for k, v in expected.items()
        if k in state_dict and tuple(getattr(state_dict[k], "shape", ())) != tuple(v.shape)
    ]
    problems = [
        f"{what} {', '.join(keys[:MAX_KEYS_NAMED])}"
        + (f" (+{len(keys) - MAX_KEYS_NAMED} more)" if len(keys) > MAX_KEYS_NAMED else "")
        for what, keys in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("size mismatch", resized),
        )
        if keys
    ]
    if problems:
        raise CheckpointMismatchError(
            f"checkpoint {source}: its weights do not fit the model its config records: "
            f"{'; '.join(problems)}; use the checkpoint as its training run wrote it"
        )


def read_sidecar(onnx_path: Path) -> ModelRecord:
    """The record saved beside an ONNX export (model.onnx -> model.onnx.json)."""
    sidecar = sidecar_path(onnx_path)
    if not sidecar.is_file():
        raise MissingFileError(
            f"{sidecar} is missing: it holds the preprocessing for {onnx_path.name}; re-run "
            "`python infer.py mode=export ckpt=<the .pt>`"
        )
    data = json.loads(sidecar.read_text())
    check_embedded(data, sidecar)
    record = ModelRecord.from_json(data)
    check_supported(record, onnx_path)
    check_policy(record, onnx_path)
    return record


def sidecar_path(onnx_path: Path) -> Path:
    return onnx_path.with_name(onnx_path.name + ".json")


def rebuild_model(record: ModelRecord, state_dict: dict[str, Any]) -> nn.Module:
    """The trained network in eval mode. A model trained with an auxiliary head (by
    model.aux_head or the loss branch) has `aux.*` weights, so it is rebuilt with one. Pretrained
    weights (a zoo model's model.weights) are not read again: the state dict holds them."""
    # A user's model registers itself when its module is imported: by the user (infer.py
    # plugins=[...]), never on the checkpoint's word.
    check_plugins(
        list(record.config.get("plugins") or []),
        record.plugin_packages,
        record.plugin_sources,
        record.checkpoint_name,
    )
    aux_head = any(key.startswith("aux.") for key in state_dict)
    model_cfg = without_weights(option_from_dict("model", record.config["model"]))
    pretrained = pretrained_from_dict(getattr(record.recipe, "pretrained", None))
    model = build_model(record.spec, model_cfg, aux_head=aux_head, pretrained=pretrained)
    built = model.state_dict(keep_vars=True)
    if has_lazy_parameters(model) or any(key not in built for key in state_dict):
        # A layer sized (or built) at the first call: a dry forward first, as training had.
        materialise(model, spec_example(record.spec))
    check_weights_fit(model, state_dict, f"{record.checkpoint_name} ({record.model_name})")
    model.load_state_dict(state_dict)
    return model.eval()
