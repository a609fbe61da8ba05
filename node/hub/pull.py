"""`expertmesh pull`: download a MoE model's core, and only its core, plus its expert index.

The routed experts (≈ 93 % of Kimi K3's bytes) stay on the Hub and are fetched later, one at
a time, when the router asks for them. The core is fetched by byte range from the very shards
that also hold experts, so no expert byte crosses the link at pull time.

Crash safety and resume: every range is written to its own part file, published by rename
with its sha256 beside it; a re-run keeps the parts that verify and fetches the rest. Core
shards are assembled from the parts into temporary files and renamed into place; the marker
`pull_complete.json` is written last.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from tqdm.auto import tqdm

from expertmesh.node import constants
from expertmesh.node.errors import DamagedModelError, DownloadError, InsufficientDiskError, UnsupportedModelError
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub import local_models
from expertmesh.node.hub.client import RangeReader, RemoteFile
from expertmesh.node.model import safetensors_format
from expertmesh.node.model.expert_index import INDEX_FILENAME, ExpertIndex, build_index, coalesce
from expertmesh.node.model.mlx_lm_models import check_supported
from expertmesh.node.sizes import format_size

logger = logging.getLogger(__name__)

UPSTREAM_INDEX = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_PARTS = ".pull"


@dataclass
class PullResult:
    repo_id: str
    commit: str
    path: Path
    model_type: str
    core_bytes: int
    fetched_bytes: int  # core bytes downloaded by this run (less after a resume)
    expert_count: int
    expert_bytes: int  # left on the Hub
    moe_layers: int
    seconds: float
    retries: int
    already_complete: bool = False
    core_bits: int = 16  # 8, 4...: the core was stored as MLX quantised weights (node/engine/core_quantization.py)
    core_quant: str | None = None  # mlx-lm's mixed recipe it was quantised with (core_bits: its low bits)
    # the bits of a quantised core this pull found damaged and pulled anew in BF16: its caller
    # quantises it again (node/engine/core_quantization.py, `pull_with_core_bits`)
    repaired_core_bits: int | None = None


@dataclass(frozen=True)
class _Part:
    """One range of core bytes of one shard, its own file until the shard is assembled."""

    shard: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    def path(self, parts_dir: Path) -> Path:
        return _inside(parts_dir, parts_dir / self.shard / f"{self.start:015d}-{self.end:015d}.part")


def pull(
    repo_id: str,
    revision: str | None = None,
    home: Path | None = None,
    progress: bool = True,
    concurrency: int = constants.PULL_CONCURRENCY,
    reader: RangeReader | None = None,
    index_only: bool = False,
    check_index: Callable[[ExpertIndex], None] | None = None,
) -> PullResult:
    """Pull the core and expert index of `repo_id` at `revision` (default `main`).

    `index_only` pulls the config, tokenizer and expert index but not the core: all a cache peer
    (`serve --cache-only`) needs to fetch and serve experts. The core is pulled as published;
    quantising it is a step above this one (node/engine/core_quantization.py). `check_index` is
    shown the expert index before any core byte is fetched, and may refuse the model by raising.

    A pull already complete is reported from its marker, unless its files are damaged: then what
    is damaged is removed first (`_remove_damage`), and the pull runs again for what is missing.

    Raises:
        ModelNotFoundError, AuthError, EndpointUnreachableError: from the endpoint.
        UnsupportedModelError: an architecture mlx-lm lacks, or a model without routed experts.
        InsufficientDiskError: the core does not fit on the disk.
        DownloadError: a range kept failing after its retries.
        whatever `check_index` raises.
    """
    t0 = time.monotonic()
    home = home or constants.expertmesh_home()
    reader = reader or RangeReader()
    commit = hub_client.resolve_commit(repo_id, revision)
    target = local_models.model_dir(home, repo_id, commit)
    repaired_core_bits = _remove_damage(target, repo_id, commit)
    if local_models.is_complete(target):
        result = _result_from_marker(target)
    else:
        target.mkdir(parents=True, exist_ok=True)
        index, model_type = _pull_index(repo_id, commit, target, reader, concurrency, check_index)
        if index_only:
            result = _finish_index_only(index, model_type, target, reader)
        else:
            result = _pull_core(index, model_type, target, reader, concurrency, progress, repaired_core_bits)
    local_models.record_ref(home, repo_id, revision or "main", commit)
    result.seconds = time.monotonic() - t0
    return result


def _remove_damage(target: Path, repo_id: str, commit: str) -> int | None:
    """Remove what is damaged in a complete pull at `target` (a disk error, a cut copy or restore:
    what `run` would die on), so that pulling again fetches only that; None if nothing is.

    Returns the core bits the damaged pull's marker gave: a quantised core is derived from the
    BF16 one, so it is pulled anew in BF16 and its caller quantises it again.
    """
    if not local_models.is_complete(target) or (damage := local_damage(target)) is None:
        return None
    logger.warning("%s @ %s: %s: pulling it again", repo_id, commit[:12], damage.reason)
    remake = list(target.glob("*.safetensors")) if damage.core_bits not in (None, 16) else []
    for path in (*damage.files, *remake, target / local_models.COMPLETE_MARKER):
        path.unlink(missing_ok=True)
    return damage.core_bits


def _pull_index(
    repo_id: str,
    commit: str,
    target: Path,
    reader: RangeReader,
    concurrency: int,
    check_index: Callable[[ExpertIndex], None] | None,
) -> tuple[ExpertIndex, str]:
    """The small files into `target`, and the expert index from the shards' headers (not saved
    yet), shown to `check_index`; with the model type mlx-lm builds."""
    files = hub_client.list_files(repo_id, commit)
    config = _fetch_small_files(repo_id, commit, files, target)
    model_type = check_supported(config, repo_id)
    index = _build_index(repo_id, commit, files, reader, concurrency, config)
    if check_index is not None:
        check_index(index)
    return index, model_type


def _finish_index_only(index: ExpertIndex, model_type: str, target: Path, reader: RangeReader) -> PullResult:
    """Save the index and mark the folder as pulled for a cache peer (no core)."""
    index.save(target / INDEX_FILENAME)
    _write_atomic(target / local_models.INDEX_MARKER, json.dumps({"repo_id": index.repo_id, "commit": index.commit}))
    return _result(index, model_type, target, reader, core_bytes=0, fetched_bytes=0)


def _pull_core(
    index: ExpertIndex,
    model_type: str,
    target: Path,
    reader: RangeReader,
    concurrency: int,
    progress: bool,
    repaired_core_bits: int | None,
) -> PullResult:
    """Fetch the core's parts not already kept, assemble the core shards, save the index, and mark
    the pull complete (last)."""
    parts = _plan_parts(index)
    parts_dir = target / _PARTS
    have = {p for p in parts if _part_is_valid(p, parts_dir)}
    missing = [p for p in parts if p not in have]
    needed = sum(p.nbytes for p in missing) + index.core_bytes  # parts, then the assembled shards
    _check_disk(target, needed)

    bar = tqdm(
        total=index.core_bytes,
        initial=sum(p.nbytes for p in have),
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"core of {index.repo_id}",
        disable=not progress,
        dynamic_ncols=True,
    )
    try:
        _fetch_parts(index.repo_id, index.commit, missing, parts_dir, reader, concurrency, bar)
    finally:
        bar.close()

    _assemble_core(index, parts, parts_dir, target)
    index.save(target / INDEX_FILENAME)
    shutil.rmtree(parts_dir, ignore_errors=True)
    fetched = sum(p.nbytes for p in missing)
    result = _result(index, model_type, target, reader, index.core_bytes, fetched, repaired_core_bits)
    write_marker(target, result)
    return result


def _result(
    index: ExpertIndex,
    model_type: str,
    target: Path,
    reader: RangeReader,
    core_bytes: int,
    fetched_bytes: int,
    repaired_core_bits: int | None = None,
) -> PullResult:
    """What a pull that fetched did (its `seconds` are set by `pull`, once it is over)."""
    return PullResult(
        repo_id=index.repo_id,
        commit=index.commit,
        path=target,
        model_type=model_type,
        core_bytes=core_bytes,
        fetched_bytes=fetched_bytes,
        expert_count=len(index.experts),
        expert_bytes=index.expert_bytes,
        moe_layers=len(index.moe_layers),
        seconds=0.0,
        retries=reader.retries,
        repaired_core_bits=repaired_core_bits,
    )


def _fetch_small_files(repo_id: str, commit: str, files: list[str], target: Path) -> dict:
    """Config, tokenizer and generation files; returns the parsed config."""
    if "config.json" not in files:
        raise UnsupportedModelError(f"{repo_id} has no config.json: not a transformers model repository")
    wanted = [
        f
        for f in files
        if "/" not in f and f != UPSTREAM_INDEX and any(fnmatch.fnmatch(f, pat) for pat in constants.CORE_FILE_PATTERNS)
    ]
    for filename in wanted:
        hub_client.download_file(RemoteFile(repo_id, commit, filename), target)
    try:
        config = json.loads((target / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnsupportedModelError(f"{repo_id}: config.json is not valid JSON ({e})") from None
    except RecursionError:  # `[[[[...` nested past Python's recursion limit
        raise UnsupportedModelError(f"{repo_id}: config.json is nested too deeply") from None
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"{repo_id}: config.json is not a JSON object")
    return config


def _build_index(
    repo_id: str, commit: str, files: list[str], reader: RangeReader, concurrency: int, config: dict
) -> ExpertIndex:
    """The expert index from the shards' headers; the config picks the architecture whose sanitize tells
    experts from the core."""
    if UPSTREAM_INDEX in files:
        weight_map = _read_weight_map(repo_id, commit, reader)
        shards = _shard_names(repo_id, weight_map, files)
    elif SINGLE_FILE in files:
        shards = [SINGLE_FILE]
    else:
        raise UnsupportedModelError(f"{repo_id} has no safetensors weights ({UPSTREAM_INDEX} or {SINGLE_FILE})")
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        headers = dict(
            zip(
                shards,
                pool.map(lambda s: hub_client.read_safetensors_header(reader, RemoteFile(repo_id, commit, s)), shards),
            )
        )
    check_config_sizes(repo_id, config, headers)
    return build_index(repo_id, commit, headers, config)


# model.safetensors.index.json is read whole, so its size is bounded first. Kimi K3's is about
# 50-80 MB (82,432 experts × 6-9 tensors, ~100 bytes a line): four times that still fits.
MAX_WEIGHT_MAP_BYTES = 256 * 1024 * 1024


def _read_weight_map(repo_id: str, commit: str, reader: RangeReader) -> dict:
    """The `weight_map` of the upstream index, read with a bound: one byte past the cap is asked
    for, so a file over it is recognised (by its size or its length) without being read whole."""
    remote = RemoteFile(repo_id, commit, UPSTREAM_INDEX)
    raw, size = reader.read_with_size(remote, 0, MAX_WEIGHT_MAP_BYTES + 1)
    if len(raw) > MAX_WEIGHT_MAP_BYTES or (size is not None and size > MAX_WEIGHT_MAP_BYTES):
        raise UnsupportedModelError(
            f"{repo_id}: {UPSTREAM_INDEX} is {size or len(raw):,} bytes, more than the "
            f"{MAX_WEIGHT_MAP_BYTES:,} expertmesh reads of it"
        )
    try:
        weight_map = json.loads(raw)["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, KeyError, TypeError):
        raise UnsupportedModelError(f"{repo_id}: {UPSTREAM_INDEX} has no weight_map") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UnsupportedModelError(f"{repo_id}: the weight_map of {UPSTREAM_INDEX} is not a table of tensors")
    return weight_map


def _shard_names(repo_id: str, weight_map: dict, files: list[str]) -> list[str]:
    """The shards the weight_map names, sorted, each checked by `_shard_name` (once per name, not
    once per tensor: K3's map has half a million entries and 96 names).

    Raises:
        UnsupportedModelError: a value that is not a string, or a name `_shard_name` refuses.
    """
    names = set()
    for value in weight_map.values():
        if not isinstance(value, str):
            raise UnsupportedModelError(
                f"{repo_id}: {UPSTREAM_INDEX} names the shard {_shown(value)}, which is not a file name"
            )
        names.add(value)
    listed = set(files)
    return sorted(_shard_name(repo_id, name, listed) for name in names)


def _shown(value: object, limit: int = 80) -> str:
    """A value from the Hub, quoted and cut short, for a one-line error."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shard_name(repo_id: str, name: str, listed: set[str]) -> str:
    """A weight_map value, if it can safely name a shard: it becomes a path under the model's
    folder (the core shard, its parts), so only a plain relative name of a `.safetensors` file the
    repo lists is accepted; never an absolute path, `..`, a backslash or a hidden name (nor one
    that could stand for `pull_complete.json` or the parts folder).

    Raises:
        UnsupportedModelError: naming the refused value.
    """
    refuse = f"{repo_id}: {UPSTREAM_INDEX} names the shard {_shown(name)}, "
    parts = PurePosixPath(name).parts
    if (
        not name
        or "\\" in name
        or "\0" in name
        or name.startswith("/")
        or any(p.startswith(".") for p in parts)  # `..`, `.`, and hidden names
        or "/".join(parts) != name
        or not name.endswith(".safetensors")
    ):
        raise UnsupportedModelError(refuse + "which is not a plain relative .safetensors file name")
    if name not in listed:
        raise UnsupportedModelError(refuse + "which is not a file of the repository")
    return name


def _inside(folder: Path, path: Path) -> Path:
    """`path`, once it is certain to lie under `folder`: the second guard, after `_shard_name`,
    that no name from the Hub makes pull write or delete outside the model's folder."""
    if not path.resolve().is_relative_to(folder.resolve()):
        raise UnsupportedModelError(f"refusing to write {path}: it is outside {folder}")
    return path


# Sizes mlx-lm builds a module, a parameter or a list entry for, one per layer or per expert,
# from config.json alone: bounded before the model is built (expert_index._plan), as a config of a
# million layers would cost ~160 GB of module tree. Vision and audio towers are not built by
# mlx-lm, so their settings are left to their own loaders.
LAYER_COUNT_KEYS = ("num_hidden_layers", "num_layers", "n_layers", "n_layer")
EXPERT_COUNT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts", "n_experts")
MAX_LAYERS = 4096
MAX_EXPERTS = 1 << 16
_NOT_BUILT = ("vision", "audio")
_EXPERT_SEGMENTS = ("experts", "switch_mlp")


def check_config_sizes(repo_id: str, config: dict, headers: dict[str, tuple[dict, int]]) -> None:
    """Refuse a config whose layer or expert counts exceed what the shards hold (or a sane cap).

    The shards' headers are what the model really is: its layers are the numbers of `layers.N`
    in the tensor names (found as mlx_lm_models.layer_number finds them, so `h.N` and `blocks.N`
    count too), its experts the numbers after `experts.` or, for stacked experts, their tensors'
    first axis. A count the config gives beyond those would only make mlx-lm build modules that
    nothing fills, at ~160 KB and ~0.6 ms of Python per decoder layer.

    Raises:
        UnsupportedModelError: saying which count, what the shards hold, and the cap.
    """
    layers, experts = _sizes_in_headers(headers)
    for where, key, value in _counts(config):
        if key in LAYER_COUNT_KEYS:
            cap, held, what = MAX_LAYERS, layers, "layers"
        elif key in EXPERT_COUNT_KEYS:
            cap, held, what = MAX_EXPERTS, experts, "experts per layer"
        else:
            continue
        if value > cap or (held is not None and value > held):
            holds = f"the shards hold {held}" if held is not None else "the shards name none"
            raise UnsupportedModelError(
                f"{repo_id}: config.json sets {where}{key} = {value}, but {holds} {what} "
                f"(expertmesh builds at most {cap}): the config does not describe these weights"
            )


def _counts(config: dict, where: str = "", depth: int = 0):
    """`(path, key, number)` for every numeric setting of `config` and of the sub-configs mlx-lm
    builds (`text_config`...), bounded in depth."""
    for key, value in config.items():
        if isinstance(value, dict) and depth < 4 and not any(w in key for w in _NOT_BUILT):
            yield from _counts(value, f"{where}{key}.", depth + 1)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            yield where, key, value


def _sizes_in_headers(headers: dict[str, tuple[dict, int]]) -> tuple[int | None, int | None]:
    """The layers and the experts per layer the shards' tensor names and shapes show (None: none)."""
    layers = experts = None
    for tensors, _ in headers.values():
        for entry in tensors.values():
            parts = entry.name.split(".")
            layer = _layer_of(parts)
            if layer is not None and (layers is None or layer >= layers):
                layers = layer + 1
            for i, part in enumerate(parts[:-1]):
                if part not in _EXPERT_SEGMENTS:
                    continue
                after = parts[i + 1]
                n = int(after) + 1 if _is_number(after) else (entry.shape[0] if entry.shape else None)
                if n is not None and (experts is None or n > experts):
                    experts = n
                break
    return layers, experts


def _is_number(part: str) -> bool:
    return part.isascii() and part.isdigit()  # `"²".isdigit()` is True, and `int("²")` fails


def _layer_of(parts: list[str]) -> int | None:
    """The layer a tensor name is in, as mlx_lm_models.layer_number finds it for a module path:
    the number after `layers`, else the name's first number."""
    for i, part in enumerate(parts[1:], 1):
        if _is_number(part) and parts[i - 1] == "layers":
            return int(part)
    return next((int(p) for p in parts if _is_number(p)), None)


MIN_PART_BYTES = 1024 * 1024
PARTS_PER_CORE = 64  # a core of a few spans still gives every connection work to do


def _plan_parts(index: ExpertIndex) -> list[_Part]:
    """Core bytes as ranges: adjacent core tensors coalesce, and spans are split into parts of
    about 1/PARTS_PER_CORE of the core (between MIN_PART_BYTES and MAX_RANGE_BYTES), so the
    configured number of requests stay in flight even when the core is a few large spans, and a
    resume loses at most one part per request. The plan depends on the core alone, so a resumed
    pull finds the parts of the one it resumes."""
    spans = coalesce((t.file, t.start, t.end) for t in index.core.values())
    total = sum(s.end - s.start for s in spans)
    size = min(constants.MAX_RANGE_BYTES, max(MIN_PART_BYTES, total // PARTS_PER_CORE))
    parts = []
    for span in spans:
        for start in range(span.start, span.end, size):
            parts.append(_Part(span.file, start, min(span.end, start + size)))
    return parts


def _part_is_valid(part: _Part, parts_dir: Path) -> bool:
    """A part survives a resume only if its size and recorded sha256 both check out."""
    path = part.path(parts_dir)
    sidecar = path.with_suffix(".sha256")
    try:
        if path.stat().st_size != part.nbytes:
            raise ValueError("size")
        if _sha256_file(path) != sidecar.read_text().strip():
            raise ValueError("sha256")
    except (OSError, ValueError):
        path.unlink(missing_ok=True)
        sidecar.unlink(missing_ok=True)
        return False
    return True


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _check_disk(target: Path, needed: int) -> None:
    free = shutil.disk_usage(target).free
    if free < needed + constants.DISK_HEADROOM_BYTES:
        raise InsufficientDiskError(
            f"pulling needs {format_size(needed)} plus {format_size(constants.DISK_HEADROOM_BYTES)} headroom, "
            f"but the disk of {target} has {format_size(free)} free"
        )


def _fetch_parts(
    repo_id: str, commit: str, parts: list[_Part], parts_dir: Path, reader: RangeReader, concurrency: int, bar: tqdm
) -> None:
    def fetch(part: _Part) -> int:
        data = reader.read(RemoteFile(repo_id, commit, part.shard), part.start, part.end)
        if len(data) != part.nbytes:
            raise DownloadError(f"{part.shard}: got {len(data)} bytes for a {part.nbytes}-byte range")
        path = part.path(parts_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _write_atomic(path.with_suffix(".sha256"), hashlib.sha256(data).hexdigest())
        return part.nbytes

    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        for future in as_completed([pool.submit(fetch, p) for p in parts]):
            bar.update(future.result())
    except BaseException:
        reader.cancel()  # on an error or Ctrl-C, reads in flight stop at their next chunk
        raise
    finally:
        # Queued ranges are dropped; published parts stay for the resume.
        pool.shutdown(wait=True, cancel_futures=True)


def _assemble_core(index: ExpertIndex, parts: list[_Part], parts_dir: Path, target: Path) -> None:
    """Write each shard's core tensors as a local shard of the same name.

    Core spans coalesce only tensors that touch, so a shard's parts, concatenated in order,
    are exactly its core tensors in file order: the new data section.
    """
    weight_map = {}
    for shard in sorted({t.file for t in index.core.values()}):
        tensors = sorted((t for t in index.core.values() if t.file == shard), key=lambda t: t.start)
        out = _inside(target, target / shard)
        out.parent.mkdir(parents=True, exist_ok=True)  # a shard in a folder of the repo
        header = safetensors_format.encode_header((t.name, t.dtype, t.shape, t.nbytes) for t in tensors)
        if not _shard_is_complete(out, tensors):
            tmp = out.with_name(out.name + ".tmp")
            with open(tmp, "wb") as f:
                f.write(header)
                for part in (p for p in parts if p.shard == shard):
                    with open(part.path(parts_dir), "rb") as src:
                        shutil.copyfileobj(src, f, 1 << 20)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, out)
        weight_map.update({t.name: shard for t in tensors})
    doc = {"metadata": {"total_size": index.core_bytes, "expertmesh": "core only"}, "weight_map": weight_map}
    _write_atomic(target / UPSTREAM_INDEX, json.dumps(doc, indent=1))


def _shard_is_complete(path: Path, tensors: list) -> bool:
    try:
        local = safetensors_format.read_header(path)
    except (OSError, safetensors_format.SafetensorsFormatError):
        return False
    return {n: (e.dtype, e.shape, e.nbytes) for n, e in local.items()} == {
        t.name: (t.dtype, t.shape, t.nbytes) for t in tensors
    }


@dataclass
class Damage:
    reason: str
    files: list[Path]  # to remove before pulling again
    core_bits: int | None  # what the marker said, to pull the same core again


def local_damage(target: Path) -> Damage | None:
    """What is wrong with a complete pull's files, found cheaply: the marker, the JSON files and
    the index parse, and every safetensors file holds the bytes its header says (no hashing)."""
    core_bits = None
    try:
        marker = local_models.read_marker(target)
        core_bits = int(marker.get("core_bits", 16)) if isinstance(marker, dict) else None
        if not isinstance(marker, dict):
            raise ValueError("not an object")
    except (OSError, ValueError, TypeError, DamagedModelError) as e:
        return Damage(f"{local_models.COMPLETE_MARKER} is unreadable ({e})", [], None)
    wanted = None if core_bits == 16 else core_bits
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", UPSTREAM_INDEX):
        path = target / name
        try:
            if path.exists():
                json.loads(path.read_bytes())
        except (OSError, ValueError, RecursionError) as e:
            return Damage(f"{name} is damaged ({type(e).__name__})", [path], wanted)
    try:
        ExpertIndex.load(target / INDEX_FILENAME)
    except (OSError, ValueError, KeyError, TypeError, IndexError, UnsupportedModelError) as e:
        return Damage(f"{INDEX_FILENAME} is damaged ({type(e).__name__})", [target / INDEX_FILENAME], wanted)
    for path in sorted(target.rglob("*.safetensors")):
        if _PARTS in path.relative_to(target).parts:
            continue
        try:
            safetensors_format.read_header(path)
        except (OSError, safetensors_format.SafetensorsFormatError) as e:
            return Damage(f"{path.relative_to(target)} is damaged ({e})", [path], wanted)
    return None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_marker(target: Path, r: PullResult) -> None:
    """Mark the pull at `target` complete, as `r` describes it (written last, atomically)."""
    doc = {k: v for k, v in r.__dict__.items() if k not in ("path", "already_complete", "repaired_core_bits")}
    _write_atomic(target / local_models.COMPLETE_MARKER, json.dumps(doc, indent=1))


def _result_from_marker(target: Path) -> PullResult:
    """What the complete pull at `target` did, as its marker says; nothing was fetched now."""
    doc = local_models.read_marker(target)
    doc.update(path=target, fetched_bytes=0, seconds=0.0, retries=0, already_complete=True)
    return PullResult(**doc)
