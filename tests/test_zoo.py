"""The model zoo (model=torchvision, model=timm): architecture names checked against the
libraries, weights read only from local files and the libraries' own caches (each test writes
them there: a randomly initialised model of the same architecture, at the exact path the library
reads), the weights' preprocessing resolved without reading them, fixed input sizes, and trained
zoo models rebuilt and exported without their pretrained files."""

from __future__ import annotations

import logging
import os
import shutil
import socket
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch
from torch import nn

from kiln.config.base import ConfigError, check_tree
from kiln.config.model import PretrainedConfig
from kiln.data.spec import DataSpec
from kiln.models import build_model, without_weights
from kiln.models.zoo import WeightsError
from kiln.preprocessing.pretrained import pretrained_input
from kiln.registry import MODELS, model_inputs

from .conftest import compose_config, train_in_process, train_main_here

RESNET18_FILE = "resnet18-f37072fd.pth"  # torchvision's ResNet18_Weights.IMAGENET1K_V1
TINY_RUN = (
    "data=synthetic_images",
    "data.image_size=32",
    "data.num_train=48",
    "data.num_val=16",
    "data.batch_size=16",
    "trainer.max_steps=3",
    "trainer.max_epochs=1",
    "logger=none",
    "env.progress_bar=false",
    "device=cpu",
)


def image_spec(channels: int = 3, side: int = 32, classes: int = 7) -> DataSpec:
    names = tuple(f"c{i}" for i in range(classes))
    return DataSpec("classification", "image", classes, names, channels, (side, side))


def token_spec(classes: int = 7, vocab_size: int = 60, max_length: int = 16) -> DataSpec:
    names = tuple(f"c{i}" for i in range(classes))
    return DataSpec(
        "classification",
        "tokens",
        classes,
        names,
        vocab_size=vocab_size,
        max_length=max_length,
        pad_id=0,
    )


def spec_for(model: str, classes: int) -> DataSpec:
    """A small spec of the input kind the model takes."""
    if model_inputs(model)[0] == "tokens":
        return token_spec(classes)
    return image_spec(classes=classes)


def zoo_cfg(model: str, *overrides: str):
    data = ("data=csv_text",) if model_inputs(model)[0] == "tokens" else ()
    return compose_config(f"model={model}", *data, *overrides).model


@pytest.fixture
def torch_home(tmp_path, monkeypatch) -> Path:
    """$TORCH_HOME in tmp_path: torchvision's weights cache is <it>/hub/checkpoints."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path / "torch" / "hub" / "checkpoints"


@pytest.fixture
def hf_hub(tmp_path, monkeypatch) -> Path:
    """$HF_HOME in tmp_path: the Hugging Face hub cache is <it>/hub."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    return tmp_path / "hf" / "hub"


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test: weights come from disk or not at all."""

    def refuse(self, address):
        raise AssertionError(f"a network connection was attempted: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)


def torchvision_file(arch: str, weights: str, folder: Path, **kwargs) -> dict[str, torch.Tensor]:
    """A random model of `arch` saved where torchvision's `weights` would be cached."""
    import torchvision.models

    named = torchvision.models.get_model_weights(arch)[weights]
    torch.manual_seed(1)
    classes = len(named.meta["categories"])
    state = torchvision.models.get_model(arch, weights=None, num_classes=classes, **kwargs)
    state = state.state_dict()
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(state, folder / os.path.basename(urlparse(named.url).path))
    return state


def hf_cache_file(name: str, hub: Path, **kwargs) -> dict[str, torch.Tensor]:
    """A random timm model saved as the hub cache holds timm/<name>: refs/main names a revision,
    snapshots/<revision>/model.safetensors is the file."""
    import timm
    from safetensors.torch import save_file

    repo = timm.models.get_pretrained_cfg(name).hf_hub_id
    torch.manual_seed(1)
    state = timm.create_model(name.partition(".")[0], pretrained=False, **kwargs).state_dict()
    folder = hub / f"models--{repo.replace('/', '--')}"
    revision = "0123456789abcdef0123456789abcdef01234567"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(revision)
    (folder / "snapshots" / revision).mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        folder / "snapshots" / revision / "model.safetensors",
    )
    return state


