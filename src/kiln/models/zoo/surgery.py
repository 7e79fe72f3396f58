"""State-dict and module surgery on a library's network (torchvision's; timm does its own):
the input convolution adapted to the data's channels, the classifier head found, cut out or
re-initialised, old key layouts renamed, a library-layout state dict loaded with what did not
fit named."""

from __future__ import annotations

import logging
import re

import torch
from torch import Tensor, nn

from kiln.errors import first_few
from kiln.models.weights import WeightsError

log = logging.getLogger(__name__)


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
    num_classes: int | None = None,
) -> None:
    """Load a library-layout state dict into `net`: the input convolution adapted to the data's
    channels, the head's tensors of another size dropped (the net's new ones stay; `num_classes`:
    the classes the net's head is built for, where its outputs are not one per class), keys the
    net does not have (googlenet's aux logits) ignored. Any other missing or misshapen tensor is
    an error."""
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
    # Only the head's tensors sized by the classes: a detector's head also holds layers that are
    # not (SSDlite's depthwise convolutions and their BatchNorm), which load from the file.
    resized = [k for k in head_keys if k in state and state[k].shape != own[k].shape]
    if resized:
        first = resized[0]
        # A detector's class layer has (anchors or boxes) x classes outputs: the classes are the
        # model's count scaled by the file's outputs over the model's.
        classes = num_classes or own[first].shape[0]
        saved_classes = state[first].shape[0] * classes // own[first].shape[0]
        for k in resized:
            state.pop(k)
        notes.append(
            f"head {first_few(resized, 4)} re-initialised ({saved_classes} classes in the file, "
            f"{classes} in the data)"
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
