"""The expert index: where every routed expert and every core tensor lives in the upstream shards.

An expert is addressed by `(layer, expert)` within a pinned `(repo, commit)`. Upstream
checkpoints store it in one of two ways, and the index covers both:

- per-expert tensors (`...layers.{l}...experts.{e}.{w1,...}`): the expert is those tensors,
  usually adjacent in one shard, so they coalesce into one byte range (K3: one range);
- stacked tensors (MLX conversions, `...layers.{l}...switch_mlp.{proj}.{weight,...}` with the
  experts on axis 0): the expert is one contiguous slice of each stacked tensor.

Everything else is the core. The index is built from `model.safetensors.index.json` and the
shards' safetensors headers (range reads, never a whole shard) and saved as compact JSON
beside the core: tensors of one kind (same name pattern, dtype and shape) share one record,
so Kimi K3's 82,432 experts stay a few MB.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from expertmesh.node.errors import UnsupportedModelError
from expertmesh.node.hub.safetensors_format import DTYPE_BYTES, TensorEntry

INDEX_FILENAME = "expert_index.json"
FORMAT_VERSION = 1

# `experts` must be a whole name segment, so `shared_experts` stays in the core.
_PER_EXPERT_RE = re.compile(
    r"^(?P<pre>(?:.*\.)?layers\.)(?P<layer>\d+)(?P<mid>\.(?:.*\.)?experts\.)(?P<expert>\d+)(?P<post>\..+)$"
)
_STACKED_RE = re.compile(
    r"^(?P<pre>(?:.*\.)?layers\.)(?P<layer>\d+)(?P<post>\.(?:.*\.)?(?:switch_mlp|experts)\.[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)?)$"
)


@dataclass(frozen=True)
class TensorSlice:
    """The bytes of one tensor of one expert: a whole per-expert tensor or a stacked slice."""

    name: str  # upstream tensor name (the stacked tensor's, for a slice)
    dtype: str
    shape: tuple[int, ...]  # the expert's part (axis 0 removed for a slice)
    file: str
    start: int  # absolute offsets in `file`
    end: int
    stacked: bool = False

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ByteRange:
    file: str
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class ExpertLocation:
    layer: int
    expert: int
    tensors: list[TensorSlice]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def ranges(self) -> list[ByteRange]:
        """The expert's bytes as few ranges as possible: adjacent tensors coalesce."""
        return coalesce((t.file, t.start, t.end) for t in self.tensors)


# A core tensor is addressed exactly like an expert's tensor: a whole tensor of one shard.
CoreTensor = TensorSlice


@dataclass
class ExpertIndex:
    """Every expert's tensors and byte ranges, and every core tensor, of one pinned revision."""

    repo_id: str
    commit: str
    files: dict[str, int]  # shard name -> size in bytes
    core: dict[str, CoreTensor]
    experts: dict[tuple[int, int], ExpertLocation] = field(repr=False)

    @property
    def moe_layers(self) -> list[int]:
        return sorted({layer for layer, _ in self.experts})

    def experts_in_layer(self, layer: int) -> int:
        return sum(1 for lay, _ in self.experts if lay == layer)

    @property
    def expert_bytes(self) -> int:
        return sum(loc.nbytes for loc in self.experts.values())

    @property
    def core_bytes(self) -> int:
        return sum(t.nbytes for t in self.core.values())

    def expert(self, layer: int, expert: int) -> ExpertLocation:
        return self.experts[(layer, expert)]

    # -- persistence -------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Write the compact JSON atomically."""
        kinds: dict[tuple, int] = {}
        files = list(self.files)
        file_ids = {f: i for i, f in enumerate(files)}
        experts = []
        for (layer, expert), loc in sorted(self.experts.items()):
            row = []
            for t in loc.tensors:
                pattern = _name_pattern(t.name, layer, expert, t.stacked)
                kind = kinds.setdefault((pattern, t.dtype, t.shape, t.stacked), len(kinds))
                row.append([kind, file_ids[t.file], t.start])
            experts.append([layer, expert, row])
        doc = {
            "format_version": FORMAT_VERSION,
            "repo_id": self.repo_id,
            "commit": self.commit,
            "files": [[f, self.files[f]] for f in files],
            "core": [[t.name, t.dtype, list(t.shape), file_ids[t.file], t.start, t.end] for t in self.core.values()],
            "expert_kinds": [[p, d, list(s), st] for (p, d, s, st) in kinds],
            "experts": experts,
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, separators=(",", ":")))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> ExpertIndex:
        doc = json.loads(Path(path).read_text())
        if doc.get("format_version") != FORMAT_VERSION:
            raise UnsupportedModelError(f"{path}: expert index format {doc.get('format_version')} is not supported")
        files = [f for f, _ in doc["files"]]
        core = {}
        for name, dtype, shape, fid, start, end in doc["core"]:
            core[name] = CoreTensor(name, dtype, tuple(shape), files[fid], start, end)
        kinds = [(p, d, tuple(s), st) for p, d, s, st in doc["expert_kinds"]]
        experts = {}
        for layer, expert, row in doc["experts"]:
            tensors = []
            for kind, fid, start in row:
                pattern, dtype, shape, stacked = kinds[kind]
                tensors.append(
                    TensorSlice(
                        pattern.format(layer=layer, expert=expert),
                        dtype,
                        shape,
                        files[fid],
                        start,
                        start + _nbytes(dtype, shape),
                        stacked,
                    )
                )
            experts[(layer, expert)] = ExpertLocation(layer, expert, tensors)
        return cls(doc["repo_id"], doc["commit"], {f: n for f, n in doc["files"]}, core, experts)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = DTYPE_BYTES[dtype]
    for d in shape:
        n *= d
    return n