def assert_loaded(model: nn.Module, state: dict, prefix: str, skip: tuple[str, ...]) -> int:
    """Every tensor of the file but the skipped head equals the built model's; returns how many."""
    own = model.state_dict()
    compared = 0
    for key, value in state.items():
        if key.startswith(skip):
            continue
        assert torch.equal(own[prefix + key], value), key
        compared += 1
    return compared


# ---------------------------------------------------------------------------------------------
# Names


@pytest.mark.parametrize(
    ("model", "typo", "nearest"),
    [
        ("torchvision", "mobilenetv3_small", "mobilenet_v3_small"),
        ("timm", "convnext_atoo", "convnext_atto"),
    ],
)
def test_a_misspelt_arch_is_one_error_suggesting_the_nearest_names(model, typo, nearest):
    with pytest.raises(ConfigError) as info:
        pretrained_input(zoo_cfg(model, f"model.arch={typo}"))
    message = str(info.value)
    assert f"{typo!r} (model.arch): list them with python -c " in message  # how to list them
    assert f"; did you mean {nearest}" in message


def test_a_timm_encoder_without_a_classifier_is_refused_naming_it():
    """timm builds qwen3_vit_88m_enc headless whatever num_classes says: its output is features
    (N, 4, 1024), which rule 1 would blame on literals in forward. The builder says what it is
    (built on the meta device: the check comes before any forward)."""
    with torch.device("meta"), pytest.raises(ConfigError, match="has no classifier head") as info:
        build_model(image_spec(side=64), zoo_cfg("timm", "model.arch=qwen3_vit_88m_enc"))
    assert info.value.key == "model.arch"
    assert "asked for 7 classes it built num_classes=0" in str(info.value)


def test_train_py_refuses_a_misspelt_arch_before_hydra_starts_a_run(tmp_path, capfd):
    run_dir = tmp_path / "run"
    code, stderr = train_main_here(
        capfd,
        f"hydra.run.dir={run_dir}",
        "model=timm",
        "model.arch=resnet81",
        "data=synthetic_images",
    )
    assert code == 2, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "did you mean resnet18" in errors[0], stderr[-2000:]
    assert not run_dir.exists()  # no run directory, no data loaded


def test_a_pretrained_tag_in_the_arch_says_where_it_goes():
    with pytest.raises(ConfigError, match="set model.arch=resnet18 model.weights=a1_in1k"):
        pretrained_input(zoo_cfg("timm", "model.arch=resnet18.a1_in1k"))


@pytest.mark.parametrize(
    ("model", "listing"),
    [("torchvision", "m.list_models(module=m)"), ("timm", "timm.list_models(")],
)
def test_help_says_how_to_list_the_architectures(model, listing):
    from kiln.cli.help import describe

    assert listing in describe(f"model={model}")


def test_an_init_scheme_would_overwrite_the_weights():
    with pytest.raises(ConfigError, match="init=kaiming would overwrite the weights DEFAULT"):
        compose_config("model=torchvision", "model.weights=DEFAULT", "model.init=kaiming")


@pytest.mark.parametrize(
    "model", [n for n in MODELS.names() if issubclass(MODELS.entry(n).config, PretrainedConfig)]
)
def test_every_schema_with_weights_refuses_an_init_scheme(model):
    """One check (PretrainedConfig's) for every model that loads weights."""
    schema = MODELS.entry(model).config
    with pytest.raises(ConfigError, match="init=kaiming would overwrite the weights DEFAULT"):
        check_tree(schema(name=model, weights="DEFAULT", init="kaiming"), "model")


# ---------------------------------------------------------------------------------------------
# torchvision weights: $TORCH_HOME/hub/checkpoints only


