"""model=<option>: one schema per model. Every model is built from the dataset's DataSpec plus
these keys; nothing here is a shape the data already tells."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, ClassVar

from omegaconf import MISSING

from kiln.config.base import ConfigError, at_least, check_branch_defaults, in_range, invalid
from kiln.registry import MODELS

MIB = 1024 * 1024


class Init(StrEnum):
    default = "default"  # PyTorch's per-layer defaults
    kaiming = "kaiming"
    xavier = "xavier"


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Options every model has."""

    name: str = MISSING  # the model (set by model=<option>)
    init: Init = Init.default  # weight initialisation: default | kaiming | xavier
    # Options that add an optional branch (a head, a loss term): rule 2 wants each off by default.
    branch_flags: ClassVar[tuple[str, ...]] = ()

    def check(self, key: str) -> None:
        check_branch_defaults(type(self), self.branch_flags, key, self.name)


@dataclass(frozen=True, kw_only=True)
class ClassifierConfig(ModelConfig):
    """Options every classifier has."""

    dropout: float = 0.0  # dropout probability before the classifier head
    aux_head: bool = False  # add an auxiliary classifier head (also switched on by loss.aux_head)
    # not trained: null | backbone (all but the head) | embeddings (what precedes the first
    # numbered layer) | layers:K (the embeddings and the first K layers) | [module-name prefixes]
    freeze: Any = None
    branch_flags: ClassVar[tuple[str, ...]] = ("aux_head",)

    def check(self, key: str) -> None:
        super().check(key)
        in_range(self.dropout, 0, 1, f"{key}.dropout", open_high=True)
        frozen = self.freeze
        if frozen in (None, "backbone", "embeddings"):
            return
        if isinstance(frozen, str) and re.fullmatch(r"layers:\d+", frozen):
            return
        if not isinstance(frozen, list | tuple) or not all(isinstance(p, str) for p in frozen):
            raise ConfigError(
                f"freeze={frozen!r} is none of backbone, embeddings, layers:K or a list of "
                "module-name prefixes",
                f"{key}.freeze",
                "use model.freeze=backbone, embeddings, layers:2 or [layer1,layer2]",
            )


@dataclass(frozen=True, kw_only=True)
class MlpConfig(ClassifierConfig):
    """A multilayer perceptron over flattened images."""

    dropout: float = 0.1
    hidden_dims: list[int] = field(default_factory=lambda: [256, 128])  # hidden layer widths

    def check(self, key: str) -> None:
        super().check(key)
        for width in self.hidden_dims:
            at_least(width, 1, f"{key}.hidden_dims")


@dataclass(frozen=True, kw_only=True)
class ResNetConfig(ClassifierConfig):
    """torchvision ResNet (weights=None), adapted to the data's channels and classes."""

    small_input_stem: bool | None = None  # 3x3 stem without max-pool (null: when side < 64)


@dataclass(frozen=True, kw_only=True)
class TextBowConfig(ClassifierConfig):
    """fastText: each word the mean of its own and its character n-grams' embeddings, a text the
    sum of its words' and its hashed token n-grams' -> linear classifier."""

    dropout: float = 0.3
    embed_dim: int = 32  # embedding width
    ngrams: int = 2  # longest token n-gram embedded (1: tokens only; 2: plus bigrams; ...)
    # character n-gram lengths of each vocabulary word ([shortest, longest]; []: none). [] here
    # and [2, 5] in conf/model/text_bow.yaml: a checkpoint saved before the option rebuilds as it
    # was trained. [2, 5] costs 2-3x the training time; on kiln's three package-text corpora it
    # is what brings text_bow level with TF-IDF + LinearSVC (docs/benchmarks.md)
    char_ngrams: list[int] = field(default_factory=list)
    num_buckets: int = 65536  # hash buckets shared by token and character n-grams (2**16)
    sparse_grads: bool = True  # gradients of the table rows a batch touches (one process, adamw)
    # a feature seen tf times in a text counts 1 + ln(tf), as TF-IDF's sublinear tf (else tf).
    # false here, true in conf/model/text_bow.yaml: a checkpoint saved before the option (its
    # config lacks the key) was trained on raw counts and rebuilds so
    sublinear_tf: bool = False

    def check(self, key: str) -> None:
        super().check(key)
        at_least(self.embed_dim, 1, f"{key}.embed_dim")
        at_least(self.ngrams, 1, f"{key}.ngrams")
        at_least(self.num_buckets, 1, f"{key}.num_buckets")
        grams = list(self.char_ngrams)
        if grams and (len(grams) != 2 or not 1 <= grams[0] <= grams[1]):
            raise invalid(
                f"{key}.char_ngrams",
                f"must be [shortest, longest] with 1 <= shortest <= longest, or [] for none; "
                f"got {grams}",
            )


