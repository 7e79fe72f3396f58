"""`model=torchvision`: any classification builder of torchvision.models, sized from the data,
with named weights (DEFAULT, IMAGENET1K_V1, ...) from torch.hub's cache or a file."""

from __future__ import annotations

import dataclasses
import inspect
from functools import lru_cache
from pathlib import Path
from typing import Any

from kiln.config.base import ConfigError
from kiln.config.model import TorchvisionConfig
from kiln.models.weights import read_state_dict
from kiln.models.zoo.archs import check_arch, check_image_spec
from kiln.models.zoo.cache import (
    is_weight_file,
    torch_hub_checkpoints,
    url_file_name,
    warn_on_hash_mismatch,
    weight_file,
)
from kiln.models.zoo.surgery import (
    adapt_first_conv,
    first_conv_name,
    head_layer_name,
    library_state,
    load_weights,
    split_at_head,
)
from kiln.models.zoo.wrappers import ZooClassifier
from kiln.preprocessing.pretrained import PretrainedInput

TORCHVISION_LISTING = (
    "python -c \"import torchvision.models as m; print(*m.list_models(module=m), sep='\\n')\""
)


@lru_cache(maxsize=1)
def torchvision_archs() -> tuple[str, ...]:
    import torchvision.models

    return tuple(torchvision.models.list_models(module=torchvision.models))


def check_torchvision_arch(arch: str) -> str:
    from kiln.models.zoo.detection import is_detection_arch

    if is_detection_arch(arch):
        raise ConfigError(
            f"model=torchvision takes classifiers; {arch} is a detector of "
            "torchvision.models.detection",
            "model.arch",
            f"use model=torchvision_detection model.arch={arch} (with detection data: data=coco, "
            "data=yolo or data=shapes_detection)",
        )
    return check_arch(arch, torchvision_archs(), "torchvision.models", TORCHVISION_LISTING)


def torchvision_num_params(arch: str) -> int:
    """The parameter count torchvision publishes with the arch's DEFAULT weights (some builders
    cannot run on the meta device to be counted)."""
    import torchvision.models

    return int(torchvision.models.get_model_weights(arch).DEFAULT.meta["num_params"])


def torchvision_model_class(arch: str) -> type:
    """The nn.Module class a builder returns (its return annotation), without building it."""
    import torchvision.models

    return inspect.signature(torchvision.models.get_model_builder(arch)).return_annotation


def torchvision_size_param(arch: str) -> str | None:
    """The constructor argument that fixes the input size (ViT's image_size, MaxViT's
    input_size), for the architectures that have one."""
    params = inspect.signature(torchvision_model_class(arch).__init__).parameters
    return next((p for p in ("image_size", "input_size") if p in params), None)


def torchvision_weights(arch: str, name: str):
    """The WeightsEnum member `name` (DEFAULT, IMAGENET1K_V1, or ResNet18_Weights.IMAGENET1K_V1)."""
    import torchvision.models

    enum = torchvision.models.get_model_weights(arch)
    short = name.split(".", 1)[1] if name.startswith(f"{enum.__name__}.") else name
    if short not in enum.__members__:
        choices = ", ".join(enum.__members__)
        raise ConfigError(
            f"torchvision has no weights {name!r} for {arch}",
            "model.weights",
            f"choose one of {choices} (or null, or a .pth/.safetensors file)",
        )
    return enum[short]


def torchvision_cached_file(weights) -> Path:
    folder = torch_hub_checkpoints()
    path = folder / url_file_name(weights.url)
    if not path.is_file():
        raise ConfigError(
            f"torchvision weights {weights!r} are not on this machine (kiln downloads nothing)",
            "model.weights",
            f"put {path.name} (from {weights.url}) in {folder} (set TORCH_HOME to use another "
            "folder), or pass model.weights=<file>",
        )
    return path


@dataclasses.dataclass(frozen=True)
class TorchvisionWeights:
    label: str  # what the log and PretrainedInput.source say
    path: Path
    named: Any = None  # the WeightsEnum member, for named weights


def resolve_torchvision_weights(cfg: TorchvisionConfig) -> TorchvisionWeights | None:
    if cfg.weights is None:
        return None
    if is_weight_file(cfg.weights):
        path = weight_file(cfg.weights)
        return TorchvisionWeights(f"file {path.name}", path)  # the name: no absolute path kept
    named = torchvision_weights(cfg.arch, cfg.weights)
    return TorchvisionWeights(f"torchvision {named!r}", torchvision_cached_file(named), named)


