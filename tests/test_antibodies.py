"""The three rules and the device diagnosis, on every registered model paired with every dataset
whose inputs it accepts (a model added tomorrow is tested by this same code, with no edit), and on
deliberately broken models that each rule must catch, in the suite and in train.py."""

from __future__ import annotations

import collections
import contextlib
import copy
import ctypes
import dataclasses
import functools
import gc
import importlib
import itertools
import math
import random
import re
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from kiln.cli.paths import CONF_DIR
from kiln.config import ConfigError
from kiln.config.data import DataConfig
from kiln.data import build_data
from kiln.data.extremes import probe_batches
from kiln.engine.loss import build_criterion
from kiln.errors import attempt
from kiln.guards import (
    DeviceMismatchError,
    LossBranchError,
    ProbabilitiesNotLogitsError,
    ShapeContractError,
    ShapeInferenceError,
    check_sizes_follow_inputs,
    check_train_eval_agreement,
)
from kiln.guards.batch_independence import BatchDependenceError
from kiln.guards.contract import (
    check_behaviour,
    check_device_diagnosis,
    check_optimizer_sees_every_parameter,
    check_outputs_are_logits,
    check_rule1,
    check_rule2,
    check_rule3,
)
from kiln.guards.determinism import NondeterministicEvalError
from kiln.guards.input_sizes import EpochPlan, MemoryLayoutError
from kiln.guards.learn_probe import CannotLearnError
from kiln.guards.no_trace import untouched
from kiln.guards.numerics import NumericsError
from kiln.guards.optimizer_coverage import OutsideTheOptimizerError
from kiln.guards.padding import PaddingError
from kiln.guards.purity import ImpureForwardError
from kiln.guards.rules import (
    BATCH,
    COVERAGE,
    DEAD,
    DETERMINISM,
    DEVICES,
    LAYOUT,
    LEARN,
    LOGITS,
    NUMERICS,
    PADDING,
    PURITY,
    RULE_1,
    RULE_2,
    RULE_3,
    ProbeFailure,
)
from kiln.models import build_model
from kiln.registry import DATASETS, MODELS, compatible_pairs, dataset_provides, model_inputs

from .broken_models import BROKEN, BROKEN_DATA, TWINS, Broken, Twin
from .conftest import PROBES_OFF, compose_config, resident_mb, slow_tests_run, train_in_process
from .image_folder_helpers import EXAMPLES
from .test_engine import make_trainer

DETECTION = EXAMPLES.parent / "detection"  # kiln.data.photo_boxes' folder (COCO and YOLO)
# Smaller than the options' defaults, for speed only: a dataset missing here runs as configured.
SMALL = {
    "synthetic_images": ("data.num_train=32", "data.num_val=16", "data.num_classes=7"),
    "image_folder": (f"data.train_dir={EXAMPLES / 'train'}", "data.image_size=32"),
    "shapes_detection": (
        "data.num_train=8",
        "data.num_val=4",
        "data.image_size=64",
        "data.min_image_size=40",
        "data.num_background=1",  # a detector must train on an image with no box
    ),
    "coco": (
        f"data.train_json={DETECTION / 'coco/train.json'}",
        f"data.train_images={DETECTION / 'coco/images/train'}",
    ),
    "yolo": (f"data.train_dir={DETECTION / 'yolo/images/train'}",),
}
_examples: dict[str, tuple[str, ...]] = {}


@pytest.fixture(scope="session", autouse=True)
def example_folder(tmp_path_factory):
    """Where the datasets that read files write their declared examples (one per session)."""
    global EXAMPLE_ROOT
    EXAMPLE_ROOT = tmp_path_factory.mktemp("dataset-examples")
    return EXAMPLE_ROOT


EXAMPLE_ROOT = None


def small(data: str) -> tuple[str, ...]:
    """The overrides a dataset is tested with: a registry entry that reads files declares a
    small example of its own input (`example=`: folder -> overrides, written into that
    folder), so a plugin dataset a user adds tomorrow is built here too; else SMALL's."""
    declared = DATASETS.entry(data).meta.get("example")
    if declared is None:
        return SMALL.get(data, ())
    if data not in _examples:
        root = EXAMPLE_ROOT or Path(tempfile.mkdtemp(prefix="kiln-examples-"))
        folder = root / data
        folder.mkdir(parents=True, exist_ok=True)
        _examples[data] = tuple(declared(folder))
    return _examples[data]


PAIRS = compatible_pairs()
# Zoo entries (model=torchvision, model=timm, model=hf, model=torchvision_detection) also run
# each architecture their registry entry declares as a sample, on small data of the kind they
# take: (model, data, model overrides).
ZOO_DATA = {"image": "synthetic_images", "tokens": "csv_text", "image_list": "shapes_detection"}
CASES = [(model, data, ()) for model, data in PAIRS] + [
    (model, ZOO_DATA[model_inputs(model)[0]], (f"model.arch={arch}",))
    for model in MODELS.names()
    for arch in MODELS.entry(model).meta.get("samples", ())
]
IDS = [
    f"{model}{'[' + over[0].split('=')[1] + ']' if over else ''}-on-{data}"
    for model, data, over in CASES
]
# Detection read from files (data=coco, data=yolo: photos of about 128 px) gives the detectors
# what shapes_detection gives them at 64 px, four times the pixels: minutes of probes per pair
# on two CPU cores. Their readers have tests of their own (tests/test_detection_files.py).
SLOW_DATA = ("coco", "yolo")
# resnet50 on 32-64 px images: a minute and a half of probes for code resnet18 runs through
# (kiln.models.resnet builds both); resnet50 on digits stays in the default suite.
SLOW_PAIRS = (("resnet50", "image_folder"), ("resnet50", "synthetic_images"))
CASES = [
    pytest.param(*case, marks=pytest.mark.slow)
    if case[1] in SLOW_DATA or case[:2] in SLOW_PAIRS
    else case
    for case in CASES
]
ERRORS = {
    RULE_1: ShapeInferenceError,
    RULE_2: LossBranchError,
    RULE_3: ShapeContractError,
    DEVICES: DeviceMismatchError,
    LOGITS: ProbabilitiesNotLogitsError,
    NUMERICS: NumericsError,
    BATCH: BatchDependenceError,
    DETERMINISM: NondeterministicEvalError,
    PURITY: ImpureForwardError,
    DEAD: ProbeFailure,
    LEARN: CannotLearnError,
    LAYOUT: MemoryLayoutError,
    PADDING: PaddingError,
    COVERAGE: OutsideTheOptimizerError,
}

_bundles: dict[tuple[str, ...], object] = {}


def bundle_for(data: str, data_overrides=()):
    key = (data, *data_overrides)
    if key not in _bundles:
        fits = {"image": "mlp", "tokens": "text_bow", "image_list": "detector"}
        model = fits[dataset_provides(data)]
        overrides = (f"data={data}", f"model={model}", *small(data), *data_overrides)
        _bundles[key] = build_data(compose_config(*overrides).data)
    return _bundles[key]


@functools.cache  # the configs are frozen: one composition per model, data and overrides
def model_config(model: str, data: str, model_overrides=()):
    """The option's YAML values where kiln's conf/ has it, else its schema's defaults (a plugin's
    model, whose YAML lives in the user's own folder)."""
    if (CONF_DIR / "model" / f"{model}.yaml").is_file():
        overrides = (f"data={data}", f"model={model}", *small(data), *model_overrides)
        return compose_config(*overrides).model
    return MODELS.entry(model).config(name=model)


