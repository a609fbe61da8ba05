"""The expert index: where every routed expert and every core tensor lives in the upstream shards.

An expert is addressed by `(layer, expert)` within a pinned `(repo, commit)`. Which upstream
tensors make it up is not guessed from names: mlx-lm's own `sanitize` for the architecture is
traced on stand-ins of the checkpoint's tensors (node/model/expert_trace.py), so the index learns
which tensors feed each `SwitchGLU` (or `SwitchMLP`) parameter and how. An expert is then

- whole tensors (per-expert checkpoints: `...experts.{e}.{w1,...}`), usually adjacent in one
  shard, so they coalesce into one byte range (K3: one range);
- or one slice of each stacked tensor (experts on axis 0, MLX conversions and fused
  `(E, 2·I, H)` gate/up checkpoints alike): a contiguous range per tensor;

plus its `Recipe`: the operations sanitize applies to those bytes (split a fused gate/up on the
row axis, transpose, view packed bytes as uint32...), which the codec replays per expert. Order
in a file never matters. Tensors sanitize drops (multi-token-prediction layers, vision towers)
are neither; everything else is the core.

The index is built from `model.safetensors.index.json` and the shards' safetensors headers
(range reads, never a whole shard) and saved as compact JSON beside the core: tensors of one
kind (same name pattern, dtype and shape) share one record, and experts stored alike share one
recipe, so Kimi K3's 82,432 experts stay a few MB.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from expertmesh.node.errors import UnsupportedModelError
from expertmesh.node.model.safetensors_format import TensorEntry, tensor_nbytes

INDEX_FILENAME = "expert_index.json"
FORMAT_VERSION = 2  # 2: recipes; an index of format 1 (name-based experts) still loads
_READABLE_VERSIONS = (1, 2)
# The parameters an expert block's projection can have, as mlx-lm names them.
PARAMETER_KINDS = ("weight", "scales", "biases", "bias")
# A whole tensor every expert of a layer reads (a per-tensor scale) is copied into each: only if small.
SHARED_INPUT_MAX_BYTES = 1 << 20

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


@dataclass(frozen=True)
class Recipe:
    """How an expert's tensors become its block parameters.

    `text` is JSON mapping each parameter, named relative to the expert block
    (`gate_proj.weight`), to an expression over the recipe's inputs by position (see
    `expert_trace.encode_expert`); input i is the expert's tensor `inputs[i]`. Experts stored
    alike share one `text` whatever their tensors' order in a file.
    """

    text: str
    inputs: tuple[int, ...]

    @functools.cached_property
    def parameters(self) -> dict[str, Any]:
        return json.loads(self.text)


# An expert's upstream bytes, its ranges concatenated: what the tiers move, check and keep.
ExpertBytes = bytes | bytearray | memoryview


@dataclass
class ExpertLocation:
    layer: int
    expert: int
    tensors: list[TensorSlice]  # in blob order: by file, then offset
    # None for an index of format 1, whose experts the codec decodes by tensor name.
    recipe: Recipe | None = None

    @functools.cached_property
    def nbytes(self) -> int:  # asked for every use of the expert: summed once
        return sum(t.nbytes for t in self.tensors)

    @property
    def ranges(self) -> list[ByteRange]:
        """The expert's bytes as few ranges as possible: adjacent tensors coalesce."""
        return coalesce((t.file, t.start, t.end) for t in self.tensors)

    def blob_offsets(self) -> list[int]:
        """Where each of `tensors` starts in the expert's blob (its `ranges` concatenated)."""
        offsets = []
        ranges = self.ranges
        for t in self.tensors:
            base = 0
            for r in ranges:
                if t.file == r.file and r.start <= t.start and t.end <= r.end:
                    offsets.append(base + t.start - r.start)
                    break
                base += r.nbytes
        return offsets


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
    # mlx-lm's sanitize makes the core right only when it sees the experts' tensors too (qwen3_next)
    sanitize_with_experts: bool = False

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

    def expert_tensors(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The upstream tensors the experts are made of, whole (name -> dtype, shape): what a
        checkpoint holds besides the core, for sanitize's stand-ins (`sanitize_with_experts`)."""
        out: dict[str, tuple[str, tuple[int, ...]]] = {}
        rows: dict[str, int] = {}
        for loc in self.experts.values():
            used = loc.recipe.inputs if loc.recipe is not None else range(len(loc.tensors))
            for t in (loc.tensors[i] for i in used):
                out[t.name] = (t.dtype, t.shape)
                if t.stacked:
                    rows[t.name] = rows.get(t.name, 0) + 1
        return {n: (d, (rows[n], *s) if n in rows else s) for n, (d, s) in out.items()}

    # -- persistence -------------------------------------------------------------------------

    def save(self, path: Path) -> None:
        """Write the compact JSON atomically."""
        kinds: dict[tuple, int] = {}
        files = list(self.files)
        file_ids = {f: i for i, f in enumerate(files)}
        texts: dict[str, int] = {}
        recipes: dict[tuple[int, tuple[int, ...]], int] = {}
        experts = []
        for (layer, expert), loc in sorted(self.experts.items()):
            row = []
            for t in loc.tensors:
                pattern = _name_pattern(t.name, layer, expert, t.stacked)
                kind = kinds.setdefault((pattern, t.dtype, t.shape, t.stacked), len(kinds))
                row.append([kind, file_ids[t.file], t.start])
            recipe = None
            if loc.recipe is not None:
                text = texts.setdefault(loc.recipe.text, len(texts))
                recipe = recipes.setdefault((text, loc.recipe.inputs), len(recipes))
            experts.append([layer, expert, row, recipe])
        doc = {
            "format_version": FORMAT_VERSION,
            "repo_id": self.repo_id,
            "commit": self.commit,
            "files": [[f, self.files[f]] for f in files],
            "core": [[t.name, t.dtype, list(t.shape), file_ids[t.file], t.start, t.end] for t in self.core.values()],
            "expert_kinds": [[p, d, list(s), st] for (p, d, s, st) in kinds],
            "recipe_texts": list(texts),
            "recipes": [[text, list(inputs)] for text, inputs in recipes],
            "experts": experts,
        }
        if self.sanitize_with_experts:
            doc["sanitize_with_experts"] = True
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(doc, separators=(",", ":")))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> ExpertIndex:
        doc = json.loads(Path(path).read_text())
        if doc.get("format_version") not in _READABLE_VERSIONS:
            raise UnsupportedModelError(f"{path}: expert index format {doc.get('format_version')} is not supported")
        files = [f for f, _ in doc["files"]]
        core = {}
        for name, dtype, shape, fid, start, end in doc["core"]:
            core[name] = CoreTensor(name, dtype, tuple(shape), files[fid], start, end)
        kinds = [(p, d, tuple(s), st) for p, d, s, st in doc["expert_kinds"]]
        texts = doc.get("recipe_texts", [])
        recipes = [Recipe(texts[text], tuple(inputs)) for text, inputs in doc.get("recipes", [])]
        experts = {}
        for layer, expert, row, *rest in doc["experts"]:
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
                        start + tensor_nbytes(dtype, shape),
                        stacked,
                    )
                )
            recipe = recipes[rest[0]] if rest and rest[0] is not None else None
            experts[(layer, expert)] = ExpertLocation(layer, expert, tensors, recipe)
        return cls(
            doc["repo_id"],
            doc["commit"],
            {f: n for f, n in doc["files"]},
            core,
            experts,
            sanitize_with_experts=bool(doc.get("sanitize_with_experts", False)),
        )


