"""model=hf folders, hub snapshots and kiln's checkpoints fed hostile input (issue 46), each
through what the user types (train.py, infer.py) and checked for the one `error:` line, exit
status 2, and -- where memory is the point -- the peak RSS of a fresh process:

- confined: a shard index naming `../../outside/...` or an absolute path, a tokenizer file that
  links out of the folder, a hub blob that links out of its cache folder; malformed indexes;
- sized before allocation: hidden_size 10^6, vocab_size 10^9, max_position_embeddings 10^9 and
  10^4 layers refused from the meta-device count, a 200 MB tokenizer.json and a 100 MB
  config.json from their size, weights larger than the memory from theirs;
- no prompt: a folder with `auto_map` and code that would write a marker, trained with "y" on
  stdin: refused, the marker never written;
- checkpoints: an embedded tokenizer.json with two words' ids swapped (config.json, the
  preprocessing record, an ONNX sidecar) refused by predict, evaluate, export and serve; a
  checkpoint naming plugins makes infer.py import nothing and print the override to add."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from kiln.cli.paths import REPO_ROOT
from kiln.config.base import ConfigError
from kiln.models.zoo.transformers import hf_preprocessing
from kiln.threads import available_memory

from .conftest import SUBPROCESS_ENV, compose_config, run_python, train_in_process, train_main_here
from .hf_helpers import (
    bad_index,
    copy_folder,
    edit_json,
    into_hub_cache_linked,
    linked_outside,
    sharded_outside,
    sized_config,
    sparse_file,
    swap_two_words,
    with_remote_code,
    write_bert,
)
from .inference_helpers import free_port
from .test_evaluate import run_infer

TEXTS = [
    "the ndarray broadcast along an axis",
    "a session cookie in the request header",
    "dtype of the array",
    "the http header",
] * 10
HF = ("data=csv_text", "model=hf")


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    return write_bert(tmp_path_factory.mktemp("hostile") / "bert", TEXTS)


def refused(capsys, folder: Path, *extra: str) -> str:
    """`python train.py data=csv_text model=hf model.arch=<folder>` in this process: exit status
    2 and exactly one `error:` line on stderr, returned. It stops at the start-up check, before
    Hydra makes a run directory."""
    code, stderr = train_main_here(capsys, *HF, f"model.arch={folder}", *extra)
    lines = stderr.strip().splitlines()
    assert code == 2, lines
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def check(folder: Path, *extra: str):
    return hf_preprocessing(compose_config(*HF, f"model.arch={folder}", *extra).model)


# ---------------------------------------------------------------------------------------------
# Every file a folder names stays inside its root


@pytest.mark.parametrize("name", ["../../outside/stolen.safetensors", "ABSOLUTE"])
def test_a_shard_index_naming_a_file_outside_the_folder_is_refused(bert, tmp_path, capsys, name):
    """transformers and safetensors join a weight_map's file names to the folder as written and
    load them; the probe loaded 39 tensors from outside and the run ended ok."""
    if name == "ABSOLUTE":
        name = str(tmp_path / "elsewhere" / "stolen.safetensors")
    folder = sharded_outside(bert, tmp_path / "a" / "b" / "model", name)
    shard = Path(name) if Path(name).is_absolute() else folder / name
    assert shard.resolve().is_file() and not shard.resolve().is_relative_to(folder)
    line = refused(capsys, folder)
    assert "model.safetensors.index.json's weight_map['" in line
    assert f"names {name!r}, outside the model folder {folder}" in line
    assert "(model.arch)" in line


@pytest.mark.parametrize("name", ["vocab.txt", "tokenizer.json"])
def test_a_tokenizer_file_linking_out_of_the_folder_is_refused(bert, tmp_path, capsys, name):
    """vocab.txt linked to a file outside: its lines ended up in best.pt as the vocabulary."""
    secret = tmp_path / "secret.txt"
    secret.write_text("password\nhunter2\n")
    folder = linked_outside(bert, tmp_path / "model", name, secret)
    line = refused(capsys, folder)
    assert f"{name} leads to {secret}, outside the model folder {folder}" in line


def test_a_hub_snapshot_links_into_its_blobs_and_no_further(bert, tmp_path, monkeypatch, capsys):
    """The hub cache's own layout (snapshots/<commit>/<file> -> ../../blobs/<sha256>) is read,
    by hub id and as a snapshot path; a blob that is itself a link out of the repo's cache
    folder is refused."""
    snapshot = into_hub_cache_linked(bert, tmp_path / "hub", "org/tiny")
    assert (snapshot / "tokenizer.json").is_symlink()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert check("org/tiny").tokenizer_sha256 == check(bert).tokenizer_sha256
    assert check(snapshot).model_config["model_type"] == "bert"
    blob = (snapshot / "tokenizer_config.json").resolve()
    secret = tmp_path / "secret.json"
    secret.write_text(blob.read_text())
    blob.unlink()
    blob.symlink_to(secret)  # the snapshot's link resolves, through the blob, out of the cache
    line = refused(capsys, snapshot)
    repo = tmp_path / "hub" / "models--org--tiny"
    assert f"tokenizer_config.json leads to {secret}, outside the model folder {repo}" in line


MALFORMED = {
    "no weight_map": ({"metadata": {}}, "has no weight_map"),
    "a list": ({"weight_map": ["model.safetensors"]}, "has a weight_map of <class 'list'>"),
    "empty": ({"weight_map": {}}, "has an empty weight_map"),
    "a number for a file": ({"weight_map": {"bert.x": 3}}, "gives 3, not a file name"),
    "not an object": ([1, 2], "holds a JSON list, not an object"),
    "a missing shard": ({"weight_map": {"bert.x": "gone.safetensors"}}, "no such file"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_shard_index_is_one_line_naming_it(bert, tmp_path, capsys, case):
    """It ended as `KeyError @ step 0`."""
    index, said = MALFORMED[case]
    folder = bad_index(bert, tmp_path / "model", index)
    line = refused(capsys, folder)
    assert "model.safetensors.index.json" in line and said in line, line


def test_a_fast_tokenizer_file_named_outside_the_folder_is_refused(bert, tmp_path, capsys):
    folder = copy_folder(bert, tmp_path / "model")
    edit_json(folder / "tokenizer_config.json", fast_tokenizer_files=["../../tokenizer.4.0.json"])
    line = refused(capsys, folder)
    assert "tokenizer_config.json's fast_tokenizer_files names '../../tokenizer.4.0.json'" in line


def test_a_fifo_for_a_tokenizer_file_is_refused_not_waited_on(bert, tmp_path, capsys):
    folder = copy_folder(bert, tmp_path / "model")
    (folder / "tokenizer.json").unlink()
    os.mkfifo(folder / "tokenizer.json")
    assert "tokenizer.json is a FIFO (named pipe), not a regular file" in refused(capsys, folder)


# ---------------------------------------------------------------------------------------------
# Sizes before allocation

SIZES = {  # config.json changes -> the key the refusal names
    "hidden_size": ({"hidden_size": 10**6}, "hidden_size=1000000"),
    "vocab_size": ({"vocab_size": 10**9}, "vocab_size=1000000000"),
    "max_position_embeddings": (
        {"max_position_embeddings": 10**9},
        "max_position_embeddings=1000000000",
    ),
    # BERT-base's width, 10^4 layers: 7e10 parameters, past any machine kiln runs on
    "num_hidden_layers": (
        {
            "num_hidden_layers": 10**4,
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_attention_heads": 12,
        },
        "num_hidden_layers=10000",
    ),
}


@pytest.mark.parametrize("case", SIZES)
def test_a_config_past_the_machine_is_refused_naming_the_key_and_the_size(
    bert, tmp_path, capsys, case
):
    """Allocated about 4 GB before `RuntimeError @ step 0`; 10^4 layers ran 600 s: now counted on
    the meta device and refused before anything is built (peak memory: the next test; no timed
    assertion: 1.2 s on a slow day failed one)."""
    sizes, key = SIZES[case]
    folder = sized_config(bert, tmp_path / "model", **sizes)
    with pytest.raises(ConfigError):
        check(folder)
    line = refused(capsys, folder)
    assert f"config.json's {key} gives a model of " in line and "parameters" in line
    assert "nothing was built (model.arch)" in line
    gigabytes = float(line.split("weights and gradients need ")[1].split(" GB")[0])
    assert gigabytes * 2**30 > available_memory()


def test_a_model_type_sized_past_the_machine_by_model_config_is_refused_before_it_is_built():
    """model.config reaches a from-scratch model type's sizes too: judged with the data's
    vocabulary and max_length when the model is built, before transformers allocates it."""
    from kiln.data.spec import DataSpec
    from kiln.models import build_model

    spec = DataSpec("classification", "tokens", 2, ("a", "b"), vocab_size=50, max_length=16)
    cfg = compose_config(*HF, "model.arch=bert", "+model.config.hidden_size=1000000")
    said = r"bert \(from scratch\): config \(with model.config\)'s hidden_size=1000000 gives a"
    with pytest.raises(ConfigError, match=said):
        build_model(spec, cfg.model)


def test_model_max_params_is_a_limit_of_ones_own(bert, capsys):
    line = refused(capsys, bert, "model.max_params=1000")
    assert "more than model.max_params=1000 (model.max_params)" in line
    assert check(bert, "model.max_params=10000000") is not None


def test_refusals_take_little_memory_in_a_fresh_process(tmp_path, monkeypatch, capsys):
    """scripts/hostile_models.py checks each hostile folder in one fresh process after a good
    one (the floor: torch and transformers imported): no refusal raises the peak RSS by more
    than 64 MiB (a 200 MB tokenizer.json reached 5.4 GB before). The script's own main() runs
    here: the fresh process that measures is the one it starts."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "scripts"))
    monkeypatch.setattr(sys, "path", list(sys.path))  # the paths the script adds leave with it
    import hostile_models

    out = tmp_path / "hostile.json"
    hostile_models.main(["--out", str(out)])
    assert "| tokenizer.json of 200 MB |" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["markdown"].startswith("*Recorded "), report["markdown"]  # docs/ reads it
    results = report["cases"]
    assert len(results) == 7, results
    for name, result in results.items():
        assert result["outcome"] != "accepted", name
        assert result["above_floor_mib"] < 64, (name, result)


