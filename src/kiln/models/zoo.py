"""The model zoo: `model=torchvision` (any classification builder of torchvision.models) and
`model=timm` (any timm.list_models() name), sized from the data and, with `model.weights`,
initialised from pretrained weights found on this machine only.

    model.weights   null                random initialisation
                    DEFAULT, IMAGENET1K_V1, ...  torchvision weights, read from
                                        $TORCH_HOME/hub/checkpoints/<the file name of their URL>
                    a1_in1k, ..., DEFAULT   a timm pretrained tag (resnet18.a1_in1k), read from
                                        the Hugging Face hub cache ($HF_HOME, $HF_HUB_CACHE)
                    path/to/file.pth|.pt|.safetensors  a state dict (or a dict holding one
                                        under "state_dict" or "model")

Nothing is ever downloaded: a missing file is one error naming the file, the folder it belongs
in and where it comes from. A head of another size in the file is dropped and re-initialised;
a first convolution made for 3 channels is adapted to the data's (timm's adapt_input_conv, for
torchvision too).

Every zoo model declares `head_prefixes` (the module-name prefixes of its classifier head and aux
head: what model.freeze=backbone leaves trainable and optimizer.head_lr_mult scales) and
`fixed_input_size` (True: it takes only the input size it was built for, a ViT's positions).
Rebuilding a trained model (inference, rule 1's fresh builds) goes through `without_weights`:
the checkpoint holds the weights."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import inspect
import logging
import os
import re
import warnings
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import Tensor, nn

from kiln.config.base import ConfigError
from kiln.config.model import TimmConfig, TorchvisionConfig
from kiln.errors import UserError
from kiln.preprocessing.pretrained import PretrainedInput

log = logging.getLogger(__name__)

WEIGHT_FILE_SUFFIXES = (".pth", ".pt", ".safetensors", ".bin")
DEFAULT_WEIGHTS = "DEFAULT"
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
NUM_SUGGESTIONS = 3


class WeightsError(UserError, ValueError):
    """model.weights names a file that does not fit the architecture."""


# ---------------------------------------------------------------------------------------------
# Names: checked against the library's own lists


@lru_cache(maxsize=1)
def torchvision_archs() -> tuple[str, ...]:
    import torchvision.models

    return tuple(torchvision.models.list_models(module=torchvision.models))


@lru_cache(maxsize=1)
def timm_archs() -> tuple[str, ...]:
    import timm

    return tuple(timm.list_models())


def check_arch(arch: str, names: Iterable[str], library: str, listing: str) -> str:
    names = list(names)
    if arch in names:
        return arch
    close = difflib.get_close_matches(arch, names, n=NUM_SUGGESTIONS, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise ConfigError(
        f"{library} has no architecture {arch!r}",
        "model.arch",
        f"{hint}list them with {listing}",
    )


TORCHVISION_LISTING = (
    "python -c \"import torchvision.models as m; print(*m.list_models(module=m), sep='\\n')\""
)
TIMM_LISTING = "python -c \"import timm; print(*timm.list_models('{pattern}*'), sep='\\n')\""


def check_torchvision_arch(arch: str) -> str:
    return check_arch(arch, torchvision_archs(), "torchvision.models", TORCHVISION_LISTING)


def check_timm_arch(arch: str) -> str:
    base, dot, tag = arch.partition(".")
    if dot and base in timm_archs():
        raise ConfigError(
            f"model.arch={arch} names a pretrained tag",
            "model.arch",
            f"set model.arch={base} model.weights={tag}",
        )
    return check_arch(arch, timm_archs(), "timm", TIMM_LISTING.format(pattern=arch[:3]))


# ---------------------------------------------------------------------------------------------
# Weight files: local paths and the libraries' caches, never the network


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


def read_state_dict(path: Path) -> dict[str, Tensor]:
    """A plain state dict, or the one a dict holds under "state_dict" or "model"."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            loaded: Any = load_file(str(path), device="cpu")
        else:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any unreadable file is the user's to replace
        raise WeightsError(
            f"cannot read weights file {path} (model.weights): {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}"
        ) from None
    for key in ("state_dict", "model"):
        if isinstance(loaded, dict) and isinstance(loaded.get(key), dict):
            loaded = loaded[key]
            break
    tensors = isinstance(loaded, dict) and all(isinstance(v, Tensor) for v in loaded.values())
    if not tensors or not loaded:
        raise WeightsError(
            f"{path} holds no state dict (model.weights): save model.state_dict(), or a dict "
            "holding it under 'state_dict' or 'model'"
        )
    return loaded


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


# ---------------------------------------------------------------------------------------------
# torchvision


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


def first_conv_name(net: nn.Module) -> str | None:
    """The convolution that reads the image: the first registered Conv2d taking 3 channels."""
    for name, module in net.named_modules():
        if isinstance(module, nn.Conv2d):
            return name if module.in_channels == 3 else None
    return None