def _name_pattern(name: str, layer: int, expert: int, stacked: bool) -> str:
    """The tensor name with its layer (and, for a per-expert tensor, expert) number turned into
    format fields, so tensors of one kind share a record; the name itself if no pattern
    reproduces it (a record of its own: correct, only less compact)."""
    parts = name.replace("{", "{{").replace("}", "}}").split(".")
    numeric = [i for i, p in enumerate(parts) if p.isdigit()]
    at_layer = [i for i in numeric if int(parts[i]) == layer and i > 0 and parts[i - 1] == "layers"]
    if at_layer:
        parts[at_layer[0]] = "{layer}"
        if not stacked:
            at_expert = [i for i in numeric if i > at_layer[0] and int(parts[i]) == expert]
            if at_expert:
                parts[at_expert[-1]] = "{expert}"
    pattern = ".".join(parts)
    if pattern.format(layer=layer, expert=expert) != name:
        return name.replace("{", "{{").replace("}", "}}")
    return pattern


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
    """By name alone: `("expert", layer, expert)`, `("stacked", layer, None)`, or None.

    Only for tests and tools that look at a tiny repo's names; the index finds experts from what
    mlx-lm's sanitize does with the checkpoint (`build_index`).
    """
    if m := _PER_EXPERT_RE.match(name):
        return "expert", int(m["layer"]), int(m["expert"])
    if m := _STACKED_RE.match(name):
        return "stacked", int(m["layer"]), None
    return None