@pytest.mark.parametrize("weights", ["IMAGENET1K_V1", "DEFAULT", "ResNet18_Weights.IMAGENET1K_V1"])
def test_torchvision_weights_load_from_torch_home_with_a_new_head(weights, torch_home, caplog):
    state = torchvision_file("resnet18", "IMAGENET1K_V1", torch_home)
    caplog.set_level(logging.INFO, logger="kiln.models.zoo")
    model = build_model(image_spec(), zoo_cfg("torchvision", f"model.weights={weights}"))
    assert assert_loaded(model, state, "backbone.", skip=("fc.",)) == len(state) - 2
    assert model.head.weight.shape == (7, 512)
    assert (
        "head fc.weight, fc.bias re-initialised (1000 classes in the file, 7 in the data)"
        in caplog.text
    )


def test_torchvision_first_conv_is_adapted_to_one_channel_as_timm_does(torch_home):
    from timm.models import adapt_input_conv

    state = torchvision_file("resnet18", "IMAGENET1K_V1", torch_home)
    model = build_model(image_spec(channels=1), zoo_cfg("torchvision", "model.weights=DEFAULT"))
    conv = model.backbone.conv1
    assert conv.in_channels == 1
    assert torch.equal(conv.weight, adapt_input_conv(1, state["conv1.weight"]))
    assert torch.allclose(conv.weight, state["conv1.weight"].sum(dim=1, keepdim=True))
    model(torch.randn(2, 1, 32, 32))


def test_missing_torchvision_weights_name_the_file_folder_and_url(torch_home, no_network):
    with pytest.raises(ConfigError) as info:
        pretrained_input(zoo_cfg("torchvision", "model.weights=IMAGENET1K_V1"))
    message = str(info.value)
    assert (
        f"put {RESNET18_FILE} (from https://download.pytorch.org/models/{RESNET18_FILE})" in message
    )
    assert f"in {torch_home} " in message and "\n" not in message


def test_torchvision_googlenet_weights_drop_their_aux_logits_and_train_mode_returns_logits(
    torch_home, caplog
):
    kwargs = {"aux_logits": True, "init_weights": True}
    state = torchvision_file("googlenet", "IMAGENET1K_V1", torch_home, **kwargs)
    caplog.set_level(logging.INFO, logger="kiln.models.zoo")
    model = build_model(
        image_spec(), zoo_cfg("torchvision", "model.arch=googlenet", "model.weights=DEFAULT")
    )
    assert "ignored (not in the model): aux1, aux2" in caplog.text
    assert_loaded(model, state, "backbone.", skip=("fc.", "aux1.", "aux2."))
    output = model.train()(torch.randn(2, 3, 32, 32))
    assert isinstance(output, torch.Tensor) and output.shape == (2, 7)  # no GoogLeNetOutputs


@pytest.mark.parametrize(
    ("file_name", "layout"),
    [
        ("w.safetensors", "plain"),
        ("w.pth", "state_dict"),
        ("w.pt", "model"),
        ("w.bin", "model_state_dict"),
    ],
)
def test_a_weights_file_of_each_layout_loads_its_head_too_when_it_fits(tmp_path, file_name, layout):
    import torchvision.models

    torch.manual_seed(2)
    state = torchvision.models.squeezenet1_1(num_classes=7).state_dict()
    path = tmp_path / file_name
    if layout == "plain":
        from safetensors.torch import save_file

        save_file(state, path)
    else:  # model_state_dict: as a DDP run saved it, "module." before every key
        ddp = layout == "model_state_dict"
        saved = {f"module.{k}" if ddp else k: v for k, v in state.items()}
        torch.save({layout: saved, "epoch": 3}, path)
    model = build_model(
        image_spec(), zoo_cfg("torchvision", "model.arch=squeezenet1_1", f"model.weights={path}")
    )
    features = {k.removeprefix("features."): v for k, v in state.items() if "features." in k}
    assert assert_loaded(model, features, "backbone.", ()) == len(features)  # squeezenet.features
    assert torch.equal(model.head[1].weight, state["classifier.1.weight"])  # 7 classes: kept


def test_a_weights_file_of_another_arch_is_one_error(tmp_path):
    import torchvision.models

    path = tmp_path / "resnet18.pth"
    torch.save(torchvision.models.resnet18().state_dict(), path)
    with pytest.raises(
        WeightsError, match=r"does not fit this ResNet \(model.weights\): \d+ tensors missing"
    ):
        build_model(
            image_spec(), zoo_cfg("torchvision", "model.arch=resnet34", f"model.weights={path}")
        )


