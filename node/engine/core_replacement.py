"""Replacing a pulled core's files by a quantised core's, so that a crash leaves one or the other.

`pull --core-bits` quantises a BF16 core in place: the BF16 shards must go (a K3 core is 114 GB)
and the quantised ones come in, with a new `config.json`, a new `model.safetensors.index.json`
and a new marker. mlx-lm loads every `model*.safetensors` of the folder, so at no moment may the
folder hold a mixture that `run` would load. The replacement is a small journal:

    1. the new files are written into `.core-staging/` (mlx-lm never looks into a subfolder);
       a crash here leaves the BF16 pull untouched, and the next `pull --core-bits` starts over;
    2. a manifest (what to remove, what to install, the new marker) is written there, every file
       is synced, and the folder is renamed `.core-ready/`: the commit point, one atomic rename;
    3. rolling forward: the BF16 shards named by the manifest are removed, each staged file is
       renamed into place, the marker is rewritten, and `.core-ready/` is deleted.

Every step of 3 can be repeated: a removed file is not removed twice, a file already moved is
no longer in `.core-ready/`. So whoever finds `.core-ready/` — the next `pull`, or `run` before it
loads anything (`finish_replacement`) — completes it, and the folder is either the BF16 pull or
the finished quantised core. A lock file serialises the processes that replace or complete.

`crash_point` marks the moments between those steps; tests replace it to kill the process there.
Nothing here imports MLX: completing a replacement is only renames.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from expertmesh.node.hub.local_models import COMPLETE_MARKER

STAGING = ".core-staging"  # being written: never loaded, deleted by whoever starts again
READY = ".core-ready"  # complete: rolled forward by whoever finds it
MANIFEST = "replacement.json"
LOCK = ".core-replacement.lock"


def crash_point(name: str) -> None:
    """A moment a crash would leave the folder in a state worth testing (see the module's docstring)."""


@contextlib.contextmanager
def locked(model_dir: Path) -> Iterator[None]:
    """Hold the folder's replacement lock (another process replacing or completing waits)."""
    with open(model_dir / LOCK, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def new_staging(model_dir: Path) -> Path:
    """An empty `.core-staging/` (what an interrupted staging left is thrown away). Hold `locked`."""
    staging = model_dir / STAGING
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    return staging


def commit(model_dir: Path, remove: list[str], marker: dict) -> None:
    """Make what `.core-staging/` holds the folder's core: the BF16 files named in `remove` go,
    every staged file takes its name in the folder, and the marker becomes `marker`. Hold `locked`.

    Raises:
        ValueError: a staged file has the name of one to remove (they would be deleted together).
    """
    staging = model_dir / STAGING
    install = sorted(p.name for p in staging.iterdir())
    if set(install) & set(remove):
        raise ValueError(f"the quantised core's files would replace files it removes: {set(install) & set(remove)}")
    manifest = staging / MANIFEST
    manifest.write_text(json.dumps({"remove": sorted(remove), "install": install, "marker": marker}, indent=1))
    for p in staging.iterdir():
        _fsync(p)
    _fsync(staging)
    crash_point("staged")
    os.replace(staging, model_dir / READY)
    _fsync(model_dir)
    crash_point("ready")
    _roll_forward(model_dir)


def finish_replacement(model_dir: Path) -> bool:
    """Complete a replacement a crash interrupted after its commit point; True if there was one.
    Cheap when there is none (one `stat`): `run` calls it before loading a core."""
    if not (model_dir / READY).is_dir():
        return False
    with locked(model_dir):
        if not (model_dir / READY).is_dir():  # another process completed it meanwhile
            return False
        _roll_forward(model_dir)
    return True


def _roll_forward(model_dir: Path) -> None:
    ready = model_dir / READY
    doc = json.loads((ready / MANIFEST).read_text())
    for name in doc["remove"]:
        (model_dir / name).unlink(missing_ok=True)
        crash_point("removed")
    for name in doc["install"]:
        if name == MANIFEST:
            continue
        src = ready / name
        if src.exists():
            os.replace(src, model_dir / name)
            crash_point("installed")
    tmp = model_dir / (COMPLETE_MARKER + ".tmp")
    tmp.write_text(json.dumps(doc["marker"], indent=1))
    os.replace(tmp, model_dir / COMPLETE_MARKER)
    _fsync(model_dir)
    crash_point("marked")
    shutil.rmtree(ready)


def _fsync(path: Path) -> None:
    """Flush a file or a folder's entries to the disk (a rename is durable only once its folder is)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
