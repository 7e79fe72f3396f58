"""`model=hf`: any model AutoModelForSequenceClassification builds, sized from the data's classes
(num_labels, id2label, label2id), with its own fast tokenizer for the data.

    model.arch   a folder written by save_pretrained (config.json, the weights, tokenizer.json)
                 a hub id (org/name), read from the Hugging Face cache only -- never downloaded
                 a model type (bert, roberta, deberta-v2, ...): built small from scratch, on the
                 tokenizer kiln learns from the data
    model.weights  auto: the weights beside config.json (none for a model type); null: random
                 weights from the config; a .safetensors/.bin/.pt file

Before transformers opens a folder's files, kiln.models.zoo.hf_folder checks them (confined to
the folder, sizes bounded, no `auto_map` code) and kiln.models.zoo.hf_size counts the model its
config.json asks for on the meta device; transformers is always called with
trust_remote_code=False and with nothing to read on stdin. The weights are read by
kiln.models.weights.read_state_dict (the one reader) and matched by name and shape: a head of
another size (another number of classes) is re-initialised and said so, as for the other zoo
models. The tokenizer and config.json travel in the checkpoint (PretrainedText),
so inference and serving need neither the folder nor the hub again."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from kiln.config.base import ConfigError
from kiln.config.model import HfConfig
from kiln.errors import attempt, did_you_mean, first_few
from kiln.graph import graph_leaves
from kiln.models.weights import WeightsError, check_values, read_state_dict
from kiln.models.zoo.cache import hub_cache_dir, weight_file
from kiln.models.zoo.hf_folder import (
    CONFIG_FILE,
    SHARD_INDEXES,
    WEIGHT_FILES,
    check_folder,
    check_weights_fit_memory,
    folder_root,
    read_json,
    shard_files,
)
from kiln.models.zoo.hf_size import check_model_size
from kiln.models.zoo.wrappers import HfClassifier
from kiln.preprocessing.pretrained import PretrainedText
from kiln.threads import available_memory

log = logging.getLogger(__name__)

AUTO_WEIGHTS = "auto"
# A model type built from scratch: small enough for a CPU run in seconds (model.config grows it).
SMALL_SIZE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 128,
}
# Size settings of model types that name theirs otherwise (Perceiver: its latents), set to
# the small size where the type has them: otherwise "small" would be the library's full size.
SMALL_SIZE_ELSEWHERE = {"d_latents": 64, "num_latents": 32, "num_self_attends_per_block": 2}


def position_offset(config: Any) -> int:
    """How many position ids come before the first token's, as the model itself says: a
    position embedding with a padding row numbers positions after it (RoBERTa's
    create_position_ids_from_input_ids and its kin; MPNet pads at 1 whatever the config), so
    its last usable position is max_position_embeddings - padding_idx - 1. Read from the
    model's own modules, built on the meta device (no memory, a tenth of a second), not from a
    list of model types that falls behind transformers. 0 where the build fails there (the real
    build names why)."""
    return _position_offset(type(config), config.to_json_string(use_diff=False))


@functools.lru_cache(maxsize=64)
def _position_offset(config_class: type, config_json: str) -> int:
    from transformers import AutoModel

    data = json.loads(config_json)
    # the embeddings are what is read: one layer builds faster (not every type lets it be set)
    config, failed = attempt(config_class.from_dict, {**data, "num_hidden_layers": 1})
    if failed is not None:
        config, failed = attempt(config_class.from_dict, data)
    if failed is not None:
        return 0
    with torch.device("meta"):
        model, failed = attempt(AutoModel.from_config, config)
    if failed is not None:
        return 0
    for name, module in model.named_modules():
        padding = getattr(module, "padding_idx", None)
        if name.rsplit(".", 1)[-1] == "position_embeddings" and padding is not None:
            return int(padding) + 1
    return 0


UNBOUNDED = 1_000_000  # a tokenizer's model_max_length past this is "no limit" (transformers' 1e30)


@dataclass(frozen=True)
class HfSource:
    """Where model.arch points: a folder (its own, or a hub snapshot), or a model type."""

    arch: str
    folder: Path | None  # None: a model type, built from scratch
    label: str


def model_types() -> tuple[str, ...]:
    from transformers import CONFIG_MAPPING

    return tuple(CONFIG_MAPPING.keys())


def sequence_classification_types() -> tuple[str, ...]:
    """The model types AutoModelForSequenceClassification maps: every model.arch the slow
    registry-wide suite builds small from scratch."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES as MAPPED,
    )

    return tuple(sorted(MAPPED))


