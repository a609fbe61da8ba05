"""Where pulled models live under `EXPERTMESH_HOME`.

    models/{namespace}--{name}/
        refs/{revision}            the commit sha a revision name was pinned to at pull time
        {commit}/                  the local core: config, tokenizer, core-only shards,
                                   model.safetensors.index.json (core only), expert_index.json
        {commit}/pull_complete.json  written last; a model without it is not pulled yet
        {commit}/index_complete.json `pull --index-only` finished (the index, no core)
        {commit}/.last_used        touched by `run`, `chat` and `demo`, for `expertmesh ls`
    drafts/                        draft models (`--draft REPO`), in huggingface_hub's cache layout

Keying the folder by commit sha means cached bytes never mix two versions of a repo.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from expertmesh.node.errors import DamagedModelError, NotPulledError

COMPLETE_MARKER = "pull_complete.json"
INDEX_MARKER = "index_complete.json"  # `pull --index-only`: the expert index without the core
_SHA_RE = re.compile(r"[0-9a-f]{40}")
logger = logging.getLogger(__name__)


def repo_folder(repo_id: str) -> str:
    if repo_id.count("/") != 1 or any(p in ("", ".", "..") for p in repo_id.split("/")):
        raise ValueError(f"{repo_id!r} is not a repository id of the form namespace/name")
    return repo_id.replace("/", "--")


def model_root(home: Path, repo_id: str) -> Path:
    return home / "models" / repo_folder(repo_id)


def model_dir(home: Path, repo_id: str, commit: str) -> Path:
    """The folder of `repo_id` at `commit`, which must be a commit sha: it names a folder, and a
    commit that came from a Hub or a ref file could otherwise be an absolute path or `..`."""
    if not is_commit(commit):
        raise ValueError(f"{commit!r:.60} is not a 40-hex-digit commit sha")
    return model_root(home, repo_id) / commit


def is_commit(text: object) -> bool:
    """Whether `text` is a commit sha as the Hub gives them (40 lowercase hex digits)."""
    return isinstance(text, str) and _SHA_RE.fullmatch(text) is not None


def record_ref(home: Path, repo_id: str, revision: str, commit: str) -> None:
    if not is_commit(commit):
        raise ValueError(f"{commit!r:.60} is not a 40-hex-digit commit sha")
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
    commit = revision if is_commit(revision) else None
    ref = root / "refs" / revision.replace("/", "--")
    if commit is None and ref.is_file():
        commit = ref.read_text().strip()
        if not is_commit(commit):  # a damaged (or planted) ref: pulling again writes it afresh
            logger.warning("ignoring %s: it holds %r, not a commit sha", ref, commit[:60])
            return None
    return root / commit if commit else None


def local_commit(home: Path, repo_id: str, revision: str) -> str | None:
    """The commit `revision` (a sha, or a revision name recorded at pull time) stands for here, if known."""
    folder = _local_commit(home, repo_id, revision)
    return folder.name if folder is not None else None


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
    """The completed pull's record. Raises DamagedModelError when it is not one (`pull` repairs it)."""
    try:
        doc = json.loads((path / COMPLETE_MARKER).read_bytes())
    except (ValueError, RecursionError) as e:
        raise DamagedModelError(f"{path / COMPLETE_MARKER} is damaged ({e}): `expertmesh pull` repairs it") from None
    if not isinstance(doc, dict):
        raise DamagedModelError(f"{path / COMPLETE_MARKER} is damaged: `expertmesh pull` repairs it")
    return doc


# -- what a home holds (`expertmesh ls`, `rm`, `cache`) ---------------------------------------

LAST_USED_FILENAME = ".last_used"  # in a commit folder: touched by `run`, `chat` and `demo`
DRAFTS_DIRNAME = "drafts"  # draft models for `--speculate draft`, in huggingface_hub's cache layout