def build_index(
    repo_id: str, commit: str, headers: dict[str, tuple[dict[str, TensorEntry], int]], config: dict
) -> ExpertIndex:
    """Build the index from the parsed header of every shard and the model's config.

    Args:
        headers: shard name -> (its tensors with absolute offsets, the shard's size).
        config: the repo's config.json, which picks mlx-lm's architecture.

    Raises:
        UnsupportedModelError: no routed experts, experts stored in a way expertmesh cannot yet
            address (the message says how they are stored), or inconsistent experts.
    """
    entries: dict[str, tuple[str, TensorEntry]] = {}
    for file, (tensors, _) in headers.items():
        for entry in tensors.values():
            entries.setdefault(entry.name, (file, entry))
    plan = _plan(repo_id, config, {n: (e.dtype, e.shape) for n, (_, e) in entries.items()})
    _check_dtypes(repo_id, plan, {n: e.dtype for n, (_, e) in entries.items()})
    core = {}
    for name in sorted(plan.core, key=lambda n: (entries[n][0], entries[n][1].start)):
        file, entry = entries[name]
        core[name] = CoreTensor(name, entry.dtype, entry.shape, file, entry.start, entry.end)
    used = set(plan.core) | {name for inputs, _ in plan.experts.values() for name, _ in inputs}
    dropped: dict[tuple[str, int], TensorEntry] = {
        (file, e.start): e for name, (file, e) in entries.items() if name not in used and e.nbytes
    }
    recipes: dict[tuple[str, tuple[int, ...]], Recipe] = {}
    experts: dict[tuple[int, int], ExpertLocation] = {}
    for key, (inputs, text) in plan.experts.items():
        slices = []
        for name, row in inputs:
            file, entry = entries[name]
            if row is None:
                slices.append(TensorSlice(name, entry.dtype, entry.shape, file, entry.start, entry.end))
            else:
                stride = entry.nbytes // entry.shape[0]
                start = entry.start + row * stride
                slices.append(TensorSlice(name, entry.dtype, entry.shape[1:], file, start, start + stride, True))
        slices += _gap_fillers(slices, dropped)
        order = sorted(range(len(slices)), key=lambda i: (slices[i].file, slices[i].start))
        position = {i: n for n, i in enumerate(order)}
        used_as = tuple(position[i] for i in range(len(inputs)))
        recipe = recipes.setdefault((text, used_as), Recipe(text, used_as))
        experts[key] = ExpertLocation(*key, [slices[i] for i in order], recipe)
    _check_consistent(experts)
    files = {f: size for f, (_, size) in headers.items()}
    return ExpertIndex(
        repo_id, commit, files, core, dict(sorted(experts.items())), sanitize_with_experts=plan.sanitize_with_experts
    )


def _check_dtypes(repo_id: str, plan: _Plan, dtypes: dict[str, str]) -> None:
    """Refuse, at pull, a model whose experts or core are stored in a dtype of the format that
    expertmesh cannot use yet: what `mx.load` reads is what the codec decodes an expert from and
    what the core is loaded as (expert_trace.SAFETENSORS_DTYPES). A tensor in another dtype that
    mlx-lm's sanitize drops is no obstacle: it is neither core nor expert, and never fetched.

    Raises:
        UnsupportedModelError: naming the tensor, its dtype, and what is supported.
    """
    from expertmesh.node.model.expert_trace import SAFETENSORS_DTYPES

    known = ", ".join(sorted(SAFETENSORS_DTYPES))
    for (layer, _), (inputs, _) in sorted(plan.experts.items()):
        for name, _ in inputs:
            if dtypes[name] not in SAFETENSORS_DTYPES:
                raise UnsupportedModelError(
                    f"{repo_id}: the routed experts of layer {layer} are stored as {dtypes[name]} ({name}), "
                    f"which expertmesh cannot decode yet (it decodes experts stored as {known})"
                )
    for name in sorted(plan.core):
        if dtypes[name] not in SAFETENSORS_DTYPES:
            raise UnsupportedModelError(
                f"{repo_id}: the core tensor {name} is stored as {dtypes[name]}, which MLX cannot load yet, "
                "so expertmesh cannot run this model yet"
            )


