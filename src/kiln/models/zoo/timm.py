"""`model=timm`: any timm.list_models() name, sized from the data, with a pretrained tag's
weights from the Hugging Face hub cache (or torch.hub's, for the few published by URL) or a
file, loaded by timm itself."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.config.base import ConfigError
from kiln.config.model import TimmConfig
from kiln.errors import did_you_mean
from kiln.models.weights import WeightsError, read_state_dict
from kiln.models.zoo.archs import NUM_SUGGESTIONS, check_arch, check_image_spec
from kiln.models.zoo.cache import (
    DEFAULT_WEIGHTS,
    hub_cache_dir,
    is_weight_file,
    torch_hub_checkpoints,
    url_file_name,
    weight_file,
)
from kiln.models.zoo.surgery import what_fits
from kiln.models.zoo.wrappers import TimmClassifier
from kiln.preprocessing.pretrained import PretrainedInput

log = logging.getLogger(__name__)

INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
TIMM_LISTING = "python -c \"import timm; print(*timm.list_models('{pattern}*'), sep='\\n')\""


@lru_cache(maxsize=1)
def timm_archs() -> tuple[str, ...]:
    import timm

    return tuple(timm.list_models())


def check_timm_arch(arch: str) -> str:
    base, dot, tag = arch.partition(".")
    if dot and base in timm_archs():
        raise ConfigError(
            f"model.arch={arch} names a pretrained tag",
            "model.arch",
            f"set model.arch={base} model.weights={tag}",
        )
    return check_arch(arch, timm_archs(), "timm", TIMM_LISTING.format(pattern=arch[:3]))


@dataclasses.dataclass(frozen=True)
class TimmWeights:
    label: str
    path: Path
    model_name: str  # what timm.create_model builds: arch.tag for a tag, arch for a file
    from_file: bool = False  # model.weights is a file (its head may have any size)

    def head_classes(self) -> int:
        """The head size in the file: what timm is told, so it drops a head of another size."""
        if self.from_file:
            found = file_classes(self.path, timm_classifiers(self.model_name))
            if found is not None:
                return found
        return timm_pretrained_cfg(self.model_name).num_classes


def timm_pretrained_cfg(name: str):
    from timm.models import get_pretrained_cfg

    return get_pretrained_cfg(name)


def timm_tag(arch: str, weights: str) -> str:
    """arch.tag for a pretrained tag (DEFAULT: timm's default tag for the arch)."""
    import timm

    tags = [name.partition(".")[2] for name in timm.list_pretrained(f"{arch}.*")]
    if not tags:
        raise ConfigError(
            f"timm has no pretrained weights for {arch}",
            "model.weights",
            "set model.weights=null (random) or a .pth/.safetensors file",
        )
    if weights == DEFAULT_WEIGHTS:
        return f"{arch}.{timm_pretrained_cfg(arch).tag}"
    if weights not in tags:
        hint = did_you_mean(weights, tags, most=NUM_SUGGESTIONS, cutoff=0.4)
        raise ConfigError(
            f"timm has no pretrained tag {weights!r} for {arch}",
            "model.weights",
            f"tags: {', '.join(tags)}, or DEFAULT{hint}",
        )
    return f"{arch}.{weights}"


def timm_cached_file(name: str) -> Path:
    """The cached weights of a timm arch.tag: the Hugging Face hub cache (timm's own order of
    file names), or torch.hub's checkpoints for the few weights published by URL only."""
    from huggingface_hub import try_to_load_from_cache

    pcfg = timm_pretrained_cfg(name)
    if pcfg.hf_hub_id:
        repo, _, revision = pcfg.hf_hub_id.partition("@")
        names = [pcfg.hf_hub_filename] if pcfg.hf_hub_filename else ["model.safetensors"]
        if not pcfg.hf_hub_filename:
            names.append("pytorch_model.bin")
        cache = hub_cache_dir()
        for filename in names:
            found = try_to_load_from_cache(
                repo, filename, cache_dir=cache, revision=revision or None
            )
            if isinstance(found, str):
                return Path(found)
        folder = cache / f"models--{repo.replace('/', '--')}"
        raise ConfigError(
            f"timm weights {name} are not on this machine (kiln downloads nothing)",
            "model.weights",
            f"put {names[0]} (from https://huggingface.co/{repo}) in {folder}/snapshots/<rev>/ "
            f"with the file refs/{revision or 'main'} holding <rev> (what `hf download {repo} "
            f"{names[0]}` leaves where there is internet; HF_HOME or HF_HUB_CACHE move the "
            "folder), or pass model.weights=<file>",
        )
    path = torch_hub_checkpoints() / url_file_name(pcfg.url)
    if not path.is_file():
        raise ConfigError(
            f"timm weights {name} are not on this machine (kiln downloads nothing)",
            "model.weights",
            f"put {path.name} (from {pcfg.url}) in {path.parent} (set TORCH_HOME to use another "
            "folder), or pass model.weights=<file>",
        )
    return path


def timm_classifiers(name: str) -> tuple[str, ...]:
    classifier = timm_pretrained_cfg(name).classifier or ()
    return (classifier,) if isinstance(classifier, str) else tuple(classifier)


def file_classes(path: Path, classifiers: tuple[str, ...]) -> int | None:
    """The head size a weights file was saved with (None: the file has no head)."""
    key = f"{classifiers[0]}.weight" if classifiers else None
    state = read_state_dict(path, "model.weights")
    return int(state[key].shape[0]) if key in state else None


def resolve_timm_weights(cfg: TimmConfig) -> TimmWeights | None:
    if cfg.weights is None:
        return None
    if is_weight_file(cfg.weights):
        path = weight_file(cfg.weights)
        return TimmWeights(f"file {path.name}", path, cfg.arch, from_file=True)
    name = timm_tag(cfg.arch, cfg.weights)
    return TimmWeights(f"timm {name}", timm_cached_file(name), name)


def timm_preprocessing(cfg: TimmConfig) -> PretrainedInput | None:
    """The weights' pretrained_cfg (mean, std, input size, crop_pct, interpolation): nothing
    is loaded or built. A file is taken to expect what the arch's default tag does."""
    check_timm_arch(cfg.arch)
    source = resolve_timm_weights(cfg)
    if source is None:
        return None
    pcfg = timm_pretrained_cfg(source.model_name)
    interpolation = pcfg.interpolation if pcfg.interpolation in INTERPOLATIONS else "bicubic"
    label = source.label
    if is_weight_file(cfg.weights):
        label = f"{source.label} (preprocessing of timm {cfg.arch}.{pcfg.tag})"
    return PretrainedInput(
        source=label,
        mean=tuple(float(m) for m in pcfg.mean),
        std=tuple(float(s) for s in pcfg.std),
        image_size=int(pcfg.input_size[-1]),
        crop_pct=float(pcfg.crop_pct),
        interpolation=interpolation,
        fixed_input_size=bool(pcfg.fixed_input_size),
    )


def build_timm(spec, cfg: TimmConfig, *, aux_head: bool = False) -> TimmClassifier:
    import timm

    check_image_spec(spec, cfg)
    arch = check_timm_arch(cfg.arch)
    source = resolve_timm_weights(cfg)
    pcfg = timm_pretrained_cfg(arch)
    fixed = bool(pcfg.fixed_input_size)
    kwargs: dict[str, Any] = {"num_classes": spec.num_classes, "in_chans": spec.channels}
    if cfg.dropout > 0:
        kwargs["drop_rate"] = cfg.dropout
    if cfg.drop_path_rate > 0:
        kwargs["drop_path_rate"] = cfg.drop_path_rate
    if fixed:  # ViTs and kin: built for the data's size (pretrained positions resampled)
        kwargs["img_size"] = tuple(spec.image_size)
    overlay = None
    if source is not None:
        # timm's own loading (filter_fn, in_chans adaptation, head dropped when num_classes
        # differs), from the file found: num_classes says what the file's head holds.
        classes = source.head_classes()
        overlay = {"file": str(source.path), "num_classes": classes}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            net = timm.create_model(
                source.model_name if source else arch,
                pretrained=source is not None,
                pretrained_cfg_overlay=overlay,
                **kwargs,
            )
    except TypeError as err:
        raise timm_argument_error(arch, spec, pcfg, kwargs, err) from None
    except (AssertionError, ValueError) as err:
        if not fixed:
            raise
        raise fixed_size_error(arch, spec, pcfg, err) from None
    except RuntimeError as err:
        if source is None:
            raise
        raise WeightsError(
            f"{source.label} does not fit timm {arch} (model.weights): "
            f"{str(err).splitlines()[0][:300]}: "
            f"{what_fits(read_state_dict(source.path, 'model.weights'))}"
        ) from None
    if getattr(net, "num_classes", spec.num_classes) != spec.num_classes:
        # timm builds some architectures headless whatever num_classes says (an image encoder
        # for a multimodal model): its output is features, not the data's classes.
        raise ConfigError(
            f"timm {arch} has no classifier head: asked for {spec.num_classes} classes it built "
            f"num_classes={net.num_classes} (an encoder: its output is features)",
            "model.arch",
            "choose an architecture with a classifier (timm.list_models())",
        )
    if source is not None:
        log_timm_load(source, classes, spec.num_classes, timm_classifiers(source.model_name))
    if fixed:
        try:
            fill_size_caches(net, spec)
        except RuntimeError as err:  # the side is too small for its patches or windows
            raise fixed_size_error(arch, spec, pcfg, err) from None
    return TimmClassifier(net, spec.num_classes, aux_head, timm_classifiers(arch), fixed)


def fill_size_caches(net: nn.Module, spec) -> None:
    """Some fixed-size models fill a cache buffer for their input size on the first forward
    (convit's rel_indices): one eval forward here, so no later forward changes a buffer (rule 3
    would rightly call that a statistic leaking from eval mode)."""
    device = next(net.parameters()).device
    with torch.no_grad():
        net.eval()(torch.zeros(1, spec.channels, *spec.image_size, device=device))
    net.train()


def log_timm_load(source: TimmWeights, classes: int, num_classes: int, classifiers) -> None:
    head = ""
    if classes != num_classes:
        head = (
            f"; head {', '.join(classifiers)} re-initialised ({classes} classes in the file, "
            f"{num_classes} in the data)"
        )
    log.info("model.weights: loaded by timm from %s%s", source.label, head)


def fixed_size_error(arch: str, spec, pcfg, err: BaseException) -> ConfigError:
    height, width = spec.image_size
    side = pcfg.input_size[-1]
    return ConfigError(
        f"timm {arch} does not build for {height}x{width} inputs ({str(err)[:200]})",
        "data.image_size",
        f"set data.image_size={side} (its weights' size)",
    )


def timm_argument_error(arch: str, spec, pcfg, kwargs, err: TypeError) -> ConfigError:
    text = str(err)
    for arg, key in (("drop_path_rate", "model.drop_path_rate"), ("drop_rate", "model.dropout")):
        if arg in text and arg in kwargs:
            return ConfigError(f"timm {arch} takes no {arg}", key, f"set {key}=0")
    if "img_size" in text:
        return fixed_size_error(arch, spec, pcfg, err)
    return ConfigError(f"timm {arch} cannot be built here ({text[:200]})", "model.arch", "")
