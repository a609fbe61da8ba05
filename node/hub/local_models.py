"""Where pulled models live under `EXPERTMESH_HOME`.

    models/{namespace}--{name}/
        refs/{revision}            the commit sha a revision name was pinned to at pull time
        {commit}/                  the local core: config, tokenizer, core-only shards,
                                   model.safetensors.index.json (core only), expert_index.json
        {commit}/pull_complete.json  written last; a model without it is not pulled yet

Keying the folder by commit sha means cached bytes never mix two versions of a repo.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from expertmesh.node.errors import NotPulledError

COMPLETE_MARKER = "pull_complete.json"
INDEX_MARKER = "index_complete.json"  # `pull --index-only`: the expert index without the core
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")


def repo_folder(repo_id: str) -> str:
    if repo_id.count("/") != 1 or any(p in ("", ".", "..") for p in repo_id.split("/")):
        raise ValueError(f"{repo_id!r} is not a repository id of the form namespace/name")
    return repo_id.replace("/", "--")


def model_root(home: Path, repo_id: str) -> Path:
    return home / "models" / repo_folder(repo_id)


def model_dir(home: Path, repo_id: str, commit: str) -> Path:
    return model_root(home, repo_id) / commit


def record_ref(home: Path, repo_id: str, revision: str, commit: str) -> None:
    refs = model_root(home, repo_id) / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    path = refs / revision.replace("/", "--")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(commit)
    os.replace(tmp, path)


def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file()


def _local_commit(home: Path, repo_id: str, revision: str) -> Path | None:
    """The folder `revision` (a sha, or a ref recorded at pull time) points to, if known."""
    root = model_root(home, repo_id)
    commit = revision if _SHA_RE.match(revision) else None
    ref = root / "refs" / revision.replace("/", "--")
    if commit is None and ref.is_file():
        commit = ref.read_text().strip()
    return root / commit if commit else None


def find_pulled(home: Path, repo_id: str, revision: str | None = None) -> Path:
    """The folder of a completely pulled revision (default `main`).

    Raises:
        NotPulledError: with the command that pulls it.
    """
    revision = revision or "main"
    folder = _local_commit(home, repo_id, revision)
    if folder is not None and is_complete(folder):
        return folder
    hint = f" --revision {revision}" if revision != "main" else ""
    raise NotPulledError(f"{repo_id}@{revision} is not pulled yet: run `expertmesh pull {repo_id}{hint}`")


def find_index(home: Path, repo_id: str, revision: str | None = None) -> Path:
    """The folder of a revision whose expert index is pulled (with or without its core).

    Raises:
        NotPulledError: with the command that pulls it.
    """
    revision = revision or "main"
    folder = _local_commit(home, repo_id, revision)
    if folder is not None and ((folder / INDEX_MARKER).is_file() or is_complete(folder)):
        return folder
    hint = f" --revision {revision}" if revision != "main" else ""
    raise NotPulledError(
        f"{repo_id}@{revision} has no expert index here: run `expertmesh pull --index-only {repo_id}{hint}`"
    )


def read_marker(path: Path) -> dict:
    return json.loads((path / COMPLETE_MARKER).read_text())
