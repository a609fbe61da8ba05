"""A pulled model ready to generate: mlx-lm's model with the core in memory and every expert
block streaming from the store (engine/blocks.py). expertmesh/assembly.py loads it on the MLX thread
(node/engine/model_thread.py), builds the store around its codec, then binds the blocks to that
store. Its memory — the core held whole or streamed (engine/streamed_core.py), the context, the RAM
tier, MLX's buffer cache, wiring — is planned in engine/memory.py."""

from __future__ import annotations

import logging
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchLinear
from mlx_lm.tokenizer_utils import TokenizerWrapper

from expertmesh.node.engine.blocks import StreamingExperts
from expertmesh.node.engine.forward_pass import ForwardPass
from expertmesh.node.engine.speculative import CacheRollback
from expertmesh.node.errors import DamagedModelError, UnsupportedModelError
from expertmesh.node.hub import local_models
from expertmesh.node.model.codec import ExpertCodec
from expertmesh.node.model.expert_index import ExpertIndex
from expertmesh.node.store.stats import StoreStats
from expertmesh.node.store.store import ExpertStore
from expertmesh.node.store.tiers.disk import DiskCache

if TYPE_CHECKING:  # loaded with a streamed core only (`load_streamed_model`)
    from expertmesh.node.engine.streamed_core import StreamedCore

logger = logging.getLogger(__name__)


class TokenObserver(Protocol):
    """What watches every generation (observability/metrics.py's NodeMetrics)."""

    def prompt(self, tokens: int) -> None: ...

    def first_token(self, seconds: float) -> None: ...

    def token(self, seconds: float) -> None: ...

    def speculative(self, drafted: int, accepted: int) -> None: ...

    # optional (looked up with getattr, so an observer may leave them out):
    # request(seconds) once per generation at its end; batch(size) per batched decode step;
    # prefix(reused) once per generation that looked for a stored prefix of its prompt


@dataclass
class StreamedModel:
    repo_id: str
    commit: str
    path: Path
    model: nn.Module
    tokenizer: TokenizerWrapper
    config: dict
    index: ExpertIndex
    codec: ExpertCodec  # how the blocks' expert bytes become MLX arrays
    blocks: list[StreamingExperts]
    core_bytes: int
    core_bits: int = 16  # 8, 4...: stored and run as MLX quantised weights (`pull --core-bits`)
    core_quant: str | None = None  # mlx-lm's mixed recipe of a quantised core (`pull --core-quant`)
    core_stream: StreamedCore | None = None  # when the core is streamed
    context_limit: int | None = None  # `--max-context`: the tokens a conversation may hold here
    token_observer: TokenObserver | None = None
    # the (layer, expert) keys the household's peers hold (set by the assembly where the node has
    # peers): what an approximate prompt counts as held besides this node's own tiers
    household_holds: Callable[[], Container[tuple[int, int]]] | None = field(default=None, repr=False)
    _store: ExpertStore | None = field(default=None, repr=False)  # once bound
    _disk: DiskCache | None = field(default=None, repr=False)
    _close: Callable[[], None] | None = field(default=None, repr=False)
    # forward passes whose uses are not counted yet, oldest first (two while a pass is built ahead)
    _open: list[ForwardPass] = field(default_factory=list, repr=False)

    @property
    def model_context(self) -> int | None:
        """The context the model was trained for (its config's `max_position_embeddings`)."""
        cfg = self.config.get("text_config", self.config)
        return cfg.get("max_position_embeddings") or self.config.get("max_position_embeddings")

    @property
    def max_context(self) -> int | None:
        """The tokens a conversation may hold: `--max-context` (what the memory plan counted), at
        most the model's own context."""
        limits = [n for n in (self.context_limit, self.model_context) if n]
        return min(limits) if limits else None

    @property
    def store(self) -> ExpertStore:
        """The expert store the blocks stream from.

        Raises:
            RuntimeError: the model is not bound yet (`bind`: build_node binds it as it builds the node).
        """
        if self._store is None:
            raise RuntimeError(f"the model of {self.repo_id} is not bound to an expert store yet")
        return self._store

    @property
    def disk(self) -> DiskCache:
        """The disk tier of the store (raises RuntimeError before `bind`, as `store` does)."""
        if self._disk is None:
            raise RuntimeError(f"the model of {self.repo_id} is not bound to an expert store yet")
        return self._disk

    def core_read_bytes(self) -> int:
        """Core bytes read from the SSD so far (0 unless the core is streamed)."""
        return self.core_stream.stats.read_bytes if self.core_stream is not None else 0

    def bind(self, store: ExpertStore, disk: DiskCache, close: Callable[[], None]) -> StreamedModel:
        """Route every expert block to `store`; `close` closes what the model belongs to (its node)."""
        self._store, self._disk, self._close = store, disk, close
        for block in self.blocks:
            block.bind(store)
        return self

    def forward(
        self, inputs: mx.array, cache: list | None, ledgers: list[StoreStats] | None = None, rollback: bool = False
    ) -> ForwardPass:
        """mlx-lm's forward pass of `inputs` (its logits lazy, in `.logits`), its expert uses
        counted: in the store, and with `ledgers` (a batch's: one StoreStats per row of `inputs`)
        per row too. Layers whose experts are all resident run without a sync; their uses are
        counted by the pass's `count_uses`, which a caller calls once the logits are evaluated
        and before it hands out a token (so a token's uses are counted with it).

        `rollback`: the pass keeps what puts `cache` back as it was before it, so `discard()`
        (or `commit(keep)`) can take its tokens out again where a trim cannot. Nothing here
        waits for an earlier pass: one may be built while the one before still computes
        (engine/generation.py does, as mlx-lm's `generate_step`). MLX thread only."""
        saved = CacheRollback(cache) if cache is not None else None
        if rollback and saved is not None:
            saved.snapshot()
        step = ForwardPass(ledgers=ledgers, rollback=saved, fed=int(inputs.shape[-1]), _open=self._open)
        self._open.append(step)
        with step.build():
            step.output = self.model(inputs, cache=cache)
        return step

    def count_open(self) -> None:
        """Count the uses of every pass not counted yet; call it once their output is evaluated
        (a generation does at its start and its end), else reading them syncs. A layer-major
        prompt's pass parked between its layers (a batch's joiner) is left to its own count:
        its later layers are still to come."""
        for step in list(self._open):
            if step.waiting:
                continue
            try:
                step.count_uses()
            except RuntimeError:  # MLX could not evaluate the pass (it failed): its uses go uncounted
                logger.debug("a pass's resident expert uses were not counted", exc_info=True)

    def all_resident(self) -> bool:
        """Whether every expert of every MoE layer is in a RAM-tier slot (a pass then syncs once)."""
        return self._store is not None and all(self._store.ram.resident(b.layer) for b in self.blocks)

    def close(self) -> None:
        if self._close is not None:
            self._close()