def _name_pattern(name: str, layer: int, expert: int, stacked: bool) -> str:
    """The tensor name with its layer (and expert) numbers turned into format fields."""
    name = name.replace("{", "{{").replace("}", "}}")
    if stacked:
        m = _STACKED_RE.match(name)
        return f"{m['pre']}{{layer}}{m['post']}"
    m = _PER_EXPERT_RE.match(name)
    return f"{m['pre']}{{layer}}{m['mid']}{{expert}}{m['post']}"


def coalesce(spans: Iterable[tuple[str, int, int]], gap_bytes: int = 0) -> list[ByteRange]:
    """Merge byte spans of the same file that touch (or are within `gap_bytes`)."""
    out: list[ByteRange] = []
    for file, start, end in sorted(spans):
        if out and out[-1].file == file and start <= out[-1].end + gap_bytes:
            last = out[-1]
            out[-1] = ByteRange(file, last.start, max(last.end, end))
        else:
            out.append(ByteRange(file, start, end))
    return out


def run_ranges(locs: list[ExpertLocation]) -> list[ByteRange] | None:
    """The ranges of several experts merged, if they merge into no more ranges than one expert has
    (its tensors are laid out expert after expert); None otherwise, when a run would save nothing."""
    merged = coalesce((r.file, r.start, r.end) for loc in locs for r in loc.ranges)
    return merged if len(merged) <= len(locs[0].ranges) else None


def classify(name: str) -> tuple[str, int, int | None] | None:
    """`("expert", layer, expert)`, `("stacked", layer, None)`, or None for a core tensor."""
    if m := _PER_EXPERT_RE.match(name):
        return "expert", int(m["layer"]), int(m["expert"])
    if m := _STACKED_RE.match(name):
        return "stacked", int(m["layer"]), None
    return None


def build_index(repo_id: str, commit: str, headers: dict[str, tuple[dict[str, TensorEntry], int]]) -> ExpertIndex:
    """Build the index from the parsed header of every shard.

    Args:
        headers: shard name -> (its tensors with absolute offsets, the shard's size).

    Raises:
        UnsupportedModelError: no routed experts, or experts whose tensors are inconsistent.
    """
    core: dict[str, CoreTensor] = {}
    per_expert: dict[tuple[int, int], list[TensorSlice]] = {}
    stacked: dict[int, list[tuple[str, TensorEntry]]] = {}
    for file, (tensors, _) in headers.items():
        for entry in tensors.values():
            kind = classify(entry.name)
            if kind is None:
                core[entry.name] = CoreTensor(entry.name, entry.dtype, entry.shape, file, entry.start, entry.end)
            elif kind[0] == "expert":
                t = TensorSlice(entry.name, entry.dtype, entry.shape, file, entry.start, entry.end)
                per_expert.setdefault((kind[1], kind[2]), []).append(t)
            else:
                stacked.setdefault(kind[1], []).append((file, entry))

    experts: dict[tuple[int, int], ExpertLocation] = {}
    for key, tensors in per_expert.items():
        experts[key] = ExpertLocation(*key, sorted(tensors, key=lambda t: (t.file, t.start)))
    for layer, entries in stacked.items():
        counts = {e.shape[0] for _, e in entries if e.shape}
        if len(counts) != 1:
            raise UnsupportedModelError(f"layer {layer}: stacked expert tensors disagree on the number of experts")
        (n,) = counts
        for e in range(n):
            slices = []
            for file, entry in sorted(entries, key=lambda fe: (fe[0], fe[1].start)):
                stride = entry.nbytes // n
                start = entry.start + e * stride
                slices.append(TensorSlice(entry.name, entry.dtype, entry.shape[1:], file, start, start + stride, True))
            experts[(layer, e)] = ExpertLocation(layer, e, slices)

    if not experts:
        raise UnsupportedModelError(f"{repo_id} has no routed experts: expertmesh runs Mixture-of-Experts models only")
    _check_consistent(experts)
    files = {f: size for f, (_, size) in headers.items()}
    return ExpertIndex(repo_id, commit, files, core, dict(sorted(experts.items())))


def _check_consistent(experts: dict[tuple[int, int], ExpertLocation]) -> None:
    """Every MoE layer numbers its experts 0..E-1 and every expert has the same tensor kinds."""
    by_layer: dict[int, list[int]] = {}
    for layer, e in experts:
        by_layer.setdefault(layer, []).append(e)
    for layer, ids in by_layer.items():
        if sorted(ids) != list(range(len(ids))):
            raise UnsupportedModelError(f"layer {layer}: expert ids are not 0..{len(ids) - 1}")
        shapes = {tuple((t.dtype, t.shape) for t in experts[(layer, e)].tensors) for e in ids}
        if len(shapes) != 1:
            raise UnsupportedModelError(f"layer {layer}: experts have different tensors")