@dataclass(frozen=True, kw_only=True)
class TextTransformerConfig(ClassifierConfig):
    """Token + position embeddings -> Transformer encoder (padding masked) -> mean -> linear."""

    dropout: float = 0.1
    embed_dim: int = 64  # model width; must be divisible by num_heads
    num_layers: int = 2  # encoder layers
    num_heads: int = 4  # attention heads per layer

    def check(self, key: str) -> None:
        super().check(key)
        at_least(self.num_layers, 1, f"{key}.num_layers")
        at_least(self.num_heads, 1, f"{key}.num_heads")
        if self.embed_dim % self.num_heads:
            divisors = [h for h in range(1, self.embed_dim + 1) if self.embed_dim % h == 0]
            raise ConfigError(
                f"embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}",
                f"{key}.num_heads",
                f"choose num_heads in {divisors[:8]}",
            )


@dataclass(frozen=True, kw_only=True)
class DetectorConfig(ModelConfig):
    """A small CenterNet (anchor-free, GroupNorm) trained from scratch; CPU-sized."""

    width: int = 32  # channels of the first stage (later stages: 2x and 4x)
    score_threshold: float = 0.05  # detections scoring below this are not returned
    max_detections: int = 50  # per image, at most (also the fixed K of the ONNX outputs)

    def check(self, key: str) -> None:
        super().check(key)
        at_least(self.width, 1, f"{key}.width")
        in_range(self.score_threshold, 0, 1, f"{key}.score_threshold", open_high=True)
        at_least(self.max_detections, 1, f"{key}.max_detections")


@dataclass(frozen=True, kw_only=True)
class PretrainedConfig(ModelConfig):
    """Options every model that loads weights has: an architecture of its library and the
    weights, which an init other than the default would overwrite."""

    PATH_KEYS: ClassVar[tuple[str, ...]] = ("weights",)

    arch: str = MISSING  # the library's architecture name
    weights: str | None = None  # null (random) | a name or tag | a .pth/.pt/.safetensors file

    def check(self, key: str) -> None:
        super().check(key)
        if self.weights is not None and str(self.init) != "default":
            raise ConfigError(
                f"init={self.init} would overwrite the weights {self.weights}",
                f"{key}.init",
                f"keep {key}.init=default with {key}.weights, or set {key}.weights=null",
            )


@dataclass(frozen=True, kw_only=True)
class ZooConfig(PretrainedConfig, ClassifierConfig):
    """Options every model-zoo classifier has: an architecture of the library and its weights."""


@dataclass(frozen=True, kw_only=True)
class TorchvisionConfig(ZooConfig):
    """Any classification builder of torchvision.models, head sized from the data's classes and
    the first convolution adapted to its channels. Weights: torchvision names (DEFAULT,
    IMAGENET1K_V1, ...) from $TORCH_HOME, or a file."""

    arch: str = "resnet18"  # torchvision.models.list_models(module=torchvision.models)


@dataclass(frozen=True, kw_only=True)
class TimmConfig(ZooConfig):
    """Any timm.list_models() architecture (timm.create_model with num_classes and in_chans).
    Weights: a pretrained tag (a1_in1k for resnet18.a1_in1k; DEFAULT: timm's default tag) from
    the Hugging Face hub cache, or a file."""

    arch: str = "resnet18"  # any timm.list_models() name (a pretrained tag goes in weights)
    drop_path_rate: float = 0.0  # stochastic depth, for the architectures that have it

    def check(self, key: str) -> None:
        super().check(key)
        in_range(self.drop_path_rate, 0, 1, f"{key}.drop_path_rate", open_high=True)


