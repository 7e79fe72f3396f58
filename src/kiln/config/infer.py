"""`python infer.py key=value ...`: typed settings, parsed without Hydra (inference needs no
config composition, only a checkpoint and a few switches). An unknown key or a value of the
wrong type is an error naming the key, the valid keys and the closest match."""

from __future__ import annotations

import os
import re
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from kiln.errors import UserError, did_you_mean

MODES = ("predict", "export", "serve", "evaluate")
SPLITS = ("val", "test")
BACKENDS = ("torch", "onnx", "echo")
EXPORT_FORMATS = ("onnx", "triton")
MODEL_NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")  # safe in a URL path and a folder name
MIB = 1024 * 1024
PATH_KEYS = frozenset(["ckpt", "input", "output", "data", "export_dir"])


class ArgumentError(UserError, ValueError):
    """A command-line mistake; the message says which argument and what is valid."""


@dataclass(kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise (0.0.0.0 exposes it to the network)
    port: int = 8000  # 1..65535
    max_batch_size: int = 32  # inputs per model call; requests are gathered (and split) to this
    max_delay_ms: float = 5.0  # how long the first queued input waits for others to join it
    max_queue_size: int = 8192  # inputs waiting, all requests together; beyond it: 503 at once
    max_inputs_per_request: int = 4096  # more inputs in one request: 413
    max_body_bytes: int = 32 * MIB  # a larger body (after decompression): 413, unparsed
    timeout_ms: float = 10_000.0  # per-request deadline: 504 past it; unrun inputs leave the queue
    drain_grace_s: float = 30.0  # on SIGTERM: time to answer accepted requests, then 503 the rest
    header_timeout_s: float = 10.0  # a request's headers must arrive within this, or it is closed
    # CPU threads per model call (0: kiln's rule, kiln.threads: one for a small model call,
    # else the usable physical cores but one, kept for HTTP)
    model_threads: int = 0
    # Image files (models trained on them): each file's width x height (x a GIF's frames) is read
    # from its header before decoding; more pixels than this is a 4xx naming the item. The
    # default is Pillow's MAX_IMAGE_PIXELS (about 0.25 GiB of 24-bit pixels).
    max_image_pixels: int = 89_478_485
    decode_threads: int = 0  # threads decoding image files off the event loop (0: cores, 2..8)
    max_decode_queue_size: int = 4096  # image files waiting for a decode thread; beyond: 503
    # An image file the decoder refuses (too many pixels, damaged) is answered 422 this long
    # after the refusal, off the event loop and outside the request's admission: a client
    # sending bombs back to back is held to a few per second, and its CPU (on the same machine:
    # the server's) with it. Good requests are never delayed. 0: answer at once.
    refusal_delay_ms: float = 500.0
    # Texts (text models): a longer text is a 422 naming the item, before it is cleaned or
    # tokenized (a tokenizer holds every token of a text before truncating it to max_length);
    # the default is training's data.max_field_bytes
    max_text_chars: int = 1_048_576
    model_name: str = "kiln"  # the <name> in /v2/models/<name> (and the Triton model's folder)


@dataclass(kw_only=True)
class InferConfig:
    mode: str = "predict"  # predict | export | serve | evaluate
    ckpt: str | None = None  # a training checkpoint (.pt), or an exported .onnx for backend=onnx
    input: str | None = None  # predict: .npy/.npz/.csv of pixels, image files (file, dir, glob)
    output: str | None = None  # predict: CSV (null: preds.csv); evaluate: folder (null: <run>/eval)
    data: str | None = None  # evaluate: class subfolders or a labelled .csv (null: ckpt's own data)
    split: str | None = None  # evaluate, no data=: test | val (null: test if the data has one)
    num_errors: int = 100  # evaluate: rows of errors.csv, the most confidently wrong first
    text_column: str | None = None  # predict, text models: the CSV column (null: training's)
    backend: str = "torch"  # torch | onnx (after `mode=export`) | echo (no model: a ceiling)
    device: str = "cpu"  # cpu | cuda | auto
    int8: bool = False  # backend=onnx: use model.int8.onnx; mode=export: also write it
    format: str = "onnx"  # export: onnx (model.onnx beside the checkpoint) | triton (a repository)
    export_dir: str | None = None  # format=triton: the repository (null: triton/ beside ckpt)
    batch_size: int = 256  # predict: inputs per model call (image files: read per batch too)
    # predict: an input file that cannot be read, is too large or cannot be decoded gets a row
    # with its error (the others are predicted); strict=true stops at the first, writing nothing.
    # Image files whose header asks for more pixels (every frame of an animated one) are refused
    # before decoding.
    strict: bool = False  # predict: stop at the first input that cannot be predicted
    max_image_pixels: int | None = 89_478_485  # predict, evaluate: header pixels above: refused
    follow_symlinks: bool = True  # predict, evaluate: follow links in input folders
    # predict, detectors, image files: each image also written with its boxes drawn, as
    # <output name>_boxes/<index>_<file>.png beside the CSV
    draw: bool = False
    # your modules that register the checkpoint's model or data (my_parts for ./my_parts.py),
    # imported before the checkpoint is read: kiln never imports a module a checkpoint names,
    # and refuses one trained with plugins not given here, printing the plugins=[...] to add
    plugins: list[str] = field(default_factory=list)
    server: ServerConfig = field(default_factory=ServerConfig)


USAGE = """usage: python infer.py [mode=predict|export|serve] ckpt=<path> [key=value ...]
  plugins: python infer.py ckpt=... plugins=[my_parts]   # a checkpoint trained with plugins
  predict: python infer.py ckpt=run/checkpoints/best.pt input=x.npy output=preds.csv [backend=onnx]
           python infer.py ckpt=run/checkpoints/best.pt input=photos/test   # image files, a glob
  export:  python infer.py mode=export ckpt=run/checkpoints/best.pt [int8=true] [format=triton]
  serve:   python infer.py mode=serve ckpt=run/checkpoints/best.pt [server.port=8000 ...]
  evaluate: python infer.py mode=evaluate ckpt=run/checkpoints/best.pt [data=<folder or .csv>]
keys: """


def _all_keys(schema: type, prefix: str = "") -> dict[str, type]:
    """Dotted key -> declared type, e.g. {"server.port": int, ...}."""
    hints = typing.get_type_hints(schema)
    keys: dict[str, type] = {}
    for f in fields(schema):
        if is_dataclass(hints[f.name]):
            keys.update(_all_keys(hints[f.name], f"{prefix}{f.name}."))
        else:
            keys[prefix + f.name] = hints[f.name]
    return keys


KEYS = _all_keys(InferConfig)


def usage() -> str:
    return USAGE + ", ".join(KEYS)


def _convert(key: str, text: str, declared: Any) -> Any:
    if typing.get_origin(declared) is list:
        return _names(key, text)
    optional = isinstance(declared, types.UnionType) and type(None) in typing.get_args(declared)
    if optional and text.lower() in ("null", "none", ""):
        return None
    base = (
        next(t for t in typing.get_args(declared) if t is not type(None)) if optional else declared
    )
    if base is bool:
        if text.lower() not in ("true", "false", "1", "0"):
            raise ArgumentError(f"{key}={text!r}: expected true or false")
        return text.lower() in ("true", "1")
    try:
        return base(text)
    except ValueError:
        raise ArgumentError(f"{key}={text!r}: expected {base.__name__}") from None


def _names(key: str, text: str) -> list[str]:
    """`[a,b]` (or `a`, or `[]`) as train.py's plugins=[...] writes it: a list of module names."""
    inner = text.strip()
    if inner.startswith("[") and inner.endswith("]"):
        inner = inner[1:-1]
    names = [name.strip().strip("'\"") for name in inner.split(",")]
    names = [name for name in names if name]
    bad = [name for name in names if not all(part.isidentifier() for part in name.split("."))]
    if bad:
        raise ArgumentError(
            f"{key}={text!r}: {bad[0]!r} is not a module name (e.g. {key}=[my_parts])"
        )
    return names


def _unknown_key(key: str) -> ArgumentError:
    return ArgumentError(
        f"unknown argument {key!r}; valid keys: {', '.join(KEYS)}{did_you_mean(key, KEYS)}"
    )


def parse_args(argv: list[str]) -> InferConfig:
    cfg = InferConfig()
    for arg in argv:
        key, sep, text = arg.partition("=")
        if not sep:
            raise ArgumentError(f"argument {arg!r} is not key=value\n{usage()}")
        if key not in KEYS:
            raise _unknown_key(key)
        target, _, name = key.rpartition(".")
        value = _convert(key, text, KEYS[key])
        if key in PATH_KEYS and isinstance(value, str):
            value = os.path.expanduser(value)  # as train.py's path keys: ~ is the home folder
        setattr(getattr(cfg, target) if target else cfg, name, value)
    validate(cfg)
    return cfg


def validate(cfg: InferConfig) -> None:
    if cfg.mode not in MODES:
        raise ArgumentError(f"unknown mode={cfg.mode!r}; valid modes: {', '.join(MODES)}")
    if cfg.ckpt is None:
        raise ArgumentError(f"mode={cfg.mode} needs ckpt=<path to a checkpoint .pt>")
    if cfg.mode == "predict" and cfg.input is None:
        raise ArgumentError("mode=predict needs input=<.npy, .npz, .csv file or a folder>")
    if cfg.backend not in BACKENDS:
        raise ArgumentError(f"backend={cfg.backend!r}: choose one of {', '.join(BACKENDS)}")
    if cfg.format not in EXPORT_FORMATS:
        raise ArgumentError(f"format={cfg.format!r}: choose one of {', '.join(EXPORT_FORMATS)}")
    _at_least("batch_size", cfg.batch_size, 1)
    if cfg.max_image_pixels is not None:
        _at_least("max_image_pixels", cfg.max_image_pixels, 1)
    validate_server(cfg.server)
    if cfg.mode == "evaluate":
        validate_evaluate(cfg)
    # Missing files are reported here, before the model stack (seconds of imports) is loaded.
    if Path(cfg.ckpt).is_dir():
        raise ArgumentError(checkpoint_folder_message(Path(cfg.ckpt)))
    if not Path(cfg.ckpt).exists():
        raise ArgumentError(f"checkpoint {cfg.ckpt} does not exist (ckpt=)")
    globbed = any(c in cfg.input for c in "*?[") if cfg.mode == "predict" else False
    if cfg.mode == "predict" and not Path(cfg.input).exists() and not globbed:
        raise ArgumentError(
            f"input {cfg.input} does not exist (input=): a .npy, .npz, .csv file, an image "
            "file, a folder or a glob"
        )


def checkpoint_folder_message(folder: Path) -> str:
    """ckpt= naming a folder: say so, and name the checkpoints it (or its checkpoints/) holds."""
    found = [
        p
        for name in ("best.pt", "last.pt", "model.onnx")
        for p in (folder / name, folder / "checkpoints" / name)
        if p.is_file()
    ]
    hint = f"e.g. ckpt={found[0]}" if found else "a .pt file (a run's checkpoints/best.pt)"
    return f"ckpt={folder} is a folder, not a checkpoint file (ckpt=): give the file, {hint}"


def validate_evaluate(cfg: InferConfig) -> None:
    _at_least("num_errors", cfg.num_errors, 0)
    if cfg.split is not None and cfg.split not in SPLITS:
        raise ArgumentError(f"split={cfg.split!r}: choose one of {', '.join(SPLITS)}")
    if cfg.split is not None and cfg.data is not None:
        raise ArgumentError(
            f"split={cfg.split} picks a split of the checkpoint's own data, but data={cfg.data} "
            "is given (all of it is evaluated); leave out one of them"
        )
    if cfg.input is not None:
        raise ArgumentError(
            f"mode=evaluate takes labelled data=<folder of class subfolders or .csv>, not "
            f"input={cfg.input} (that is predict's)"
        )
    if cfg.data is not None and not Path(cfg.data).exists():
        raise ArgumentError(
            f"data {cfg.data} does not exist (data=): a folder with one subfolder per class, "
            "or a .csv with the training run's text and label columns"
        )
    if cfg.output is not None and Path(cfg.output).is_file():
        raise ArgumentError(f"output={cfg.output} is a file; evaluate writes a folder there")


def _at_least(key: str, value: float, low: float) -> None:
    if value < low:
        raise ArgumentError(f"{key}={value:g}: must be >= {low:g}")


def validate_server(s: ServerConfig) -> None:
    """Every server key checked at start-up, each error naming its key (server.<key>)."""
    if not 1 <= s.port <= 65535:
        raise ArgumentError(f"server.port={s.port}: must be in 1..65535")
    _at_least("server.max_batch_size", s.max_batch_size, 1)
    _at_least("server.max_delay_ms", s.max_delay_ms, 0)
    _at_least("server.max_queue_size", s.max_queue_size, 1)
    _at_least("server.max_inputs_per_request", s.max_inputs_per_request, 1)
    _at_least("server.max_body_bytes", s.max_body_bytes, 1024)
    _at_least("server.model_threads", s.model_threads, 0)
    _at_least("server.max_image_pixels", s.max_image_pixels, 1)
    _at_least("server.decode_threads", s.decode_threads, 0)
    _at_least("server.max_decode_queue_size", s.max_decode_queue_size, 1)
    _at_least("server.refusal_delay_ms", s.refusal_delay_ms, 0)
    _at_least("server.max_text_chars", s.max_text_chars, 1)
    if s.timeout_ms <= 0:
        raise ArgumentError(f"server.timeout_ms={s.timeout_ms:g}: must be > 0")
    if s.drain_grace_s <= 0:
        raise ArgumentError(f"server.drain_grace_s={s.drain_grace_s:g}: must be > 0")
    if s.header_timeout_s <= 0:
        raise ArgumentError(f"server.header_timeout_s={s.header_timeout_s:g}: must be > 0")
    if s.max_inputs_per_request > s.max_queue_size:
        raise ArgumentError(
            f"server.max_inputs_per_request={s.max_inputs_per_request} is larger than "
            f"server.max_queue_size={s.max_queue_size}: such a request could never be queued; "
            "raise server.max_queue_size or lower server.max_inputs_per_request"
        )
    # Every accepted request is answered by its deadline (504 at worst), so a grace longer than
    # the deadline answers every accepted request before the process exits.
    if s.drain_grace_s * 1000 <= s.timeout_ms:
        raise ArgumentError(
            f"server.drain_grace_s={s.drain_grace_s:g} must be longer than server.timeout_ms="
            f"{s.timeout_ms:g} ms, so a shutdown answers every accepted request; raise "
            "server.drain_grace_s or lower server.timeout_ms"
        )
    if not MODEL_NAME_PATTERN.fullmatch(s.model_name):
        raise ArgumentError(
            f"server.model_name={s.model_name!r}: use letters, digits, '_', '.' or '-' only"
        )


def validate_file_server(s: ServerConfig) -> None:
    """What only a server of a model that takes image files must also hold."""
    if s.max_inputs_per_request > s.max_decode_queue_size:
        raise ArgumentError(
            f"server.max_inputs_per_request={s.max_inputs_per_request} is larger than "
            f"server.max_decode_queue_size={s.max_decode_queue_size}: a request of that many "
            "image files could never be queued for decoding; raise server.max_decode_queue_size "
            "or lower server.max_inputs_per_request"
        )


# A decode at the default pixel limit holds up to 1.4 GB (Pillow's path; 0.24 GB through
# torchvision's), and up to threads - 1 large images decode at once.
DEFAULT_DECODE_THREADS_MAX = 8


def decode_threads(setting: int) -> int:
    """server.decode_threads resolved: 0 means one per core, at least two (so one large image
    never holds every decoder) and at most DEFAULT_DECODE_THREADS_MAX (memory: up to threads - 1
    images at server.max_image_pixels decode at once)."""
    import os

    return setting or min(DEFAULT_DECODE_THREADS_MAX, max(2, os.cpu_count() or 2))


def model_threads(setting: int) -> int | str:
    """server.model_threads resolved: 0 means kiln's rule ("auto": the predictor counts a call
    of server.max_batch_size inputs and keeps one core for HTTP). A serving process also parses
    and answers HTTP; model threads that take every core spin against it."""
    return setting or "auto"