def resolve_source(arch: str) -> HfSource:
    """model.arch -> a folder holding config.json, or a model type. A hub id is looked up in
    the hub cache ($HF_HUB_CACHE, $HF_HOME/hub) only; HF_HUB_OFFLINE or not, nothing is fetched."""
    path = Path(arch).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"{path} has no config.json",
                "model.arch",
                "pass a folder written by save_pretrained (model and tokenizer)",
            )
        return HfSource(arch, path.resolve(), f"hf folder {path.resolve()}")
    if arch in model_types():
        return HfSource(arch, None, f"hf model type {arch} (from scratch)")
    if arch.count("/") > 1 or arch.startswith((".", "/", "~")) or path.suffix:
        raise ConfigError(
            f"no folder {path}",
            "model.arch",
            f"pass a folder written by save_pretrained, a hub id (org/name) or a model type "
            f"(bert, roberta, ...); looked in {Path.cwd()}",
        )
    return HfSource(arch, hub_snapshot(arch), f"hf hub {arch}")


def hub_snapshot(repo_id: str) -> Path:
    """The cached snapshot of `repo_id` (the one refs/main names) holding its config.json."""
    from huggingface_hub import try_to_load_from_cache

    cache = hub_cache_dir()
    found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache)
    if isinstance(found, str):
        return Path(found).parent
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    hint = did_you_mean(repo_id, cached_repo_ids(cache), spell=lambda c: f"model.arch={c}")
    raise ConfigError(
        f"hf model {repo_id} is not on this machine (kiln downloads nothing; looked in {folder})",
        "model.arch",
        f"run `hf download {repo_id}` where there is internet (HF_HOME or HF_HUB_CACHE move the "
        f"cache), or pass model.arch=<a folder written by save_pretrained>{hint}",
    )


def cached_repo_ids(cache: Path) -> list[str]:
    """The model repos the hub cache holds (models--org--name folders), as hub ids."""
    if not cache.is_dir():
        return []
    prefix = "models--"
    return sorted(
        p.name[len(prefix) :].replace("--", "/", 1)
        for p in cache.iterdir()
        if p.name.startswith(prefix) and p.is_dir()
    )


# ---------------------------------------------------------------------------------------------
# The tokenizer and the numbers the data must respect (start-up, before the data is built)


def hf_preprocessing(cfg: HfConfig) -> PretrainedText | None:
    """The model's own fast tokenizer and config.json, as plain data; None for a model type
    (kiln learns its tokenizer from the data). Checks model.arch and model.weights first."""
    source = resolve_source(cfg.arch)
    if source.folder is None:
        if cfg.weights not in (None, AUTO_WEIGHTS):
            weight_file(cfg.weights)  # a file for a from-scratch type: it must exist
        return None
    # The folder's files, then the size its config.json asks for, then its weights' files, all
    # before transformers reads any of them (and before the data is built).
    config = check_folder(
        source.folder,
        source.label,
        max_config_bytes=cfg.max_config_bytes,
        max_tokenizer_bytes=cfg.max_tokenizer_bytes,
    )
    typed = transformers_config(config, cfg, source.label)
    check_size(typed, cfg, source.label)
    path = weights_of(source, cfg.weights)  # a missing weights file fails now, not after the data
    if path is not None:
        check_weights_fit_memory(weight_files(path, source, cfg), available_memory(), source.label)
    tokenizer = fast_tokenizer(source)
    backend = tokenizer.backend_tokenizer
    tokenizer_json = backend.to_str()
    pad_id = tokenizer.pad_token_id
    if pad_id is None:  # GPT-style vocabularies: pad with end-of-text, masked all the same
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return PretrainedText(
        source=source.label,
        tokenizer_json=tokenizer_json,
        tokenizer_sha256=hashlib.sha256(tokenizer_json.encode()).hexdigest(),
        special_tokens={k: str(v) for k, v in tokenizer.special_tokens_map.items()},
        pad_id=int(pad_id),
        unk_id=tokenizer.unk_token_id,
        position_limit=position_limit(typed, tokenizer.model_max_length),
        lowercase=normalizer_lowercases(json.loads(tokenizer_json).get("normalizer")),
        model_input_names=tuple(tokenizer.model_input_names),
        model_config=config,
        sep_id=tokenizer.sep_token_id,
    )


