"""What a model takes in memory, computed from its config alone: the core at any bits, what a
streamed core keeps, and the context's state per token. Nothing is materialised.

mlx-lm's own model class is built from the config with its weights unevaluated (MLX arrays know
their shapes and dtypes before they are computed; node/model/mlx_lm_models.py `build_model`), the
routed experts swapped out as `run` swaps them (node/engine/blocks.py), the floating parameters
cast to the config's dtype, and the core quantised as `pull --core-bits` would
(node/engine/core_quantization.py), lazily: its bytes are then a sum of shapes. The context is
measured the same way: a forward pass of 256 and of 512 tokens is built, not computed, on
mlx-lm's own prompt cache (`make_prompt_cache`), and each cache's state is read by its shapes —
KV caches grow per token (in their `step`s of tokens), linear-attention states and sliding
windows do not beyond their size.
So the plan knows what a model needs before a byte of it is downloaded, for this machine or any
other (`expertmesh doctor --plan`), and `run` plans with the same numbers.

K3's figures come from its shape (`kimi_k3_config`): the facts the project uses (93 layers,
hidden 7168, 896 routed experts of 17,547,264 bytes in a 3584-wide latent space, 2 shared, 69 KDA
and 24 MLA layers) and mlx-lm's kimi_k3 defaults (vocabulary 163,840, 96 heads); KDA's 96 heads of
128 with a full-rank output gate and MLA's 512-wide latent (64 rope, 128 nope and value dims) are
Kimi Linear's settings at K3's width, which bring the BF16 core to the ≈ 114 GB the project
quotes. Computed, not measured: say so wherever they are shown.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map_with_path

from expertmesh.node.constants import K3_EXPERTS_PER_LAYER
from expertmesh.node.engine.blocks import StreamingExperts, install_streaming_blocks
from expertmesh.node.engine.core_quantization import format_name, quantize_model
from expertmesh.node.engine.memory import CoreLayout, CoreTooLargeError, DeviceMemory, MemoryPlan, plan_memory
from expertmesh.node.engine.streamed_core import split_parameters
from expertmesh.node.model.mlx_lm_models import build_model, top_k_of, tree_arrays
from expertmesh.node.sizes import format_size

logger = logging.getLogger(__name__)

PROBE_TOKENS = (256, 512)  # two prompt lengths: what grows between them grows per token
K3_LABEL = "K3 (computed from its shape, not measured)"


def kimi_k3_config() -> dict:
    """Kimi K3's config as mlx-lm's kimi_k3 reads it (see the module's docstring for its sources)."""
    layers = 93
    full = [n for n in range(4, layers + 1, 4)] + [layers]  # 24 MLA layers, 1-based as upstream
    return {
        "model_type": "kimi_k3",
        "torch_dtype": "bfloat16",
        "text_config": {
            "model_type": "kimi_linear",
            "vocab_size": 163840,
            "hidden_size": 7168,
            "num_hidden_layers": layers,
            "num_attention_heads": 96,
            "num_key_value_heads": 96,
            "intermediate_size": 33792,
            "rms_norm_eps": 1e-5,
            "max_position_embeddings": 1048576,
            "linear_attn_config": {
                "kda_layers": [n for n in range(1, layers + 1) if n not in full],
                "full_attn_layers": full,
                "num_heads": 96,
                "head_dim": 128,
                "short_conv_kernel_size": 4,
                "use_full_rank_gate": True,
            },
            "hidden_act": "situ",
            "q_lora_rank": None,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "mla_use_nope": True,
            "num_experts": K3_EXPERTS_PER_LAYER,
            "num_experts_per_token": 16,
            "num_shared_experts": 2,
            "moe_intermediate_size": 3072,
            "routed_expert_hidden_size": 3584,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "tie_word_embeddings": False,
        },
    }


@dataclass
class ModelSizes:
    """The sizes of the model `config` describes (see the module's docstring); computed once each."""

    config: dict
    _layouts: dict = field(default_factory=dict, repr=False)
    _context: tuple | None = field(default=None, repr=False)
    _prompt_row: int | None = field(default=None, repr=False)

    def _model(self) -> nn.Module:
        model = build_model(self.config)
        install_streaming_blocks(model)
        dtype = getattr(mx, _dtype_name(self.config), mx.bfloat16)
        keep = getattr(model, "cast_predicate", lambda _path: True)
        model.update(
            tree_map_with_path(
                lambda p, v: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and keep(p) else v,
                model.parameters(),
            )
        )
        return model

    def layout(self, bits: int = 16, recipe: str | None = None) -> CoreLayout:
        """The core at `bits` (or mlx-lm's `recipe`), and what a streamed core would keep and read."""
        key = (bits, recipe)
        if key not in self._layouts:
            model = self._model()
            if bits != 16:
                quantize_model(model, bits, recipe)
            kept, layers = split_parameters(model)
            resident = sum(a.nbytes for a in kept.values())
            per_layer = tuple(sum(a.nbytes for a in params.values()) for _, params in layers.values())
            self._layouts[key] = CoreLayout(resident + sum(per_layer), format_name(bits, recipe), resident, per_layer)
        return self._layouts[key]

    def context_bytes(self, tokens: int) -> int | None:
        """The prompt cache's state at `tokens` tokens; None if mlx-lm's model could not be probed."""
        if self._context is None:
            self._context = self._probe()
        if not self._context:
            return None
        total = 0.0
        for const, per_token, cap, step in self._context:
            n = -(-tokens // step) * step  # a KV cache grows in steps of tokens
            total += const + per_token * (min(n, cap) if cap else n)
        return int(total)

    def prompt_bytes(self, tokens: int) -> int:
        """What a prompt of `tokens` tokens holds at an expert layer while it is prefilled
        layer-major (engine/prefill.py): each token's row into the experts and its top-k outputs,
        every chunk at once, and one chunk's more while its outputs are weighted and summed. 0 where the
        model's top-k is not in its config (said once)."""
        if self._prompt_row is None:
            self._prompt_row = self._prompt_row_bytes()
        from expertmesh.node.engine.generation import PREFILL_STEP

        return (tokens + min(tokens, PREFILL_STEP)) * self._prompt_row if tokens > 0 else 0

    def _prompt_row_bytes(self) -> int:
        """One prompt token at the widest expert layer: its row as the experts take it and top-k
        outputs, each as wide as an expert's output, in the activations' dtype (the config's)."""
        k = top_k_of(self.config)
        blocks = [m for m in self._model().modules() if isinstance(m, StreamingExperts)]
        if not k or not blocks:
            if blocks:
                logger.warning("a prompt's memory could not be computed: the config names no top-k")
            return 0
        dtype = getattr(mx, _dtype_name(self.config), mx.bfloat16)
        return max(b.input_width + k * b.output_dims for b in blocks) * dtype.size

    def _probe(self) -> tuple:
        from mlx_lm.models.cache import make_prompt_cache

        from expertmesh.node.engine.forward_pass import ForwardPass

        try:
            model = self._model()
            sizes = []
            for n in PROBE_TOKENS:
                cache = make_prompt_cache(model)
                with ForwardPass(routing_only=True).build():  # routing recorded, no expert needed: nothing computes
                    model(mx.zeros((1, n), dtype=mx.int32), cache=cache)
                sizes.append([(_state_bytes(c), getattr(c, "max_size", None), getattr(c, "step", 1)) for c in cache])
        except Exception as e:  # noqa: BLE001 - an architecture the probe cannot drive: said, not fatal
            logger.warning("the context's memory could not be computed for this model (%s: %s)", type(e).__name__, e)
            return ()
        (a, b) = sizes
        span = PROBE_TOKENS[1] - PROBE_TOKENS[0]
        out = []
        for (x, cap, step), (y, _, _) in zip(a, b):
            per_token = max(0, y - x) / span
            out.append((x - per_token * PROBE_TOKENS[0], per_token, cap, step if isinstance(step, int) else 1))
        return tuple(out)


def _dtype_name(config: dict) -> str:
    return str(config.get("torch_dtype") or config.get("text_config", {}).get("dtype") or "bfloat16")


def _state_bytes(cache) -> int:
    try:
        state = cache.state
    except (AttributeError, TypeError, ValueError):
        return 0
    return sum(a.nbytes for a in tree_arrays(state))


# in order of how much they give up: the first that fits is the smallest change of bits
_FEWER_BITS = ((8, None), (4, "mixed_4_6"), (4, None), (3, "mixed_3_6"), (3, "mixed_3_4"), (2, "mixed_2_6"))
_SHORTEST_CONTEXT = 2048


@dataclass
class Planner:
    """One model's memory plan on one machine (`plan`), and the single changes of flags that would
    each make it fit with the core held whole (`changes`): what `doctor` and `run` print.

    `pulled_bits` is the format the model is pulled in here (None: not pulled, a plan for a
    model known by its config): fewer bits then mean `pull --core-bits` rather than a flag of `run`.
    """

    repo_id: str
    sizes: ModelSizes
    device: DeviceMemory
    expert_bytes: int
    layout: CoreLayout
    fetch_workers: int = 8
    ram_budget: str = "50%"
    max_context: int = 32768
    core_budget: str | None = None
    core_bits: int = 16
    pulled_bits: int | None = None
    prefix_cache_bytes: int = 0
    household_bytes: int = 0  # a household node's buffers for its peers (engine/memory.py)

    def plan(
        self, layout: CoreLayout | None = None, max_context: int | None = None, ram_budget: str | None = None
    ) -> MemoryPlan:
        """The plan with these settings changed. Raises memory.CoreTooLargeError."""
        context = max_context or self.max_context
        layout = layout or self.layout
        return plan_memory(
            ram_budget or self.ram_budget,
            self.device,
            core_bytes=layout.core_bytes,
            expert_bytes=self.expert_bytes,
            fetch_workers=self.fetch_workers,
            repo_id=self.repo_id,
            core_bits=self.core_bits,
            layout=layout,
            context_bytes=self.sizes.context_bytes(context) or 0,
            prompt_bytes=self.sizes.prompt_bytes(context),
            max_context=context,
            core_budget=self.core_budget,
            prefix_cache_bytes=self.prefix_cache_bytes,
            household_bytes=self.household_bytes,
        )

    def _fits(
        self, layout: CoreLayout | None = None, max_context: int | None = None, ram_budget: str | None = None
    ) -> bool:
        try:
            return self.plan(layout, max_context, ram_budget).fits
        except CoreTooLargeError:
            return False

    def changes(self) -> list[str]:
        """Each single change that would hold the core whole: a smaller `--ram-budget` (when it
        is a size), a shorter `--max-context`, fewer core bits; empty when it fits already."""
        if self._fits():
            return []
        out = []
        if not self.ram_budget.strip().endswith("%"):
            try:
                p = self.plan(ram_budget="0")
                room = (
                    p.device.limit_bytes
                    - p.core_bytes
                    - p.context_bytes
                    - p.prefix_cache_bytes
                    - p.prompt_bytes
                    - p.buffer_bytes
                )
                if p.fits and room > 0:
                    out.append(
                        f"--ram-budget {room // 10**9}GB" if room >= 10**9 else f"--ram-budget {room // 10**6}MB"
                    )
            except CoreTooLargeError:
                pass
        n = self.max_context // 2
        while n >= _SHORTEST_CONTEXT and not self._fits(max_context=n):
            n //= 2
        if n >= _SHORTEST_CONTEXT:
            out.append(f"--max-context {n}")
        current = self.layout.core_bytes
        for bits, recipe in _FEWER_BITS:
            layout = self.sizes.layout(bits, recipe)
            if layout.core_bytes < current and self._fits(layout=layout):
                flag = f"--core-quant {recipe}" if recipe else f"--core-bits {bits}"
                size = f"core {format_size(layout.core_bytes)}"
                if self.pulled_bits is None:
                    out.append(f"{flag} ({size})")
                elif self.pulled_bits == 16:
                    out.append(f"`expertmesh pull {self.repo_id} {flag}` ({size})")
                else:
                    out.append(f"`expertmesh rm {self.repo_id}` and `expertmesh pull {self.repo_id} {flag}` ({size})")
                break
        return out