@dataclass
class PulledModel:
    """One revision folder under `models/`, whatever state its pull reached."""

    repo_id: str
    commit: str
    path: Path
    state: str  # "complete" (core and index), "index" (`pull --index-only`) or "partial" (a pull not finished)
    refs: list[str] = field(default_factory=list)  # revision names pinned to this commit
    core_bytes: int = 0  # the core as stored (after --core-bits), from the marker; 0 unless complete
    core_bits: int = 16
    core_quant: str | None = None  # mlx-lm's mixed recipe of a quantised core
    expert_count: int | None = None  # None: not known yet (a partial pull has no index)
    expert_bytes: int | None = None

    @property
    def disk_bytes(self) -> int:
        """Bytes of the folder on disk: the core, its index, tokenizer, and any parts of an unfinished pull."""
        return folder_bytes(self.path)


def folder_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (0 if it is gone); what `du` would count, near enough."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def repo_from_folder(folder: str) -> str:
    """`namespace--name` back to `namespace/name`: Hub repo ids never contain `--`, so this is exact."""
    return folder.replace("--", "/", 1)


def pulled_models(home: Path, repo_id: str | None = None) -> list[PulledModel]:
    """Every revision folder under `home/models` (of `repo_id` only, if given), sorted by repo id.

    Read only: nothing is created, locked or repaired, so `ls` is safe beside a running node."""
    base = home / "models"
    roots = [model_root(home, repo_id)] if repo_id else sorted(p for p in base.glob("*") if p.is_dir())
    out = []
    for root in roots:
        refs: dict[str, list[str]] = {}
        for ref in sorted((root / "refs").glob("*")):
            with contextlib.suppress(OSError):
                refs.setdefault(ref.read_text().strip(), []).append(ref.name.replace("--", "/"))
        for path in sorted(p for p in root.glob("*") if p.is_dir() and is_commit(p.name)):
            out.append(_describe(path, repo_id or repo_from_folder(root.name), refs.get(path.name, [])))
    return out


def _describe(path: Path, repo_id: str, refs: list[str]) -> PulledModel:
    model = PulledModel(repo_id, path.name, path, "partial", refs)
    try:
        if is_complete(path):
            doc = read_marker(path)
            model.state = "complete"
            model.repo_id = doc.get("repo_id", repo_id)
            model.core_bytes = int(doc.get("core_bytes", 0))
            model.core_bits = int(doc.get("core_bits", 16))
            model.core_quant = doc.get("core_quant")
            model.expert_count, model.expert_bytes = doc.get("expert_count"), doc.get("expert_bytes")
        elif (path / INDEX_MARKER).is_file():
            from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex

            index = ExpertIndex.load(path / INDEX_FILENAME)
            model.state = "index"
            model.expert_count, model.expert_bytes = len(index.experts), index.expert_bytes
    except (OSError, ValueError, KeyError, TypeError, DamagedModelError):  # a damaged marker or index: unfinished
        model.state = "partial"
    return model


def mark_used(path: Path) -> None:
    """Note that the pulled revision at `path` was just used (for `ls`); never fails a generation:
    a read-only home simply keeps its old date."""
    with contextlib.suppress(OSError):
        (path / LAST_USED_FILENAME).touch()  # an existing stamp gets a new mtime


def last_used(path: Path) -> float | None:
    """When the revision at `path` was last used as far as this folder knows (its stamp, else when
    its pull finished); None if neither exists. `ls` also looks at the expert cache's files."""
    for name in (LAST_USED_FILENAME, COMPLETE_MARKER, INDEX_MARKER):
        with contextlib.suppress(OSError):
            return (path / name).stat().st_mtime
    return None


def drafts_dir(home: Path) -> Path:
    return home / DRAFTS_DIRNAME


def fetch_draft(home: Path, repo_id: str, revision: str | None = None) -> Path:
    """The folder of draft model `repo_id` at `revision` (default `main`, pinned to its commit),
    downloaded into the home (not huggingface_hub's own cache, so `rm -r $EXPERTMESH_HOME` and a
    home on another disk hold everything expertmesh keeps) through the hub layer (node/hub/client.py:
    its rate gate, retries and messages); reused offline once there.

    Raises:
        SpeculationError: the repository cannot be had, with the hub layer's reason.
    """
    from expertmesh.node.errors import ExpertmeshError, SpeculationError
    from expertmesh.node.hub.client import download_repo

    try:
        return download_repo(repo_id, revision, cache_dir=drafts_dir(home))
    except ExpertmeshError as e:
        raise SpeculationError(f"draft model {repo_id!r} is neither a folder nor a reachable repository: {e}") from None