def adapt_first_conv(net: nn.Module, name: str, channels: int) -> None:
    """Replace the 3-channel input convolution by one for `channels`, its weights adapted as
    timm adapts pretrained weights (1 channel: the sum over RGB; more: repeated and scaled)."""
    from timm.models import adapt_input_conv

    old = net.get_submodule(name)
    new = nn.Conv2d(
        channels,
        old.out_channels,
        old.kernel_size,
        old.stride,
        old.padding,
        old.dilation,
        old.groups,
        old.bias is not None,
        old.padding_mode,
    )
    with torch.no_grad():
        new.weight.copy_(adapt_input_conv(channels, old.weight))
        if old.bias is not None:
            new.bias.copy_(old.bias)
    parent, _, attr = name.rpartition(".")
    setattr(net.get_submodule(parent) if parent else net, attr, new)


def head_layer_name(net: nn.Module) -> str:
    """The classifier layer: the last registered Linear (resnet fc, vgg/mobilenet/efficientnet/
    convnext classifier[-1], vit heads.head, swin head, ...), squeezenet's 1x1 convolution."""
    from torchvision.models import SqueezeNet

    if isinstance(net, SqueezeNet):
        return "classifier.1"
    return [name for name, m in net.named_modules() if isinstance(m, nn.Linear)][-1]


# torchvision's own fix for DenseNet files written before '.' was refused in module names
# (torchvision.models.densenet._load_state_dict): denselayer1.norm.1 -> denselayer1.norm1.
DENSENET_OLD_KEY = re.compile(
    r"^(.*denselayer\d+\.(?:norm|relu|conv))\.((?:[12])\.(?:weight|bias|running_mean|running_var))$"
)