def torchvision_preprocessing(cfg: TorchvisionConfig) -> PretrainedInput | None:
    """What the weights expect (their transforms()): no weights are read, no model is built.
    A file is taken to expect what the arch's DEFAULT weights do."""
    arch = check_torchvision_arch(cfg.arch)
    source = resolve_torchvision_weights(cfg)
    if source is None:
        return None
    import torchvision.models

    named = source.named or torchvision.models.get_model_weights(arch).DEFAULT
    transform = named.transforms()
    crop, resize = transform.crop_size[0], transform.resize_size[0]
    label = source.label if source.named else f"{source.label} (preprocessing of {named!r})"
    return PretrainedInput(
        source=label,
        mean=tuple(float(m) for m in transform.mean),
        std=tuple(float(s) for s in transform.std),
        image_size=int(crop),
        crop_pct=round(crop / resize, 4),
        interpolation=transform.interpolation.value,
        fixed_input_size=torchvision_size_param(arch) is not None,
    )


def torchvision_side(arch: str, spec, source: TorchvisionWeights | None) -> int:
    """The side a fixed-size architecture is built for: the data's, which must be the weights'
    own when they are named torchvision weights."""
    height, width = spec.image_size
    if source is not None and source.named is not None:
        need = int(source.named.transforms().crop_size[0])
        if (height, width) != (need, need):
            raise ConfigError(
                f"model.arch={arch} with weights {source.named.name} takes {need}x{need} "
                f"inputs, the data gives {height}x{width}",
                "data.image_size",
                f"set data.image_size={need}",
            )
    if height != width:
        raise ConfigError(
            f"model.arch={arch} takes square inputs, the data gives {height}x{width}",
            "data.image_size",
            "set data.image_size to one side",
        )
    return height


def torchvision_kwargs(arch: str, spec, source: TorchvisionWeights | None) -> dict[str, Any]:
    """Constructor arguments that depend on the data only, so a rebuild without weights makes
    the same network."""
    kwargs: dict[str, Any] = {"num_classes": spec.num_classes}
    size_param = torchvision_size_param(arch)
    if size_param is not None:
        side = torchvision_side(arch, spec, source)
        kwargs[size_param] = side if size_param == "image_size" else (side, side)  # MaxViT: (H, W)
    params = inspect.signature(torchvision_model_class(arch).__init__).parameters
    if "aux_logits" in params:  # googlenet, inception_v3: one output in both modes (rule 3)
        # transform_input: torchvision's own choice for its weights (ImageNet-normalised inputs
        # re-normalised as the Google weights expect); it assumes RGB.
        kwargs.update(aux_logits=False, init_weights=True, transform_input=spec.channels == 3)
    return kwargs


def build_torchvision(spec, cfg: TorchvisionConfig, *, aux_head: bool = False) -> ZooClassifier:
    import torchvision.models

    check_image_spec(spec, cfg)
    arch = check_torchvision_arch(cfg.arch)
    source = resolve_torchvision_weights(cfg)
    kwargs = torchvision_kwargs(arch, spec, source)
    fixed = torchvision_size_param(arch) is not None
    try:
        net = torchvision.models.get_model(arch, weights=None, **kwargs)
    except (AssertionError, ValueError, RuntimeError) as err:
        if not fixed:
            raise
        raise ConfigError(
            f"model.arch={arch} does not build for {spec.image_size[0]}x{spec.image_size[1]} "
            f"inputs ({err})",
            "data.image_size",
            "choose a side it takes (its weights' 224 always works)",
        ) from None
    first_conv = first_conv_name(net)
    if spec.channels != 3 and first_conv is not None:
        adapt_first_conv(net, first_conv, spec.channels)
    head = head_layer_name(net)
    if source is not None:
        if source.named is not None:
            warn_on_hash_mismatch(source.path)
        state = library_state(net, read_state_dict(source.path, "model.weights"))
        load_weights(
            net,
            state,
            label=source.label,
            head=head,
            first_conv=first_conv,
            channels=spec.channels,
        )
    backbone, head_module, width = split_at_head(net, head)
    return ZooClassifier(
        backbone, head_module, width, spec.num_classes, cfg.dropout, aux_head, fixed, head
    )