def zoo_config(model: str, data: str, arch: str):
    """model_config with `model.arch=<arch>`: the model composed once, its arch replaced (the
    config composing `model.arch=<arch>` gives: test_a_zoo_config_is_the_composed_one), not
    one composition per architecture (a tenth of a zoo case)."""
    return dataclasses.replace(model_config(model, data), arch=arch)


def parts(
    model: str, data: str, *overrides: str, model_overrides=(), data_overrides=(), model_cfg=None
):
    """(build, criterion, bundle) as the engine makes them, for `model` on `data` (its config
    composed with `model_overrides`, or `model_cfg`)."""
    fits = {"image": "mlp", "tokens": "text_bow", "image_list": "detector"}
    base = fits[dataset_provides(data)]
    cfg = compose_config(f"data={data}", f"model={base}", *small(data), *overrides)
    model_cfg = model_cfg or model_config(model, data, model_overrides)
    cfg = dataclasses.replace(cfg, model=model_cfg)
    build = SeededBuild(cfg.model, aux=cfg.loss.force_all_branches or cfg.loss.aux_head)
    bundle = bundle_for(data, data_overrides)
    return build, build_criterion(build.original(bundle.spec), cfg.loss), bundle


def tensor_shapes(model: nn.Module) -> dict[str, tuple]:
    named = itertools.chain(model.named_parameters(), model.named_buffers())
    return {name: tuple(t.shape) for name, t in named}


class SeededBuild:
    """spec -> a fresh model: a seeded build, made once and copied each call (the same weights
    as a fresh build, without paying a large model's initialisation at every probe). A spec
    whose build has the tensors of a network already built (its build on the meta device says,
    as a run's rule 1 decides whether to build again) is a copy of that network."""

    def __init__(self, model_cfg, aux: bool):
        self.model_cfg, self.aux = model_cfg, aux
        self.built: dict = {}
        # Set before the last check: it gets the networks themselves, not copies (a copy of a
        # CNN's many small modules took a third of a zoo case).
        self.last_use = False
        self.lending: tuple | None = None  # inside lent(): what puts them back, their versions

    def __call__(self, spec) -> nn.Module:
        if self.last_use:
            network = self.original(spec)
            _BUILT.pop(self._key(spec), None)  # changed by its last user: never handed out again
            return network
        if self.lending is not None:
            putting_back, versions = self.lending
            network = self.original(spec)
            if network not in versions:
                putting_back.enter_context(untouched(network))
                versions[network] = [p._version for p in network.parameters()]  # in-place writes
            return network
        return copy.deepcopy(self.original(spec))

    @contextlib.contextmanager
    def lent(self):
        """Inside: the networks themselves, for checks that step no weights (rules 1 to 3: a
        forward and backward change only gradients, buffers and modes; a weight written in
        place fails the block, by the parameters' version counters); after: each as it was
        (kiln.guards.no_trace, as a run's probes leave its model), the RNG state too. A copy
        per check was an eighth of a zoo case."""
        with contextlib.ExitStack() as putting_back:
            versions: dict[nn.Module, list[int]] = {}
            self.lending = putting_back, versions
            try:
                yield
                for network, before in versions.items():  # a check that stepped fails here
                    written = [p._version for p in network.parameters()] != before
                    assert not written, "a check lent the network wrote its weights: give it a copy"
            finally:
                self.lending = None

    def original(self, spec) -> nn.Module:
        """The network the copies are made from: read it, never change it."""
        if spec not in self.built:
            alike = self._built_alike(spec)
            self.built[spec] = alike if alike is not None else self._seeded(spec)
        return self.built[spec]

    def _key(self, spec) -> tuple:
        return repr(self.model_cfg), self.aux, spec

    def _seeded(self, spec) -> nn.Module:
        """The seeded build; the same one another test of this case made just before, with the
        random state its build left (tests/conftest.py runs a case's tests one after another:
        each of the eight built its network again, a seventh of this file's time)."""
        key = self._key(spec)
        if key in _BUILT:
            network, flags, rng = _BUILT[key]
            if module_flags(network) == flags:  # read, never changed: as built
                torch.set_rng_state(rng)
                return network
        torch.manual_seed(0)
        network = build_model(spec, self.model_cfg, aux_head=self.aux).to("cpu")
        _BUILT[key] = network, module_flags(network), torch.get_rng_state()
        while len(_BUILT) > 2:  # a case's network, with and without its loss branches
            del _BUILT[next(iter(_BUILT))]
        return network

    def _built_alike(self, spec) -> nn.Module | None:
        if not self.built:
            return None
        shapes, failed = attempt(self._meta_shapes, spec)
        if failed is not None:  # a builder the meta device cannot run: a real build
            return None
        return next((m for m in self.built.values() if tensor_shapes(m) == shapes), None)

    def _meta_shapes(self, spec) -> dict[str, tuple]:
        with torch.device("meta"):
            return tensor_shapes(build_model(spec, self.model_cfg, aux_head=self.aux))


_BUILT: dict[tuple, tuple] = {}  # SeededBuild's last networks: (network, its flags, RNG state)


def module_flags(network: nn.Module) -> tuple:
    """Each module's mode and each parameter's requires_grad: what a check would change."""
    modes = tuple(m.training for m in network.modules())
    return modes, tuple(p.requires_grad for p in network.parameters())


def optimizer_for_config(cfg):
    """The run's optimizer for a model (what the learn probe builds for its copy)."""
    from kiln.engine.finetune import parameter_groups
    from kiln.engine.optim import build_optimizer

    def build(model, lr_scale):
        scaled = dataclasses.replace(cfg.optimizer, lr=cfg.optimizer.lr * lr_scale)
        return build_optimizer(parameter_groups(model, scaled), scaled)

    return build


def test_every_registered_model_has_a_dataset_to_be_tested_on():
    assert {model for model, _ in PAIRS} == set(MODELS.names())


CASE_ARGS = ("model", "data", "model_overrides")


@pytest.mark.parametrize(CASE_ARGS, CASES, ids=IDS)
def test_rule1_sizes_follow_inputs(model, data, model_overrides):
    check_rule1(*parts(model, data, model_overrides=model_overrides))


@pytest.mark.parametrize(CASE_ARGS, CASES, ids=IDS)
def test_rule2_every_branch_on_gives_finite_nonzero_terms_that_reach_the_weights(
    model, data, model_overrides
):
    overrides = ("loss.force_all_branches=true",)
    terms = check_rule2(*parts(model, data, *overrides, model_overrides=model_overrides))
    classifier = bundle_for(data).spec.task == "classification"
    if classifier:
        assert set(terms) == {"main", "label_smoothing", "z_loss", "confidence_penalty", "aux_head"}