@dataclass(frozen=True, kw_only=True)
class TorchvisionDetectionConfig(PretrainedConfig):
    """Any detection builder of torchvision.models.detection (Faster R-CNN, RetinaNet, FCOS,
    SSD, SSDlite), its box predictor sized from the data's classes (+ the background), its
    min_size and max_size from data.image_size. Weights: a torchvision name (DEFAULT, COCO_V1)
    from $TORCH_HOME, or a file; the COCO class head is re-initialised."""

    PATH_KEYS: ClassVar[tuple[str, ...]] = ("weights", "weights_backbone")

    arch: str = "fasterrcnn_mobilenet_v3_large_320_fpn"  # list_models(torchvision.models.detection)
    weights: str | None = None  # null (random) | DEFAULT, COCO_V1, ... | a .pth/.safetensors file
    # BatchNorm layers frozen (torchvision's FrozenBatchNorm2d, as its pretrained detectors
    # train); false: BatchNorm2d, which needs large batches of images to learn its statistics
    frozen_batchnorm: bool = True
    # ImageNet weights of the backbone alone (Faster R-CNN, RetinaNet, FCOS: resnet50 or
    # mobilenet_v3_large), a torchvision name (DEFAULT, IMAGENET1K_V1) or a file; with weights
    # null (the detector's own COCO weights hold a backbone already)
    weights_backbone: str | None = None
    # backbone stages trained, counted from the top (torchvision's trainable_backbone_layers:
    # resnet 0..5, mobilenet 0..6); null: all of them
    trainable_layers: int | None = None

    def check(self, key: str) -> None:
        super().check(key)
        if self.weights is not None and self.weights_backbone is not None:
            raise ConfigError(
                "weights and weights_backbone are both set",
                f"{key}.weights_backbone",
                "the detector's weights hold its backbone's: set one of the two",
            )
        if self.trainable_layers is not None:
            at_least(self.trainable_layers, 0, f"{key}.trainable_layers")


@dataclass(frozen=True, kw_only=True)
class HfConfig(PretrainedConfig, ClassifierConfig):
    """Any model AutoModelForSequenceClassification builds (transformers), with num_labels and
    id2label/label2id from the data's classes, tokenizing with the model's own fast tokenizer.
    model.arch is a folder written by save_pretrained, a hub id read from the Hugging Face cache
    only (nothing is downloaded), or a model type (bert, roberta, ...) built small from scratch
    on kiln's own tokenizer."""

    PATH_KEYS: ClassVar[tuple[str, ...]] = ("arch",)

    arch: str = "bert"  # a save_pretrained folder | a hub id in the HF cache | a model type
    # auto: the weights beside the model's config.json (a folder or hub snapshot; none for a
    # model type) | null: random weights from the config | a .safetensors/.bin/.pt file
    weights: str | None = "auto"
    # config.json values to change (hidden_dropout_prob=0.2, ...); for a model type, on top of
    # kiln's small default size (2 layers, width 64, 2 heads)
    config: dict[str, Any] = field(default_factory=dict)
    # recompute each encoder layer's activations in the backward pass instead of keeping them:
    # less memory for longer texts or larger batches, about a third more compute
    gradient_checkpointing: bool = False
    # the most parameters the config may give the model, counted before anything is built
    # (null: no limit of its own; what the weights, their gradients and one sequence's
    # activations need is always compared with the memory this process may take)
    max_params: int | None = None
    # config.json and a shard index (*.index.json): a larger file is refused before it is
    # parsed (real ones are a few KB; one naming 20,000 classes is about 1 MB)
    max_config_bytes: int = 4 * MIB
    # each tokenizer file (tokenizer.json, tokenizer_config.json, vocab.txt, merges.txt, ...):
    # a larger one is refused before it is parsed (real ones go to ~30 MB: large multilingual
    # vocabularies; the default is about twice that)
    max_tokenizer_bytes: int = 64 * MIB

    def check(self, key: str) -> None:
        super().check(key)
        if self.max_params is not None:
            at_least(self.max_params, 1, f"{key}.max_params")
        at_least(self.max_config_bytes, 1024, f"{key}.max_config_bytes")
        at_least(self.max_tokenizer_bytes, 1024, f"{key}.max_tokenizer_bytes")


# Zoo architectures the default test suite checks against every registry-wide rule, at a small
# input size: cheap members of convolutional and transformer families.
TORCHVISION_SAMPLES = (
    "resnet18",
    "mobilenet_v3_small",
    "squeezenet1_1",
    "efficientnet_b0",
    "shufflenet_v2_x0_5",
    "googlenet",
    "swin_t",
)
TIMM_SAMPLES = (
    "resnet10t",
    "mobilenetv3_small_050",
    "convnext_atto",
    "efficientnet_b0",
    "vit_tiny_patch16_224",
    "deit_tiny_distilled_patch16_224",
    "levit_128s",
    "mixer_s32_224",
)
# model=hf: model types built small from scratch (no download), on kiln's own tokenizer.
HF_SAMPLES = ("bert", "distilbert", "roberta", "deberta-v2", "albert", "electra")

