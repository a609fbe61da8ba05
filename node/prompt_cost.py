"""What a prompt of N tokens costs before its first token: the union of its experts, read once.

A prompt's experts are the union of what its tokens route to, layer by layer. With a router that
spreads its load evenly (as trained MoE routers are pushed to: K3's selection biases), each of a
layer's E experts is missed by one token's top-k with probability 1 - k/E, so N tokens leave it
unused with probability (1 - k/E)^N and the layer's union is about E * (1 - (1 - k/E)^N). Real
routings are correlated between tokens, so real unions are smaller (colibri measured about 190 of
K3's 896 for 32 tokens, where this gives 393): this is the cost's upper bound.

The layer-major prefill (node/engine/prefill.py) reads each distinct expert once, so the prompt
moves the union's bytes: cold from the link, warm from the disk. `doctor --plan MODEL
--prompt-tokens N` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass


def expected_union(experts: int, top_k: int, tokens: int) -> float:
    """A layer's expected distinct experts over `tokens` tokens, each choosing `top_k` of
    `experts` evenly (the module says why this is an upper bound)."""
    if experts <= 0 or tokens <= 0:
        return 0.0
    k = min(top_k, experts)
    return experts * (1.0 - (1.0 - k / experts) ** tokens)


@dataclass
class PromptCost:
    tokens: int
    moe_layers: int
    experts: int  # per MoE layer
    top_k: int
    expert_bytes: int
    link_bytes_per_s: float
    disk_bytes_per_s: float

    @property
    def union_per_layer(self) -> float:
        return expected_union(self.experts, self.top_k, self.tokens)

    @property
    def union_bytes(self) -> float:
        return self.union_per_layer * self.moe_layers * self.expert_bytes

    @property
    def cold_s(self) -> float:
        """Seconds the union takes over the link, each expert once."""
        return self.union_bytes / self.link_bytes_per_s

    @property
    def warm_s(self) -> float:
        """Seconds the union takes from the disk, each expert once."""
        return self.union_bytes / self.disk_bytes_per_s

    def lines(self) -> list[str]:
        from expertmesh.node.sizes import format_size

        return [
            f"a prompt of {self.tokens} tokens: about {self.union_per_layer:.0f} of {self.experts} experts a layer "
            f"(top-{self.top_k}, an even router: at most), {self.moe_layers} MoE layers, "
            f"{format_size(self.union_bytes)} of experts, each read once",
            f"  cold: {self.cold_s:.0f} s at {format_size(self.link_bytes_per_s)}/s from the link; "
            f"warm (on disk): {self.warm_s:.1f} s at {format_size(self.disk_bytes_per_s)}/s; "
            "compute comes on top where it is slower",
        ]

    def as_json(self) -> dict:
        return {
            "prompt_tokens": self.tokens,
            "union_per_layer": self.union_per_layer,
            "union_bytes": self.union_bytes,
            "cold_s": self.cold_s,
            "warm_s": self.warm_s,
            "link_bytes_per_s": self.link_bytes_per_s,
            "disk_bytes_per_s": self.disk_bytes_per_s,
        }