def _gap_fillers(slices: list[TensorSlice], dropped: dict[tuple[str, int], TensorEntry]) -> list[TensorSlice]:
    """Tensors mlx-lm drops (compressed-tensors' `weight_shape`, say) that lie between an expert's
    tensors and fill the gap exactly: fetched with the expert, unused, so that its bytes stay one
    range (one request) as they are upstream."""
    extra = []
    ranges = coalesce((t.file, t.start, t.end) for t in slices)
    for a, b in zip(ranges, ranges[1:]):
        if a.file != b.file:
            continue
        run, at = [], a.end
        while at < b.start and (entry := dropped.get((a.file, at))) is not None:
            run.append(TensorSlice(entry.name, entry.dtype, entry.shape, a.file, entry.start, entry.end))
            at = entry.end
        if at == b.start:
            extra += run
    return extra


@dataclass
class _Plan:
    core: set[str]  # upstream tensors the core's parameters are made of
    experts: dict[tuple[int, int], tuple[list[tuple[str, int | None]], str]]  # inputs, recipe text
    sanitize_with_experts: bool = False  # see _core_needs_expert_standins


def _plan(repo_id: str, config: dict, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> _Plan:
    """Which tensors are core and which feed each expert, from mlx-lm's sanitize traced."""
    # imported when an index is built, not when one is read: mlx-lm takes about a second to import,
    # and `status`, `ls` and the cache peer read indexes without ever computing
    from expertmesh.node.model import expert_trace, mlx_lm_models

    model_type = config.get("model_type")
    try:
        module = mlx_lm_models.module_name(config)
    except ValueError:
        raise UnsupportedModelError(f"{repo_id}: architecture {model_type!r} is not implemented by mlx-lm") from None
    no_experts = f"{repo_id} has no routed experts: expertmesh runs Mixture-of-Experts models only"
    if module not in mlx_lm_models.expert_modules():
        raise UnsupportedModelError(f"{no_experts} (mlx-lm's {module} builds no SwitchGLU or SwitchMLP)")
    try:
        model = mlx_lm_models.build_model(config)
    except Exception as e:  # the architecture's own checks of its config
        raise UnsupportedModelError(
            f"{repo_id}: mlx-lm cannot build model_type {model_type!r} from config.json ({e})"
        ) from e
    blocks = mlx_lm_models.expert_blocks(model)
    if not blocks:
        raise UnsupportedModelError(f"{no_experts} (this config of {model_type!r} builds no SwitchGLU or SwitchMLP)")
    cannot = f"expertmesh cannot yet address experts stored as {{}} in model_type {model_type!r}"
    try:
        out = expert_trace.trace_sanitize(model, tensors)
    except expert_trace.Untraceable as e:
        raise UnsupportedModelError(
            f"expertmesh cannot yet address the experts of model_type {model_type!r}: {e}"
        ) from None

    # Only the projections stream: a block's other parameters (muse_spark keeps a norm under its
    # experts) are core, which the streaming block keeps as they are (engine/blocks.py).
    streamed = streamed_prefixes(blocks)
    by_block: dict[str, dict[str, Any]] = {p: {} for p in blocks}
    core_out: dict[str, Any] = {}
    for key, value in out.items():
        path = next((p for p in blocks if key.startswith(p + ".")), None)
        if path is None or not key.startswith(streamed):
            core_out[key] = value
        else:
            by_block[path][key[len(path) + 1 :]] = value
    core: set[str] = set()
    for value in core_out.values():
        core |= expert_trace.leaves_of(value)

    params = _parameter_names(model)
    modules = dict(model.named_modules())
    layers: dict[int, str] = {}
    experts: dict[tuple[int, int], tuple[list[tuple[str, int | None]], str]] = {}
    shared_inputs: dict[str, int] = {}
    for path, targets in sorted(by_block.items(), key=lambda pt: _numbers(pt[0])):
        layer = mlx_lm_models.layer_number(path)
        if layer is None:
            raise UnsupportedModelError(f"{repo_id}: expert block {path} is not inside a numbered layer")
        projections = mlx_lm_models.BLOCK_PROJECTIONS[blocks[path]]
        if layer in layers:
            raise UnsupportedModelError(f"{repo_id}: layer {layer} has two expert blocks, {layers[layer]} and {path}")
        layers[layer] = path
        if not targets:
            unused = sorted(k for k in out if f"layers.{layer}." in k and k not in params)
            stored = _sample(unused) or "tensors mlx-lm's sanitize does not map onto it"
            raise UnsupportedModelError(cannot.format(stored) + f": nothing in the checkpoint feeds {path}")
        # first: a packing mlx-lm would not build or the kernels cannot take is said as such
        _check_quantization(repo_id, config.get("quantization"), modules, path, layer, projections, targets)
        for rel, value in targets.items():
            proj, _, kind = rel.rpartition(".")
            if kind not in PARAMETER_KINDS:
                names = _sample(sorted(expert_trace.leaves_of(value)))
                raise UnsupportedModelError(cannot.format(f"{names}, which mlx-lm loads as {kind} (of {path}.{proj})"))
            if not isinstance(value, expert_trace.Sym) or value._shape is None or not value.shape:
                ops = ", ".join(sorted(set(expert_trace.opaque_ops(value)))) or "an unrecorded operation"
                names = _sample(sorted(expert_trace.leaves_of(value)))
                raise UnsupportedModelError(cannot.format(f"{names} (sanitize makes {path}.{rel} with {ops})"))
        missing = [p for p in projections if f"{p}.weight" not in targets]
        if missing:
            raise UnsupportedModelError(cannot.format(f"tensors that give {path} no {', '.join(missing)}"))
        shared = sorted(set().union(*(expert_trace.leaves_of(v) for v in targets.values())) & core)
        if shared:
            raise UnsupportedModelError(cannot.format(f"tensors shared with the core ({_sample(shared)})"))
        counts = {v.shape[0] for v in targets.values()}
        if len(counts) != 1:
            raise UnsupportedModelError(
                f"{repo_id}: layer {layer}: expert parameters disagree on the number of experts"
            )
        (n,) = counts
        for expert in range(n):
            try:
                selected = {rel: expert_trace.select(v, 0, expert) for rel, v in targets.items()}
                inputs, text = expert_trace.encode_expert(selected)
            except expert_trace.Unaddressable as err:
                raise UnsupportedModelError(cannot.format(err)) from None
            for name, row in inputs:
                if row is None:
                    shared_inputs[name] = shared_inputs.get(name, 0) + 1
            experts[(layer, expert)] = (inputs, text)
    for name, uses in shared_inputs.items():
        dtype, shape = tensors[name]
        if uses > 1 and tensor_nbytes(dtype, shape) > SHARED_INPUT_MAX_BYTES:
            raise UnsupportedModelError(cannot.format(f"{name}, one tensor every expert reads whole"))
    expert_inputs = {name for inputs, _ in experts.values() for name, _ in inputs}
    standins = _core_needs_expert_standins(model, model_type, tensors, core, expert_inputs, core_out, streamed)
    return _Plan(core, experts, standins)


def _check_quantization(
    repo_id: str,
    quantization: dict | None,
    modules: dict[str, Any],
    path: str,
    layer: int,
    projections: tuple[str, ...],
    targets: dict[str, Any],
) -> None:
    """Refuse, at pull, experts whose stored packing mlx-lm's loader would not build from the
    config's quantization, or that the streamed kernels cannot take: the reading the codec decodes
    with (node/model/mlx_quantization.py), so a model that pulls runs.

    A projection whose tensors sanitize does not make plainly (no weight, a shape the trace
    cannot know) is left to the checks after this one, which say what is wrong with it.

    Raises:
        UnsupportedModelError: one line naming the layer, the projection and why.
    """
    from expertmesh.node.model.expert_trace import Sym
    from expertmesh.node.model.mlx_quantization import StoredPacking, projection_quantization

    for proj in projections:
        scales, weight = targets.get(f"{proj}.scales"), targets.get(f"{proj}.weight")
        if weight is None or not all(
            isinstance(t, Sym) and t._shape is not None for t in (weight, scales) if t is not None
        ):
            continue
        stored = StoredPacking(
            modules[f"{path}.{proj}"].weight.shape[-1],  # mlx-lm's unquantised SwitchLinear
            tuple(weight.shape),
            None if scales is None else tuple(scales.shape),
            None if scales is None else scales.dtype,
            f"{proj}.biases" in targets,
        )
        try:
            projection_quantization(quantization, f"{path}.{proj}", stored, f"layer {layer} {proj}")
        except UnsupportedModelError as e:
            raise UnsupportedModelError(
                f"{repo_id}: the routed experts' quantization cannot be streamed: {e}"
            ) from None


def _core_needs_expert_standins(
    model: Any,
    model_type: str | None,
    tensors: dict[str, tuple[str, tuple[int, ...]]],
    core: set[str],
    expert_inputs: set[str],
    full: dict,
    streamed: tuple[str, ...],
) -> bool:
    """Whether mlx-lm's sanitize must see the experts' tensors to make the core right.

    The node sanitizes the pulled core without the routed experts. Some sanitize methods decide
    what to do to core tensors from whether expert tensors are present (qwen3_next shifts its
    norms and moves its conv weights only when it finds `experts.0.up_proj`); loaded alone, such a
    core would silently differ from mlx-lm's model. Then the node gives sanitize lazy stand-ins of
    the expert tensors (never evaluated) and drops what it makes of them (blocks.load_core_model):
    True here when that makes the same core as the whole checkpoint does, a refusal with the
    reason when even that does not.
    """
    from expertmesh.node.model import expert_trace  # imported when needed, as in `_plan`

    def differ(made: dict) -> list[str]:
        def core_keys(d: dict) -> set[str]:
            return {k for k in d if not k.startswith(streamed)}

        return sorted(
            k
            for k in core_keys(full) | core_keys(made)
            if expert_trace.fingerprint(full.get(k)) != expert_trace.fingerprint(made.get(k))
        )

    def traced(names: set[str]) -> dict:
        try:
            return expert_trace.trace_sanitize(model, {n: tensors[n] for n in names})
        except expert_trace.Untraceable as e:
            raise UnsupportedModelError(
                f"expertmesh cannot yet load the core of model_type {model_type!r} without its routed experts: {e}"
            ) from None

    if not differ(traced(core)):
        return False
    wrong = differ(traced(core | expert_inputs))
    if wrong:
        raise UnsupportedModelError(
            f"expertmesh cannot yet load the core of model_type {model_type!r}: mlx-lm's sanitize makes "
            f"{_sample(wrong)} differently when tensors other than the core and the routed experts are "
            "absent, as they are from a pulled core"
        )
    return True


def streamed_prefixes(blocks: dict[str, str]) -> tuple[str, ...]:
    """The parameter-name prefixes of what streams: each block's projections (`path.gate_proj.`...),
    not its other parameters. `blocks`: path -> `SwitchGLU` or `SwitchMLP`."""
    from expertmesh.node.model.mlx_lm_models import BLOCK_PROJECTIONS  # imported when needed, as in `_plan`

    return tuple(f"{p}.{proj}." for p, kind in blocks.items() for proj in BLOCK_PROJECTIONS[kind])


def _numbers(path: str) -> list[int]:
    """A module path's numbers, so that layer 2 sorts before layer 10."""
    return [int(n) for n in re.findall(r"\d+", path)]


def _parameter_names(model: Any) -> set[str]:
    from expertmesh.node.model import mlx_lm_models  # imported when needed, as in `_plan`

    return set(mlx_lm_models.flat_parameters(model))


def _sample(names: list[str], n: int = 3) -> str:
    shown = ", ".join(names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def _check_consistent(experts: dict[tuple[int, int], ExpertLocation]) -> None:
    """Every MoE layer numbers its experts 0..E-1 and every expert has the same tensor kinds."""
    by_layer: dict[int, list[int]] = {}
    for layer, e in experts:
        by_layer.setdefault(layer, []).append(e)
    for layer, ids in by_layer.items():
        if sorted(ids) != list(range(len(ids))):
            raise UnsupportedModelError(f"layer {layer}: expert ids are not 0..{len(ids) - 1}")
        if len({_stored_as(experts[(layer, e)]) for e in ids}) != 1:
            raise UnsupportedModelError(f"layer {layer}: experts are not stored alike (different tensors or recipes)")


def _stored_as(loc: ExpertLocation) -> tuple:
    """What two experts of a layer must share: the recipe and its inputs' dtypes and shapes (the
    order of their tensors in a file may differ)."""
    if loc.recipe is None:
        return tuple((t.dtype, t.shape) for t in loc.tensors)
    inputs = [loc.tensors[i] for i in loc.recipe.inputs]
    rest = sorted((t.dtype, t.shape) for i, t in enumerate(loc.tensors) if i not in loc.recipe.inputs)
    return loc.recipe.text, tuple((t.dtype, t.shape) for t in inputs), tuple(rest)