@functools.lru_cache(maxsize=4)
def folder_sep_id(folder: Path) -> int | None:
    """The separator token of a folder's tokenizer (a fresh build during training)."""
    return fast_tokenizer(HfSource(str(folder), folder, f"hf folder {folder}")).sep_token_id


@contextlib.contextmanager
def nothing_on_stdin():
    """stdin replaced by an empty stream: a library that asks (transformers' "[y/N]" before it
    runs a folder's code) reads end-of-file, never what a user or `yes |` would type."""
    saved = sys.stdin
    with open(os.devnull, encoding="utf-8") as empty:
        sys.stdin = empty
        try:
            yield
        finally:
            sys.stdin = saved


def fast_tokenizer(source: HfSource):
    from transformers import AutoTokenizer

    try:
        with warnings.catch_warnings(), nothing_on_stdin():
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(
                str(source.folder), local_files_only=True, trust_remote_code=False
            )
    except (OSError, ValueError, TypeError, KeyError) as err:
        raise ConfigError(
            f"{source.label}: no tokenizer could be read ({str(err).splitlines()[0][:200]})",
            "model.arch",
            "save the model's tokenizer beside it (tokenizer.save_pretrained(folder))",
        ) from None
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(
            f"{source.label}: its tokenizer ({type(tokenizer).__name__}) has no fast (Rust) "
            "version, which kiln's token cache, infer.py and the server run",
            "model.arch",
            "save a tokenizer.json beside the model (convert it with transformers' "
            "convert_slow_tokenizer where that is possible), or pick a model that has one",
        )
    return tokenizer


def config_dict(folder: Path, cfg: HfConfig, label: str) -> dict[str, Any]:
    """The folder's config.json, bounded by model.max_config_bytes before it is parsed."""
    return read_json(folder / CONFIG_FILE, cfg.max_config_bytes, label, "model.max_config_bytes")


def transformers_config(data: dict[str, Any], cfg: HfConfig, label: str) -> Any:
    """config.json as its transformers config class (never a class of the folder's own: a
    recorded or checked config.json's `auto_map` is dropped, the class is model_type's), with
    model.config's changes."""
    from transformers import CONFIG_MAPPING

    data = {k: v for k, v in data.items() if k != "auto_map"}
    model_type = data.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(
            f"{label}: config.json has model_type {model_type!r}, which transformers does not know",
            "model.arch",
            "use a model saved by save_pretrained of a transformers architecture",
        )
    try:
        config = CONFIG_MAPPING[model_type].from_dict(data)
    except (ValueError, TypeError, KeyError) as err:  # the config class refuses the file's values
        raise ConfigError(
            f"{label}: transformers cannot read its config.json "
            f"({str(err).splitlines()[0][:200] if str(err) else type(err).__name__})",
            "model.arch",
            "save the model again with save_pretrained",
        ) from None
    for key, value in dict(cfg.config).items():
        if not hasattr(config, key):
            raise ConfigError(
                f"{type(config).__name__} has no setting {key!r}",
                f"model.config.{key}",
                "use a key of the model's config.json",
            )
        setattr(config, key, value)
    return config


def check_size(
    config: Any, cfg: HfConfig, label: str, length: int | None = None, name: str = "config.json"
) -> None:
    """The model `config` describes, counted on the meta device, against model.max_params and
    the memory this process may take (kiln.models.zoo.hf_size); a config.json whose model
    transformers cannot build is one error too. `name`: what the error calls the config."""
    try:
        check_model_size(
            config,
            label,
            max_params=cfg.max_params,
            available=available_memory(),
            length=length,
            config_name=name,
        )
    except (ValueError, TypeError, IndexError, AttributeError) as err:
        if isinstance(err, ConfigError):
            raise
        # transformers' own refusal of the sizes (hidden_size not a multiple of the heads...)
        raise ConfigError(
            f"{label}: transformers cannot build the model its config.json describes "
            f"({str(err).splitlines()[0][:200] if str(err) else type(err).__name__})",
            "model.arch",
            "save the model again with save_pretrained",
        ) from None


# (config.json as JSON, max_length, model.max_params) already judged to fit: the run's own
# later copies of its model (the probes' fresh builds) are not judged again against a memory
# the first copy now holds.
_FITS: set[tuple[str, int | None, int | None]] = set()


