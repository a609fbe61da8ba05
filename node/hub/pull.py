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
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from expertmesh.node import constants
from expertmesh.node.engine.core_quantization import CoreBitsError, check_core_bits, quantize_core
from expertmesh.node.engine.mlx_lm_models import check_supported
from expertmesh.node.errors import DownloadError, InsufficientDiskError, UnsupportedModelError
from expertmesh.node.hub import client as hub_client
from expertmesh.node.hub import local_models, safetensors_format
from expertmesh.node.hub.client import RangeReader, RemoteFile
from expertmesh.node.hub.expert_index import INDEX_FILENAME, ExpertIndex, build_index, coalesce

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
    core_bits: int = 16  # 8: the core was stored as MLX 8-bit weights (node/engine/core_quantization.py)


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
        return parts_dir / self.shard / f"{self.start:015d}-{self.end:015d}.part"


def pull(
    repo_id: str,
    revision: str | None = None,
    home: Path | None = None,
    progress: bool = True,
    concurrency: int = constants.PULL_CONCURRENCY,
    reader: RangeReader | None = None,
    index_only: bool = False,
    core_bits: int | None = None,
) -> PullResult:
    """Pull the core and expert index of `repo_id` at `revision` (default `main`).

    `index_only` pulls the config, tokenizer and expert index but not the core: all a cache peer
    (`serve --cache-only`) needs to fetch and serve experts. `core_bits` 8 stores the core as MLX
    8-bit weights (`--core-bits 8`); None keeps what is pulled (16, the upstream BF16, if new).

    Raises:
        ModelNotFoundError, AuthError, EndpointUnreachableError: from the endpoint.
        UnsupportedModelError: an architecture mlx-lm lacks, or a model without routed experts.
        InsufficientDiskError: the core does not fit on the disk.
        DownloadError: a range kept failing after its retries.
        CoreBitsError: a `core_bits` other than 16 or 8, or 16 for a core already stored in 8 bits.
    """
    t0 = time.monotonic()
    home = home or constants.expertmesh_home()
    reader = reader or RangeReader()
    commit = hub_client.resolve_commit(repo_id, revision)
    target = local_models.model_dir(home, repo_id, commit)
    if core_bits is not None:
        check_core_bits(core_bits)
    if local_models.is_complete(target):
        local_models.record_ref(home, repo_id, revision or "main", commit)
        result = _result_from_marker(target, time.monotonic() - t0)
        if core_bits is None or core_bits == result.core_bits:
            return result
        _refuse_requantising(repo_id, ExpertIndex.load(target / INDEX_FILENAME), core_bits)
        if result.core_bits != 16:
            raise CoreBitsError(
                f"{repo_id} @ {commit[:12]} is pulled with a {result.core_bits}-bit core; the BF16 core "
                f"is no longer here: delete {target} and pull again"
            )
        q = quantize_core(target, core_bits)  # the BF16 core is here: quantise it in place
        result.core_bits, result.core_bytes, result.already_complete = core_bits, q.core_bytes_after, False
        _write_marker(target, result)
        return result

    target.mkdir(parents=True, exist_ok=True)
    files = hub_client.list_files(repo_id, commit)
    config = _fetch_small_files(repo_id, commit, files, target)
    model_type = check_supported(config, repo_id)

    index = _build_index(repo_id, commit, files, reader, concurrency, config)
    _refuse_requantising(repo_id, index, core_bits)
    if index_only:
        index.save(target / INDEX_FILENAME)
        result = PullResult(
            repo_id=repo_id,
            commit=commit,
            path=target,
            model_type=model_type,
            core_bytes=0,
            fetched_bytes=0,
            expert_count=len(index.experts),
            expert_bytes=index.expert_bytes,
            moe_layers=len(index.moe_layers),
            seconds=time.monotonic() - t0,
            retries=reader.retries,
        )
        _write_atomic(target / local_models.INDEX_MARKER, json.dumps({"repo_id": repo_id, "commit": commit}))
        local_models.record_ref(home, repo_id, revision or "main", commit)
        return result
    parts = _plan_parts(index)
    parts_dir = target / _PARTS
    have = {p for p in parts if _part_is_valid(p, parts_dir)}
    missing = [p for p in parts if p not in have]
    needed = sum(p.nbytes for p in missing) + index.core_bytes  # parts, then the assembled shards
    _check_disk(target, needed)

    have_bytes = sum(p.nbytes for p in have)
    bar = tqdm(
        total=index.core_bytes,
        initial=have_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc=f"core of {repo_id}",
        disable=not progress,
        dynamic_ncols=True,
    )
    try:
        _fetch_parts(repo_id, commit, missing, parts_dir, reader, concurrency, bar)
    finally:
        bar.close()

    _assemble_core(index, parts, parts_dir, target)
    index.save(target / INDEX_FILENAME)
    stored_core_bytes = index.core_bytes
    if core_bits not in (None, 16):
        stored_core_bytes = quantize_core(target, core_bits).core_bytes_after
    shutil.rmtree(parts_dir, ignore_errors=True)
    result = PullResult(
        repo_id=repo_id,
        commit=commit,
        path=target,
        model_type=model_type,
        core_bytes=stored_core_bytes,
        fetched_bytes=sum(p.nbytes for p in missing),
        expert_count=len(index.experts),
        expert_bytes=index.expert_bytes,
        moe_layers=len(index.moe_layers),
        seconds=time.monotonic() - t0,
        retries=reader.retries,
        core_bits=core_bits or 16,
    )
    _write_marker(target, result)
    local_models.record_ref(home, repo_id, revision or "main", commit)
    return result


