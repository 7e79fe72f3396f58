"""How large a model=hf config makes its model, before anything is allocated, and whether this
process can hold it (`check_model_size`, run by kiln.models.zoo.transformers at start-up and
again before the model is built).

- parameters: counted on the meta device (AutoModelForSequenceClassification built without
  memory), once with one layer and once with two, then extrapolated to num_hidden_layers: a
  config asking for 10,000 layers is counted in milliseconds, not built;
- need: 8 bytes a parameter (the float32 weights and their gradients, which every training step
  holds; the optimizer's state comes on top) plus, once the data's max_length is known, one
  sequence's activations (Korthikanti et al. 2022's count, doubled for float32);
- compared with model.max_params (when set) and with the memory this process may take
  (kiln.threads.available_memory). A refusal names the config.json key whose typical size
  (BERT-base's) would shrink the model most, with its value and the size it asks for."""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass
from typing import Any

from kiln.config.base import ConfigError

BYTES_PER_PARAM = 8  # float32 weights and their gradients
# BERT-base's sizes: a key past its typical size is a candidate for the one to name.
TYPICAL = {
    "vocab_size": 30_522,
    "max_position_embeddings": 512,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "type_vocab_size": 2,
}


@dataclass(frozen=True)
class ModelSize:
    params: int
    activation_bytes: int  # one sequence of the data's max_length (0: not known yet)

    @property
    def need_bytes(self) -> int:
        return BYTES_PER_PARAM * self.params + self.activation_bytes


def check_model_size(
    config: Any,
    label: str,
    *,
    max_params: int | None,
    available: int,
    length: int | None = None,
    config_name: str = "config.json",
) -> ModelSize:
    """The size of the model `config` (a transformers config) describes, refused with one
    ConfigError when it is past `max_params` or needs more than `available` bytes.
    `config_name`: what the refusal calls the config (config.json, or a model type's)."""
    size = model_size(config, length)
    too_many = max_params is not None and size.params > max_params
    if not too_many and size.need_bytes <= available:
        return size
    key, value = largest_key(config, length)
    asked = f"{key}={value} gives" if key else "its sizes give"
    what = f"{label}: {config_name}'s {asked} a model of {size.params:.3g} parameters"
    if too_many:
        raise ConfigError(
            f"{what}, more than model.max_params={max_params}",
            "model.max_params",
            "give a smaller model, or raise model.max_params",
        )
    activations = (
        f" and one sequence of {length} tokens {size.activation_bytes / 2**30:.1f} GB"
        if size.activation_bytes
        else ""
    )
    raise ConfigError(
        f"{what}: its float32 weights and gradients need "
        f"{BYTES_PER_PARAM * size.params / 2**30:.1f} GB{activations}, and this process may take "
        f"{available / 2**30:.1f} GB of memory; nothing was built",
        "model.arch",
        f"check the sizes {config_name} asks for (against the weights it came with); for a "
        "model this large use a machine with more memory (model.max_params sets a limit of "
        "your own)",
    )


def model_size(config: Any, length: int | None = None) -> ModelSize:
    params = count_params(config)
    return ModelSize(params, activation_bytes(config, length) if length else 0)


def count_params(config: Any) -> int:
    """Parameters of AutoModelForSequenceClassification.from_config(config), counted on the meta
    device: with one layer and with two, extrapolated to num_hidden_layers."""
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, int) and layers > 2:
        one = _meta_params(_with(config, num_hidden_layers=1))
        two = _meta_params(_with(config, num_hidden_layers=2))
        if two > one:
            return one + (layers - 1) * (two - one)
    return _meta_params(config)


def activation_bytes(config: Any, length: int) -> int:
    """One sequence's activations in training: per layer, length x (34 h + 5 heads x length)
    bytes at 16 bits (Korthikanti et al. 2022, "Reducing activation recomputation in large
    transformer models"), doubled for float32; 0 for a config without these sizes."""
    sizes = [getattr(config, k, None) for k in ("num_hidden_layers", "hidden_size")]
    heads = getattr(config, "num_attention_heads", None) or 1
    if not all(isinstance(s, int) for s in sizes):
        return 0
    layers, hidden = sizes
    return 2 * layers * length * (34 * hidden + 5 * int(heads) * length)


def largest_key(config: Any, length: int | None) -> tuple[str | None, Any]:
    """(config.json key, its value) of the size whose typical value (TYPICAL) would shrink what
    the model needs the most; (None, None) when no key is past its typical size."""
    need = model_size(config, length).need_bytes
    best, best_need = (None, None), need
    for key, typical in TYPICAL.items():
        value = getattr(config, key, None)
        if not isinstance(value, int) or value <= typical:
            continue
        try:
            shrunk = model_size(_with(config, **{key: typical}), length).need_bytes
        except (ValueError, TypeError, AttributeError, IndexError):  # sizes that do not combine
            continue
        if shrunk < best_need:
            best, best_need = (_json_key(config, key), value), shrunk
    return best


def _json_key(config: Any, key: str) -> str:
    """The name config.json gives `key` (GPT-2's n_embd for hidden_size, ...)."""
    return getattr(config, "attribute_map", {}).get(key, key)


def _with(config: Any, **changes: int) -> Any:
    changed = copy.deepcopy(config)
    for key, value in changes.items():
        setattr(changed, key, value)
    layer_types = getattr(changed, "layer_types", None)  # one entry per layer in newer configs
    if "num_hidden_layers" in changes and isinstance(layer_types, list):
        changed.layer_types = layer_types[: changes["num_hidden_layers"]]
    return changed


def _meta_params(config: Any) -> int:
    import torch
    from transformers import AutoModelForSequenceClassification

    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        net = AutoModelForSequenceClassification.from_config(config, trust_remote_code=False)
    return sum(p.numel() for p in net.parameters())