# inputs: the DataSpec.input_kind values a model accepts (the suite pairs it with every dataset
# that provides one of them; train.py refuses other pairings at start-up).
MODELS.declare("mlp", "kiln.models.mlp:build_mlp", config=MlpConfig, inputs=("image",))
MODELS.declare(
    "resnet18", "kiln.models.resnet:build_resnet18", config=ResNetConfig, inputs=("image",)
)
MODELS.declare(
    "resnet50", "kiln.models.resnet:build_resnet50", config=ResNetConfig, inputs=("image",)
)
MODELS.declare(
    "text_bow",
    "kiln.models.text:build_text_bow",
    config=TextBowConfig,
    inputs=("tokens",),
    preprocessing="kiln.models.text:text_bow_input",  # unknown words spelled (WordSpelling)
)
MODELS.declare(
    "text_transformer",
    "kiln.models.text:build_text_transformer",
    config=TextTransformerConfig,
    inputs=("tokens",),
)
# preprocessing: a function (model config) -> PretrainedInput | None, run at start-up before the
# data is built and without loading any weights: the weights' own mean, std and input size; it
# also checks model.arch and model.weights (names, files, caches) against the library.
# archs: a function listing every model.arch (num_params: an arch's size, where published);
# samples: the ones the default test suite puts through the registry-wide rules (every arch runs
# under -m slow); help: for --help.
MODELS.declare(
    "torchvision",
    "kiln.models.zoo:build_torchvision",
    config=TorchvisionConfig,
    inputs=("image",),
    preprocessing="kiln.models.zoo:torchvision_preprocessing",
    archs="kiln.models.zoo:torchvision_archs",
    num_params="kiln.models.zoo:torchvision_num_params",
    samples=TORCHVISION_SAMPLES,
    help=(
        "model.arch: any classification builder of torchvision.models; list them with\n"
        '  python -c "import torchvision.models as m; print(*m.list_models(module=m), '
        "sep='\\n')\"\n"
        "model.weights names: torchvision.models.get_model_weights('resnet18').__members__; "
        "their files go in $TORCH_HOME/hub/checkpoints (~/.cache/torch/hub/checkpoints)"
    ),
)
MODELS.declare(
    "timm",
    "kiln.models.zoo:build_timm",
    config=TimmConfig,
    inputs=("image",),
    preprocessing="kiln.models.zoo:timm_preprocessing",
    archs="kiln.models.zoo:timm_archs",
    samples=TIMM_SAMPLES,
    help=(
        "model.arch: any of timm.list_models(); list them (a pattern narrows) with\n"
        "  python -c \"import timm; print(*timm.list_models('convnext*'), sep='\\n')\"\n"
        "model.weights tags: timm.list_pretrained('resnet18.*') (resnet18.a1_in1k -> a1_in1k); "
        "their files go in the Hugging Face cache ($HF_HOME/hub, ~/.cache/huggingface/hub)"
    ),
)
# uses_pretrained: the builder takes `pretrained=` (what the preprocessing function returned,
# or what a checkpoint recorded of it): model=hf rebuilds its architecture from the recorded
# config.json, without the folder it came from.
MODELS.declare(
    "hf",
    "kiln.models.zoo.transformers:build_hf",
    config=HfConfig,
    inputs=("tokens",),
    preprocessing="kiln.models.zoo.transformers:hf_preprocessing",
    uses_pretrained=True,
    samples=HF_SAMPLES,
    archs="kiln.models.zoo.transformers:sequence_classification_types",
    help=(
        "model.arch: a folder written by save_pretrained (model and tokenizer), a hub id in the\n"
        "  Hugging Face cache ($HF_HOME/hub; fill it with `hf download <id>`), or a model type\n"
        "  (bert, roberta, ...) built small from scratch on kiln's own tokenizer\n"
        "model.weights: auto (the folder's), null (random) or a file; docs/transformers.md"
    ),
)
MODELS.declare(
    "detector", "kiln.models.detector:build_detector", config=DetectorConfig, inputs=("image_list",)
)
MODELS.declare(
    "torchvision_detection",
    "kiln.models.zoo.detection:build_torchvision_detection",
    config=TorchvisionDetectionConfig,
    inputs=("image_list",),
    help=(
        "model.arch: any builder of torchvision.models.detection (fasterrcnn_*, retinanet_*, "
        "fcos_*, ssd300_vgg16, ssdlite320_mobilenet_v3_large); list them with\n"
        '  python -c "import torchvision.models as m; '
        "print(*m.list_models(module=m.detection), sep='\\n')\"\n"
        "model.weights names: torchvision.models.get_model_weights(arch).__members__; their "
        "files go in $TORCH_HOME/hub/checkpoints (~/.cache/torch/hub/checkpoints)"
    ),
)
