"""`python infer.py mode=export format=triton` writes a Triton model repository: config.pbtxt,
parsed here with Triton's own model-config protobuf, must describe the ONNX model beside it
(names, datatypes, dims with -1 where dynamic, max_batch_size, dynamic batching), and the
repository's model, run by ONNX Runtime on raw inputs as a Triton client sends them, must give
the predictions infer.py gives."""

from __future__ import annotations

import itertools
import sys
import zlib

import numpy as np
import onnx
import pandas as pd
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from kiln.cli.paths import REPO_ROOT
from kiln.inference import Predictor
from kiln.inference.backends import ort_session
from kiln.inference.triton import export_triton

from .conftest import run_python
from .inference_helpers import (
    detector_run,
    digits_run,
    mixed_size_images,
    raw_digits_val,
    text_run,
)

ONNX_TO_TRITON = {
    onnx.TensorProto.FLOAT: model_config_pb2.TYPE_FP32,
    onnx.TensorProto.INT64: model_config_pb2.TYPE_INT64,
}


def read_repository(model_dir):
    config = text_format.Parse(
        (model_dir / "config.pbtxt").read_text(), model_config_pb2.ModelConfig()
    )
    graph = onnx.load(str(model_dir / "1" / "model.onnx")).graph
    return config, graph


def assert_config_describes_the_graph(config, graph) -> None:
    """Every ONNX input/output has an entry with its name, datatype and dims (batch axis
    dropped, -1 where the ONNX dim is symbolic), and nothing else is listed."""
    for entries, values in ((config.input, graph.input), (config.output, graph.output)):
        assert [e.name for e in entries] == [v.name for v in values]
        for entry, value in zip(entries, values, strict=True):
            tensor_type = value.type.tensor_type
            assert entry.data_type == ONNX_TO_TRITON[tensor_type.elem_type], entry.name
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor_type.shape.dim]
            assert dims[0] == -1, f"{entry.name}: the batch axis must be dynamic"
            assert list(entry.dims) == dims[1:], entry.name


def test_image_classifier_repository_via_infer_py(tmp_path_factory, tmp_path):
    run_dir, _ = digits_run(tmp_path_factory)
    ckpt = run_dir / "checkpoints" / "best.pt"
    repo = tmp_path / "repo"
    cmd = [sys.executable, str(REPO_ROOT / "infer.py"), "mode=export", "format=triton"]
    cmd += [f"ckpt={ckpt}", f"export_dir={repo}", "server.max_batch_size=16"]
    cmd += ["server.max_delay_ms=3", "server.model_name=digits"]
    done = run_python(cmd)
    assert done.returncode == 0, done.stderr
    assert "wrote Triton model" in done.stdout and "parity" in done.stdout

    model_dir = repo / "digits"
    config, graph = read_repository(model_dir)
    assert config.name == "digits" and config.platform == "onnxruntime_onnx"
    assert config.max_batch_size == 16
    assert config.dynamic_batching.max_queue_delay_microseconds == 3000
    assert_config_describes_the_graph(config, graph)
    assert list(config.input[0].dims) == [1, 8, 8]
    probs_entry = next(o for o in config.output if o.name == "probs")
    assert probs_entry.label_filename == "labels.txt"
    labels = (model_dir / "labels.txt").read_text().split()
    assert labels == [str(i) for i in range(10)]

    # Raw pixels in, as a Triton client (or kiln's) sends them: the normalisation is inside.
    raw = raw_digits_val()[0][:50]
    np.save(tmp_path / "x.npy", raw)
    out = tmp_path / "preds.csv"
    cmd = [sys.executable, str(REPO_ROOT / "infer.py"), f"ckpt={ckpt}"]
    cmd += [f"input={tmp_path / 'x.npy'}", f"output={out}"]
    assert run_python(cmd).returncode == 0
    frame = pd.read_csv(out, dtype={"label": str})
    session = ort_session(model_dir / "1" / "model.onnx")
    (probs,) = session.run(["probs"], {"input": raw[:, None].astype(np.float32)})
    assert [labels[i] for i in probs.argmax(1)] == frame["label"].tolist()
    np.testing.assert_allclose(probs, frame[[f"prob_{c}" for c in labels]].to_numpy(), atol=1e-5)


