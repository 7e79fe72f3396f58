"""torchvision ResNets (weights=None), adapted to the data: input channels and classes from the
spec, and a 3x3 stride-1 stem without max-pool when images are small (CIFAR-style)."""

from __future__ import annotations

from torch import Tensor, nn
from torchvision.models import resnet18, resnet50

from kiln.config.model import ResNetConfig

SMALL_INPUT_SIDE = 64  # below this, the 7x7/2 stem + max-pool would discard most of the image


class KilnResNet(nn.Module):
    """The torchvision network, run stage by stage so an auxiliary head can tap layer3."""

    head_prefixes = ("net.fc", "aux")  # the classifier heads (model.freeze, head_lr_mult)

    def __init__(self, net: nn.Module, num_classes: int, aux_head: bool):
        super().__init__()
        self.net = net
        aux_width = net.layer3[-1].conv1.in_channels  # layer3's output width
        self.aux = nn.Linear(aux_width, num_classes) if aux_head else None

    def forward(self, x: Tensor) -> Tensor | dict[str, Tensor]:
        n = self.net
        x = n.maxpool(n.relu(n.bn1(n.conv1(x))))
        x = n.layer3(n.layer2(n.layer1(x)))
        aux = self.aux(x.mean(dim=(2, 3))) if self.aux is not None else None
        logits = n.fc(n.avgpool(n.layer4(x)).flatten(1))
        return logits if aux is None else {"logits": logits, "aux_logits": aux}


def _adapt(factory, spec, cfg: ResNetConfig, aux_head: bool) -> KilnResNet:
    if spec.input_kind != "image":
        raise ValueError(f"model {cfg.name} needs image data, got {spec.input_kind}")
    net = factory(weights=None, num_classes=spec.num_classes)
    small = cfg.small_input_stem
    if small is None:
        small = min(spec.image_size) < SMALL_INPUT_SIDE
    if small:
        net.conv1 = nn.Conv2d(spec.channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        net.maxpool = nn.Identity()
    elif spec.channels != 3:
        net.conv1 = nn.Conv2d(spec.channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    if cfg.dropout > 0:
        net.fc = nn.Sequential(nn.Dropout(cfg.dropout), net.fc)
    return KilnResNet(net, spec.num_classes, aux_head)


def build_resnet18(spec, cfg: ResNetConfig, *, aux_head: bool = False) -> KilnResNet:
    return _adapt(resnet18, spec, cfg, aux_head)


def build_resnet50(spec, cfg: ResNetConfig, *, aux_head: bool = False) -> KilnResNet:
    return _adapt(resnet50, spec, cfg, aux_head)
