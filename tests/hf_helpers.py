"""Small Hugging Face model folders for the tests (kiln.models.zoo.tiny_hf writes them, as
`save_pretrained` does), the same folder laid out as the Hugging Face hub cache keeps it
(models--org--name/snapshots/<commit>/..., refs/main; `into_hub_cache_linked`: with blobs/ and
the snapshot's links into it, as huggingface_hub writes it), and hostile copies of a folder
(issue 46): sizes past any machine, links and shard names out of the folder, malformed shard
indexes, code of the folder's own behind `auto_map`, a tokenizer with two words' ids swapped."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from kiln.models.zoo.tiny_hf import POSITIONS, TINY, csv_texts, write_bert, write_roberta

__all__ = ["POSITIONS", "TINY", "csv_texts", "into_hub_cache", "write_bert", "write_roberta"]


def into_hub_cache(folder: Path, hub_cache: Path, repo_id: str, commit: str = "0" * 40) -> Path:
    """`folder`'s files as the hub cache holds a download of `repo_id`: the snapshot of
    `commit`, named by refs/main (real caches link blobs; a plain copy reads the same)."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


# ---------------------------------------------------------------------------------------------
# Hostile model folders (issue 46): each a copy of a real tiny folder with one thing made
# hostile, as an attacker (or a damaged download) would leave it.


def copy_folder(folder: Path, dest: Path) -> Path:
    shutil.copytree(folder, dest)
    return dest


def edit_json(path: Path, **changes) -> None:
    """Set keys of a JSON object file (None deletes the key)."""
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


def sized_config(folder: Path, dest: Path, **sizes) -> Path:
    """`folder` whose config.json asks for other sizes (hidden_size=10**6, ...); the weights
    and tokenizer stay the tiny ones."""
    copy_folder(folder, dest)
    edit_json(dest / "config.json", **sizes)
    return dest


def sparse_file(path: Path, size: int) -> Path:
    """A file of `size` bytes that takes no disk (a hole): large by its stat(), zeros if read."""
    path.unlink(missing_ok=True)
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def into_hub_cache_linked(
    folder: Path, hub_cache: Path, repo_id: str, commit: str = "1" * 40
) -> Path:
    """`folder`'s files as huggingface_hub lays a download out: each file once in blobs/ (named
    by its sha256), and snapshots/<commit>/<name> a relative link to it (../../blobs/<sha>)."""
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(folder.iterdir()):
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, repo / "blobs" / blob)
        (snapshot / file.name).symlink_to(f"../../blobs/{blob}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def linked_outside(folder: Path, dest: Path, name: str, outside: Path) -> Path:
    """`folder` with its file `name` replaced by a link to `outside` (a file out of the folder:
    its lines would be read as the vocabulary)."""
    copy_folder(folder, dest)
    (dest / name).unlink(missing_ok=True)
    (dest / name).symlink_to(outside)
    return dest


def sharded_outside(folder: Path, dest: Path, shard_name: str) -> Path:
    """`folder` saved as a sharded checkpoint whose index's weight_map names `shard_name` for
    every tensor (`../../outside/stolen.safetensors`, or an absolute path): the shard is
    written there, with the folder's own tensors, so a loader that follows the name loads it."""
    from safetensors.torch import load_file, save_file

    copy_folder(folder, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    (dest / "model.safetensors").unlink()
    shard = Path(shard_name) if Path(shard_name).is_absolute() else dest / shard_name
    shard.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = {"metadata": {"total_size": 0}, "weight_map": dict.fromkeys(tensors, shard_name)}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    return dest


def bad_index(folder: Path, dest: Path, index: object) -> Path:
    """`folder` whose model.safetensors.index.json holds `index` (a malformed one)."""
    copy_folder(folder, dest)
    (dest / "model.safetensors").unlink()
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    return dest


REMOTE_CODE = """
from pathlib import Path
Path({marker!r}).write_text("the folder's code ran")
"""


def with_remote_code(folder: Path, dest: Path, marker: Path) -> Path:
    """`folder` as a model of its own code: config.json of a model_type transformers does not
    know, `auto_map` in it and in tokenizer_config.json, and the .py files they name, each of
    which writes `marker` when imported. transformers asks "[y/N]" on stdin before it imports
    them (trust_remote_code unset); `yes |` answers y."""
    copy_folder(folder, dest)
    code = {
        "AutoConfig": "configuration_evil.EvilConfig",
        "AutoModelForSequenceClassification": "modeling_evil.EvilModel",
    }
    edit_json(dest / "config.json", model_type="evil", auto_map=code)
    edit_json(
        dest / "tokenizer_config.json",
        auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]},
    )
    for module in ("configuration_evil", "modeling_evil", "tokenization_evil"):
        (dest / f"{module}.py").write_text(REMOTE_CODE.format(marker=str(marker)))
    return dest


def swap_two_words(tokenizer_json: str) -> tuple[str, tuple[str, str]]:
    """tokenizer.json with the ids of two of its words swapped (the vocabulary's first two
    all-letter words of 4+ letters), and the words."""
    data = json.loads(tokenizer_json)
    vocab = data["model"]["vocab"]
    first, second = [w for w in vocab if w.isalpha() and len(w) > 3][:2]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    return json.dumps(data), (first, second)