def test_text_repository_says_what_to_send(tmp_path_factory, tmp_path):
    from tokenizers import Tokenizer

    run_dir, _ = text_run(tmp_path_factory)
    ckpt = run_dir / "checkpoints" / "best.pt"
    report = export_triton(ckpt, tmp_path / "repo", max_batch_size=8)
    config, graph = read_repository(report.model_dir)
    assert_config_describes_the_graph(config, graph)
    assert (
        list(config.input[0].dims) == [-1]
        and config.input[0].data_type == model_config_pb2.TYPE_INT64
    )
    header = (report.model_dir / "config.pbtxt").read_text()
    assert "tokenizer.json" in header and "pad every row" in header

    # What a Triton client does: tokenize with tokenizer.json, spell each unknown word after
    # its [UNK] as the header says (text_bow), pad with 0, send INT64 ids.
    assert "crc32(utf8(g)) % 2**30" in header
    texts = ["the home team won the final", "stir in the garlic", "a new phone chip zorblefax"]
    tokenizer = Tokenizer.from_file(str(report.model_dir / "tokenizer.json"))
    unk, vocab_size = tokenizer.token_to_id("[UNK]"), tokenizer.get_vocab_size()
    limit = tokenizer.truncation["max_length"]

    def spelled(word: str) -> list[int]:  # the header's rule, for model.char_ngrams [2, 5]
        marked = f"<{word}>"
        grams = {marked[i : i + n] for n in range(2, 6) for i in range(len(marked) - n + 1)}
        grams = sorted(grams - {marked}, key=lambda g: (len(g), marked.find(g)))[:47]
        return [vocab_size + zlib.crc32(g.encode("utf-8")) % 2**30 for g in grams]

    encoded = []
    for text, e in zip(texts, tokenizer.encode_batch(texts), strict=True):
        pairs = zip(e.ids, e.offsets, strict=True)
        ids = [[i] if i != unk else [unk, *spelled(text[a:b])] for i, (a, b) in pairs]
        encoded.append(list(itertools.chain.from_iterable(ids))[:limit] or [unk])
    assert any(i >= vocab_size for i in encoded[2])  # the unknown word was spelled
    ids = np.zeros((len(texts), max(map(len, encoded))), dtype=np.int64)
    for row, sequence in enumerate(encoded):
        ids[row, : len(sequence)] = sequence
    (probs,) = ort_session(report.model_dir / "1" / "model.onnx").run(["probs"], {"input": ids})
    np.testing.assert_allclose(
        probs, Predictor.from_checkpoint(ckpt).predict_probs(texts), atol=1e-5
    )


def test_detector_repository_returns_kilns_boxes(tmp_path_factory, tmp_path):
    run_dir, _ = detector_run(tmp_path_factory)
    ckpt = run_dir / "checkpoints" / "best.pt"
    report = export_triton(ckpt, tmp_path / "repo", max_batch_size=4)
    assert all(c.unit == "box" for c in report.parity)
    config, graph = read_repository(report.model_dir)
    assert_config_describes_the_graph(config, graph)
    assert list(config.input[0].dims) == [3, -1, -1]
    assert {o.name: list(o.dims) for o in config.output} == {
        "boxes": [50, 4],
        "scores": [50],
        "labels": [50],
    }
    session = ort_session(report.model_dir / "1" / "model.onnx")
    predictor = Predictor.from_checkpoint(ckpt)
    for image in mixed_size_images(2, seed=5):
        boxes, scores, labels = session.run(None, {"input": image[None]})
        keep = scores[0] >= predictor.record.config["model"]["score_threshold"]
        (expected,) = predictor.detect([image])
        np.testing.assert_allclose(boxes[0][keep], expected["boxes"], atol=1e-2)
        assert labels[0][keep].tolist() == expected["labels"].tolist()


@pytest.mark.parametrize("bad", ["format=tensorrt"])
def test_unknown_export_format_is_one_line(bad, capsys):
    from kiln.cli.infer import main

    with pytest.raises(SystemExit) as exit_info:
        main(["mode=export", "ckpt=x.pt", bad])
    assert exit_info.value.code == 2
    assert "format='tensorrt': choose one of onnx, triton" in capsys.readouterr().err