class RootAtZero(nn.Module):
    """sqrt(x) where x > 1, else x, at x = 0: a finite output whose gradient is NaN (the
    unused branch's infinite slope times the mask's zero)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 2)
        nn.init.zeros_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def forward(self, x):
        y = self.fc(x)
        return torch.where(y > 1, y.sqrt(), y)


def test_a_non_finite_gradient_is_named_whatever_the_gradient():
    """kiln.guards.numerics.nonfinite_grads, what rules 1 and 2 read: NaN, +Inf and -Inf in a
    dense fp32 or bf16 gradient or among a sparse one's values, named in the model's order;
    empty, absent and huge finite gradients (a sum of squares would overflow) are not; rule 1
    names the first."""
    from kiln.guards.input_sizes import check_sizes_follow_inputs
    from kiln.guards.numerics import nonfinite_grads

    net = nn.ModuleDict(
        {
            "dense": nn.Linear(2, 2),
            "bf16": nn.Linear(2, 2).bfloat16(),
            "rows": nn.Embedding(4, 2, sparse=True),
            "empty": nn.Linear(0, 2),
            "unused": nn.Linear(2, 2),
        }
    )
    net["rows"](torch.tensor([1, 3])).sum().backward()
    for name in ("dense", "bf16", "empty"):
        for p in net[name].parameters():
            p.grad = torch.full_like(p, 3e38)  # finite; its squares are not
    net["empty"].weight.grad = torch.zeros(2, 0)
    assert nonfinite_grads(net) == []
    net["dense"].bias.grad[1] = math.nan
    net["bf16"].weight.grad[0, 0] = -math.inf
    net["rows"].weight.grad._values()[1, 0] = math.inf
    assert nonfinite_grads(net) == ["dense.bias", "bf16.weight", "rows.weight"]
    with pytest.raises(ShapeInferenceError, match="batch 2: non-finite gradient in fc.weight"):
        check_sizes_follow_inputs(RootAtZero, [("batch 2", torch.zeros(2, 3))])


@pytest.mark.parametrize("model", MODELS.names())
def test_rule2_every_registered_models_branches_default_off(model):
    """A branch on by default is refused at start-up: every registered schema passes."""
    from kiln.config.base import check_branch_defaults
    from kiln.config.run import LossConfig

    schema = MODELS.entry(model).config
    check_branch_defaults(schema, getattr(schema, "branch_flags", ()), "model", model)
    check_branch_defaults(LossConfig, LossConfig.branch_flags, "loss")


@pytest.mark.parametrize(CASE_ARGS, CASES, ids=IDS)
def test_rule3_train_and_eval_agree(model, data, model_overrides):
    check_rule3(*parts(model, data, model_overrides=model_overrides))


@pytest.mark.parametrize(CASE_ARGS, CASES, ids=IDS)
def test_rule3_holds_under_bf16_autocast_as_amp_runs_on_cpu(model, data, model_overrides):
    """precision=amp on CPU evaluates under bf16 autocast; the check runs the model's real
    (hook-free) path there too. text_transformer's fused eval path failed only in this case.
    Two items: a bf16 convolution on a CPU without bf16 instructions costs 65 fp32 ones."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        check_rule3(*parts(model, data, model_overrides=model_overrides), size=2)


@pytest.mark.parametrize(CASE_ARGS, CASES, ids=IDS)
def test_classifiers_return_logits_not_probabilities(model, data, model_overrides):
    check_outputs_are_logits(*parts(model, data, model_overrides=model_overrides))


@pytest.mark.parametrize(CASE_ARGS, CASES, ids=IDS)
def test_behaviour_checks_and_the_learn_probe_pass(model, data, model_overrides):
    """Determinism in eval, batch independence, purity, finite values, live gradients, no
    parameter used only in some steps (as DDP would need), the device and fp16 probes, and a
    few steps on one batch lowering its loss at the option's own optimizer settings."""
    fits = {"image": "mlp", "tokens": "text_bow", "image_list": "detector"}[dataset_provides(data)]
    cfg = compose_config(f"data={data}", f"model={fits}", *small(data))
    check_behaviour(*parts(model, data, model_overrides=model_overrides), optimizer_for_config(cfg))


@pytest.mark.parametrize(CASE_ARGS, CASES, ids=IDS)
def test_the_optimizer_holds_every_trainable_parameter_after_a_step(model, data, model_overrides):
    fits = {"image": "mlp", "tokens": "text_bow", "image_list": "detector"}[dataset_provides(data)]
    cfg = compose_config(f"data={data}", f"model={fits}", *small(data))
    check_optimizer_sees_every_parameter(
        *parts(model, data, model_overrides=model_overrides), optimizer_for_config(cfg)
    )


@pytest.mark.parametrize(CASE_ARGS, CASES, ids=IDS)
def test_devices_a_layer_left_behind_is_named(model, data, model_overrides):
    message = check_device_diagnosis(*parts(model, data, model_overrides=model_overrides))
    assert message.startswith(f"{DEVICES}: device mismatch in ")


class _Sized(nn.Module):
    """Passes a torch.Size and a named tuple on, as timm's MViTv2 stages pass (x, feat_size)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, size):
        return collections.namedtuple("Out", "x size")(self.proj(x), size)


class _SizesBetweenModules(nn.Module):
    def __init__(self):
        super().__init__()
        self.stage, self.head = _Sized(), nn.Linear(4, 3)

    def forward(self, x):
        out = self.stage(x, x.shape)
        return self.head(out.x)


def test_devices_named_through_modules_that_pass_sizes_and_named_tuples():
    """The trace described each call's inputs by rebuilding their containers: a torch.Size was
    rebuilt from strings and raised inside the traced forward, so the diagnosis of timm's
    mvitv2_* named the whole model, not the head left on meta. (A named tuple raised too.)"""
    from kiln.guards.devices import diagnose, is_device_mismatch

    model, x = _SizesBetweenModules(), torch.randn(2, 4)
    model.head.to("meta")
    with torch.no_grad(), pytest.raises(RuntimeError) as raised:
        model(x)
    assert is_device_mismatch(raised.value)
    with torch.no_grad():
        found = diagnose(raised.value, model, lambda: model(x), x)
    assert found.module == "head", str(found)
    assert "its parameters/buffers are on meta, its inputs on cpu" in str(found)


# ---------------------------------------------------------------------------------------------
# Every architecture of the zoo (-m slow): each one that builds at a small size passes every rule

ZOO_MAX_PARAMS = 150_000_000  # larger ones are skipped: minutes per check on a CPU
ZOO_SIDES = (64, 128)  # 64: rule 1 then probes 96, a multiple of the usual stride 32


def load_target(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def pytest_generate_tests(metafunc):
    """Listing every zoo architecture imports its library: done only when slow tests run."""
    if "zoo_arch" not in metafunc.fixturenames:
        return
    cases = []
    for model in MODELS.names() if slow_tests_run(metafunc.config) else ():
        listing = MODELS.entry(model).meta.get("archs")
        if listing:
            cases += [(model, arch) for arch in load_target(listing)()]
    metafunc.parametrize(("zoo_model", "zoo_arch"), cases, ids=[f"{m}[{a}]" for m, a in cases])


def zoo_image_parts(model: str, arch: str, *overrides: str):
    """parts(*overrides) for the architecture at the first of ZOO_SIDES it builds and runs at
    (that build is the one the rules copy); skips the test otherwise."""
    cfg = zoo_config(model, ZOO_DATA["image"], arch)
    sized = {"model_cfg": cfg}
    reasons = []
    for side in ZOO_SIDES:
        sized["data_overrides"] = (f"data.image_size={side}",)
        spec = bundle_for(ZOO_DATA["image"], sized["data_overrides"]).spec
        try:
            with torch.device("meta"):
                size = sum(p.numel() for p in build_model(spec, cfg).parameters())
        except ConfigError as err:  # kiln refuses the architecture: a real build would too
            pytest.skip(f"{arch}: {err}")
        except Exception:  # some builders read values: the size the library publishes
            published = MODELS.entry(model).meta.get("num_params")
            size = load_target(published)(arch) if published else None
        if size is not None and size > ZOO_MAX_PARAMS:
            pytest.skip(f"{arch}: {size / 1e6:.0f}M parameters (> {ZOO_MAX_PARAMS / 1e6:.0f}M)")
        try:
            built = parts(model, ZOO_DATA["image"], *overrides, **sized)
            network = built[0].original(spec)
            with torch.no_grad():
                network.eval()(torch.zeros(2, 3, side, side))
            network.train()
            return built
        except (RuntimeError, ValueError, AssertionError, TypeError) as err:
            reasons.append(f"{side}x{side}: {type(err).__name__}: {str(err)[:120]}")
    pytest.skip(f"{arch} builds at no small size ({'; '.join(reasons)})")


def tokens_build_small(model: str, arch: str) -> None:
    """Skips the test unless the architecture builds small from scratch (kiln's 2 layers, width
    64) and runs on the batch the rules start from (the data's longest and shortest texts,
    padded): some model types need settings no small default gives, or tokens the data has not
    (mBART: an <eos> in every text). Random ids made the verdict change with the RNG's state."""
    cfg = zoo_config(model, ZOO_DATA["tokens"], arch)
    bundle = bundle_for(ZOO_DATA["tokens"])
    ids, _ = probe_batches(bundle, 2, 2).base
    try:
        with torch.no_grad():
            build_model(bundle.spec, cfg).eval()(ids)
    except Exception as err:  # noqa: BLE001 -- whatever the library raises: not small
        pytest.skip(f"{arch} builds at no small size: {type(err).__name__}: {str(err)[:160]}")


