"""model=hf's folders -- one written by save_pretrained, or a hub snapshot -- read as hostile
until checked, before transformers opens any of their files (`check_folder`, called by
kiln.models.zoo.transformers first):

- confined: every entry of the folder, and every file a shard index's weight_map names, resolves
  (links followed to the end) inside the folder's root: the folder itself, or for a hub
  snapshot (models--org--name/snapshots/<commit>/) the repo's cache folder, whose snapshots link
  into its blobs/. transformers and safetensors join a weight_map's names to the folder as they
  are written (`../x.safetensors`, `/abs/x.safetensors`) and follow any link; kiln refuses them.
- bounded: config.json and a shard index at most model.max_config_bytes, each tokenizer file
  at most model.max_tokenizer_bytes, judged from the file's size before it is parsed; the
  weights' files together no larger than the memory this process may take (they are read whole).
- regular: a FIFO, socket or device among the files transformers reads would block it; refused.
- no code: `auto_map` in config.json or tokenizer_config.json names Python files of the
  folder's own, which transformers runs only with trust_remote_code=True (after a "[y/N]"
  prompt on stdin). kiln never passes it, and refuses such a folder up front.

Every refusal is a ConfigError: one line naming the file, the key and what to do."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from kiln.config.base import ConfigError
from kiln.errors import first_few
from kiln.preprocessing.file_tree import FileAccessError, file_kind, open_regular

CONFIG_FILE = "config.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")  # transformers' order of preference
SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# What AutoTokenizer may read from a folder (the fast tokenizer, its settings, and the files a
# slow tokenizer is converted from when there is no tokenizer.json).
TOKENIZER_FILES = (
    "tokenizer.json",
    TOKENIZER_CONFIG,
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
    "chat_template.jinja",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)
MAX_DEPTH = 4  # folders below the model folder whose links are checked (chat_templates/, ...)
MAX_ENTRIES = 20_000  # a model folder holds tens of files; a hub snapshot a few hundred
NO_CODE = (
    "kiln never runs a model folder's own code: register the architecture as a kiln plugin "
    "(plugins=[my_module], kiln.registry.register_model), or save the model as one of "
    "transformers' own model types (AutoConfig.for_model(...).save_pretrained)"
)


def folder_root(folder: Path) -> Path:
    """What `folder`'s files must stay inside: the folder, resolved; for a hub snapshot
    (models--org--name/snapshots/<commit>) the repo's cache folder, whose blobs/ its links name."""
    real = Path(os.path.realpath(folder))
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real.parent.parent
    return real


def check_folder(
    folder: Path, label: str, *, max_config_bytes: int, max_tokenizer_bytes: int
) -> dict[str, Any]:
    """Every check above but the weights' (`shard_files`, `check_weights_fit_memory`); returns
    config.json, parsed."""
    root = folder_root(folder)
    check_links(folder, root, label)
    for name in TOKENIZER_FILES:
        check_size(folder / name, max_tokenizer_bytes, label, "model.max_tokenizer_bytes")
    config = read_json(folder / CONFIG_FILE, max_config_bytes, label, "model.max_config_bytes")
    refuse_code(config, CONFIG_FILE, label)
    if (folder / TOKENIZER_CONFIG).exists():
        settings = read_json(
            folder / TOKENIZER_CONFIG, max_tokenizer_bytes, label, "model.max_tokenizer_bytes"
        )
        refuse_code(settings, TOKENIZER_CONFIG, label)
        # transformers reads the first of these names it finds, joined to the folder as written
        names = settings.get("fast_tokenizer_files") or []
        for name in names if isinstance(names, list) else [names]:
            confined(folder, root, name, f"{TOKENIZER_CONFIG}'s fast_tokenizer_files", label)
    return config


def check_links(folder: Path, root: Path, label: str) -> None:
    """Refuse any entry under `folder` (hidden ones too, MAX_DEPTH folders deep) that resolves
    outside `root`: a link out of the folder, or a link to a link out of it. A linked folder is
    never entered: inside the root, the walk reaches it by its own path (or it loops)."""
    real_root = Path(os.path.realpath(root))
    stack, seen = [(folder, 0)], 0
    while stack:
        current, depth = stack.pop()
        try:
            with os.scandir(current) as scan:
                entries = list(scan)
        except OSError as err:
            raise ConfigError(
                f"{label}: cannot list {current} ({err.strerror or type(err).__name__})",
                "model.arch",
                "give a folder this user can read",
            ) from None
        seen += len(entries)
        if seen > MAX_ENTRIES:
            raise ConfigError(
                f"{label}: more than {MAX_ENTRIES} entries under {folder}, which is not a model "
                "folder",
                "model.arch",
                "give the folder save_pretrained wrote",
            )
        for entry in sorted(entries, key=lambda e: e.name):
            path = Path(entry.path)
            if entry.is_symlink():
                target = Path(os.path.realpath(path))
                if not target.is_relative_to(real_root):
                    raise outside(path.relative_to(folder), target, root, label)
            elif depth < MAX_DEPTH and entry.is_dir(follow_symlinks=False):
                stack.append((path, depth + 1))


def outside(name: Path | str, target: Path | str, root: Path, label: str) -> ConfigError:
    return ConfigError(
        f"{label}: {name} leads to {target}, outside the model folder {root}",
        "model.arch",
        "copy that file into the folder (kiln reads a model folder's files only from inside it; "
        "a hub snapshot's links into its own blobs/ are inside)",
    )