@pytest.mark.parametrize("file_name", ["r18.pth", "r18.safetensors"])
def test_an_unreadable_weights_file_is_the_same_error_for_model_weights_and_init_from(
    tmp_path, file_name
):
    """One reader (kiln.models.weights) behind model.weights= and init_from=: one WeightsError,
    naming the key the path came from."""
    from kiln.models.weights import init_from

    bad = tmp_path / file_name
    bad.write_bytes(b"not a weights file" * 8)
    cfg = zoo_cfg("torchvision", "model.arch=resnet18", f"model.weights={bad}")
    with pytest.raises(WeightsError, match=rf"cannot read weights file \S+{file_name} \(model.w"):
        build_model(image_spec(), cfg)
    with pytest.raises(WeightsError, match=rf"cannot read weights file \S+{file_name} \(init_fr"):
        init_from(nn.Linear(2, 2), bad)


def test_a_kiln_models_weights_as_model_weights_point_to_init_from(tmp_path):
    cfg = zoo_cfg("torchvision", "model.arch=squeezenet1_1")
    path = tmp_path / "kiln_state.pt"
    torch.save(build_model(image_spec(), cfg).state_dict(), path)
    cfg = zoo_cfg("torchvision", "model.arch=squeezenet1_1", f"model.weights={path}")
    with pytest.raises(WeightsError, match="a kiln model's weights: pass it as init_from=<file>"):
        build_model(image_spec(), cfg)


# ---------------------------------------------------------------------------------------------
# timm weights: the Hugging Face hub cache only


@pytest.mark.parametrize("weights", ["a1_in1k", "DEFAULT"])
def test_timm_tag_loads_from_the_hub_cache_with_a_new_head(weights, hf_hub, no_network, caplog):
    state = hf_cache_file("resnet18.a1_in1k", hf_hub)
    caplog.set_level(logging.INFO, logger="kiln.models.zoo")
    model = build_model(image_spec(), zoo_cfg("timm", f"model.weights={weights}"))
    assert assert_loaded(model, state, "net.", skip=("fc.",)) == len(state) - 2
    assert model.net.fc.weight.shape == (7, 512)
    assert "head fc re-initialised (1000 classes in the file, 7 in the data)" in caplog.text


def test_timm_vit_weights_at_a_small_size_have_their_positions_resampled(hf_hub):
    name = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    state = hf_cache_file(name, hf_hub)
    cfg = zoo_cfg("timm", "model.arch=vit_tiny_patch16_224", "model.weights=augreg_in21k_ft_in1k")
    model = build_model(image_spec(side=32), cfg)
    assert model.fixed_input_size and model.net.pos_embed.shape == (1, 1 + 2 * 2, 192)
    assert_loaded(model, state, "net.", skip=("head.", "pos_embed"))
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_missing_timm_weights_name_the_hub_folder_and_repo(hf_hub, no_network):
    with pytest.raises(ConfigError) as info:
        pretrained_input(zoo_cfg("timm", "model.weights=a1_in1k"))
    message = str(info.value)
    assert f"in {hf_hub}/models--timm--resnet18.a1_in1k/snapshots/<rev>/" in message
    assert "put model.safetensors (from https://huggingface.co/timm/resnet18.a1_in1k)" in message


def test_a_timm_weights_file_keeps_a_head_of_the_data_size(tmp_path):
    import timm

    torch.manual_seed(3)
    state = timm.create_model("resnet10t", num_classes=7).state_dict()
    path = tmp_path / "finetuned.pth"
    torch.save({"model": state}, path)
    model = build_model(
        image_spec(), zoo_cfg("timm", "model.arch=resnet10t", f"model.weights={path}")
    )
    assert assert_loaded(model, state, "net.", skip=()) == len(state)


# ---------------------------------------------------------------------------------------------
# The weights' preprocessing: from the config alone


