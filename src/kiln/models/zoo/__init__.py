"""The model zoo: `model=torchvision` (any classification builder of torchvision.models) and
`model=timm` (any timm.list_models() name), sized from the data and, with `model.weights`,
initialised from pretrained weights found on this machine only.

    model.weights   null                random initialisation
                    DEFAULT, IMAGENET1K_V1, ...  torchvision weights, read from
                                        $TORCH_HOME/hub/checkpoints/<the file name of their URL>
                    a1_in1k, ..., DEFAULT   a timm pretrained tag (resnet18.a1_in1k), read from
                                        the Hugging Face hub cache ($HF_HOME, $HF_HUB_CACHE)
                    path/to/file.pth|.pt|.safetensors  a state dict (or a dict holding one
                                        under "model", "state_dict" or "model_state_dict"),
                                        read by kiln.models.weights, as init_from= is

Nothing is ever downloaded: a missing file is one error naming the file, the folder it belongs
in and where it comes from. A head of another size in the file is dropped and re-initialised;
a first convolution made for 3 channels is adapted to the data's (timm's adapt_input_conv, for
torchvision too).

Every zoo model declares `head_prefixes` (the module-name prefixes of its classifier head and aux
head: what model.freeze=backbone leaves trainable and optimizer.head_lr_mult scales) and
`fixed_input_size` (True: it takes only the input size it was built for, a ViT's positions).
Rebuilding a trained model (inference, rule 1's fresh builds) goes through `without_weights`:
the checkpoint holds the weights.

One module per library (torchvision.py, timm.py) around what they share: cache.py (where weights
are found), archs.py (names checked against the library's list), surgery.py (input convolution,
head, old key layouts) and wrappers.py (the nn.Modules a zoo model is)."""

from kiln.models.weights import WeightsError
from kiln.models.zoo.cache import hub_cache_dir, torch_hub_checkpoints
from kiln.models.zoo.timm import build_timm, timm_archs, timm_preprocessing
from kiln.models.zoo.torchvision import (
    build_torchvision,
    torchvision_archs,
    torchvision_num_params,
    torchvision_preprocessing,
)
from kiln.models.zoo.wrappers import TimmClassifier, ZooClassifier

__all__ = [
    "TimmClassifier",
    "WeightsError",
    "ZooClassifier",
    "build_timm",
    "build_torchvision",
    "hub_cache_dir",
    "timm_archs",
    "timm_preprocessing",
    "torch_hub_checkpoints",
    "torchvision_archs",
    "torchvision_num_params",
    "torchvision_preprocessing",
]
