"""A pulled model ready to generate: core in memory, experts behind the store's tiers."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from expertmesh.node import constants
from expertmesh.node.hub import local_models
from expertmesh.node.hub.expert_index import INDEX_FILENAME, ExpertIndex
from expertmesh.node.sizes import parse_budget
from expertmesh.node.store.codec import ExpertCodec
from expertmesh.node.store.integrity import DIGESTS_FILENAME, DigestBook
from expertmesh.node.store.policies import DEFAULT_POLICY
from expertmesh.node.store.store import ByteSource, ExpertStore, RamCache
from expertmesh.node.store.tiers.disk import DiskCache, cache_dir
from expertmesh.node.store.tiers.hub import (
    DEFAULT_CONNECTIONS,
    DEFAULT_MIN_PIECE_BYTES,
    DEFAULT_PIECES_PER_EXPERT,
    HubSource,
)


@dataclass
class StoreConfig:
    """Budgets and fetch settings of the expert store; sizes or percentages as on the CLI."""

    ram_budget: str = constants.DEFAULT_RAM_BUDGET
    disk_budget: str = constants.DEFAULT_DISK_BUDGET
    fetch_concurrency: int = constants.EXPERT_FETCH_CONCURRENCY
    ram_policy: str = DEFAULT_POLICY  # see node/store/policies.py and `expertmesh replay`
    trace_path: Path | None = None  # record every layer's routed experts here (`--trace`)
    prefetch: bool = True  # guess the next layer's experts and fetch them behind the demands
    fill: bool = True  # while generating, fetch experts not yet held onto free disk budget when the link is idle
    hub_min_piece_bytes: int = DEFAULT_MIN_PIECE_BYTES  # experts are split into pieces no smaller
    hub_connections: int = DEFAULT_CONNECTIONS  # range requests in flight to the Hub at once
    hub_pieces_per_expert: int = DEFAULT_PIECES_PER_EXPERT  # separate requests an expert is split into, at most
    coalesce: bool = True  # demanded experts back to back in a shard fetched as one run of requests


@dataclass
class StreamedModel:
    repo_id: str
    commit: str
    path: Path
    model: nn.Module
    tokenizer: object  # mlx-lm's TokenizerWrapper
    config: dict
    index: ExpertIndex
    store: ExpertStore
    disk: DiskCache
    core_bytes: int
    core_bits: int = 16  # 8: stored and run as MLX 8-bit weights (`pull --core-bits 8`)

    @property
    def max_context(self) -> int | None:
        cfg = self.config.get("text_config", self.config)
        return cfg.get("max_position_embeddings") or self.config.get("max_position_embeddings")

    def close(self) -> None:
        self.store.close()


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 16 * 1024**3


def resolve_budgets(cfg: StoreConfig, core_bytes: int, cache_root: Path) -> tuple[int, int]:
    """(RAM bytes, disk bytes): percentages of memory left after the core and of free disk."""
    ram = max(
        constants.MIN_RAM_BUDGET_BYTES if cfg.ram_budget == constants.DEFAULT_RAM_BUDGET else 0,
        parse_budget(cfg.ram_budget, max(0, _physical_memory() - core_bytes)),
    )
    cache_root.mkdir(parents=True, exist_ok=True)
    disk = parse_budget(cfg.disk_budget, shutil.disk_usage(cache_root).free)
    return ram, disk


def open_model(
    repo_id: str,
    revision: str | None = None,
    home: Path | None = None,
    store_config: StoreConfig | None = None,
    hub_reader=None,
    extra_sources: list[ByteSource] | None = None,
) -> StreamedModel:
    """Load a pulled model's core and tokenizer and wire its expert store.

    Raises:
        NotPulledError: the core is not here (the message says which command pulls it).
        UnsupportedModelError: mlx-lm lacks the architecture or it has no streamable experts.
    """
    from mlx_lm.utils import load_tokenizer

    from expertmesh.node.engine.blocks import load_core_model

    home = home or constants.expertmesh_home()
    cfg = store_config or StoreConfig()
    path = local_models.find_pulled(home, repo_id, revision)
    marker = local_models.read_marker(path)
    index = ExpertIndex.load(path / INDEX_FILENAME)
    model, config, blocks = load_core_model(path)

    dense_dtype = None
    if not mx.metal.is_available() and _has_dense_experts(index):
        dense_dtype = mx.float32  # MLX's CPU gather_mm computes in float32 only
        model.set_dtype(mx.float32)
    codec = ExpertCodec(
        config.get("quantization"),
        {b.layer: b.path for b in blocks},
        {b.layer: b.input_dims for b in blocks},
        dense_dtype,
    )
    missing = sorted(set(index.moe_layers) - {b.layer for b in blocks})
    if missing:
        raise ValueError(f"{repo_id}: the index has experts for layers {missing} that the model does not route")

    root = cache_dir(home, repo_id, index.commit)
    ram_bytes, disk_bytes = resolve_budgets(cfg, marker.get("core_bytes", index.core_bytes), root)
    digests = DigestBook(root / DIGESTS_FILENAME)
    disk = DiskCache(root, index, disk_bytes, digests)
    sources: list[ByteSource] = [
        disk,
        *(extra_sources or []),
        HubSource(
            index,
            hub_reader,
            connections=cfg.hub_connections,
            pieces_per_expert=cfg.hub_pieces_per_expert,
            min_piece_bytes=cfg.hub_min_piece_bytes,
        ),
    ]
    store = ExpertStore(
        index,
        codec,
        RamCache(ram_bytes, cfg.ram_policy),
        sources,
        sinks=[disk],
        concurrency=cfg.fetch_concurrency,
        digests=digests,
        prefetch=cfg.prefetch,
        fill_order=_fill_order(index) if cfg.fill else None,
        coalesce=cfg.coalesce,
    )
    if cfg.trace_path is not None:
        from expertmesh.node.observability.routing_trace import TraceWriter

        store.trace = TraceWriter(cfg.trace_path, index)
    for b in blocks:
        b.bind(store)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return StreamedModel(
        repo_id,
        index.commit,
        path,
        model,
        tokenizer,
        config,
        index,
        store,
        disk,
        marker.get("core_bytes", index.core_bytes),
        marker.get("core_bits", 16),
    )


def _has_dense_experts(index: ExpertIndex) -> bool:
    loc = next(iter(index.experts.values()))
    return not any(t.name.endswith((".scales", ".weight_scale", ".weight_packed")) for t in loc.tensors)


def _fill_order(index: ExpertIndex) -> list[tuple[int, int]]:
    """Idle-link fill goes expert 0 of every layer, then expert 1, ... (`expertmesh warm`'s order
    without traces), so a partial fill helps every layer alike."""
    from expertmesh.node.household.warm import warm_order

    return warm_order(index)