def test_torchvision_preprocessing_reads_no_weights(torch_home):
    torch_home.mkdir(parents=True)
    (torch_home / "resnet50-11ad3fa6.pth").write_bytes(b"not a checkpoint")  # never read
    found = pretrained_input(
        zoo_cfg("torchvision", "model.arch=resnet50", "model.weights=IMAGENET1K_V2")
    )
    assert found.source == "torchvision ResNet50_Weights.IMAGENET1K_V2"
    assert found.mean == (0.485, 0.456, 0.406) and found.std == (0.229, 0.224, 0.225)
    assert (found.image_size, found.crop_pct) == (224, round(224 / 232, 4))
    assert found.interpolation == "bilinear" and not found.fixed_input_size
    assert pretrained_input(zoo_cfg("torchvision")) is None  # random weights


def test_timm_preprocessing_reads_no_weights(hf_hub):
    folder = hf_hub / "models--timm--vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("abc")
    (folder / "snapshots" / "abc").mkdir(parents=True)
    (folder / "snapshots" / "abc" / "model.safetensors").write_bytes(b"not weights")
    cfg = zoo_cfg("timm", "model.arch=vit_tiny_patch16_224", "model.weights=DEFAULT")
    found = pretrained_input(cfg)
    assert found.source == "timm vit_tiny_patch16_224.augreg_in21k_ft_in1k"
    assert (found.mean, found.std) == ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
    assert (found.image_size, found.crop_pct, found.interpolation) == (224, 0.9, "bicubic")
    assert found.fixed_input_size
    assert pretrained_input(zoo_cfg("timm")) is None


def test_a_weights_file_is_taken_to_expect_the_arch_default_preprocessing(tmp_path):
    path = tmp_path / "mine.pth"
    path.write_bytes(b"not read")
    found = pretrained_input(zoo_cfg("timm", f"model.weights={path}"))
    # the file's name, not its absolute path: the recipe travels in checkpoints and exports
    assert found.source == "file mine.pth (preprocessing of timm resnet18.a1_in1k)"
    assert (found.crop_pct, found.interpolation) == (0.95, "bicubic")
    found = pretrained_input(zoo_cfg("torchvision", f"model.weights={path}"))
    assert found.source == "file mine.pth (preprocessing of ResNet18_Weights.IMAGENET1K_V1)"


# ---------------------------------------------------------------------------------------------
# Fixed input sizes


def test_a_torchvision_vit_with_weights_fails_at_start_up_naming_its_size(torch_home, tmp_path):
    torch_home.mkdir(parents=True)
    (torch_home / "vit_b_16-c867db91.pth").write_bytes(b"")  # present; never read
    overrides = ("model=torchvision", "model.arch=vit_b_16", "model.weights=IMAGENET1K_V1")
    with pytest.raises(ConfigError) as info:
        train_in_process(tmp_path / "run", *overrides, *TINY_RUN)
    assert str(info.value) == (
        "model.arch=vit_b_16 with weights IMAGENET1K_V1 takes 224x224 inputs, the data gives "
        "32x32 (data.image_size): set data.image_size=224"
    )
    assert '"steps": 0' in (tmp_path / "run" / "summary.json").read_text()


def test_a_random_torchvision_vit_is_built_for_the_data_size_or_names_what_it_takes():
    model = build_model(image_spec(side=32), zoo_cfg("torchvision", "model.arch=vit_b_32"))
    assert model.fixed_input_size and model.backbone.image_size == 32
    with pytest.raises(
        ConfigError, match=r"vit_b_32 does not build for 40x40 inputs \(Input shape indivisible"
    ):
        build_model(image_spec(side=40), zoo_cfg("torchvision", "model.arch=vit_b_32"))


def test_maxvit_is_built_for_the_data_size():
    model = build_model(
        image_spec(side=224, classes=3), zoo_cfg("torchvision", "model.arch=maxvit_t")
    )
    assert model.fixed_input_size
    with torch.no_grad():
        assert model.eval()(torch.randn(1, 3, 224, 224)).shape == (1, 3)


def test_rule1_skips_the_second_input_size_for_a_fixed_size_model(caplog):
    from kiln.guards.input_sizes import size_probes

    batch = (torch.randn(4, 3, 32, 32), torch.zeros(4, dtype=torch.long))
    caplog.set_level(logging.INFO, logger="kiln.guards.input_sizes")
    fixed = size_probes(batch, image_spec(), [1, 3], fixed_input_size=True)
    assert [p.label for p in fixed] == ["batch 1", "batch 3"]
    assert "no second size" in caplog.text
    assert any(p.new_size for p in size_probes(batch, image_spec(), [1, 3]))


