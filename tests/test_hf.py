"""model=hf: a folder written by save_pretrained (a small BERT whose WordPiece vocabulary is
built here from the training CSV, a small RoBERTa with a byte-level BPE one) trains through the
real `train.py data=csv_text ... model=hf model.name=<folder>` on a damaged CSV, above the
majority baseline; the same model is found in a hub cache layout under HF_HUB_OFFLINE=1; and
infer.py and the ONNX model give the evaluation's probabilities without the folder."""

from __future__ import annotations

import json
import logging
import shlex
import shutil
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pandas as pd
import pytest
import torch

from kiln.commands import RunCommand, cache_environment
from kiln.config.base import ConfigError
from kiln.inference import Predictor
from kiln.models import build_model
from kiln.models.zoo.transformers import hf_preprocessing, position_limit
from kiln.preprocessing.pretrained import PretrainedText, pretrained_from_dict
from kiln.serving import create_app

from .conftest import (
    compose_config,
    read_summary,
    run_python,
    run_train,
    train_in_process,
)
from .damaged_csv import clean_rows, write_damaged_csv
from .hf_helpers import POSITIONS, csv_texts, into_hub_cache, write_bert, write_roberta
from .inference_helpers import live_server
from .test_evaluate import run_infer

CLASSES = ("arrays", "http")  # two topics whose words never overlap: learnable in a few epochs
DAMAGE = {"stray_quote": 1, "missing_label": 1, "extra_columns": 1, "markup_only": 1}
REPO_ID = "kiln-tests/tiny-bert"
TRAIN = (
    "data=csv_text",
    "model=hf",
    f"data.max_length={POSITIONS}",
    "data.batch_size=16",
    "optimizer.lr=0.003",  # a tiny BERT from scratch (tiny_hf), not a pretrained one
    "trainer.max_epochs=6",
)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    write_damaged_csv(root / "train.csv", 240, DAMAGE, classes=CLASSES)
    return root


@pytest.fixture(scope="module")
def bert_run(corpus) -> tuple[Path, Path]:
    """(run dir, the CSV): a BERT folder trained through train.py, then the folder moved away
    (inference must not need it). A copy of it is kept as a hub cache download."""
    folder = write_bert(corpus / "bert", csv_texts(corpus / "train.csv"), num_labels=3)
    into_hub_cache(folder, corpus / "hub", REPO_ID)
    run_dir = corpus / "bert_run"
    done = run_train(
        run_dir,
        *TRAIN,
        f"data.train_path={corpus / 'train.csv'}",
        f"data.cache_dir={corpus / 'cache'}",
        f"model.name={folder}",  # the spelling (model_name_or_path): read as model.arch
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (corpus / "bert_run_stdout.txt").write_text(done.stdout)  # what it printed, to type again
    shutil.move(folder, corpus / "moved_away")
    return run_dir, corpus / "train.csv"


def majority_share(run_dir: Path) -> float:
    report = json.loads((run_dir / "data_report.json").read_text())
    val = report["class_counts"]["val"]
    return max(val.values()) / sum(val.values())


def test_a_bert_folder_trains_on_a_damaged_csv_above_the_majority_baseline(bert_run):
    run_dir, _ = bert_run
    summary = read_summary(run_dir)
    assert summary["status"] == "ok", summary
    assert summary["val_acc"] > majority_share(run_dir) + 0.15, summary
    model = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)["config"]["model"]
    assert (model["name"], Path(model["arch"]).name) == ("hf", "bert"), model
    report = json.loads((run_dir / "data_report.json").read_text())
    assert report["train_file"]["rows_dropped"] == len(DAMAGE)
    assert report["tokenizer"].startswith("hf folder ")
    log = (run_dir / "train.log").read_text()
    head = "head classifier.weight, classifier.bias re-initialised (3 classes in the file, 2 in"
    assert head in log
    assert "its normalizer lower-cases (an uncased model)" in log
    ckpt = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    recorded = pretrained_from_dict(ckpt["preprocessing"]["pretrained"])
    assert isinstance(recorded, PretrainedText) and recorded.model_config["model_type"] == "bert"
    assert ckpt["preprocessing"]["cleaning"]["lowercase"] is False  # the tokenizer's job