def check_size_once(config: Any, cfg: HfConfig, source: HfSource, length: int | None) -> None:
    key = (config.to_json_string(use_diff=False), length, cfg.max_params)
    if key not in _FITS:
        # a model type's config is kiln's small size with model.config's changes
        name = "config.json" if source.folder is not None else "config (with model.config)"
        check_size(config, cfg, source.label, length, name)
        _FITS.add(key)


def position_limit(config: Any, model_max_length: int | None = None) -> int:
    """The longest sequence the model's position embeddings take (`config`: its transformers
    config), and its tokenizer's model_max_length when that is set to a real number."""
    limit = int(getattr(config, "max_position_embeddings", None) or UNBOUNDED)
    if limit < UNBOUNDED:
        limit -= position_offset(config)
    if model_max_length is not None and 0 < model_max_length < UNBOUNDED:
        limit = min(limit, int(model_max_length))
    return limit


def normalizer_lowercases(normalizer: dict | None) -> bool:
    """Whether a tokenizer.json normalizer lower-cases (BertNormalizer lowercase=true, a
    Lowercase step, possibly inside a Sequence)."""
    if not normalizer:
        return False
    if normalizer.get("type") == "Lowercase" or normalizer.get("lowercase") is True:
        return True
    return any(normalizer_lowercases(n) for n in normalizer.get("normalizers", []))


# ---------------------------------------------------------------------------------------------
# The model


def build_hf(
    spec, cfg: HfConfig, *, aux_head: bool = False, pretrained: PretrainedText | None = None
) -> HfClassifier:
    """The model for `spec`'s classes. `pretrained`: what hf_preprocessing returned (or a
    checkpoint recorded of it): its config.json is used, so a checkpoint rebuilds without the
    folder; without it, model.arch is resolved again."""
    if spec.input_kind != "tokens":
        raise ValueError(f"model hf needs token data (data=csv_text), got {spec.input_kind}")
    source = None
    if pretrained is None and cfg.weights is None and not _is_folder_or_hub(cfg.arch):
        source = HfSource(cfg.arch, None, f"hf model type {cfg.arch}")
    elif pretrained is None:
        source = resolve_source(cfg.arch)
    config = architecture(spec, cfg, source, pretrained)
    if source is not None and not torch.empty(0).is_meta:  # a checkpoint's: its weights' size
        check_size_once(config, cfg, source, spec.max_length)
    from transformers import AutoModelForSequenceClassification

    with warnings.catch_warnings(), nothing_on_stdin():
        warnings.simplefilter("ignore")
        net = AutoModelForSequenceClassification.from_config(config, trust_remote_code=False)
    if cfg.weights is not None and source is not None:
        path = weights_of(source, cfg.weights)
        if path is not None:
            files = weight_files(path, source, cfg)
            load_hf_weights(net, read_weights(files), label=f"{source.label} ({path.name})")
    elif cfg.weights is None and source is not None and source.folder is not None:
        log.info("model.weights=null: %s built from its config.json, random weights", cfg.arch)
    if cfg.gradient_checkpointing:
        if not net.supports_gradient_checkpointing:
            raise ConfigError(
                f"{type(net).__name__} does not support gradient checkpointing",
                "model.gradient_checkpointing",
                "set model.gradient_checkpointing=false",
            )
        # non-reentrant: works with frozen embeddings and keeps autograd's usual semantics
        net.gradient_checkpointing_enable({"use_reentrant": False})
    sep_id = None
    if pretrained is not None:
        sep_id = pretrained.sep_id
    elif source is not None and source.folder is not None:
        sep_id = folder_sep_id(source.folder)
    if int(getattr(config, "type_vocab_size", 0) or 0) < 2:
        sep_id = None  # the model has no token types (RoBERTa's one, DistilBERT's none)
    model = HfClassifier(net, spec.num_classes, spec.pad_id, aux_head, sep_id=sep_id)
    freeze_unreached(model)
    return model