def test_a_lent_network_comes_back_as_it_was_and_a_weight_write_fails_the_block():
    """SeededBuild.lent, as the zoo uses it: a forward and backward inside leave the network
    with its gradients, modes and buffers as before; a weight written in place is refused."""
    build, criterion, bundle = parts("resnet18", "synthetic_images")
    network = build.original(bundle.spec)
    buffers = {n: b.clone() for n, b in network.named_buffers()}
    with build.lent():
        lent = build(bundle.spec)
        assert lent is network  # the network itself, not a copy
        check_rule3(build, criterion, bundle, size=2)  # train mode: batch norm's statistics move
        criterion(lent, probe_batches(bundle, 2, 2).base)[0].backward()
    assert all(p.grad is None for p in network.parameters())
    assert all(torch.equal(b, buffers[n]) for n, b in network.named_buffers())
    with pytest.raises(AssertionError, match="wrote its weights"), build.lent(), torch.no_grad():
        next(build(bundle.spec).parameters()).add_(1.0)
    assert build(bundle.spec) is not network  # outside lent(): a copy again


@pytest.mark.parametrize("model, arch", [("timm", "vit_small_patch16_224"), ("hf", "roberta")])
def test_a_zoo_config_is_the_composed_one(model, arch):
    data = ZOO_DATA[model_inputs(model)[0]]
    composed_with_arch = model_config(model, data, (f"model.arch={arch}",))
    assert zoo_config(model, data, arch) == composed_with_arch
    assert composed_with_arch != model_config(model, data)  # the arch is what tells them apart


_frozen: list[bool] = []
TRIM_ABOVE_MB = 2048  # a worker starts the zoo near 0.9 GB


@pytest.fixture
def memory_given_back():
    """A zoo case's networks (vgg19: 4.7 GB at its peak) go back to the system after it: glibc
    kept what they freed, and a worker of make test-all grew to 9 GB by timm's v* and was
    killed for memory (its pending tests never ran, and xdist waited for them). Cycles first,
    then, once the worker holds more than TRIM_ABOVE_MB, the heap's free pages (malloc_trim): a
    trim after every case made the next fault its memory in again (274 resnet, efficientnet and
    mobilenet cases on 3 workers: 384 -> 370 s, 83 -> 42 CPU-s in the kernel; a worker's
    largest RSS 3.6 GB, inside a case). A collection of every object torch, timm and
    transformers made took 0.38 s, ten minutes of the zoo's worker time: what was alive before
    the first case is frozen, out of the collector's walk."""
    if not _frozen:
        gc.collect()
        gc.freeze()
        _frozen.append(True)
    yield
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; elsewhere nothing to do
    if trim is not None and resident_mb() > TRIM_ABOVE_MB:
        trim(0)


@pytest.mark.slow
@pytest.mark.usefixtures("memory_given_back")
def test_every_zoo_architecture_that_builds_small_passes_every_rule(zoo_model, zoo_arch):
    """Each rule on one seeded build with every loss branch on (rule 2 needs them; rules 1 and 3
    and the device diagnosis run on that network too, as they catch the broken models above):
    built once per input size, lent to the rules (none steps the weights), then handed to the
    device diagnosis, which moves a layer. Rule 1 probes as a run does: the extra backward at
    each batch size that the registry's own models and the broken ones get would be a backward
    of the library's code that no run of kiln asks for (a sixth of a zoo case). Rules 2 and 3
    on batches of 2, not 4: an architecture's branches and modes agree alike, at half the
    compute."""
    kind = model_inputs(zoo_model)[0]
    branches = "loss.force_all_branches=true"
    if kind == "image":
        every_branch = zoo_image_parts(zoo_model, zoo_arch, branches)
    else:
        tokens_build_small(zoo_model, zoo_arch)
        every_branch = parts(
            zoo_model,
            ZOO_DATA[kind],
            branches,
            model_cfg=zoo_config(zoo_model, ZOO_DATA[kind], zoo_arch),
        )
    with every_branch[0].lent():  # none steps the weights: the network itself, put back after
        check_rule1(*every_branch, backward_every_probe=False)  # rule 1 as a run probes
        check_rule2(*every_branch, size=2)
        check_rule3(*every_branch, size=2)
    every_branch[0].last_use = True
    check_device_diagnosis(*every_branch)


# ---------------------------------------------------------------------------------------------
# The broken models: caught by the same checks, each with its rule's message


@pytest.fixture
def registered():
    """Register broken models for one test; unregistered after it."""
    added = []

    def register(broken: Broken) -> None:
        MODELS.register(broken.name, config=broken.config, inputs=broken.inputs)(broken.builder)
        added.append(broken.name)

    yield register
    for name in added:
        del MODELS._entries[name]


def broken_parts(broken: Broken, *overrides: str):
    schema_option = {"image": "mlp", "tokens": "text_bow", "image_list": "detector"}
    base = schema_option[broken.inputs[0]]
    cfg = compose_config(
        f"data={broken.data}", f"model={base}", *small(broken.data), *broken.overrides, *overrides
    )
    if type(cfg.model) is broken.config:
        model = dataclasses.replace(cfg.model, name=broken.name)
    else:  # a schema of its own: its defaults
        model = broken.config(name=broken.name)
    return dataclasses.replace(cfg, model=model)


def config_check(build, criterion, bundle, broken: Broken):
    """What start-up checks of a model's schema (check_tree runs it in load_config)."""
    broken.config(name=broken.name).check("model")


def behaviour_check(build, criterion, bundle, cfg=None):
    return check_behaviour(build, criterion, bundle, optimizer_for_config(cfg), fp16=False)


def fp16_check(build, criterion, bundle, cfg=None):
    return check_behaviour(build, criterion, bundle, optimizer_for_config(cfg), fp16=True)


def coverage_check(build, criterion, bundle, cfg=None):
    return check_optimizer_sees_every_parameter(build, criterion, bundle, optimizer_for_config(cfg))