def library_state(net: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    from torchvision.models import DenseNet

    if not isinstance(net, DenseNet):
        return state
    return {
        (m.group(1) + m.group(2) if (m := DENSENET_OLD_KEY.match(k)) else k): v
        for k, v in state.items()
    }


def load_weights(
    net: nn.Module,
    state: dict[str, Tensor],
    *,
    label: str,
    head: str,
    first_conv: str | None,
    channels: int,
) -> None:
    """Load a library-layout state dict into `net`: the input convolution adapted to the data's
    channels, a head of another size dropped (the net's new head stays), keys the net does not
    have (googlenet's aux logits) ignored. Any other missing or misshapen tensor is an error."""
    from timm.models import adapt_input_conv

    own = net.state_dict()
    state = dict(state)
    notes = []
    conv_key = f"{first_conv}.weight" if first_conv else None
    if conv_key in state and state[conv_key].shape[1] != own[conv_key].shape[1]:
        source_channels = state[conv_key].shape[1]
        state[conv_key] = adapt_input_conv(channels, state[conv_key], base_chans=source_channels)
        notes.append(f"{conv_key} adapted from {source_channels} to {channels} channels")
    head_keys = [k for k in own if k.startswith(f"{head}.")]
    if any(k in state and state[k].shape != own[k].shape for k in head_keys):
        saved_classes = state[head_keys[0]].shape[0]
        for k in head_keys:
            state.pop(k, None)
        notes.append(
            f"head {', '.join(head_keys)} re-initialised ({saved_classes} classes in the file, "
            f"{own[head_keys[0]].shape[0]} in the data)"
        )
    missing = [k for k in own if k not in state and k not in head_keys]
    misshapen = [
        f"{k} {tuple(state[k].shape)} in the file, {tuple(own[k].shape)} here"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    if missing or misshapen:
        listed = (misshapen + [f"{k} missing" for k in missing])[:4]
        raise WeightsError(
            f"{label} does not fit this {type(net).__name__} (model.weights): "
            f"{len(missing)} tensors missing, {len(misshapen)} of another shape, e.g. "
            f"{'; '.join(listed)}: {what_fits(state)}"
        )
    ignored = sorted({k.split(".")[0] for k in state if k not in own})
    if ignored:
        notes.append(f"ignored (not in the model): {', '.join(ignored)}")
    net.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    loaded = sum(1 for k in state if k in own)
    log.info("model.weights: %d tensors from %s; %s", loaded, label, "; ".join(notes) or "all")


def what_fits(state: dict[str, Tensor]) -> str:
    """The advice for a file that does not fit: a kiln checkpoint's weights are keyed by kiln's
    wrapper (backbone./net.), the library's files by the library's own names."""
    if any(key.startswith(("backbone.", "net.")) for key in state):
        return "it holds a kiln model's weights: pass it as init_from=<file> instead"
    return "use weights made for model.arch (and this input size, for a fixed-size arch)"


class ZooClassifier(nn.Module):
    """A torchvision network split at its classifier layer:

    backbone(x) -> features (N, F) pooled (squeezenet: its feature map)
    -> dropout -> head -> logits (N, classes); aux (Linear on the pooled features)
    """

    def __init__(
        self,
        backbone: nn.Module,
        head: nn.Module,
        num_features: int,
        num_classes: int,
        dropout: float,
        aux_head: bool,
        fixed_input_size: bool,
        library_head: str = "fc",
    ):
        super().__init__()
        self.library_head = library_head  # the head's name in the library's own network
        self.backbone = backbone
        self.dropout = nn.Dropout(dropout)
        self.head = head
        self.aux = nn.Linear(num_features, num_classes) if aux_head else None
        self.head_prefixes = ("head", "aux")
        self.fixed_input_size = fixed_input_size

    def library_key(self, key: str) -> str:
        """A key of the library's own state dict (torchvision's file) as this model names it:
        init_from= such a file loads like a kiln checkpoint."""
        if self.library_head == "classifier.1":  # squeezenet: features -> classifier
            first, _, rest = key.partition(".")
            return {"features": f"backbone.{rest}", "classifier": f"head.{rest}"}.get(first, key)
        if key.startswith(f"{self.library_head}."):
            return "head." + key[len(self.library_head) + 1 :]
        return f"backbone.{key}"

    def forward(self, x: Tensor) -> Tensor | dict[str, Tensor]:
        features = self.backbone(x)
        logits = self.head(self.dropout(features))
        if self.aux is None:
            return logits
        pooled = features if features.dim() == 2 else features.mean(dim=(2, 3))
        return {"logits": logits, "aux_logits": self.aux(pooled)}


def split_at_head(net: nn.Module, head: str) -> tuple[nn.Module, nn.Module, int]:
    """(backbone, head module, feature width): the head layer cut out of the net."""
    from torchvision.models import SqueezeNet

    if isinstance(net, SqueezeNet):  # features -> (dropout, 1x1 conv, ReLU, pool) -> flatten
        width = net.classifier[1].in_channels
        return net.features, nn.Sequential(*net.classifier, nn.Flatten(1)), width
    layer = net.get_submodule(head)
    parent, _, attr = head.rpartition(".")
    setattr(net.get_submodule(parent) if parent else net, attr, nn.Identity())
    return net, layer, layer.in_features


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
        state = library_state(net, read_state_dict(source.path))
        load_weights(
            net, state, label=source.label, head=head, first_conv=first_conv,
            channels=spec.channels,
        )  # fmt: skip
    backbone, head_module, width = split_at_head(net, head)
    return ZooClassifier(
        backbone, head_module, width, spec.num_classes, cfg.dropout, aux_head, fixed, head
    )


# ---------------------------------------------------------------------------------------------
# timm


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
        close = difflib.get_close_matches(weights, tags, n=NUM_SUGGESTIONS, cutoff=0.4)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise ConfigError(
            f"timm has no pretrained tag {weights!r} for {arch}",
            "model.weights",
            f"{hint}tags: {', '.join(tags)}, or DEFAULT",
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
    state = read_state_dict(path)
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


class TimmClassifier(nn.Module):
    """A timm model, whole; with an aux head, its pooled pre-logits features also feed a Linear
    (timm's forward_features / forward_head(pre_logits=True))."""

    def __init__(self, net: nn.Module, num_classes: int, aux_head: bool, classifiers, fixed):
        super().__init__()
        self.net = net
        width = getattr(net, "head_hidden_size", None) or net.num_features
        self.aux = nn.Linear(width, num_classes) if aux_head else None
        self.head_prefixes = (*(f"net.{c}" for c in classifiers), "aux")
        self.fixed_input_size = fixed

    def library_key(self, key: str) -> str:
        """A key of timm's own state dict as this model names it (see ZooClassifier)."""
        return f"net.{key}"

    def forward(self, x: Tensor) -> Tensor | dict[str, Tensor]:
        if self.aux is None:
            return self.net(x)
        features = self.net.forward_features(x)
        logits = self.net.forward_head(features)
        pooled = self.net.forward_head(features, pre_logits=True)
        return {"logits": logits, "aux_logits": self.aux(pooled)}


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
            f"{str(err).splitlines()[0][:300]}: {what_fits(read_state_dict(source.path))}"
        ) from None
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


# ---------------------------------------------------------------------------------------------
# Shared


def check_image_spec(spec, cfg) -> None:
    if spec.input_kind != "image":
        raise ValueError(f"model {cfg.name} needs image data, got {spec.input_kind} ({spec})")


__all__ = [
    "TimmClassifier",
    "ZooClassifier",
    "build_timm",
    "build_torchvision",
    "hub_cache_dir",
    "timm_archs",
    "timm_preprocessing",
    "torch_hub_checkpoints",
    "torchvision_archs",
    "torchvision_preprocessing",
]
