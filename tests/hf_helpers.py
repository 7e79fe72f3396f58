"""Small Hugging Face model folders for the tests (kiln.models.zoo.tiny_hf writes them, as
`save_pretrained` does), and the same folder laid out as the Hugging Face hub cache keeps it
(models--org--name/snapshots/<commit>/..., refs/main)."""

from __future__ import annotations

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