CHECKS = {
    "rule1": check_rule1,
    "rule2": check_rule2,
    "rule3": check_rule3,
    "logits": check_outputs_are_logits,
    "behaviour": behaviour_check,
    "fp16": fp16_check,
    "coverage": coverage_check,
}
WITH_CFG = ("behaviour", "fp16", "coverage")  # the checks that build the run's optimizer
WHAT = {
    RULE_1: "shapes",
    RULE_3: "shapes",
    DEVICES: "device",
    NUMERICS: "numerics",
    BATCH: "batch dependence",
    DETERMINISM: "determinism",
    PURITY: "purity",
    DEAD: "dead gradients",
    LEARN: "cannot learn",
    LAYOUT: "shapes",
    PADDING: "padding",
    COVERAGE: "optimizer coverage",
}


@pytest.mark.parametrize("broken", BROKEN, ids=[b.name for b in BROKEN])
def test_the_suite_catches_each_broken_model_with_its_rule(broken, registered):
    registered(broken)
    aux = broken.check == "rule2"
    cfg = broken_parts(
        broken,
        *(
            ["loss.force_all_branches=true"]
            if aux or broken.check in ("rule1", "rule3", "logits")
            else []
        ),
    )

    def build(spec):
        return build_model(spec, cfg.model, aux_head=aux).to("cpu")

    bundle = bundle_for(broken.data)
    if broken.check == "config":  # refused before anything is built
        with pytest.raises(ConfigError) as info:
            config_check(None, None, bundle, broken)
        assert str(info.value).startswith(broken.rule) and broken.needle in str(info.value)
        return
    criterion = build_criterion(build(bundle.spec), cfg.loss)
    # The epoch's plan as the run would cut it (batch size from the broken model's data).
    extra = {"plan": EpochPlan(len(bundle.train), cfg.data.batch_size)}
    extra = extra if broken.check == "rule1" else {}
    extra = {"cfg": cfg} if broken.check in WITH_CFG else extra
    with pytest.raises(ERRORS[broken.rule]) as info:
        CHECKS[broken.check](build, criterion, bundle, **extra)
    message = str(info.value)
    assert message.startswith(broken.rule), message
    assert broken.needle in message, message
    if broken.rule in WHAT and broken.name != "eval_only_nan":  # the [FAIL] line's <what>
        assert info.value.what == WHAT[broken.rule] or info.value.what.startswith("device")


SINGLE_PROCESS_NEEDLE = {
    "conditional_refine": "sample 0's output changes with its neighbours: alone (a batch of 1) "
    "vs in its batch of 8",
    # A run's rule 3 meets it first: with no padding, every key is masked (NaN in eval mode).
    "inverted_attention_mask": "the first module whose eval-mode output is non-finite: attend",
}


@pytest.mark.parametrize("broken", BROKEN, ids=[b.name for b in BROKEN])
def test_train_stops_each_broken_model_before_it_trains(broken, registered, tmp_path):
    """train() with the default settings (rule-2 models with every branch on, as the suite
    runs them): the rule's error before the first optimizer step. Every check runs: with the
    probe budget, which of them a busy machine's timings leave for after step 1 changes which
    catches the model first (position_table_32 met the padding check before rule 1's)."""
    registered(broken)
    overrides = ["env.progress_bar=false", "logger=none", "trainer.max_epochs=1"]
    overrides.append("trainer.probe_budget.enforce=false")
    if broken.check == "rule2":
        overrides.append("loss.force_all_branches=true")
    if broken.check == "config":  # through the real composition: train.py refuses it at start-up
        (tmp_path / "conf" / "model").mkdir(parents=True)
        (tmp_path / "conf" / "model" / f"{broken.name}.yaml").write_text("dropout: 0.0\n")
        with pytest.raises(ConfigError, match=re.escape(broken.needle)):
            compose_config(
                *overrides, f"model={broken.name}", f"hydra.searchpath=[file://{tmp_path}/conf]"
            )
        return
    cfg = broken_parts(broken, *overrides)
    from kiln.engine.run import train

    # A NaN branch is met by the numerics check first: a batch of 1's output holds it. A
    # branch taken when some sample of the batch asks for it makes each sample's output depend
    # on its neighbours: one process stops it there (under DDP, tests/test_ddp.py, the
    # parameters it leaves without a gradient stop it first).
    rule = {
        "nan_aux": NUMERICS,
        "conditional_refine": BATCH,
        "inverted_attention_mask": NUMERICS,
    }.get(broken.name, broken.rule)
    needle = SINGLE_PROCESS_NEEDLE.get(broken.name, broken.needle)
    with pytest.raises(ERRORS[rule]) as info:
        train(cfg, tmp_path / "run")
    message = str(info.value)
    assert message.startswith(rule), message
    summary = (tmp_path / "run" / "summary.json").read_text()
    assert '"steps": 0' in summary or '"steps": 1' in summary  # at the first step at the latest
    if broken.check in ("behaviour", "fp16"):  # before step 1, naming the module
        assert '"steps": 0' in summary and needle in message, message
    if broken.check == "coverage":  # after step 1, before anything is saved
        assert '"steps": 1' in summary and needle in message, message
        assert not (tmp_path / "run" / "checkpoints" / "best.pt").exists()


def register_twin(twin: Twin) -> Broken:
    """The twin registered under its own name, with its broken model's schema and data."""
    broken = twin.broken()
    MODELS.register(twin.name, config=broken.config, inputs=broken.inputs)(twin.builder)
    return dataclasses.replace(broken, name=twin.name, builder=twin.builder)


@pytest.fixture
def twin_registered():
    added = []

    def register(twin: Twin) -> Broken:
        added.append(twin.name)
        return register_twin(twin)

    yield register
    for name in added:
        del MODELS._entries[name]


@pytest.mark.parametrize("twin", TWINS, ids=[t.name for t in TWINS])
def test_each_correct_twin_passes_the_check_its_broken_model_fails(twin, twin_registered):
    """The same model with the bug mended: the check that stops the broken one lets it by (the
    checks look at the behaviour, not at a name or a shape)."""
    as_broken = twin_registered(twin)
    aux = as_broken.check == "rule2"
    cfg = broken_parts(as_broken)

    def build(spec):
        return build_model(spec, cfg.model, aux_head=aux).to("cpu")

    bundle = bundle_for(as_broken.data)
    criterion = build_criterion(build(bundle.spec), cfg.loss)
    extra = {"cfg": cfg} if as_broken.check in WITH_CFG else {}
    CHECKS[as_broken.check](build, criterion, bundle, **extra)


@pytest.mark.parametrize("twin", TWINS, ids=[t.name for t in TWINS])
def test_each_correct_twin_trains_as_it_does_without_the_probes(twin, twin_registered, tmp_path):
    """train() with every probe on and with every one off: the same steps, the same accuracy
    (the probes leave no trace on the run, and stop no correct model)."""
    from kiln.checkpoint import load_checkpoint
    from kiln.engine.run import train

    as_broken = twin_registered(twin)
    # A trace the probes left (a random number drawn, a buffer moved, a weight not put back)
    # shows from the first step on: a few steps tell it
    steps = 2 if as_broken.data == "shapes_detection" else 3  # a detector's step: seconds
    # One thread on both sides: threads=auto counts what neighbours keep busy, and two thread
    # counts sum in two orders (not bitwise) on a loaded machine.
    short = (
        "env.progress_bar=false",
        "logger=none",
        f"trainer.max_steps={steps}",
        "trainer.threads=1",
    )
    summaries, weights = [], []
    for extra in ((), PROBES_OFF):
        run_dir = tmp_path / ("on" if not extra else "off")
        summaries.append(train(broken_parts(as_broken, *short, *extra), run_dir))
        weights.append(load_checkpoint(run_dir / "checkpoints" / "last.pt")["model"])
    on, off = summaries
    assert on["steps"] == off["steps"] > 0
    monitor = on["monitor"]
    assert on[monitor] == off[monitor] and on["status"] == off["status"], (on, off)
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name
    assert on["probe_times_s"] and not any(
        k in off["probe_times_s"] for k in ("learn probe", "step probe", "batch dependence")
    )