@pytest.mark.parametrize(
    ("name", "size", "key"),
    [
        ("tokenizer.json", 200 * 2**20, "model.max_tokenizer_bytes"),
        ("config.json", 100 * 2**20, "model.max_config_bytes"),
    ],
)
def test_a_file_past_its_size_limit_is_refused_before_it_is_parsed(
    bert, tmp_path, capsys, name, size, key
):
    folder = copy_folder(bert, tmp_path / "model")
    sparse_file(folder / name, size)  # zeros: not JSON at all, and never read
    line = refused(capsys, folder)
    assert f"{name} is {size / 2**20:.1f} MiB, more than {key}=" in line
    assert "refused before it is parsed" in line
    assert line.endswith(
        f"({key}): raise {key} if the file is genuine (see docs/transformers.md for real sizes)"
    )


def test_weights_larger_than_the_memory_are_refused_before_a_byte_is_read(bert, tmp_path, capsys):
    folder = copy_folder(bert, tmp_path / "model")
    sparse_file(folder / "model.safetensors", available_memory() + 2**30)
    line = refused(capsys, folder)
    assert "its weights (model.safetensors) are" in line and "(model.weights)" in line


# ---------------------------------------------------------------------------------------------
# No prompt, no code of the folder's own


def test_a_folder_with_auto_map_is_refused_and_its_code_never_runs_even_answering_yes(
    bert, tmp_path
):
    """transformers asks "[y/N]" before it imports a folder's configuration_*.py; the probe
    answered y (`yes |`) and its marker files were written. train.py, fed y on stdin: one line
    naming auto_map, exit 2, and no marker."""
    marker = tmp_path / "the_folders_code_ran"
    folder = with_remote_code(bert, tmp_path / "evil", marker)
    train = [sys.executable, str(REPO_ROOT / "train.py"), *HF, f"model.arch={folder}"]
    done = run_python([*train, f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, input="y\n" * 1000)
    assert not marker.exists()
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: hf folder {folder}: config.json has auto_map (")
    assert "configuration_evil.EvilConfig" in line and "kiln never runs a model folder's" in line
    assert "[y/N]" not in done.stdout + done.stderr


def test_auto_map_in_tokenizer_config_alone_is_refused_too(bert, tmp_path, capsys):
    folder = copy_folder(bert, tmp_path / "model")
    edit_json(folder / "tokenizer_config.json", auto_map={"AutoTokenizer": ["tok.Evil", None]})
    assert "tokenizer_config.json has auto_map (['tok.Evil', None])" in refused(capsys, folder)


# ---------------------------------------------------------------------------------------------
# Checkpoints: embedded files against their hashes, plugins never imported on their word


@pytest.fixture(scope="module")
def hf_checkpoint(bert, tmp_path_factory) -> Path:
    """A model=hf run's best.pt (one step: what matters is what it embeds)."""
    root = tmp_path_factory.mktemp("hf_run")
    rows = [(text, "arrays" if "array" in text else "http") for text in TEXTS]
    pd.DataFrame(rows, columns=["text", "label"]).to_csv(root / "train.csv", index=False)
    summary = train_in_process(
        root / "run",
        *HF,
        f"model.arch={bert}",
        f"data.train_path={root / 'train.csv'}",
        "data.max_length=32",
        "trainer.max_steps=1",
        f"data.cache_dir={root / 'cache'}",
    )
    assert summary["error"] is None, summary
    return root / "run" / "checkpoints" / "best.pt"


def tampered(best: Path, dest: Path, edit) -> Path:
    """A copy of `best` whose record `edit(ckpt)` changed, saved by torch as kiln saves."""
    ckpt = torch.load(best, weights_only=True)
    edit(ckpt)
    torch.save(ckpt, dest)
    return dest


def swap_tokenizer(ckpt: dict) -> None:
    """Two words' ids swapped in the tokenizer inference reads (and in the record's copy)."""
    swapped, _ = swap_two_words(ckpt["preprocessing"]["tokenizer_json"])
    ckpt["preprocessing"]["tokenizer_json"] = swapped
    ckpt["preprocessing"]["pretrained"]["tokenizer_json"] = swapped


MODES = {
    "predict": ("input={csv}", "output={tmp}/preds.csv"),
    "evaluate": ("mode=evaluate", "data={csv}", "output={tmp}/eval"),
    "export": ("mode=export",),
    "serve": ("mode=serve", "server.port={port}"),
}


@pytest.mark.timeout(120)  # serve, were the check gone, would listen until stopped
@pytest.mark.parametrize("mode", MODES)
def test_an_edited_tokenizer_in_a_checkpoint_is_refused_by_every_mode(
    hf_checkpoint, tmp_path, capsys, mode
):
    """Two words' ids swapped in the embedded tokenizer.json was used silently: its sha256 was
    recorded and never compared."""
    ckpt = tampered(hf_checkpoint, tmp_path / "best.pt", swap_tokenizer)
    csv = hf_checkpoint.parent.parent.parent / "train.csv"
    args = [a.format(csv=csv, tmp=tmp_path, port=free_port()) for a in MODES[mode]]
    code, _, err = run_infer(capsys, f"ckpt={ckpt}", *args)
    assert code == 2, err
    assert err.strip().splitlines() == [
        f"error: checkpoint {ckpt}: its embedded tokenizer.json does not match the sha256 "
        f"recorded when it was written ({err.split('written (')[1].split(')')[0]}): it was "
        "edited or damaged since; refused -- use the checkpoint as its training run wrote it"
    ]
    assert not (tmp_path / "preds.csv").exists() and not (tmp_path / "model.onnx").exists()


def edit_config(ckpt: dict) -> None:
    ckpt["preprocessing"]["pretrained"]["model_config"]["hidden_act"] = "relu"


def edit_classes(ckpt: dict) -> None:
    names = ckpt["preprocessing"]["class_names"]
    ckpt["preprocessing"]["class_names"] = list(reversed(names))


def older_checkpoint_swapped(ckpt: dict) -> None:
    """A checkpoint from before embedded_sha256: model=hf's tokenizer_sha256 still holds."""
    del ckpt["embedded_sha256"]
    ckpt["preprocessing"]["tokenizer_json"] = swap_two_words(
        ckpt["preprocessing"]["tokenizer_json"]
    )[0]


@pytest.mark.parametrize(
    ("edit", "name"),
    [
        (edit_config, "config.json"),
        (edit_classes, "preprocessing"),
        (older_checkpoint_swapped, "tokenizer.json"),
    ],
)
def test_each_embedded_file_is_checked_and_named(hf_checkpoint, tmp_path, capsys, edit, name):
    ckpt = tampered(hf_checkpoint, tmp_path / "best.pt", edit)
    code, _, err = run_infer(capsys, f"ckpt={ckpt}", "mode=export")
    assert code == 2 and f"its embedded {name} does not match the sha256" in err, err


def test_an_untouched_checkpoint_and_one_older_than_the_hashes_are_read(
    hf_checkpoint, tmp_path, capsys
):
    csv = hf_checkpoint.parent.parent.parent / "train.csv"
    code, _, err = run_infer(
        capsys, f"ckpt={hf_checkpoint}", f"input={csv}", f"output={tmp_path}/a.csv"
    )
    assert code == 0, err

    def older(ckpt: dict) -> None:
        del ckpt["embedded_sha256"]

    ckpt = tampered(hf_checkpoint, tmp_path / "older.pt", older)
    code, _, err = run_infer(capsys, f"ckpt={ckpt}", f"input={csv}", f"output={tmp_path}/b.csv")
    assert code == 0, err
    assert (tmp_path / "a.csv").read_text() == (tmp_path / "b.csv").read_text()


def test_an_edited_onnx_sidecar_is_refused(hf_checkpoint, tmp_path, capsys):
    """backend=onnx reads the preprocessing from model.onnx.json: it carries the hashes too."""
    import shutil

    best = shutil.copy(hf_checkpoint, tmp_path / "best.pt")
    assert run_infer(capsys, f"ckpt={best}", "mode=export")[0] == 0
    sidecar = tmp_path / "model.onnx.json"
    record = json.loads(sidecar.read_text())
    assert set(record["embedded_sha256"]) == {"tokenizer.json", "config.json", "preprocessing"}
    record["preprocessing"]["tokenizer_json"] = swap_two_words(
        record["preprocessing"]["tokenizer_json"]
    )[0]
    sidecar.write_text(json.dumps(record))
    csv = hf_checkpoint.parent.parent.parent / "train.csv"
    code, _, err = run_infer(
        capsys, f"ckpt={best}", "backend=onnx", f"input={csv}", f"output={tmp_path}/p.csv"
    )
    assert code == 2 and f"checkpoint {sidecar}: its embedded tokenizer.json" in err, err


MARKER_PLUGIN = """
from pathlib import Path
Path({marker!r}).write_text("imported on the checkpoint's word")
"""


def test_a_checkpoint_naming_plugins_makes_infer_import_nothing(hf_checkpoint, tmp_path):
    """A best.pt whose record names a plugin and the folder it came from (plugins.sources), and
    an installed package's module (plugins.packages) that sits in the working directory: infer.py
    imported both before. Now: no marker, exit 2, and the override to add."""
    planted = tmp_path / "planted"
    planted.mkdir()
    marker = tmp_path / "marker"
    (planted / "evil_parts.py").write_text(MARKER_PLUGIN.format(marker=str(marker)))
    (tmp_path / "evil_pkg.py").write_text(MARKER_PLUGIN.format(marker=str(marker)))

    def plant(ckpt: dict) -> None:
        ckpt["config"]["plugins"] = ["evil_parts"]
        ckpt["plugins"] = {
            "sources": {"evil_parts": str(planted)},
            "config_dirs": [],
            "packages": {"evil_pkg": {"distribution": "evil", "version": "1", "entry_point": None}},
        }

    ckpt = tampered(hf_checkpoint, tmp_path / "best.pt", plant)
    csv = hf_checkpoint.parent.parent.parent / "train.csv"
    infer = [sys.executable, str(REPO_ROOT / "infer.py"), f"ckpt={ckpt}", f"input={csv}"]
    done = run_python(infer, tmp_path)
    assert not marker.exists()
    assert done.returncode == 2, done.stderr[-3000:]
    (line,) = done.stderr.strip().splitlines()
    assert (
        "was trained with 'plugins=[evil_parts]', and this command imported no evil_parts" in line
    )
    assert "add 'plugins=[evil_parts]' to the command" in line
    assert f"evil_parts was imported from {planted}" in line
    named = subprocess.run(
        [*infer, "plugins=[evil_pkg]"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=SUBPROCESS_ENV,
    )
    assert named.returncode == 2 and "imported no evil_parts" in named.stderr  # only what is named
    assert marker.exists()  # evil_pkg, which the user named, was imported: the user's choice