def test_infer_and_onnx_give_the_evaluations_probabilities_without_the_folder(
    bert_run, tmp_path, capsys
):
    run_dir, _ = bert_run
    csv = tmp_path / "held_out.csv"
    rows = clean_rows(40, seed=5, classes=CLASSES)
    pd.DataFrame(rows, columns=["text", "label"]).to_csv(csv, index=False)
    ckpt = f"ckpt={run_dir}/checkpoints/best.pt"
    code, _, err = run_infer(capsys, "mode=evaluate", ckpt, f"data={csv}", f"output={tmp_path}/ev")
    assert code == 0, err
    evaluated = pd.read_csv(tmp_path / "ev" / "predictions.csv")
    code, _, err = run_infer(capsys, ckpt, f"input={csv}", f"output={tmp_path}/preds.csv")
    assert code == 0, err
    predicted = pd.read_csv(tmp_path / "preds.csv")
    probs = [c for c in evaluated.columns if c.startswith("prob_")]
    assert len(predicted) == len(evaluated) == 40
    np.testing.assert_allclose(predicted[probs], evaluated[probs], atol=1e-4)
    code, out, err = run_infer(capsys, "mode=export", ckpt)
    assert code == 0, err
    onnx = run_dir / "checkpoints" / "model.onnx"
    code, _, err = run_infer(
        capsys, f"ckpt={onnx}", "backend=onnx", f"input={csv}", f"output={tmp_path}/onnx.csv"
    )
    assert code == 0, err
    np.testing.assert_allclose(
        pd.read_csv(tmp_path / "onnx.csv")[probs], evaluated[probs], atol=1e-4
    )
    # The server, on raw text: the same probabilities, from the checkpoint alone.
    predictor = Predictor.from_checkpoint(run_dir / "checkpoints" / "best.pt")
    texts = [text for text, _ in rows]
    with live_server(create_app(predictor, max_batch_size=8, max_delay_ms=5)) as server:
        answer = httpx.post(f"{server.url}/v1/predict", json={"inputs": texts}, timeout=60)
    assert answer.status_code == 200, answer.text
    served = np.array([p["probs"] for p in answer.json()["predictions"]])
    np.testing.assert_allclose(served, evaluated[probs].to_numpy(), atol=1e-4)


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_onnx_logits_match_torch_at_any_batch_and_length(bert_run, batch, capsys):
    """Dynamic batch and sequence axes: ORT's logits within 1e-4 of PyTorch's at lengths 1, 7
    and max_length, padding with the tokenizer's pad id in the longer rows."""
    import onnxruntime as ort

    from kiln.inference.record import read_checkpoint, rebuild_model

    run_dir, _ = bert_run
    best = run_dir / "checkpoints" / "best.pt"
    onnx = best.with_name("model.onnx")
    if not onnx.is_file():
        assert run_infer(capsys, "mode=export", f"ckpt={best}")[0] == 0
    record, state = read_checkpoint(best)
    model = rebuild_model(record, state)
    session = ort.InferenceSession(str(onnx), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(batch)
    for length in (1, 7, POSITIONS):
        ids = torch.randint(5, record.spec.vocab_size, (batch, length), generator=gen)
        ids[1:, max(1, length // 2) :] = record.spec.pad_id  # shorter rows, padded
        with torch.no_grad():
            expected = model(ids).numpy()
        (logits,) = session.run(["logits"], {"input": ids.numpy()})
        np.testing.assert_allclose(logits, expected, atol=1e-4, err_msg=f"length {length}")


def test_int8_export_states_how_often_it_agrees_with_torch(bert_run, tmp_path):
    """int8=true quantises the encoder's weights (dynamic quantisation) and says how often its
    prediction matches torch's on the validation examples; a low agreement is refused."""
    from kiln.inference import export
    from kiln.inference.export import INT8_MIN_AGREEMENT

    run_dir, _ = bert_run
    report = export(run_dir / "checkpoints" / "best.pt", tmp_path / "model.onnx", int8=True)
    assert report.int8_path.is_file() and report.int8_num_examples > 0
    assert report.int8_agreement >= INT8_MIN_AGREEMENT
    assert any("agrees with torch on" in line for line in report.lines())


def test_the_triton_repository_ships_the_models_tokenizer_a_client_can_run(bert_run, tmp_path):
    """What a Triton client does for model=hf: run the repository's tokenizer.json (the
    model's own, special tokens and all), truncate at the recorded length, pad with the pad id
    the config.pbtxt names, send INT64 ids: the graph gives infer.py's probabilities."""
    from tokenizers import Tokenizer

    from kiln.inference.backends import ort_session
    from kiln.inference.record import read_checkpoint
    from kiln.inference.triton import export_triton

    run_dir, _ = bert_run
    best = run_dir / "checkpoints" / "best.pt"
    report = export_triton(best, tmp_path / "repo", max_batch_size=8)
    record, _ = read_checkpoint(best)
    header = (report.model_dir / "config.pbtxt").read_text()
    assert f"pad every row to the longest with {record.recipe.pad_id}" in header
    tokenizer = Tokenizer.from_file(str(report.model_dir / "tokenizer.json"))
    tokenizer.enable_truncation(record.recipe.max_length)
    texts = [
        "the ndarray broadcast along an axis",
        "a session cookie in the request header",
        " ".join(["dtype"] * 200),  # longer than max_length: truncated
    ]
    encoded = [e.ids for e in tokenizer.encode_batch(texts)]
    assert encoded[0][0] == tokenizer.token_to_id("[CLS]")  # the model's special tokens
    ids = np.full((len(texts), max(map(len, encoded))), record.recipe.pad_id, dtype=np.int64)
    for row, sequence in enumerate(encoded):
        ids[row, : len(sequence)] = sequence
    session = ort_session(report.model_dir / "1" / "model.onnx")
    (probs,) = session.run(["probs"], {session.get_inputs()[0].name: ids})
    expected = Predictor.from_checkpoint(best).predict_probs(texts)
    np.testing.assert_allclose(probs, expected, atol=1e-4)


def test_the_same_model_is_read_from_the_hub_cache_offline(bert_run, corpus, monkeypatch, caplog):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(corpus / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(corpus / "hub"))
    with caplog.at_level(logging.INFO):
        summary = train_in_process(
            corpus / "hub_run",
            *TRAIN,
            f"data.train_path={corpus / 'train.csv'}",
            f"data.cache_dir={corpus / 'cache'}",
            f"model.arch={REPO_ID}",
            "trainer.max_steps=2",
        )
    assert summary["status"] in ("ok", "at_chance"), summary
    assert f"model.weights: 39 tensors from hf hub {REPO_ID}" in caplog.text
    assert "cache hit" in caplog.text  # the same tokenizer hash: bert_run's token store


def test_a_hub_id_not_in_the_cache_is_one_error_line_naming_the_folder_and_the_download(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    cfg = compose_config("data=csv_text", "model=hf", "model.arch=some-org/absent-model")
    with pytest.raises(ConfigError) as caught:
        hf_preprocessing(cfg.model)
    message = str(caught.value)
    assert "\n" not in message
    assert str(tmp_path / "hub" / "models--some-org--absent-model") in message
    assert "`hf download some-org/absent-model`" in message


def test_a_hub_id_in_the_wrong_case_gets_the_cached_one_suggested(bert_run, corpus, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(corpus / "hub"))  # holds kiln-tests/tiny-bert
    cfg = compose_config("data=csv_text", "model=hf", "model.arch=Kiln-Tests/Tiny-BERT")
    with pytest.raises(ConfigError, match=r"did you mean model.arch=kiln-tests/tiny-bert\?"):
        hf_preprocessing(cfg.model)


def test_the_printed_train_longer_command_works_with_the_model_folder_gone(bert_run, corpus):
    """bert_run's folder was moved away after training: the printed `init_from=` command reads
    the checkpoint's own config.json and tokenizer, as printed (plus where to write, 2 steps)."""
    run_dir, _ = bert_run
    printed = (corpus / "bert_run_stdout.txt").read_text().splitlines()
    (command,) = [line.split("  # ")[0] for line in printed if "init_from=" in line]
    assert not (corpus / "bert").exists()
    program, *args = shlex.split(command)
    assert program == "python"  # this environment's
    args += ["trainer.max_steps=2", f"hydra.run.dir={corpus / 'longer'}"]
    done = run_python([sys.executable, *args], corpus)
    assert done.returncode == 0, done.stderr[-3000:]
    log = (corpus / "longer" / "train.log").read_text()
    assert "init_from: the tokenizer and config.json recorded in" in log


def test_printed_train_commands_carry_the_caches_a_pretrained_model_came_from(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text("- model=hf\n- model.arch=org/name\n")
    (run_dir / ".hydra" / "config.yaml").write_text("model:\n  name: hf\n")
    environment = {"HF_HUB_CACHE": "/data/hf hub", "HF_HUB_OFFLINE": "1", "PATH": "/bin"}
    (run_dir / "environment.json").write_text(json.dumps(environment))
    line = RunCommand.of_run(run_dir).train("trainer.max_epochs=6")
    assert line.startswith("HF_HUB_CACHE='/data/hf hub' python ")
    assert line.endswith("model=hf model.arch=org/name trainer.max_epochs=6")
    assert cache_environment("text_bow", environment) == ()  # reads no pretrained weights


def test_model_name_holding_a_folder_is_read_as_model_arch():
    cfg = compose_config("data=csv_text", "model=hf", "model.name=./my-bert")
    assert (cfg.model.name, cfg.model.arch) == ("hf", "./my-bert")
    with pytest.raises(ConfigError, match=r"name two models"):
        compose_config("data=csv_text", "model=hf", "model.name=./a", "model.arch=./b")


def test_max_length_past_the_models_positions_is_refused_naming_both(bert_run, corpus):
    from kiln.data.csv_text import build_csv_text

    snapshot = corpus / "hub" / "models--kiln-tests--tiny-bert" / "snapshots" / ("0" * 40)
    cfg = compose_config(
        "data=csv_text",
        "model=hf",
        f"model.arch={snapshot}",
        f"data.train_path={corpus / 'train.csv'}",
        "data.max_length=300",
    )
    with pytest.raises(ConfigError, match=f"data.max_length=300 exceeds the {POSITIONS} positions"):
        build_csv_text(cfg.data, pretrained=hf_preprocessing(cfg.model))


def test_a_roberta_folder_with_byte_level_bpe_trains(corpus):
    folder = write_roberta(corpus / "roberta", csv_texts(corpus / "train.csv"))
    run_dir = corpus / "roberta_run"
    summary = train_in_process(
        run_dir,
        *TRAIN,
        f"data.train_path={corpus / 'train.csv'}",
        f"data.cache_dir={corpus / 'cache'}",
        f"model.arch={folder}",
    )
    assert summary["val_acc"] > majority_share(run_dir) + 0.15, summary
    ckpt = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert ckpt["data_spec"]["pad_id"] == 1  # <pad>, not kiln's 0 (RoBERTa's <s>)


def test_position_limits_count_the_offset_the_model_itself_has():
    """Read from the model's own position embedding (its padding row), built on the meta
    device: RoBERTa's ids start after its padding id, MPNet's after 1 whatever the config says,
    I-BERT's quantised embedding has the same row; BERT's start at 0."""
    from transformers import AutoConfig

    def config(model_type, **values):
        return AutoConfig.for_model(model_type, max_position_embeddings=514, **values)

    assert position_limit(config("bert", pad_token_id=0)) == 514
    roberta = config("roberta", pad_token_id=1)
    assert position_limit(roberta) == 512
    assert position_limit(roberta, model_max_length=128) == 128
    assert position_limit(config("roberta", pad_token_id=5)) == 508
    assert position_limit(config("mpnet", pad_token_id=0)) == 512
    assert position_limit(config("ibert", pad_token_id=1)) == 512


@pytest.mark.parametrize("arch", ["bert", "distilbert", "roberta", "deberta-v2", "albert"])
def test_model_types_build_small_from_scratch_with_the_datas_classes(arch):
    from kiln.data.spec import DataSpec

    spec = DataSpec(
        "classification", "tokens", 3, ("a", "b", "c"), vocab_size=50, max_length=12, pad_id=0
    )
    cfg = compose_config("data=csv_text", "model=hf", f"model.arch={arch}").model
    model = build_model(spec, cfg).eval()
    ids = torch.randint(1, 50, (2, 12))
    ids[1, 6:] = 0  # padding, masked
    assert model(ids).shape == (2, 3)
    assert model.net.config.id2label == {0: "a", 1: "b", 2: "c"}


def test_linear_warmup_decays_as_transformers_schedule_does():
    """scheduler=linear_warmup: up to optimizer.lr over the warm-up (its first step at lr /
    warmup, not 0, as kiln's cosine), then transformers' get_linear_schedule_with_warmup."""
    from transformers import get_linear_schedule_with_warmup

    from kiln.engine.optim import build_scheduler

    cfg = compose_config("scheduler=linear_warmup", "scheduler.warmup_ratio=0.2")
    total, warmup, lr = 50, 10, 0.01

    def lrs(make) -> list[float]:
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
        scheduler, seen = make(optimizer), []
        for _ in range(total):
            seen.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return seen

    ours = lrs(lambda opt: build_scheduler(opt, cfg.scheduler, total))
    theirs = lrs(lambda opt: get_linear_schedule_with_warmup(opt, warmup, total))
    assert ours[:warmup] == pytest.approx([lr * (s + 1) / warmup for s in range(warmup)])
    assert ours[warmup:] == pytest.approx(theirs[warmup:])
    assert ours[warmup - 1] == pytest.approx(lr) and ours[-1] == pytest.approx(
        lr / (total - warmup)
    )


def test_a_base_models_weights_load_with_the_head_named_and_a_misfit_refused(caplog):
    """A file of the base model (BertModel: no `bert.` prefix, no classifier) loads into the
    classifier, its head named as re-initialised; an encoder tensor of another shape is one
    WeightsError naming it."""
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    from kiln.models.weights import WeightsError
    from kiln.models.zoo.transformers import load_hf_weights

    config = BertConfig(
        vocab_size=40,
        max_position_embeddings=16,
        num_labels=3,
        **{
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 64,
        },
    )
    torch.manual_seed(0)
    base = BertModel(config).state_dict()
    net = BertForSequenceClassification(config)
    with caplog.at_level(logging.INFO):
        load_hf_weights(net, base, label="base.safetensors")
    assert torch.equal(
        net.bert.embeddings.word_embeddings.weight, base["embeddings.word_embeddings.weight"]
    )
    assert "head classifier.weight, classifier.bias re-initialised (not in the file" in caplog.text
    base["encoder.layer.0.output.dense.weight"] = torch.zeros(32, 32)
    with pytest.raises(WeightsError, match="bert.encoder.layer.0.output.dense.weight"):
        load_hf_weights(net, base, label="base.safetensors")


# ---------------------------------------------------------------------------------------------
# Sentence pairs: data.text_pair_column, fed as tokenizer(a, b)


def write_pairs(path: Path, num_rows: int, seed: int) -> list[tuple[str, str, str]]:
    """premise,hypothesis,label: the label is the hypothesis's topic, the premise another
    random topic's sentence (a pair the model must read both sides of to place the [SEP])."""
    import random

    rng = random.Random(seed)
    topics = {
        "arrays": ["ndarray", "broadcast", "dtype", "axis"],
        "http": ["request", "session", "header", "cookie"],
    }
    rows = []
    for i in range(num_rows):
        label = CLASSES[i % 2]
        other = rng.choice(CLASSES)
        premise = f"The {rng.choice(topics[other])} of the {rng.choice(topics[other])} ({i})"
        hypothesis = " ".join(rng.choices(topics[label], k=3))
        rows.append((premise, hypothesis, label))
    pd.DataFrame(rows, columns=["premise", "hypothesis", "label"]).to_csv(path, index=False)
    return rows


def test_a_pair_task_trains_evaluates_predicts_and_serves(corpus, tmp_path, capsys):
    train_csv, held_out = corpus / "pairs.csv", tmp_path / "pairs_held_out.csv"
    write_pairs(train_csv, 240, seed=1)
    rows = write_pairs(held_out, 30, seed=2)
    frame = pd.read_csv(train_csv)
    folder = write_bert(corpus / "pair_bert", [*frame["premise"], *frame["hypothesis"]])
    run_dir = corpus / "pair_run"
    pair = ("data.text_column=premise", "data.text_pair_column=hypothesis")
    data = (f"data.train_path={train_csv}", f"data.cache_dir={corpus / 'cache'}")
    summary = train_in_process(
        run_dir, *TRAIN, *pair, *data, f"model.arch={folder}", "trainer.max_epochs=10"
    )
    assert summary["val_acc"] > majority_share(run_dir) + 0.15, summary
    predictor = Predictor.from_checkpoint(run_dir / "checkpoints" / "best.pt")
    ids = predictor.preprocess([["The ndarray", "It checks the cookie twice"]])
    sep = predictor.record.recipe.pretrained["sep_id"]
    assert int((ids == sep).sum()) == 2  # [CLS] a [SEP] b [SEP]: tokenizer(a, b)
    ckpt = f"ckpt={run_dir}/checkpoints/best.pt"
    code, _, err = run_infer(
        capsys, "mode=evaluate", ckpt, f"data={held_out}", f"output={tmp_path}/ev"
    )
    assert code == 0, err
    evaluated = pd.read_csv(tmp_path / "ev" / "predictions.csv")
    code, _, err = run_infer(capsys, ckpt, f"input={held_out}", f"output={tmp_path}/preds.csv")
    assert code == 0, err
    probs = [c for c in evaluated.columns if c.startswith("prob_")]
    predicted = pd.read_csv(tmp_path / "preds.csv")
    np.testing.assert_allclose(predicted[probs], evaluated[probs], atol=1e-4)
    inputs = [[premise, hypothesis] for premise, hypothesis, _ in rows]
    with live_server(create_app(predictor, max_batch_size=8, max_delay_ms=5)) as server:
        answer = httpx.post(f"{server.url}/v1/predict", json={"inputs": inputs}, timeout=60)
        single = httpx.post(f"{server.url}/v1/predict", json={"inputs": ["one text"]}, timeout=60)
        flat = [text for pair in inputs for text in pair]
        tensor = {"name": "input", "shape": [len(inputs), 2], "datatype": "BYTES", "data": flat}
        v2 = httpx.post(f"{server.url}/v2/models/kiln/infer", json={"inputs": [tensor]}, timeout=60)
        example = httpx.get(f"{server.url}/v1/example", params={"api": "v2"}).json()
        from_example = httpx.post(f"{server.url}/v2/models/kiln/infer", json=example, timeout=60)
    assert answer.status_code == 200, answer.text
    assert v2.status_code == 200, v2.text
    assert from_example.status_code == 200, from_example.text
    (probs_v2,) = [t for t in v2.json()["outputs"] if t["name"] == "probs"]
    np.testing.assert_allclose(
        np.reshape(probs_v2["data"], probs_v2["shape"]), evaluated[probs].to_numpy(), atol=1e-4
    )
    served = np.array([p["probs"] for p in answer.json()["predictions"]])
    np.testing.assert_allclose(served, evaluated[probs].to_numpy(), atol=1e-4)
    assert single.status_code == 422 and "expected a pair of texts" in single.text


def test_kiln_text_models_take_pairs_joined_and_export_them(corpus, tmp_path, capsys):
    """model=text_bow on the pair CSV: its own tokenizer reads a pair as the two texts joined;
    infer.py and the ONNX export read both columns."""
    train_csv, held_out = corpus / "bow_pairs.csv", tmp_path / "held_out.csv"
    write_pairs(train_csv, 240, seed=3)
    write_pairs(held_out, 20, seed=4)
    run_dir = corpus / "bow_pair_run"
    summary = train_in_process(
        run_dir,
        "data=csv_text",
        "model=text_bow",
        "data.text_column=premise",
        "data.text_pair_column=hypothesis",
        f"data.train_path={train_csv}",
        f"data.cache_dir={corpus / 'cache'}",
        "trainer.max_epochs=3",
        "data.batch_size=16",
    )
    assert summary["val_acc"] > majority_share(run_dir) + 0.15, summary
    ckpt = f"ckpt={run_dir}/checkpoints/best.pt"
    code, _, err = run_infer(capsys, ckpt, f"input={held_out}", f"output={tmp_path}/torch.csv")
    assert code == 0, err
    assert run_infer(capsys, "mode=export", ckpt)[0] == 0
    onnx = run_dir / "checkpoints" / "model.onnx"
    code, _, err = run_infer(
        capsys, f"ckpt={onnx}", "backend=onnx", f"input={held_out}", f"output={tmp_path}/o.csv"
    )
    assert code == 0, err
    ours, theirs = pd.read_csv(tmp_path / "torch.csv"), pd.read_csv(tmp_path / "o.csv")
    probs = [c for c in ours.columns if c.startswith("prob_")]
    assert len(ours) == 20
    np.testing.assert_allclose(ours[probs], theirs[probs], atol=1e-4)


def test_token_types_turn_after_the_first_separator():
    from kiln.data.spec import DataSpec

    spec = DataSpec("classification", "tokens", 2, ("a", "b"), vocab_size=30, max_length=8)
    model = build_model(spec, compose_config("data=csv_text", "model=hf").model)
    model.sep_id = 3  # [CLS]=2 a a [SEP]=3 b [SEP]=3 [PAD]=0
    seen = {}
    model.net.register_forward_pre_hook(
        lambda _, args, kwargs: seen.update(kwargs), with_kwargs=True
    )
    model(torch.tensor([[2, 7, 8, 3, 9, 3, 0, 0]]))
    assert seen["token_type_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 1]]


def test_gradient_checkpointing_gives_the_same_gradients():
    from kiln.data.spec import DataSpec

    spec = DataSpec("classification", "tokens", 2, ("a", "b"), vocab_size=30, max_length=8)
    grads = []
    for on in (False, True):
        torch.manual_seed(0)
        cfg = compose_config("data=csv_text", "model=hf", f"model.gradient_checkpointing={on}")
        model = build_model(spec, cfg.model).train()
        model.net.config.hidden_dropout_prob = 0.0
        ids = torch.tensor([[2, 7, 8, 3, 0], [2, 9, 3, 0, 0]])
        torch.manual_seed(1)
        model(ids).logsumexp(1).sum().backward()
        grads.append(model.net.bert.embeddings.word_embeddings.weight.grad.clone())
        assert model.net.is_activation_checkpointing == on
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_matches_an_uninterrupted_run(bert_run, corpus, tmp_path):
    """Exact resume with model=hf (a hub snapshot folder, dropout on, pairs off) and the
    fine-tuning recipe switched on in both runs: layer-wise lr decay (one optimizer group per
    depth, each with its own AdamW moments), the embeddings frozen for the first epoch (the kill
    lands in it) and thawed at the second, linear warm-up then decay, gradient checkpointing
    and bf16 autocast: the final weights are bitwise equal."""
    import signal
    import sys

    from kiln.checkpoint import load_checkpoint
    from kiln.cli.paths import REPO_ROOT

    from .conftest import start_process

    snapshot = corpus / "hub" / "models--kiln-tests--tiny-bert" / "snapshots" / ("0" * 40)
    settings = (
        *TRAIN,
        f"data.train_path={corpus / 'train.csv'}",
        f"model.arch={snapshot}",
        f"data.cache_dir={corpus / 'cache'}",
        "trainer.max_epochs=2",
        "trainer.deterministic=true",
        "trainer.checkpoint_every_n_steps=5",
        "data.batch_size=8",
        "env.progress_bar=false",
        "optimizer.layer_decay=0.8",
        "model.freeze=embeddings",
        "trainer.unfreeze_at_epoch=1",
        "scheduler=linear_warmup",
        "model.gradient_checkpointing=true",
        "precision=bf16",
    )
    reference = tmp_path / "reference"
    assert run_train(reference, *settings).returncode == 0
    interrupted = tmp_path / "interrupted"
    cmd = [sys.executable, str(REPO_ROOT / "train.py"), f"hydra.run.dir={interrupted}", *settings]
    proc = start_process(cmd, tmp_path)
    last = interrupted / "checkpoints" / "last.pt"
    deadline = time.monotonic() + 300
    while not last.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    killed = load_checkpoint(last)
    saved, saved_model = killed["state"], killed["model"]
    assert saved["epoch"] == 0 and saved["batch_in_epoch"] > 0  # killed mid-epoch
    resumed = run_train(interrupted, *settings, "resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference_state = load_checkpoint(reference / "checkpoints" / "last.pt")
    resumed_state = load_checkpoint(last)
    expected, actual = reference_state["model"], resumed_state["model"]
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), f"{name} differs after resume"
    # The recipe did act: the embeddings thawed in epoch 2 (they moved from the killed run's
    # frozen copy) and the optimizer holds one group per depth, laid out alike in both runs.
    embeddings = "net.bert.embeddings.word_embeddings.weight"
    assert not torch.equal(saved_model[embeddings], actual[embeddings])
    groups = [
        (g["depth"], g["decay"], g["lr_mult"]) for g in resumed_state["optimizer"]["param_groups"]
    ]
    assert len({depth for depth, _, _ in groups}) > 2, groups
    assert groups == [
        (g["depth"], g["decay"], g["lr_mult"]) for g in reference_state["optimizer"]["param_groups"]
    ]


def test_parameters_the_library_never_reaches_are_frozen_and_said(caplog):
    """BigBird's classifier reads the first token's hidden state, never its pooler: kiln freezes
    the pooler (rule 2 would otherwise stop every run on a model kiln does not own) and says so;
    BERT's pooler, which its classifier reads, stays trainable; whatever is trainable gets a
    gradient from one backward."""
    from kiln.data.spec import DataSpec

    spec = DataSpec(
        "classification", "tokens", 3, ("a", "b", "c"), vocab_size=50, max_length=12, pad_id=0
    )
    hf = ("data=csv_text", "model=hf")
    with caplog.at_level(logging.INFO, logger="kiln.models.zoo.transformers"):
        big_bird = build_model(spec, compose_config(*hf, "model.arch=big_bird").model)
    frozen = [name for name, p in big_bird.named_parameters() if not p.requires_grad]
    assert frozen == ["net.bert.pooler.weight", "net.bert.pooler.bias"]
    assert "2 parameter(s) its classification forward never reaches are frozen" in caplog.text
    bert = build_model(spec, compose_config(*hf, "model.arch=bert").model)
    assert all(p.requires_grad for p in bert.parameters())
    ids = torch.randint(1, 50, (2, 12))
    for model in (big_bird, bert):
        model(ids).sum().backward()
        trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        assert all(p.grad is not None for _, p in trainable), type(model.net).__name__


def test_a_big_bird_run_trains_where_rule_2_stopped_it(tmp_path):
    """`model=hf model.arch=big_bird` stopped at rule 2 before step 1 (its pooler got no
    gradient); now it trains, the pooler as it began."""
    run_dir = tmp_path / "run"
    summary = train_in_process(
        run_dir,
        "data=csv_text",
        "model=hf",
        "model.arch=big_bird",
        "data.max_length=24",
        "trainer.max_epochs=2",
    )
    # Two epochs of a tiny model may still be at chance: what matters is that no rule stopped it.
    assert summary["status"] in ("ok", "at_chance") and summary["error"] is None, summary
    first = torch.load(run_dir / "checkpoints" / "epoch-1.pt", weights_only=True)["model"]
    last = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    for key in ("net.bert.pooler.weight", "net.bert.pooler.bias"):
        assert torch.equal(first[key], last[key]), key
    layer = "net.bert.encoder.layer.0.output.dense.weight"
    assert not torch.equal(first[layer], last[layer])


def test_a_thawed_backbone_leaves_frozen_what_the_model_froze_itself(tmp_path):
    """trainer.unfreeze_at_epoch thaws what model.freeze froze, not BigBird's unreached pooler."""
    from kiln.data import build_data
    from kiln.engine.distributed import DistInfo
    from kiln.engine.run import build_run_model

    cfg = compose_config(
        "data=csv_text",
        "model=hf",
        "model.arch=big_bird",
        "model.freeze=backbone",
        "trainer.unfreeze_at_epoch=1",
    )
    spec = build_data(cfg.data).spec
    model, plan = build_run_model(cfg, spec, torch.device("cpu"), DistInfo(), tmp_path, False)
    assert "net.bert.encoder.layer.0.output.dense.weight" in plan.names
    assert not plan.names & {"net.bert.pooler.weight", "net.bert.pooler.bias"}
    plan.apply(model, epoch=1)
    frozen = [name for name, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["net.bert.pooler.weight", "net.bert.pooler.bias"]


def test_a_model_type_built_of_sub_models_is_refused_not_built_at_full_size():
    """gemma3 from its type is a text and a vision model, each sized by its own config: kiln's
    small size reaches neither, and the library's defaults are 2.7B parameters."""
    from kiln.data.spec import DataSpec

    spec = DataSpec(
        "classification", "tokens", 3, ("a", "b", "c"), vocab_size=50, max_length=12, pad_id=0
    )
    cfg = compose_config("data=csv_text", "model=hf", "model.arch=gemma3")
    with pytest.raises(ConfigError, match="text_config and vision_config") as caught:
        build_model(spec, cfg.model)
    assert caught.value.key == "model.arch"
