"""A Kimi K3 whose experts have K3's real size, for benchmarks: speed at the proportions users have.

The layout is Moonshot's (expertmesh/devtools/tiny/kimi_k3.py): layer 0 dense, then MoE layers of
mxfp4 experts, each expert's six tensors contiguous, shards of two layers. Only the experts are
K3-sized — a 3584-wide latent space and an intermediate size of 3072 make one expert
17,547,264 bytes, as in K3 — while the core stays small (hidden size 256), so a benchmark
measures moving experts, not computing a 114 GB core on a CPU. The expert weights are random
mxfp4 codes with scales chosen so activations stay finite (mlx-lm's initialisers would need tens
of GB of float32 first); the core is mlx-lm's own initialisation, in float32 by default because
MLX's CPU quantized matmul is far slower on BF16 activations. The routers are balanced as a trained
K3's are (router_balance.py): a raw random router keeps choosing the same experts, so a decode
layer would find most of its experts already fetched, a regime K3 never runs in.

`build(out, ...)` writes the full-size model; `build_small` a variant with ~1.6 MB experts for
tests, so they exercise multi-MB experts and pieces within CI's time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from expertmesh.devtools.tiny import kimi_k3, router_balance
from expertmesh.devtools.tiny.common import (
    LazyBytes,
    Tensor,
    add_noise,
    write_generation_config,
    write_json,
    write_layered_repo,
    write_readme,
)
from expertmesh.devtools.tiny.tokenizer import write_tokenizer_files
from expertmesh.node.model.mlx_lm_models import flat_parameters, model_classes

K3_LATENT = 3584  # routed_expert_hidden_size
K3_INTERMEDIATE = 3072  # moe_intermediate_size
MXFP4_GROUP = 32
MAKER_VERSION = 3  # 2: balanced routers; 3: K3's context; a cached repo of another version is made again
K3_CONTEXT = 1048576  # max_position_embeddings, as node/engine/model_sizes.py describes K3
# e8m0 scale exponents: 2^(s - 127). Random fp4 codes (|v| <= 6) over a 3584-wide input give
# outputs of about sqrt(3584) * 3 * 2^(s - 127); s around 119 keeps them near 1.
SCALE_EXPONENTS = (118, 121)


@dataclass(frozen=True)
class Proportions:
    moe_layers: int = 3
    experts: int = 64  # routed experts per MoE layer
    top_k: int = 16
    latent: int = K3_LATENT
    intermediate: int = K3_INTERMEDIATE
    hidden: int = 256  # the core's width: small, so the core is not what a bench measures
    core_dtype: str = "float32"  # or "bfloat16", K3's own
    router: str = "balanced"  # selection biases even out the experts' load, as K3's training does; or "raw"

    @property
    def expert_bytes(self) -> int:
        """w1, w3 (intermediate x latent) and w2 (latent x intermediate), packed 4-bit plus one scale byte per group."""
        weights = self.latent * self.intermediate
        return 3 * (weights // 2 + weights // MXFP4_GROUP)


SMALL = Proportions(moe_layers=3, experts=32, top_k=8, latent=1024, intermediate=1024, hidden=128)


def config(p: Proportions) -> dict:
    cfg = kimi_k3.config()
    layers = 1 + p.moe_layers
    # 1-based, as upstream: MLA every fourth layer (K3 has 24 MLA layers in 93), the rest KDA
    full = [n for n in range(1, layers + 1) if n % 4 == 0] or [layers]
    cfg["text_config"].update(
        hidden_size=p.hidden,
        intermediate_size=2 * p.hidden,
        num_hidden_layers=layers,
        # the tiny model's 4,096 would refuse a 4,096-token prompt (no room for its answer); its MLA
        # layers use no positions (mla_use_nope), so this is only the limit a node enforces
        max_position_embeddings=K3_CONTEXT,
        num_experts=p.experts,
        num_experts_per_token=p.top_k,
        moe_intermediate_size=p.intermediate,
        routed_expert_hidden_size=p.latent,
        linear_attn_config={
            **cfg["text_config"]["linear_attn_config"],
            "kda_layers": [n for n in range(1, layers + 1) if n not in full],
            "full_attn_layers": full,
        },
    )
    cfg["torch_dtype"] = p.core_dtype
    return cfg


def _core_parameters(cfg: dict, seed: int, p: Proportions) -> dict[str, mx.array]:
    """mlx-lm's initialisation of everything but the routed experts (never materialised), with the
    noise every tiny model's norms get, the routers' selection biases then balanced on exactly
    those weights unless `p.router` is "raw"."""
    if p.router not in ("balanced", "raw"):
        raise ValueError(f"router must be 'balanced' or 'raw', not {p.router!r}")
    model_class, args_class = model_classes(cfg)
    mx.random.seed(seed)
    model: nn.Module = model_class(args_class.from_dict(cfg))
    prefix = "language_model."
    params = {k.removeprefix(prefix): v for k, v in flat_parameters(model).items() if ".switch_mlp." not in k}
    params = add_noise(params, cfg["text_config"]["num_hidden_layers"], seed)
    if p.router == "balanced":
        model.update(tree_unflatten([(prefix + k, v) for k, v in params.items()]))
        router_balance.balance_routers(model, kimi_k3.VOCAB_SIZE, p.top_k, seed)
        params = {k.removeprefix(prefix): v for k, v in flat_parameters(model).items() if ".switch_mlp." not in k}
    mx.eval(params)
    return params


def _experts(p: Proportions, seed: int):
    """The experts_fn of write_layered_repo: random mxfp4 experts, generated as they are written."""

    def projection(rng_seed: int, rows: int, cols: int) -> tuple[LazyBytes, LazyBytes]:
        def packed() -> bytes:
            return np.random.default_rng(rng_seed).integers(0, 256, rows * cols // 2, dtype=np.uint8).tobytes()

        def scales() -> bytes:
            lo, hi = SCALE_EXPONENTS
            return (
                np.random.default_rng(rng_seed + 1)
                .integers(lo, hi + 1, rows * cols // MXFP4_GROUP, dtype=np.uint8)
                .tobytes()
            )

        return LazyBytes(rows * cols // 2, packed), LazyBytes(rows * cols // MXFP4_GROUP, scales)

    shapes = {"w1": (p.intermediate, p.latent), "w3": (p.intermediate, p.latent), "w2": (p.latent, p.intermediate)}

    def experts_fn(_params: dict[str, mx.array], layer: int) -> list[Tensor]:
        out = []
        for e in range(p.experts):
            for i, upstream in enumerate(("w1", "w2", "w3")):
                rows, cols = shapes[upstream]
                packed, scales = projection(seed * 1_000_003 + layer * 100_003 + e * 7 + i * 2, rows, cols)
                name = f"model.layers.{layer}.block_sparse_moe.experts.{e}.{upstream}"
                out.append(Tensor(f"{name}.weight_packed", "U8", (rows, cols // 2), packed))
                out.append(Tensor(f"{name}.weight_scale", "U8", (rows, cols // MXFP4_GROUP), scales))
        return out

    return experts_fn


def build(out: Path, seed: int = 0, proportions: Proportions = Proportions()) -> Path:
    """Write a K3-proportioned repo into `out` (experts are `proportions.expert_bytes` each)."""
    p = proportions
    cfg = config(p)
    params = _core_parameters(cfg, seed, p)
    dtype = mx.float32 if p.core_dtype == "float32" else mx.bfloat16

    def core(name: str, a: mx.array, all_params: dict[str, mx.array]) -> list[Tensor]:
        tensors = kimi_k3._core_tensors(name, a, all_params)
        if dtype == mx.bfloat16:
            return tensors
        # kimi_k3 writes the core in BF16, as upstream; re-encode what it cast, in float32
        return [t if t.dtype != "BF16" else _as_float32(t) for t in tensors]

    layers = 1 + p.moe_layers
    out.mkdir(parents=True, exist_ok=True)
    write_layered_repo(out, params, layers, list(range(1, layers)), core, _experts(p, seed), seed, noise=False)
    write_json(out / "config.json", cfg)
    write_generation_config(out, write_tokenizer_files(out, kimi_k3.VOCAB_SIZE))
    write_readme(
        out,
        "kimi_k3",
        seed,
        f"K3-proportioned: {p.moe_layers} MoE layers of {p.experts} experts of {p.expert_bytes:,} bytes, "
        f"top-{p.top_k}, random mxfp4 experts, a {p.core_dtype} core of hidden size {p.hidden}, "
        f"{'routers balanced as a trained K3' if p.router == 'balanced' else 'raw random routers'}.",
    )
    return out


def build_small(out: Path, seed: int = 0) -> Path:
    return build(out, seed, SMALL)


def _as_float32(t: Tensor) -> Tensor:
    bits = np.frombuffer(bytes(t.data), dtype=np.uint16).astype(np.uint32) << 16
    return Tensor(t.name, "F32", t.shape, bits.view(np.float32).tobytes())