def freeze_unreached(model: HfClassifier, length: int = 8) -> list[str]:
    """Freezes the parameters the library's own classification forward never reaches, says so
    and returns their names. Some architectures carry them by design: BigBird's pooler (its head
    reads the first token's hidden state, not the pooler), a DeepSeek-style sparse-attention
    indexer (trained by an objective of its own, which a classifier does not have). Left
    trainable they would stop every run at rule 2 with advice about a model kiln does not own,
    make DDP wait for gradients that never come and take weight decay for nothing. Found by one
    train-mode forward of two short texts and a walk of its autograd graph (no backward: no
    gradient the size of the model; torch's random numbers forked, so the run's stream is
    untouched); skipped on the meta device and under inference mode, where nothing trains."""
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    if not params or next(iter(params.values())).is_meta or torch.is_inference_mode_enabled():
        return []
    training = model.training
    try:
        reached, err = attempt(_reached_by_two_texts, model, length)
    finally:
        model.train(training)
    if err is not None:  # whatever the library raises on these ids
        # Some models need what two made-up texts lack (BART reads each text's </s>); a model
        # whose forward fails on the data too is reported by the run's checks before step 1.
        log.debug("model=hf: the unreached-parameter check did not run: %s", err)
        return []
    unreached = [name for name, p in params.items() if id(p) not in reached]
    for name in unreached:
        params[name].requires_grad_(False)
    if unreached:
        log.info(
            "model=hf %s: %d parameter(s) its classification forward never reaches are frozen: %s",
            type(model.net).__name__,
            len(unreached),
            first_few(unreached),
        )
    return unreached


