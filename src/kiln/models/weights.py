"""Weights from a file into a model that may differ from the one that saved them: what
`init_from=` (fine-tuning, "train this run longer") does. Keys are matched by name and shape;
the rest is reported, never silently dropped: a head of another size keeps its fresh
initialisation and is named."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.errors import UserError

log = logging.getLogger(__name__)

WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP and torch.compile wrappers
STATE_DICT_KEYS = ("model", "state_dict", "model_state_dict")  # where files nest their weights


class WeightsError(UserError, ValueError):
    """A weights file that cannot be read, or that does not fit the model (init_from=, or a
    zoo model's model.weights=): the one error of every weights reader and loader."""


@dataclass
class WeightMatch:
    """How a file's tensors met the model's: loaded, and the three ways not to be."""

    source: str
    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # in the model, not in the file
    unexpected: list[str] = field(default_factory=list)  # in the file, not in the model
    mismatched: list[tuple[str, tuple, tuple]] = field(default_factory=list)  # (key, file, model)

    def lines(self, shown: int = 6) -> list[str]:
        def names(keys: list[str]) -> str:
            more = f", ... (+{len(keys) - shown})" if len(keys) > shown else ""
            return ", ".join(keys[:shown]) + more

        out = [f"init_from {self.source}: {len(self.loaded)} tensors loaded"]
        if self.mismatched:
            shapes = [f"{k} {tuple(f)} in the file vs {tuple(m)}" for k, f, m in self.mismatched]
            out.append(f"  shape-mismatched, re-initialised ({len(shapes)}): {names(shapes)}")
        if self.missing:
            out.append(
                f"  missing from the file, initialised fresh ({len(self.missing)}): "
                f"{names(self.missing)}"
            )
        if self.unexpected:
            out.append(
                f"  unexpected in the file, ignored ({len(self.unexpected)}): "
                f"{names(self.unexpected)}"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "loaded": len(self.loaded),
            "missing": self.missing,
            "unexpected": self.unexpected,
            "mismatched": [[k, list(f), list(m)] for k, f, m in self.mismatched],
        }


def read_state_dict(path: str | Path, key: str = "init_from") -> dict[str, torch.Tensor]:
    """The one reader of weight files (init_from=, a zoo model's model.weights=): a state dict
    from a .safetensors file, or from a .pt/.pth/.bin holding one (a kiln checkpoint, sharded
    or not, a plain state dict, or one nested under "model"/"state_dict"/"model_state_dict"),
    its DDP and torch.compile prefixes stripped. Never unpickles code. `key` names the config
    key the path came from, for the error."""
    path = Path(path)
    if not path.exists():
        raise WeightsError(
            f"weights file {path} does not exist ({key}): pass an existing .pt, .pth or "
            ".safetensors file"
        )
    from safetensors import SafetensorError

    from kiln.checkpoint import CheckpointError

    try:
        loaded = _load(path)
    except (CheckpointError, SafetensorError, OSError) as err:  # the file, not kiln, is at fault
        raise WeightsError(f"cannot read weights file {path} ({key}): {err}") from None
    return plain_state_dict(loaded, path, key)


def _load(path: Path) -> Any:
    """What the file holds, on the CPU: safetensors' tensors, or torch.load(weights_only=True)
    through kiln.checkpoint (legacy formats, sharded kiln checkpoints consolidated)."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    from kiln.checkpoint import load_weights_file

    return load_weights_file(path)


def plain_state_dict(
    data: Any, source: Path | str, key: str = "init_from"
) -> dict[str, torch.Tensor]:
    """The tensors of `data` (a state dict, or a dict holding one under STATE_DICT_KEYS) by
    their names without wrapper prefixes; a file with none is an error."""
    for nest in STATE_DICT_KEYS:
        if isinstance(data, dict) and isinstance(data.get(nest), dict):
            data = data[nest]
            break
    if not isinstance(data, dict) or not any(isinstance(v, torch.Tensor) for v in data.values()):
        raise WeightsError(
            f"{source} holds no state dict ({key}): save model.state_dict(), or a dict holding "
            f"it under {' / '.join(repr(k) for k in STATE_DICT_KEYS)}"
        )
    return {_strip(k): v for k, v in data.items() if isinstance(v, torch.Tensor)}


def _strip(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key, changed = key[len(prefix) :], True
    return key


@torch.no_grad()
def load_matching(
    model: nn.Module, state_dict: dict[str, torch.Tensor], source: str
) -> WeightMatch:
    """Copy every tensor whose name and shape match into `model` (in place: the optimizer's
    parameters stay the same objects); report the rest. Nothing matched is an error."""
    own = model.state_dict()
    state_dict = in_model_keys(model, state_dict, own)
    check_values(state_dict, own, source)
    match = WeightMatch(source)
    for key, value in state_dict.items():
        if key not in own:
            match.unexpected.append(key)
        elif tuple(value.shape) != tuple(own[key].shape):
            match.mismatched.append((key, tuple(value.shape), tuple(own[key].shape)))
        else:
            own[key].copy_(value.to(dtype=own[key].dtype))
            match.loaded.append(key)
    seen = set(state_dict)
    match.missing = [k for k in own if k not in seen]
    if not match.loaded:
        if match.mismatched:  # the names match: say the shapes
            shapes = "; ".join(
                f"{k}: {list(f)} in the file, {list(m)} in the model"
                for k, f, m in match.mismatched[:4]
            )
            more = f"; ... {len(match.mismatched)} in all" if len(match.mismatched) > 4 else ""
            raise WeightsError(
                f"{source}: every tensor the model shares a name with has another shape "
                f"({shapes}{more}): init_from needs weights of the same architecture and size "
                "(model.* as the run that saved them)"
            )
        close = ", ".join(list(state_dict)[:3])
        raise WeightsError(
            f"{source}: no tensor matches the model by name and shape (the file has "
            f"{close}, ...; the model {', '.join(list(own)[:3])}, ...): init_from needs weights "
            "of the same architecture"
        )
    return match


def check_values(state_dict: dict[str, torch.Tensor], own: dict, source: str) -> None:
    """Refuse what loading would change silently: NaN or Inf weights (else the run fails at
    step 1 with `loss NaN`, the file unnamed), and integer tensors where the model has floating
    ones (quantised weights: a cast would keep the integers and lose their scale)."""
    cast = [
        (k, v.dtype, own[k].dtype)
        for k, v in state_dict.items()
        if k in own and own[k].is_floating_point() and not v.is_floating_point()
    ]
    if cast:
        shown = ", ".join(f"{k} ({str(f).removeprefix('torch.')})" for k, f, _ in cast[:4])
        raise WeightsError(
            f"{source}: {len(cast)} tensor(s) are integers where the model's are "
            f"{str(cast[0][2]).removeprefix('torch.')}, e.g. {shown}: quantised weights, which "
            "a cast would not de-quantise; give the floating-point weights they came from"
        )
    for key, value in state_dict.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            bad = int((~torch.isfinite(value)).sum())
            raise WeightsError(
                f"{source}: tensor {key} holds {bad} NaN or Inf value(s) of {value.numel()}: "
                "the run would fail at its first step; give weights from a run that did not "
                "diverge (its best.pt, or an earlier epoch-N.pt)"
            )


def in_model_keys(model: nn.Module, state_dict: dict, own: dict) -> dict:
    """The state dict keyed as the model names its tensors: as it is, or -- for a zoo model
    given its library's own file (torchvision's resnet18-*.pth) -- through the model's
    `library_key`, whichever matches more of the model's keys."""
    translate = getattr(model, "library_key", None)
    if translate is None:
        return state_dict
    renamed = {translate(k): v for k, v in state_dict.items()}
    return renamed if len(own.keys() & renamed) > len(own.keys() & state_dict) else state_dict


def init_from(model: nn.Module, path: str | Path) -> WeightMatch:
    """`init_from=<path>`: weights only (no optimizer, schedule or step), non-strict, logged."""
    match = load_matching(model, read_state_dict(path), str(path))
    for line in match.lines():
        log.info(line)
    return match
