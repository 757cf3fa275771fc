"""A Hugging Face hub cache folder made at test time: these machines cannot download, so a model folder is
laid out the way huggingface_hub stores a downloaded repository (models--org--name/snapshots/<commit>,
refs/<revision>), and hub ids resolve against it offline."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def add_to_hub_cache(cache: Path, repo_id: str, folder: Path, revision: str = "main") -> Path:
    """Copy `folder` into `cache` as repo_id at `revision`; returns the snapshot folder."""
    commit = hashlib.sha1(f"{repo_id}@{revision}".encode()).hexdigest()
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    shutil.copytree(folder, snapshot, dirs_exist_ok=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)
    return snapshot