def _reached_by_two_texts(model: HfClassifier, length: int) -> set[int]:
    """The ids of the leaves the train-mode forward of two made-up texts reaches."""
    vocab = int(model.net.config.get_text_config().vocab_size)
    ids = torch.arange(2 * length).reshape(2, length) % max(vocab - 1, 1)
    ids = torch.where(ids >= model.pad_id, ids + 1, ids).clamp(max=vocab - 1)  # not padding
    ids[1, length // 2 :] = model.pad_id  # a padded text: the mask's path too
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        model.train()
        out = model(ids.to(next(model.parameters()).device))
        return graph_leaves(out.values() if isinstance(out, dict) else [out])


def _is_folder_or_hub(arch: str) -> bool:
    return Path(arch).expanduser().is_dir() or arch not in model_types()


def architecture(spec, cfg: HfConfig, source: HfSource | None, pretrained) -> Any:
    """The transformers config: config.json (recorded, or the folder's) or a small one of the
    model type, then model.config's changes, then the data's classes."""
    from transformers import AutoConfig

    if pretrained is not None or (source is not None and source.folder is not None):
        label = getattr(source, "label", cfg.arch)
        recorded = pretrained.model_config if pretrained is not None else None
        data = recorded if recorded is not None else config_dict(source.folder, cfg, label)
        config = transformers_config(data, cfg, label)
        if spec.vocab_size is not None and spec.vocab_size > config.vocab_size:
            raise ConfigError(
                f"the tokenizer has {spec.vocab_size} tokens, the model's embeddings "
                f"{config.vocab_size}",
                "model.arch",
                "save the model after model.resize_token_embeddings(len(tokenizer))",
            )
    else:
        positions = int(spec.max_length or 512)
        config = AutoConfig.for_model(
            cfg.arch,
            vocab_size=spec.vocab_size,
            pad_token_id=spec.pad_id,
            max_position_embeddings=positions,
            **SMALL_SIZE,
        )
        # the data's longest text in positions after the padding row, where the model has one
        config.max_position_embeddings = positions + position_offset(config)
        for key, small in SMALL_SIZE_ELSEWHERE.items():
            if hasattr(config, key):
                setattr(config, key, small)
        parts = sized_parts(config)
        if parts:
            raise ConfigError(
                f"model type {cfg.arch!r} is built of {' and '.join(parts)}, each sized by its "
                "own settings: kiln's small from-scratch size (hidden 64, 2 layers) reaches "
                "none of them, so it would be the library's full-size model",
                "model.arch",
                "give a folder save_pretrained wrote at the size you want (model.arch=<folder>), "
                "or a text-only model type (bert, roberta, llama, ...)",
            )
        for key, value in dict(cfg.config).items():
            if not hasattr(config, key):
                raise ConfigError(
                    f"{type(config).__name__} has no setting {key!r}",
                    f"model.config.{key}",
                    "use a key of the model's config.json",
                )
            setattr(config, key, value)
    if cfg.dropout > 0:
        if not hasattr(config, "classifier_dropout"):
            log.warning(
                "model.dropout=%s ignored: %s has no classifier_dropout",
                cfg.dropout,
                type(config).__name__,
            )
        else:
            config.classifier_dropout = cfg.dropout
    config.id2label = dict(enumerate(spec.class_names))
    config.label2id = {name: i for i, name in enumerate(spec.class_names)}
    config.num_labels = spec.num_classes
    if spec.multi_label:  # kiln computes the loss (BCE); said for readers of config.json
        config.problem_type = "multi_label_classification"
    return config


def sized_parts(config) -> list[str]:
    """The sub-configs with sizes of their own (a multimodal model's text_config and
    vision_config, an encoder-decoder's encoder and decoder), which SMALL_SIZE set on the
    top-level config does not reach."""
    subs = getattr(config, "sub_configs", None) or {}
    return [k for k in subs if any(hasattr(getattr(config, k, None), key) for key in SMALL_SIZE)]


def weights_of(source: HfSource, weights: str | None) -> Path | None:
    """The weights file model.weights names: the folder's own (auto), a file, or none."""
    if weights is None:
        return None
    if weights != AUTO_WEIGHTS:
        return weight_file(weights)
    if source.folder is None:
        return None  # a model type: auto is random weights
    for name in (*WEIGHT_FILES, *SHARD_INDEXES):
        if (source.folder / name).is_file():
            return source.folder / name
    raise ConfigError(
        f"{source.label} has no weights ({' or '.join(WEIGHT_FILES)})",
        "model.weights",
        "save them with model.save_pretrained(folder), or set model.weights=null for random ones",
    )


def weight_files(path: Path, source: HfSource, cfg: HfConfig) -> list[Path]:
    """The files model.weights reads: `path`, or every shard a *.index.json of the folder names
    (each confined to the folder's root: kiln.models.zoo.hf_folder.shard_files)."""
    if not path.name.endswith(".index.json"):
        return [path]
    own = cfg.weights == AUTO_WEIGHTS and source.folder is not None  # else the user's own file
    root = folder_root(source.folder if own else path.parent)
    return shard_files(path, root, source.label, cfg.max_config_bytes)


def read_weights(files: list[Path]) -> dict[str, Tensor]:
    """A state dict from a weights file, or from every shard of an index (`weight_files`)."""
    state: dict[str, Tensor] = {}
    for file in files:
        state.update(read_state_dict(file, "model.weights"))
    return state


def load_hf_weights(net: nn.Module, state: dict[str, Tensor], *, label: str) -> None:
    """Load a library-layout state dict into the transformers model `net`, matched by name and
    shape. The file may be of the base model (no `bert.` prefix) or of another head: the head
    (every module outside the base model) keeps its fresh weights when the file's are missing
    or of another size, and is named. A missing or misshapen tensor of the encoder is an
    error; tensors the model does not have (a pre-training head) are ignored and named."""
    own = net.state_dict()
    prefix = f"{net.base_model_prefix}."
    if not own.keys() & state.keys():  # a base model's file: keys without the prefix
        state = {prefix + k: v for k, v in state.items()}
    check_values(state, own, label)
    head = [k for k in own if not k.startswith(prefix)]
    misshapen = [k for k in own if k in state and state[k].shape != own[k].shape]
    refit = [k for k in head if k not in state or k in misshapen]
    notes = []
    if refit:
        classes = next((int(state[k].shape[0]) for k in refit if k in state), None)
        held = f"{classes} classes in the file" if classes is not None else "not in the file"
        notes.append(
            f"head {', '.join(refit)} re-initialised ({held}, {net.config.num_labels} in the data)"
        )
    tied = set(getattr(net, "_tied_weights_keys", None) or ())
    bad = [k for k in misshapen if k not in head]
    missing = [k for k in own if k not in state and k not in head and k not in tied]
    if bad:
        shown = "; ".join(
            f"{k} {tuple(state[k].shape)} in the file, {tuple(own[k].shape)} here" for k in bad[:4]
        )
        raise WeightsError(
            f"{label} does not fit this {type(net).__name__} (model.weights): {len(bad)} tensors "
            f"of another shape, e.g. {shown}: use the weights saved with this config.json"
        )
    if missing:
        notes.append(
            f"{len(missing)} encoder tensors not in the file, left as initialised: "
            f"{', '.join(missing[:4])}"
        )
        log.warning("model.weights: %s: %s", label, notes[-1])
    ignored = sorted({k.split(".")[0] for k in state if k not in own})
    if ignored:
        notes.append(f"ignored (not in the model): {', '.join(ignored)}")
    loadable = {k: v for k, v in state.items() if k in own and k not in misshapen}
    net.load_state_dict(loadable, strict=False)
    log.info(
        "model.weights: %d tensors from %s; %s", len(loadable), label, "; ".join(notes) or "all"
    )