# Core tensors that say the upstream core is quantised already: MLX's scales, FP8 and
# compressed-tensors' scales, packed integer or 8-bit float weights.
_QUANTISED_SUFFIXES = (".scales", ".weight_scale", ".weight_scale_inv", ".weight_packed")
_QUANTISED_DTYPES = ("U32", "I32", "U8", "I8", "F8_E4M3", "F8_E5M2")


def _refuse_requantising(repo_id: str, index: ExpertIndex, core_bits: int | None) -> None:
    """`--core-bits 8` on a core published quantised (an mlx-lm conversion, an FP8 checkpoint) would
    make nothing smaller, and recording 8 bits would say otherwise: refuse before anything is fetched."""
    if core_bits in (None, 16):
        return
    sign = next(
        (t for t in index.core.values() if t.name.endswith(_QUANTISED_SUFFIXES) or t.dtype in _QUANTISED_DTYPES), None
    )
    if sign is not None:
        raise CoreBitsError(
            f"{repo_id}'s core is already quantised as published (it has {sign.name}, {sign.dtype}): --core-bits "
            f"{core_bits} would not make it smaller; pull it without --core-bits"
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
        return json.loads((target / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise UnsupportedModelError(f"{repo_id}: config.json is not valid JSON ({e})") from None


def _build_index(
    repo_id: str, commit: str, files: list[str], reader: RangeReader, concurrency: int, config: dict
) -> ExpertIndex:
    """The expert index from the shards' headers; the config picks the architecture whose sanitize tells
    experts from the core."""
    if UPSTREAM_INDEX in files:
        raw, _ = reader.read_with_size(RemoteFile(repo_id, commit, UPSTREAM_INDEX), 0, 1 << 62)
        try:
            weight_map = json.loads(raw)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise UnsupportedModelError(f"{repo_id}: {UPSTREAM_INDEX} has no weight_map") from None
        shards = sorted(set(weight_map.values()))
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
    return build_index(repo_id, commit, headers, config)


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
            f"pulling needs {_gb(needed)} plus {_gb(constants.DISK_HEADROOM_BYTES)} headroom, "
            f"but {target.anchor or target} has {_gb(free)} free"
        )


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


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
        out = target / shard
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


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _write_marker(target: Path, r: PullResult) -> None:
    doc = {k: v for k, v in r.__dict__.items() if k not in ("path", "already_complete")}
    _write_atomic(target / local_models.COMPLETE_MARKER, json.dumps(doc, indent=1))


def _result_from_marker(target: Path, seconds: float) -> PullResult:
    doc = local_models.read_marker(target)
    doc.update(path=target, fetched_bytes=0, seconds=seconds, retries=0, already_complete=True)
    return PullResult(**doc)