def confined(folder: Path, root: Path, name: Any, where: str, label: str) -> Path:
    """`folder / name`, for a file name a folder's own JSON gives (`where`: which key): a plain
    relative name that resolves inside `root`, or a ConfigError naming the key."""
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"{label}: {where} gives {name!r}, not a file name",
            "model.arch",
            "save the model again with save_pretrained",
        )
    path = Path(name)
    real = Path(os.path.realpath(folder / path))
    inside = real.is_relative_to(os.path.realpath(root))
    if path.is_absolute() or ".." in path.parts or not inside:
        raise ConfigError(
            f"{label}: {where} names {name!r}, outside the model folder {root}",
            "model.arch",
            "a model folder's files are named relative to it, inside it: save the model again "
            "with save_pretrained, or copy the file into the folder",
        )
    return folder / path


def check_size(path: Path, max_bytes: int, label: str, limit_key: str) -> None:
    """`path`, if it is there, is a regular file of at most `max_bytes`: judged from its stat()
    (links followed), nothing read."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        return
    except OSError as err:
        raise ConfigError(
            f"{label}: {path.name} cannot be read ({err.strerror})",
            "model.arch",
            "give a folder this user can read",
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(
            f"{label}: {path.name} is {file_kind(info.st_mode)}, not a regular file",
            "model.arch",
            "replace it with the file save_pretrained wrote",
        )
    if info.st_size > max_bytes:
        raise too_large(path, info.st_size, max_bytes, label, limit_key)


def too_large(path: Path, size: int, max_bytes: int, label: str, limit_key: str) -> ConfigError:
    return ConfigError(
        f"{label}: {path.name} is {size / 2**20:.1f} MiB, more than {limit_key}={max_bytes} "
        f"({max_bytes / 2**20:.1f} MiB); it is refused before it is parsed",
        limit_key,
        f"raise {limit_key} if the file is genuine (see docs/transformers.md for real sizes)",
    )


def read_json(path: Path, max_bytes: int, label: str, limit_key: str) -> dict[str, Any]:
    """A JSON object from a regular file of at most `max_bytes` (its size judged before it is
    read, and at most max_bytes + 1 bytes read), or one ConfigError naming the file."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size > max_bytes:
                raise too_large(path, size, max_bytes, label, limit_key)
            data = f.read(max_bytes + 1)
    except FileAccessError as err:
        raise ConfigError(
            f"{label}: {path.name}: {err.detail}",
            "model.arch",
            "give a folder written by save_pretrained (model and tokenizer)",
        ) from None
    if len(data) > max_bytes:  # it grew after its stat()
        raise too_large(path, len(data), max_bytes, label, limit_key)
    try:
        parsed = json.loads(data)
    except (ValueError, RecursionError) as err:  # RecursionError: nested past Python's stack
        why = str(err).splitlines()[0][:120] if isinstance(err, ValueError) else "nested too deep"
        raise ConfigError(
            f"{label}: {path.name} is not valid JSON ({why})",
            "model.arch",
            "save the model again with save_pretrained",
        ) from None
    if not isinstance(parsed, dict):
        raise ConfigError(
            f"{label}: {path.name} holds a JSON {type(parsed).__name__}, not an object",
            "model.arch",
            "save the model again with save_pretrained",
        )
    return parsed


def refuse_code(settings: dict[str, Any], file_name: str, label: str) -> None:
    """`auto_map` names classes in the folder's own .py files: code kiln will not run."""
    if "auto_map" not in settings:
        return
    auto_map = settings["auto_map"]
    named = auto_map.values() if isinstance(auto_map, dict) else [auto_map]
    shown = first_few(str(v) for v in named)
    raise ConfigError(
        f"{label}: {file_name} has auto_map ({shown}): the model needs code of the folder's "
        "own, which transformers runs only with trust_remote_code",
        "model.arch",
        NO_CODE,
    )


def shard_files(index: Path, root: Path, label: str, max_bytes: int) -> list[Path]:
    """The weight files a shard index (model.safetensors.index.json) names, each checked: the
    index a JSON object of at most `max_bytes` whose weight_map maps tensor names to file names,
    each a plain relative name that resolves inside `root` to a regular file."""
    data = read_json(index, max_bytes, label, "model.max_config_bytes")
    weight_map = data.get("weight_map")
    fix = "save the model again with save_pretrained, or set model.weights=<one weights file>"
    if not isinstance(weight_map, dict) or not weight_map:
        what = "no weight_map" if weight_map is None else f"a weight_map of {type(weight_map)}"
        if isinstance(weight_map, dict):
            what = "an empty weight_map"
        raise ConfigError(f"{label}: {index.name} has {what}", "model.weights", fix)
    files: dict[str, Path] = {}
    for tensor, name in weight_map.items():
        if name in files:
            continue
        where = f"{index.name}'s weight_map[{tensor!r}]"
        path = confined(index.parent, root, name, where, label)
        try:
            open_regular(path).close()
        except FileAccessError as err:
            raise ConfigError(
                f"{label}: {where} names {name}: {err.detail}", "model.weights", fix
            ) from None
        files[name] = path
    return sorted(files.values())


def check_weights_fit_memory(files: list[Path], available: int, label: str) -> None:
    """The weights are read whole into memory: files larger together than the memory this
    process may take are refused before the first byte is read."""
    total = sum(os.stat(f).st_size for f in files)
    if total > available:
        raise ConfigError(
            f"{label}: its weights ({first_few(f.name for f in files)}) are {total / 2**30:.1f} GB "
            f"and this process may take {available / 2**30:.1f} GB of memory",
            "model.weights",
            "free memory, use a machine with more, or set model.weights=null for random weights",
        )
