"""`python infer.py key=value ...`: typed settings, parsed without Hydra (inference needs no
config composition, only a checkpoint and a few switches). An unknown key or a value of the
wrong type is an error naming the key, the valid keys and the closest match."""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any

MODES = ("predict", "export", "serve")


class ArgumentError(ValueError):
    """A command-line mistake; the message says which argument and what is valid."""


@dataclass(kw_only=True)
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless told otherwise (0.0.0.0 exposes it to the network)
    port: int = 8000
    max_batch_size: int = 32  # inputs per model call; requests are gathered up to this
    max_delay_ms: float = 5.0  # how long the first queued request waits for others to join it
    max_queue_size: int = 1024  # requests waiting at most; beyond it the server answers 503
    model_name: str = "kiln"  # the <name> in /v2/models/<name>


@dataclass(kw_only=True)
class InferConfig:
    mode: str = "predict"  # predict | export | serve
    ckpt: str | None = None  # a training checkpoint (.pt), or an exported .onnx for backend=onnx
    input: str | None = None  # predict: .npy (N, C, H, W) / (N, H, W) raw pixels, or .csv
    output: str = "preds.csv"  # predict: CSV with index, label and one prob_<class> per class
    text_column: str = "text"  # predict, text models: the CSV column holding the texts
    backend: str = "torch"  # torch | onnx (onnx: run `mode=export` first)
    device: str = "cpu"  # cpu | cuda | auto
    int8: bool = False  # backend=onnx: use model.int8.onnx; mode=export: also write it
    batch_size: int = 256  # predict: inputs per model call
    server: ServerConfig = field(default_factory=ServerConfig)


USAGE = """usage: python infer.py [mode=predict|export|serve] ckpt=<path> [key=value ...]
  predict: python infer.py ckpt=run/checkpoints/best.pt input=x.npy output=preds.csv [backend=onnx]
  export:  python infer.py mode=export ckpt=run/checkpoints/best.pt [int8=true]
  serve:   python infer.py mode=serve ckpt=run/checkpoints/best.pt [server.port=8000 ...]
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


def _unknown_key(key: str) -> ArgumentError:
    close = difflib.get_close_matches(key, KEYS, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return ArgumentError(f"unknown argument {key!r}; valid keys: {', '.join(KEYS)}.{hint}")


def parse_args(argv: list[str]) -> InferConfig:
    cfg = InferConfig()
    for arg in argv:
        key, sep, text = arg.partition("=")
        if not sep:
            raise ArgumentError(f"argument {arg!r} is not key=value\n{usage()}")
        if key not in KEYS:
            raise _unknown_key(key)
        target, _, name = key.rpartition(".")
        setattr(getattr(cfg, target) if target else cfg, name, _convert(key, text, KEYS[key]))
    validate(cfg)
    return cfg


def validate(cfg: InferConfig) -> None:
    if cfg.mode not in MODES:
        raise ArgumentError(f"unknown mode={cfg.mode!r}; valid modes: {', '.join(MODES)}")
    if cfg.ckpt is None:
        raise ArgumentError(f"mode={cfg.mode} needs ckpt=<path to a checkpoint .pt>")
    if cfg.mode == "predict" and cfg.input is None:
        raise ArgumentError("mode=predict needs input=<.npy or .csv file>")
    if cfg.batch_size < 1 or cfg.server.max_batch_size < 1:
        raise ArgumentError("batch_size and server.max_batch_size must be >= 1")
    if cfg.server.max_delay_ms < 0:
        raise ArgumentError(f"server.max_delay_ms must be >= 0, got {cfg.server.max_delay_ms}")