def test_the_step_names_a_parameter_that_gets_no_gradient_in_a_later_step(caplog):
    """GradientPresence, as train_step runs it: the first step's parameters with a gradient are
    the expectation; a later step without one of them is named at once, once on one process;
    under DDP (fatal) the step raises before its next collective, after telling the other
    ranks why (on_fatal)."""
    import logging

    from kiln.guards.conditional_params import ConditionalParametersError, GradientPresence

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    def step(use_second: bool) -> None:
        model.zero_grad(set_to_none=True)
        h = model[0](torch.randn(3, 4))
        (model[1](h) if use_second else h).sum().backward()

    warned = GradientPresence(model, fatal=False)
    with caplog.at_level(logging.WARNING):
        for number, use in enumerate([True, True, False, False], start=1):
            step(use)
            warned.check(number)
    said = [r.getMessage() for r in caplog.records if "used only in some steps" in r.getMessage()]
    assert (
        len(said) == 1
        and "1.weight, 1.bias (in 1 (Linear)) got no gradient at step 3" in (said[0])
        and "trainer.find_unused_parameters=true" in said[0]
    )
    told = []
    fatal = GradientPresence(model, fatal=True, on_fatal=told.append)
    step(True)
    fatal.check(1)
    step(False)
    with pytest.raises(ConditionalParametersError, match="got no gradient at step 2") as info:
        fatal.check(2)
    assert told == [str(info.value)] and info.value.what == "dead gradients"
    # A first step already without one: under DDP another rank's first step may have used it
    # (its reduction waits for this rank), so no later step is waited for.
    first = GradientPresence(model, fatal=True)
    step(False)
    with pytest.raises(ConditionalParametersError, match=r"1.weight, 1.bias .* at step 1\b"):
        first.check(1)
    lenient = GradientPresence(model, fatal=False)  # one process: the expectation, no finding
    lenient.check(1)


def test_a_correct_model_passes_every_check_at_train_time(tmp_path):
    summary = train_in_process(
        tmp_path / "run", "trainer.max_steps=2", "env.progress_bar=false", "logger=none"
    )
    assert summary["status"] == "ok"


# ---------------------------------------------------------------------------------------------
# The checks themselves


class LiteralShapeNet(nn.Module):
    """Broken on purpose: forward assumes 16x16 inputs."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3 * 16 * 16, 5)

    def forward(self, x):
        h, w = 16, 16
        return self.fc(x.reshape(x.shape[0], 3 * h * w))


def test_rule1_check_names_the_case_the_module_and_the_shapes():
    cases = [
        ("batch 3 at 16x16", torch.randn(3, 3, 16, 16)),
        ("batch 3 at 24x24", torch.randn(3, 3, 24, 24)),
    ]
    with pytest.raises(ShapeInferenceError) as info:
        check_sizes_follow_inputs(LiteralShapeNet, cases)
    message = str(info.value)
    assert message.startswith(f"{RULE_1}: LiteralShapeNet failed on batch 3 at 24x24")
    assert "(3, 3, 24, 24)" in message and "never written as literals" in message


def test_rule2_branches_default_off():
    cfg = compose_config()
    assert cfg.loss.force_all_branches is False
    flags = ("label_smoothing", "z_loss", "confidence_penalty", "aux_head")
    assert not any(getattr(cfg.loss, flag) for flag in flags)


def forward_inputs(model, batch, train_mode):
    return model(batch[0])


def test_the_probes_leave_no_trace(tmp_path):
    """The whole probe plan (rules 1 and 3, the behaviour checks, the learn probe, the device
    probe) and rule 3 before an evaluation: the model's weights, buffers, modes and gradients,
    the optimizer's state, the batch and every RNG are as they were."""
    trainer, _ = make_trainer(
        tmp_path,
        "model=resnet18",
        "data=synthetic_images",
        "data.image_size=12",
        "data.num_train=16",
        "model.dropout=0.3",
        "trainer.probe_budget.enforce=false",  # every check, however busy the machine
    )
    model = trainer.raw_model
    model.train()
    model.net.fc[1].weight.grad = torch.full_like(model.net.fc[1].weight, 0.5)
    buffers = {k: v.clone() for k, v in model.named_buffers()}

    # Without restoring, one train-mode no-grad forward moves the BN statistics:
    probe = copy.deepcopy(model)
    with torch.no_grad():
        probe(trainer.parts.probe_subject.batch[0])
    assert not torch.equal(probe.net.bn1.running_mean, model.net.bn1.running_mean)

    weights = {k: v.detach().clone() for k, v in model.named_parameters()}
    optimizer = copy.deepcopy(trainer.optimizer.state_dict())
    batch = [t.clone() for t in trainer.parts.probe_subject.batch]
    rng = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    trainer.run_probes()  # the plan before the first step
    trainer.check_shapes()  # rule 3 before an evaluation
    assert {"rule 1", "rule 3", "step probe", "learn probe", "batch dependence"} <= set(
        trainer.probe_report.seconds
    )
    assert model.training and all(m.training for m in model.modules())
    for name, value in model.named_parameters():
        assert torch.equal(value, weights[name]), f"{name} changed"
    assert trainer.optimizer.state_dict() == optimizer
    assert all(
        torch.equal(a, b) for a, b in zip(trainer.parts.probe_subject.batch, batch, strict=True)
    )
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), f"{name} changed"
    assert torch.equal(model.net.fc[1].weight.grad, torch.full_like(model.net.fc[1].weight, 0.5))
    assert all(p.grad is None for n, p in model.named_parameters() if "fc.1" not in n)
    assert random.getstate() == rng[0]
    assert np.array_equal(np.random.get_state()[1], rng[1])
    assert torch.equal(torch.get_rng_state(), rng[2])


def test_rule3_detector_is_checked_against_its_per_mode_contract(tmp_path):
    trainer, _ = make_trainer(
        tmp_path,
        "model=detector",
        "data=shapes_detection",
        "data.num_train=4",
        "data.num_val=2",
        "data.batch_size=2",
    )
    trainer.check_shapes()  # train: a loss dict; eval: detections; both as declared

    class EvalDropsScores(type(trainer.raw_model)):
        def forward(self, images, targets=None):
            output = super().forward(images, targets)
            if not self.training:
                output = [{k: v for k, v in d.items() if k != "scores"} for d in output]
            return output

    trainer.raw_model.__class__ = EvalDropsScores
    with pytest.raises(ShapeContractError, match="eval mode: .*scores"):
        trainer.check_shapes()


def test_rule3_eval_only_crash_names_the_mode_module_and_shapes():
    from .broken_models import EvalOnlyHead

    model = nn.Sequential(nn.Flatten(), EvalOnlyHead(64, 10))
    batch = (torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ShapeContractError) as info:
        check_train_eval_agreement(model, batch, forward_inputs)
    message = str(info.value)
    assert message.startswith(f"{RULE_3}: the eval-mode forward raised RuntimeError in 1.fc")
    assert "with inputs ((8, 32),)" in message