def load_streamed_model(
    repo_id: str, path: Path, index: ExpertIndex, core_budget_bytes: int | None = None, context_limit: int | None = None
) -> StreamedModel:
    """Load a pulled model's core and tokenizer; its blocks stream once bound to a store. Call it
    on the MLX thread: loading evaluates the core there, where it will run. With
    `core_budget_bytes` the core is streamed from its files within that budget
    (engine/streamed_core.py) instead of loaded whole.

    Raises:
        UnsupportedModelError: mlx-lm lacks the architecture, it has no streamable experts, or
            the index and the model disagree on which layers route.
    """
    from mlx_lm.utils import load_tokenizer

    from expertmesh.node.engine.blocks import core_standins, load_core_model

    try:
        marker = local_models.read_marker(path)
        standins = core_standins(index, marker.get("core_bits", 16))
        model, config, blocks = load_core_model(path, standins, lazy=core_budget_bytes is not None)
    except (OSError, ValueError, RuntimeError) as e:  # a cut or garbled core, config or marker
        if isinstance(e, RuntimeError) and "safetensors" not in str(e):
            raise  # MLX's own failures (memory, a kernel) are not a damaged file
        raise DamagedModelError(
            f"the local copy of {repo_id} in {path} is damaged ({type(e).__name__}: {str(e)[:200]}): "
            f"`expertmesh pull {repo_id}` repairs it"
        ) from None
    missing = sorted(set(index.moe_layers) - {b.layer for b in blocks})
    if missing:
        raise UnsupportedModelError(
            f"{repo_id}: the index has experts for layers {missing} that the model does not route"
        )
    codec = _expert_codec(index, config, blocks, model)
    if codec.dense_dtype is not None:
        model.set_dtype(codec.dense_dtype)
        if core_budget_bytes is None:
            # computed here: a lazy cast belongs to this thread's stream, and MLX refuses to evaluate
            # it on another (the gRPC worker that generates: "There is no Stream(cpu, 0) in current thread")
            mx.eval(model.parameters())
    core_stream = None
    if core_budget_bytes is not None:
        from expertmesh.node.engine.core_quantization import format_name
        from expertmesh.node.engine.streamed_core import stream_core

        label = format_name(marker.get("core_bits", 16), marker.get("core_quant"))
        core_stream = stream_core(model, path, standins, core_budget_bytes, label)
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except (OSError, ValueError) as e:
        raise DamagedModelError(
            f"the tokenizer of {repo_id} in {path} cannot be loaded ({type(e).__name__}: {str(e)[:200]}): "
            f"`expertmesh pull {repo_id}` repairs a damaged one"
        ) from None
    return StreamedModel(
        repo_id,
        index.commit,
        path,
        model,
        tokenizer,
        config,
        index,
        codec,
        blocks,
        marker.get("core_bytes", index.core_bytes),
        marker.get("core_bits", 16),
        marker.get("core_quant"),
        core_stream,
        context_limit,
    )


def _expert_codec(index: ExpertIndex, config: dict, blocks: list, model: nn.Module) -> ExpertCodec:
    """The codec of the model's experts. On a CPU, MLX's `gather_mm` computes in float32 only: a
    model with an unquantised switch layer — an expert projection stored unquantised (an upstream
    BF16 repo; a conversion whose group size does not divide a width) or one in its core
    (deepseek_v41's grouped attention output, left dense by a conversion) — then runs in float32
    (`dense_dtype`), its experts' float arrays cast as its core's are. Which expert projections
    are dense is what decoding one expert of each layer gives, so the codec's own reading of the
    quantization decides."""
    paths, dims = {b.layer: b.path for b in blocks}, {b.layer: b.input_dims for b in blocks}
    codec = ExpertCodec(config.get("quantization"), paths, dims)
    if mx.metal.is_available():
        return codec
    dense_core = any(isinstance(m, SwitchLinear) for _, m in model.named_modules())
    if dense_core or any(
        quant is None for layer in index.moe_layers for _, _, quant in codec.layout(index.expert(layer, 0)).projections
    ):
        return ExpertCodec(config.get("quantization"), paths, dims, mx.float32)
    return codec