def test_inception_v3_train_and_eval_outputs_agree():
    from kiln.guards.shape_check import check_train_eval_agreement

    model = build_model(image_spec(side=80), zoo_cfg("torchvision", "model.arch=inception_v3"))
    batch = (torch.randn(2, 3, 80, 80), torch.zeros(2, dtype=torch.long))
    check_train_eval_agreement(model, batch, lambda m, b, train: m(b[0]))  # rule 3


# ---------------------------------------------------------------------------------------------
# Heads: what model.freeze=backbone and optimizer.head_lr_mult act on

HEAD_CASES = [("mlp", ()), ("resnet18", ())] + [
    (model, (f"model.arch={arch}",))
    for model in MODELS.names()
    for arch in MODELS.entry(model).meta.get("samples", ())
]


@pytest.mark.parametrize(("model", "overrides"), HEAD_CASES, ids=[f"{m}{o}" for m, o in HEAD_CASES])
def test_head_prefixes_hold_exactly_the_parameters_sized_by_the_classes(model, overrides):
    cfg = zoo_cfg(model, *overrides)
    shapes = []
    for classes in (7, 5):
        with torch.device("meta"):  # shapes only: no memory, no initialisation
            built = build_model(spec_for(model, classes), cfg, aux_head=True)
        shapes.append({k: v.shape for k, v in built.named_parameters()})
    prefixes = built.head_prefixes
    sized = {k for k in shapes[0] if shapes[0][k] != shapes[1][k]}
    under = {k for k in shapes[0] if k.startswith(tuple(f"{p}." for p in prefixes))}
    assert sized <= under and sized, (sized, prefixes)
    assert all(any(k.startswith(f"{p}.") for k in shapes[0]) for p in prefixes), prefixes


# ---------------------------------------------------------------------------------------------
# End to end: train with cached weights, then rebuild and export without them


def test_without_weights_is_how_probes_and_inference_rebuild():
    cfg = zoo_cfg("timm", "model.weights=DEFAULT")
    assert without_weights(cfg).weights is None and cfg.weights == "DEFAULT"
    mlp = compose_config().model
    assert without_weights(mlp) is mlp


@pytest.mark.parametrize(
    ("model", "weights"),
    [("timm", "a1_in1k"), ("torchvision", "IMAGENET1K_V1")],
)
def test_resnet18_trains_then_exports_and_predicts_without_its_weights_file(
    model, weights, tmp_path, torch_home, hf_hub
):
    from kiln.inference import Predictor, export

    if model == "timm":
        hf_cache_file("resnet18.a1_in1k", hf_hub)
        cache = hf_hub
    else:
        torchvision_file("resnet18", "IMAGENET1K_V1", torch_home)
        cache = torch_home
    run_dir = tmp_path / "run"
    overrides = (f"model={model}", "model.arch=resnet18", f"model.weights={weights}", *TINY_RUN)
    summary = train_in_process(run_dir, *overrides)
    # Three steps learn nothing yet: a run at chance says so (at_chance), which is what it is.
    assert summary["status"] in ("ok", "at_chance") and summary["steps"] == 3
    ckpt = run_dir / "checkpoints" / "best.pt"
    recorded = torch.load(ckpt, weights_only=True)["pretrained"]
    assert "resnet18" in recorded["source"].lower() and recorded["image_size"] == 224
    shutil.rmtree(cache)  # inference and export never read the pretrained file again
    report = export(ckpt)
    assert report.parity and all(c.max_abs_diff <= 1e-4 for c in report.parity)
    images = torch.rand(3, 3, 32, 32).numpy()
    torch_probs = Predictor.from_checkpoint(ckpt).predict_probs(images)
    onnx_probs = Predictor.from_checkpoint(ckpt, backend="onnx").predict_probs(images)
    assert abs(torch_probs - onnx_probs).max() <= 1e-4