def test_rule2_a_branch_at_zero_that_still_pulls_passes_one_that_moves_nothing_stops():
    """A zero-initialised head (timm's naflexvit radio) gives uniform logits, where kiln's label
    smoothing term is exactly 0 while its gradient is not: the branch works and rule 2 lets it
    be. A term that is 0 and moves nothing is still a branch that does nothing."""
    from kiln.guards.branches import check_loss_branches

    head = nn.Linear(4, 3)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    batch = (torch.randn(8, 4), torch.arange(8) % 3)
    criterion = build_criterion(head, compose_config("loss.force_all_branches=true").loss)
    terms = check_loss_branches(head, criterion, batch)
    assert float(terms["label_smoothing"]) == 0.0  # the case: 0, and passed

    def dead_branch(model, batch):
        logits = model(batch[0])
        terms = {"main": nn.functional.cross_entropy(logits, batch[1]), "dead": 0.0 * logits.sum()}
        return sum(terms.values()), terms

    with pytest.raises(LossBranchError, match="'dead' term is exactly 0 and moves nothing"):
        check_loss_branches(head, dead_branch, batch)


# ---------------------------------------------------------------------------------------------
# Every dataset's checkpoint record loads back; plugin datasets that read files are built


@pytest.mark.parametrize("data", DATASETS.names())
def test_every_datasets_checkpoint_record_loads_back_with_weights_only(data):
    """What every checkpoint carries of the data (its spec and preprocessing, as
    kiln.engine.run writes them) loads with weights_only=True: a dataset whose class names are
    numpy strings trained ok, then kiln could not load its own best.pt."""
    import io

    from kiln.engine.run import checkpoint_record

    fits = {"image": "mlp", "tokens": "text_bow", "image_list": "detector"}[dataset_provides(data)]
    cfg = compose_config(f"data={data}", f"model={fits}", *small(data))
    record = checkpoint_record(cfg, bundle_for(data))
    buffer = io.BytesIO()
    torch.save(record, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["data_spec"] == record["data_spec"]
    assert all(type(name) is str for name in loaded["data_spec"]["class_names"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class RowsFileConfig(DataConfig):
    """A plugin's dataset read from a file, at a path relative to where the user trains."""

    path: str = "my_rows.npz"


def build_rows_file(cfg):
    """8x8 images and their class names (numpy strings, as a pandas column gives them) from a
    .npz file."""
    from torch.utils.data import TensorDataset

    from kiln.data.spec import DataBundle, DataSpec
    from kiln.preprocessing import ImageRecipe

    with np.load(cfg.path) as data:
        x, y, names = torch.from_numpy(data["x"]), torch.from_numpy(data["y"]), data["names"]
    spec = DataSpec(
        "classification", "image", len(names), tuple(names), channels=1, image_size=(8, 8)
    )
    recipe = ImageRecipe(
        mean=(0.0,), std=(1.0,), channels=1, image_size=(8, 8), class_names=tuple(names)
    )
    return DataBundle(spec, TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:]), recipe)


def rows_file_example(folder: Path) -> list[str]:
    """The small example of its input the dataset declares (`example=` in its registry entry)."""
    generator = np.random.default_rng(0)
    y = np.arange(64) % 2
    x = (generator.normal(size=(64, 1, 8, 8)) + y[:, None, None, None]).astype(np.float32)
    names = np.array(["left", "right"])  # numpy strings
    np.savez(folder / "rows.npz", x=x, y=y.astype(np.int64), names=names)
    return [f"data.path={folder / 'rows.npz'}"]


@pytest.fixture
def rows_file(tmp_path):
    """The plugin's dataset registered, and its option's YAML in a folder of its own."""
    from kiln import registry

    (tmp_path / "conf" / "data").mkdir(parents=True)
    (tmp_path / "conf" / "data" / "rows_file.yaml").write_text("batch_size: 16\n")
    DATASETS.register(
        "rows_file", config=RowsFileConfig, provides="image", example=rows_file_example
    )(build_rows_file)
    registry.register_config_dir(tmp_path / "conf")
    yield "rows_file"
    del DATASETS._entries["rows_file"]
    registry._CONFIG_DIRS.remove(f"file://{(tmp_path / 'conf').resolve()}")
    _examples.pop("rows_file", None)


def test_a_plugin_dataset_that_reads_a_file_is_built_from_the_example_it_declares(
    rows_file, tmp_path
):
    """The registry-wide tests build every dataset from the repository's root: a plugin's
    dataset that reads a file at a relative path was a FileNotFoundError (42 of them). Its
    declared example is what the suite builds; and its run's best.pt loads back, numpy class
    names and all."""
    from kiln.checkpoint import load_checkpoint
    from kiln.engine.run import train

    with pytest.raises(FileNotFoundError):  # what the suite met without the example
        build_data(compose_config(f"data={rows_file}").data)
    bundle = bundle_for(rows_file)
    assert len(bundle.train) == 48 and bundle.spec.class_names == ("left", "right")
    assert all(type(name) is str for name in bundle.spec.class_names)
    cfg = compose_config(
        f"data={rows_file}",
        *small(rows_file),
        "trainer.max_steps=2",
        "logger=none",
        "env.progress_bar=false",
    )
    train(cfg, tmp_path / "run")
    best = load_checkpoint(tmp_path / "run" / "checkpoints" / "best.pt")
    assert best["data_spec"]["class_names"] == ["left", "right"] or tuple(
        best["data_spec"]["class_names"]
    ) == ("left", "right")


# ---------------------------------------------------------------------------------------------
# The broken datasets (tests/broken_models.py BROKEN_DATA): stopped by the data checks before a
# model is built, each named; triage names each cause from its finding


@pytest.mark.parametrize("broken", BROKEN_DATA, ids=[b.name for b in BROKEN_DATA])
def test_the_data_checks_stop_each_broken_dataset_and_pass_its_twin(broken):
    from kiln.data.split_hygiene import checked_splits

    bundle = bundle_for(broken.data)
    with pytest.raises(RuntimeError) as info:
        checked_splits(broken.change(bundle), 0.05, f"data={broken.data}")
    assert info.value.what == broken.what == info.value.kind, info.value
    assert broken.needle in str(info.value), str(info.value)
    mended = broken.mended(bundle) if broken.mended else bundle
    checked = checked_splits(mended, 0.05, f"data={broken.data}")  # the twin passes
    assert not checked.findings and checked.report["splits"]["overlap"]


@pytest.fixture
def broken_dataset():
    """Register a broken dataset (its base dataset, changed) for one test."""
    added = []

    def register(broken) -> str:
        name = f"broken_{broken.name}"
        base = DATASETS.entry(broken.data)

        def build(cfg):
            return broken.change(build_data(dataclasses.replace(cfg, name=broken.data)))

        DATASETS.register(name, config=base.config, provides=base.meta["provides"])(build)
        added.append(name)
        return name

    yield register
    for name in added:
        del DATASETS._entries[name]


@pytest.mark.parametrize("broken", BROKEN_DATA, ids=[b.name for b in BROKEN_DATA])
def test_train_stops_each_broken_dataset_before_the_model_and_triage_names_it(
    broken, broken_dataset, tmp_path
):
    import json

    from kiln.engine.run import train
    from kiln.findings import KINDS
    from kiln.triage import triage

    name = broken_dataset(broken)
    cfg = compose_config(
        f"data={broken.data}",
        *broken.overrides,
        *small(broken.data),
        "logger=none",
        "env.progress_bar=false",
    )
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, name=name))
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError) as info:
        train(cfg, run_dir)
    assert info.value.what == broken.what and broken.needle in str(info.value)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["failed_check"]["kind"] == broken.what
    (finding,) = json.loads((run_dir / "findings.json").read_text())
    assert finding["kind"] == broken.what and finding["fatal"]
    _, causes = triage(run_dir)
    assert causes[0].title == KINDS[broken.what].title, causes
    assert causes[0].try_ == (info.value.fix or KINDS[broken.what].advice)


ISSUE_48_TITLES = {
    "mean_over_padding": "the output depends on padding: the same text alone and padded beside "
    "a longer one give different outputs",
    "softmax_over_batch": "samples leak across the batch",
    "built_in_forward": "parameters the optimizer never updates in proj",
    "tied_in_forward": "parameters the optimizer never updates in decode",
}


@pytest.mark.parametrize("name", sorted(ISSUE_48_TITLES))
def test_triage_names_each_new_kind_from_its_finding(name, registered, tmp_path):
    """kiln triage named the cause in 1 of 14 such runs: each is now the first cause, titled and
    advised by its finding's kind."""
    from kiln.engine.run import train
    from kiln.triage import triage

    broken = next(b for b in BROKEN if b.name == name)
    registered(broken)
    cfg = broken_parts(broken, "env.progress_bar=false", "logger=none", "trainer.max_epochs=1")
    with pytest.raises(ProbeFailure):
        train(cfg, tmp_path / "run")
    _, causes = triage(tmp_path / "run")
    assert causes[0].title == ISSUE_48_TITLES[name], causes
    assert causes[0].try_ and broken.needle[:40] in causes[0].evidence


def test_inference_rebuilds_a_model_whose_layers_are_built_or_sized_at_the_first_call(
    registered, tmp_path
):
    """best.pt of a model with nn.LazyLinear, and of one that builds its layer in forward (as
    an older run wrote it): infer.py refused the second ("unexpected proj.weight"); both are
    rebuilt with a dry forward and predict as trained."""
    from kiln.engine.run import train
    from kiln.inference.record import read_checkpoint, rebuild_model

    twin = next(t for t in TWINS if t.name == "lazy_projection")
    as_broken = register_twin(twin)
    try:
        cfg = broken_parts(
            as_broken, "env.progress_bar=false", "logger=none", "trainer.max_steps=2"
        )
        train(cfg, tmp_path / "run")
        record, state = read_checkpoint(tmp_path / "run" / "checkpoints" / "best.pt")
        lazy = rebuild_model(record, state)
        x = bundle_for("digits").val.tensors[0][:4]
        # The same weights under a builder that makes `proj` in forward: rebuilt too.
        del MODELS._entries[twin.name]
        from .broken_models import BuiltInForward

        MODELS.register(twin.name, config=as_broken.config)(BuiltInForward)
        built = rebuild_model(record, state)
        assert torch.equal(lazy(x), built(x))
    finally:
        del MODELS._entries[twin.name]


def test_box_predictions_flipped_misread_or_degenerate_are_named_and_right_ones_are_not():
    """After the first evaluation (kiln.guards.box_predictions): a detector that learned boxes
    flipped (a dataset's flip that left the boxes behind) or decoded in another format fits its
    targets far better read back that way; its twin, right, says nothing."""
    from torchvision.ops import box_convert

    from kiln.guards.box_predictions import box_findings

    generator = torch.Generator().manual_seed(0)
    images = [torch.zeros(3, 64, 80) for _ in range(4)]
    targets = []
    for _ in images:
        corner = torch.rand(3, 2, generator=generator) * 40
        size = 8 + torch.rand(3, 2, generator=generator) * 20
        targets.append({"boxes": torch.cat([corner, corner + size], dim=1)})

    def outputs(change):
        return [
            {"boxes": change(t["boxes"]), "scores": torch.linspace(1, 0.5, len(t["boxes"]))}
            for t in targets
        ]

    def flipped(b):
        return torch.stack([80 - b[:, 2], b[:, 1], 80 - b[:, 0], b[:, 3]], dim=1)

    def decoded_as_cxcywh(b):  # raw (x1, y1, x2, y2) outputs decoded as (cx, cy, w, h)
        return box_convert(b, "cxcywh", "xyxy")

    assert box_findings(images, targets, outputs(lambda b: b + 1.0), step=23) == []  # the twin
    (found,) = box_findings(images, targets, outputs(flipped), step=23)
    assert found.kind == "box predictions" and not found.fatal
    assert found.evidence.startswith(
        "after the first evaluation (step 23): the boxes fit their targets better flipped "
        "horizontally (mean best IoU 1.00 against"
    ), found.evidence
    misread = [f.evidence for f in box_findings(images, targets, outputs(decoded_as_cxcywh), 23)]
    assert any("better read back as (cx, cy, w, h)" in said for said in misread), misread
    flat = box_findings(images, targets, outputs(lambda b: b[:, [0, 1, 0, 1]]), step=23)
    assert "12 of 12 predicted boxes have no area" in flat[0].evidence, flat


def test_a_split_overlap_within_the_limit_is_reported_said_and_triaged(broken_dataset, tmp_path):
    """10 validation digits copied from training (2.8%, under data.max_split_overlap=0.05): the
    run goes on; data_report.json counts them and names examples, findings.json says so, and
    triage names it above the bare symptom."""
    import json

    from kiln.engine.run import train
    from kiln.triage import triage

    from .broken_models import BrokenData, _with_val

    def ten_copied(bundle):
        from torch.utils.data import ConcatDataset, Subset

        rest = Subset(bundle.val, range(10, len(bundle.val)))
        return _with_val(bundle, ConcatDataset([Subset(bundle.train, range(10)), rest]))

    name = broken_dataset(BrokenData("ten_copied", ten_copied, "digits", "split leak", ""))
    cfg = compose_config("trainer.max_steps=2", "logger=none", "env.progress_bar=false")
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, name=name))
    summary = train(cfg, tmp_path / "run")
    assert summary["status"] in ("ok", "at_chance")
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())["splits"]
    shared = report["overlap"]["val/train"]
    assert shared["shared"] == 10 and shared["compared"] == 360
    assert shared["examples"][0] == "val item 0 = train item 0"
    (finding,) = json.loads((tmp_path / "run" / "findings.json").read_text())
    assert finding["kind"] == "split leak" and not finding["fatal"]
    assert "10 of 360 val items (2.8%) are also in the train split" in finding["evidence"]
    _, causes = triage(tmp_path / "run")
    leak = [c for c in causes if c.title.startswith("the same examples in the training split")]
    assert leak and "10 of 360 val items" in leak[0].evidence, causes


def test_splits_made_by_random_split_are_compared_by_their_own_items():
    """torch's random_split gives Subsets of one table: each is its own items, not the table's
    (which would read as a 100% overlap); a copied row across them is found."""
    from torch.utils.data import Subset, TensorDataset, random_split

    from kiln.data.split_hygiene import content_keys, overlap

    table = TensorDataset(torch.randn(100, 4), torch.zeros(100))
    train, val = random_split(table, [80, 20], generator=torch.Generator().manual_seed(0))
    assert overlap("val", content_keys(val), "train", content_keys(train)).shared == 0
    leaked = Subset(table, [*val.indices[:15], train.indices[0]])
    found = overlap("val", content_keys(leaked), "train", content_keys(train))
    assert (found.shared, found.compared) == (1, 16)
    assert found.examples == ["val item 15 = train item 0"]
